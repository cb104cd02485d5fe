//! Any RESP2/RESP3 value, as a client reads it, and the encoding of commands.

use bytes::Bytes;

/// A reply from a RESP server.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Bytes),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Set(Vec<Value>),
    Double(f64),
    Boolean(bool),
    BigNumber(String),
    /// Out-of-band data (RESP3 push).
    Push(Vec<Value>),
    Null,
}

impl Value {
    /// The value as bytes, for bulk, simple and verbatim strings.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bulk(bytes) => Some(bytes),
            Value::Simple(text) => Some(text.as_bytes()),
            _ => None,
        }
    }

    pub fn as_integer(&self) -> Option<i64> {
        match self {
            Value::Integer(value) => Some(*value),
            Value::Bulk(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The elements of an array or set, or the flattened pairs of a map.
    pub fn into_items(self) -> Option<Vec<Value>> {
        match self {
            Value::Array(items) | Value::Set(items) | Value::Push(items) => Some(items),
            Value::Map(pairs) => Some(pairs.into_iter().flat_map(|(key, value)| [key, value]).collect()),
            _ => None,
        }
    }

    /// Renders the value the way redis-cli does, for the command line.
    pub fn render(&self) -> String {
        fn render_into(value: &Value, indent: usize, out: &mut String) {
            match value {
                Value::Simple(text) => out.push_str(text),
                Value::Error(text) => out.push_str(&format!("(error) {text}")),
                Value::Integer(value) => out.push_str(&format!("(integer) {value}")),
                Value::Bulk(bytes) => out.push_str(&format!("\"{}\"", bytes.escape_ascii())),
                Value::Double(value) => out.push_str(&format!("(double) {value}")),
                Value::Boolean(value) => out.push_str(&format!("({value})")),
                Value::BigNumber(text) => out.push_str(&format!("(big number) {text}")),
                Value::Null => out.push_str("(nil)"),
                Value::Array(items) | Value::Set(items) | Value::Push(items) => {
                    if items.is_empty() {
                        out.push_str("(empty array)");
                    }
                    for (position, item) in items.iter().enumerate() {
                        if position > 0 {
                            out.push('\n');
                            out.push_str(&" ".repeat(indent));
                        }
                        let label = format!("{}) ", position + 1);
                        out.push_str(&label);
                        render_into(item, indent + label.len(), out);
                    }
                }
                Value::Map(pairs) => {
                    let items: Vec<Value> =
                        pairs.iter().flat_map(|(key, value)| [key.clone(), value.clone()]).collect();
                    render_into(&Value::Array(items), indent, out);
                }
            }
        }
        let mut out = String::new();
        render_into(self, 0, &mut out);
        out
    }
}

/// Nesting deeper than this is refused rather than followed; an attribute
/// counts as a level of the reply it precedes.
const DEPTH_MAX: usize = 64;
/// The longest bulk string accepted in a reply (Redis's `proto-max-bulk-len`).
pub const REPLY_BULK_BYTES_MAX: usize = 512 << 20;

/// Where a bulk string of `length` bytes whose data starts at `next` ends,
/// its CRLF included; a length past the limit is refused, not waited for.
fn bulk_end(next: usize, length: i64) -> Result<usize, MalformedReply> {
    match usize::try_from(length) {
        Ok(length) if length <= REPLY_BULK_BYTES_MAX => Ok(next + length + 2),
        _ => Err(malformed(format!("a bulk string of {length} bytes"))),
    }
}

/// Why a reply could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed RESP reply: {0}")]
pub struct MalformedReply(pub String);

fn malformed(what: impl Into<String>) -> MalformedReply {
    MalformedReply(what.into())
}

/// A value's type byte, its header line's text, and the offset after the
/// header's CRLF.
type Header<'a> = (u8, &'a [u8], usize);

/// The header of the value at `at`; `Ok(None)` means more bytes are needed.
fn read_header(buf: &[u8], at: usize, depth: usize) -> Result<Option<Header<'_>>, MalformedReply> {
    if depth > DEPTH_MAX {
        return Err(malformed("nesting too deep"));
    }
    let Some(&marker) = buf.get(at) else { return Ok(None) };
    // The header line starts after the type byte, so a CRLF in its place is a
    // malformed header, not a slice that ends before it starts.
    let Some(line_end) =
        buf[at + 1..].windows(2).position(|pair| pair == b"\r\n").map(|offset| at + 1 + offset)
    else {
        return Ok(None);
    };
    Ok(Some((marker, &buf[at + 1..line_end], line_end + 2)))
}

fn parse_number(line: &[u8]) -> Result<i64, MalformedReply> {
    std::str::from_utf8(line).ok().and_then(|text| text.parse().ok()).ok_or_else(|| malformed("bad length"))
}

fn parse_double(line: &[u8]) -> Result<f64, MalformedReply> {
    std::str::from_utf8(line).ok().and_then(|text| text.parse().ok()).ok_or_else(|| malformed("bad double"))
}

/// Parses one value from the front of `buf`; `Ok(None)` means more bytes are needed.
pub fn parse_value(buf: &[u8]) -> Result<Option<(Value, usize)>, MalformedReply> {
    parse_at(buf, 0, 0)
}

fn parse_at(buf: &[u8], at: usize, depth: usize) -> Result<Option<(Value, usize)>, MalformedReply> {
    let Some((marker, line, next)) = read_header(buf, at, depth)? else { return Ok(None) };
    let text = || String::from_utf8_lossy(line).into_owned();
    let number = || parse_number(line);
    let value = match marker {
        b'+' => (Value::Simple(text()), next),
        b'-' => (Value::Error(text()), next),
        b':' => (Value::Integer(number()?), next),
        b'_' => (Value::Null, next),
        b'#' => (Value::Boolean(line == b"t"), next),
        b',' => (Value::Double(parse_double(line)?), next),
        b'(' => (Value::BigNumber(text()), next),
        b'$' | b'=' | b'!' => {
            let length = number()?;
            if length < 0 {
                return Ok(Some((Value::Null, next)));
            }
            let end = bulk_end(next, length)? - 2;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            let data = &buf[next..end];
            match marker {
                b'!' => (Value::Error(String::from_utf8_lossy(data).into_owned()), end + 2),
                // Verbatim strings start with a three-letter format and a colon.
                b'=' => (Value::Bulk(Bytes::copy_from_slice(data.get(4..).unwrap_or_default())), end + 2),
                _ => (Value::Bulk(Bytes::copy_from_slice(data)), end + 2),
            }
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let count = number()?;
            if count < 0 {
                return Ok(Some((Value::Null, next)));
            }
            let elements = if matches!(marker, b'%' | b'|') { count as usize * 2 } else { count as usize };
            let mut items = Vec::with_capacity(elements.min(4096));
            let mut position = next;
            for _ in 0..elements {
                match parse_at(buf, position, depth + 1)? {
                    Some((item, after)) => {
                        items.push(item);
                        position = after;
                    }
                    None => return Ok(None),
                }
            }
            let value = match marker {
                b'*' => Value::Array(items),
                b'~' => Value::Set(items),
                b'>' => Value::Push(items),
                b'|' => return parse_at(buf, position, depth + 1), // attributes precede the real reply
                _ => {
                    let mut pairs = Vec::with_capacity(items.len() / 2);
                    let mut items = items.into_iter();
                    while let (Some(key), Some(value)) = (items.next(), items.next()) {
                        pairs.push((key, value));
                    }
                    Value::Map(pairs)
                }
            };
            (value, position)
        }
        other => return Err(malformed(format!("unexpected type byte {:?}", other as char))),
    };
    Ok(Some(value))
}

/// The extent of one reply at the front of `buf`, without building it: how many
/// bytes it takes and, for an error reply at the top level, its message.
/// `Ok(None)` means more bytes are needed. For clients that only count replies
/// (load generators), this avoids an allocation per reply.
pub fn skip_value(buf: &[u8]) -> Result<Option<(usize, Option<String>)>, MalformedReply> {
    fn skip(buf: &[u8], at: usize, depth: usize) -> Result<Option<usize>, MalformedReply> {
        let Some((marker, line, next)) = read_header(buf, at, depth)? else { return Ok(None) };
        let number = || parse_number(line);
        match marker {
            b'+' | b'-' | b'_' | b'#' | b'(' => Ok(Some(next)),
            b':' => number().map(|_| Some(next)),
            b',' => parse_double(line).map(|_| Some(next)),
            b'$' | b'=' | b'!' => {
                let length = number()?;
                if length < 0 {
                    return Ok(Some(next));
                }
                let end = bulk_end(next, length)?;
                Ok((buf.len() >= end).then_some(end))
            }
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let count = number()?;
                if count < 0 {
                    return Ok(Some(next));
                }
                let elements =
                    if matches!(marker, b'%' | b'|') { count as usize * 2 } else { count as usize };
                let mut position = next;
                for _ in 0..elements {
                    match skip(buf, position, depth + 1)? {
                        Some(after) => position = after,
                        None => return Ok(None),
                    }
                }
                if marker == b'|' {
                    return skip(buf, position, depth + 1); // attributes precede the real reply
                }
                Ok(Some(position))
            }
            other => Err(malformed(format!("unexpected type byte {:?}", other as char))),
        }
    }
    let Some(end) = skip(buf, 0, 0)? else { return Ok(None) };
    let error = match buf.first() {
        Some(b'-') => Some(String::from_utf8_lossy(&buf[1..end - 2]).into_owned()),
        Some(b'!') => parse_value(&buf[..end])?.and_then(|(value, _)| match value {
            Value::Error(message) => Some(message),
            _ => None,
        }),
        _ => None,
    };
    Ok(Some((end, error)))
}

/// Appends `args` to `out` as a RESP array of bulk strings.
pub fn encode_command<A: AsRef<[u8]>>(args: &[A], out: &mut Vec<u8>) {
    let mut digits = itoa::Buffer::new();
    out.push(b'*');
    out.extend_from_slice(digits.format(args.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        let arg = arg.as_ref();
        out.push(b'$');
        out.extend_from_slice(digits.format(arg.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_nested_resp3_values() {
        let buf = b"%2\r\n+a\r\n:1\r\n$1\r\nb\r\n*2\r\n_\r\n,2.5\r\n";
        let (value, used) = parse_value(buf).unwrap().unwrap();
        assert_eq!(used, buf.len());
        assert_eq!(
            value,
            Value::Map(vec![
                (Value::Simple("a".into()), Value::Integer(1)),
                (Value::Bulk(Bytes::from_static(b"b")), Value::Array(vec![Value::Null, Value::Double(2.5)])),
            ])
        );
    }

    #[test]
    fn a_reply_starting_with_crlf_is_an_error_not_a_panic() {
        assert_eq!(parse_value(b"\r\n"), Ok(None));
        assert!(parse_value(b"\r\n:1\r\n").is_err());
        assert!(skip_value(b"\r\n:1\r\n").is_err());
    }

    #[test]
    fn a_run_of_attributes_is_refused_not_a_stack_overflow() {
        let mut buf = b"|0\r\n".repeat(200_000);
        buf.extend_from_slice(b"+OK\r\n");
        assert!(parse_value(&buf).is_err());
        assert!(skip_value(&buf).is_err());
        // A few attributes before a reply are fine.
        let buf = b"|1\r\n+ttl\r\n:3\r\n|0\r\n+OK\r\n";
        assert_eq!(parse_value(buf).unwrap(), Some((Value::Simple("OK".into()), buf.len())));
        assert_eq!(skip_value(buf).unwrap(), Some((buf.len(), None)));
    }

    #[test]
    fn a_bulk_length_past_the_limit_is_refused_not_waited_for() {
        for header in [
            format!("${}\r\nab", REPLY_BULK_BYTES_MAX + 1),
            format!("${}\r\nab", i64::MAX),
            format!("*1\r\n!{}\r\n", u64::MAX - 3),
        ] {
            assert!(parse_value(header.as_bytes()).is_err(), "{header}");
            assert!(skip_value(header.as_bytes()).is_err(), "{header}");
        }
        let at_the_limit = format!("${REPLY_BULK_BYTES_MAX}\r\nab");
        assert_eq!(parse_value(at_the_limit.as_bytes()), Ok(None), "waits for the bytes");
    }

    #[test]
    fn waits_for_incomplete_values() {
        assert_eq!(parse_value(b"*2\r\n:1\r\n").unwrap(), None);
        assert_eq!(parse_value(b"$5\r\nab").unwrap(), None);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_value(&bytes);
            let _ = skip_value(&bytes);
        }

        #[test]
        fn skipping_agrees_with_parsing(bytes in proptest::collection::vec(
            prop_oneof![Just(b'*'), Just(b'$'), Just(b'%'), Just(b'-'), Just(b'+'), Just(b':'), Just(b'1'),
                        Just(b'2'), Just(b'\r'), Just(b'\n'), Just(b'x'), Just(b'_'), Just(b'|')], 0..48)) {
            match (parse_value(&bytes), skip_value(&bytes)) {
                (Ok(Some((value, used))), Ok(Some((skipped, error)))) => {
                    prop_assert_eq!(used, skipped);
                    prop_assert_eq!(matches!(value, Value::Error(_)), error.is_some());
                }
                (Ok(None), Ok(None)) | (Err(_), Err(_)) => {}
                (parsed, skipped) => prop_assert!(false, "parse {:?} vs skip {:?}", parsed, skipped),
            }
        }
    }
}
