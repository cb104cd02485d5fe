//! The server side parser of client commands: RESP arrays of bulk strings and
//! the inline (telnet) form.
//!
//! The parser keeps its progress between calls, so a large request that arrives
//! in many reads is scanned once, not once per read. Arguments are byte ranges
//! into the caller's buffer: nothing is copied until a command decides to keep it.

use std::ops::Range;

/// Limits on what a client may send. Every field is a configuration value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest bulk string (one argument) in bytes.
    pub bulk_bytes_max: usize,
    /// The most arguments in one command.
    pub args_max: usize,
    /// The longest inline command line in bytes.
    pub inline_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { bulk_bytes_max: 512 << 20, args_max: 1 << 20, inline_bytes_max: 64 << 10 }
    }
}

/// A request the stream cannot recover from: the connection must be closed after
/// the error is sent, because the next frame boundary is unknown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("Protocol error: invalid multibulk length")]
    InvalidMultibulkLength,
    #[error("Protocol error: invalid bulk length")]
    InvalidBulkLength,
    #[error("Protocol error: expected '$', got '{0}'")]
    ExpectedBulk(char),
    #[error("Protocol error: bulk string not terminated by CRLF")]
    UnterminatedBulk,
    #[error("Protocol error: too big inline request")]
    InlineTooLong,
    #[error("Protocol error: unbalanced quotes in request")]
    UnbalancedQuotes,
}

/// The outcome of one parse attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole command ends at this offset; its arguments are in [`RequestParser::args`].
    Complete { end: usize },
    /// An empty line or `*0`: nothing to run; parsing goes on at `end`.
    Empty { end: usize },
    /// More bytes are needed.
    Incomplete,
}

/// A parsed command borrowed from the buffer it came from.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    buf: &'a [u8],
    ranges: &'a [Range<usize>],
}

impl<'a> Request<'a> {
    pub fn new(buf: &'a [u8], ranges: &'a [Range<usize>]) -> Self {
        Self { buf, ranges }
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The argument at `index` (0 is the command name).
    pub fn arg(&self, index: usize) -> &'a [u8] {
        &self.buf[self.ranges[index].clone()]
    }

    /// The request made of the arguments from `index` on: a command another
    /// wraps (`index` must be below `len()`).
    pub fn tail(&self, index: usize) -> Request<'a> {
        Request { buf: self.buf, ranges: &self.ranges[index..] }
    }

    pub fn args(&self) -> impl ExactSizeIterator<Item = &'a [u8]> + '_ {
        self.ranges.iter().map(|range| &self.buf[range.clone()])
    }
}

/// A resumable request parser. Usage: call [`parse`](Self::parse) with the buffer
/// and the offset of the next frame; after `Complete`, read [`args`](Self::args),
/// then parse on from `end`. Before dropping bytes from the buffer's front, call
/// [`discard_front`](Self::discard_front) so a half-parsed frame stays valid.
#[derive(Debug)]
pub struct RequestParser {
    limits: Limits,
    args: Vec<Range<usize>>,
    /// Whether a frame is half parsed; if so, where it starts, where parsing
    /// resumes, and how many arguments its header announced (`None` until read).
    in_progress: bool,
    frame_start: usize,
    resume_at: usize,
    args_expected: Option<usize>,
}

fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?.windows(2).position(|pair| pair == b"\r\n").map(|at| from + at)
}

/// Parses the decimal integer in `digits` (an optional '-' then 1..=18 digits).
fn parse_integer(digits: &[u8]) -> Option<i64> {
    let (negative, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value = digits.iter().fold(0i64, |acc, digit| acc * 10 + i64::from(digit - b'0'));
    Some(if negative { -value } else { value })
}

impl RequestParser {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            args: Vec::new(),
            in_progress: false,
            frame_start: 0,
            resume_at: 0,
            args_expected: None,
        }
    }

    /// The arguments of the command last reported `Complete`.
    pub fn args(&self) -> &[Range<usize>] {
        &self.args
    }

    /// Forgets a half-parsed frame: the next `parse` starts afresh.
    pub fn reset(&mut self) {
        self.in_progress = false;
    }

    /// Tells the parser that `count` bytes were removed from the buffer's front
    /// (all of them before the frame being parsed).
    pub fn discard_front(&mut self, count: usize) {
        if !self.in_progress {
            return;
        }
        assert!(count <= self.frame_start, "discarding bytes of the frame being parsed");
        self.frame_start -= count;
        self.resume_at -= count;
        for range in &mut self.args {
            *range = range.start - count..range.end - count;
        }
    }

    pub fn parse(&mut self, buf: &[u8], start: usize) -> Result<Parsed, ProtocolError> {
        if !self.in_progress || start != self.frame_start {
            self.in_progress = true;
            self.frame_start = start;
            self.resume_at = start;
            self.args_expected = None;
            self.args.clear();
        }
        let Some(&first) = buf.get(start) else { return Ok(Parsed::Incomplete) };
        let parsed = if first == b'*' { self.parse_multibulk(buf) } else { self.parse_inline(buf) };
        self.in_progress = matches!(parsed, Ok(Parsed::Incomplete));
        parsed
    }

    fn parse_multibulk(&mut self, buf: &[u8]) -> Result<Parsed, ProtocolError> {
        let expected = match self.args_expected {
            Some(expected) => expected,
            None => {
                let Some(line_end) = find_crlf(buf, self.frame_start) else {
                    if buf.len() - self.frame_start > 32 {
                        return Err(ProtocolError::InvalidMultibulkLength);
                    }
                    return Ok(Parsed::Incomplete);
                };
                let count = parse_integer(&buf[self.frame_start + 1..line_end])
                    .ok_or(ProtocolError::InvalidMultibulkLength)?;
                if count > self.limits.args_max as i64 {
                    return Err(ProtocolError::InvalidMultibulkLength);
                }
                self.resume_at = line_end + 2;
                if count <= 0 {
                    return Ok(Parsed::Empty { end: self.resume_at });
                }
                self.args.clear();
                self.args.reserve(count.min(1024) as usize);
                self.args_expected = Some(count as usize);
                count as usize
            }
        };
        while self.args.len() < expected {
            let at = self.resume_at;
            let Some(&marker) = buf.get(at) else { return Ok(Parsed::Incomplete) };
            if marker != b'$' {
                return Err(ProtocolError::ExpectedBulk(marker as char));
            }
            let Some(line_end) = find_crlf(buf, at) else {
                if buf.len() - at > 32 {
                    return Err(ProtocolError::InvalidBulkLength);
                }
                return Ok(Parsed::Incomplete);
            };
            let length = parse_integer(&buf[at + 1..line_end]).ok_or(ProtocolError::InvalidBulkLength)?;
            if length < 0 || length as u64 > self.limits.bulk_bytes_max as u64 {
                return Err(ProtocolError::InvalidBulkLength);
            }
            let data_start = line_end + 2;
            let data_end = data_start + length as usize;
            if buf.len() < data_end + 2 {
                return Ok(Parsed::Incomplete);
            }
            if &buf[data_end..data_end + 2] != b"\r\n" {
                return Err(ProtocolError::UnterminatedBulk);
            }
            self.args.push(data_start..data_end);
            self.resume_at = data_end + 2;
        }
        Ok(Parsed::Complete { end: self.resume_at })
    }

    /// The inline form: one line of space-separated words, with "double" and
    /// 'single' quotes for words that contain spaces.
    fn parse_inline(&mut self, buf: &[u8]) -> Result<Parsed, ProtocolError> {
        let start = self.frame_start;
        let Some(newline) = buf[start..].iter().position(|&byte| byte == b'\n').map(|at| start + at) else {
            if buf.len() - start > self.limits.inline_bytes_max {
                return Err(ProtocolError::InlineTooLong);
            }
            return Ok(Parsed::Incomplete);
        };
        if newline - start > self.limits.inline_bytes_max {
            return Err(ProtocolError::InlineTooLong);
        }
        let line_end = if newline > start && buf[newline - 1] == b'\r' { newline - 1 } else { newline };
        self.args.clear();
        let mut at = start;
        while at < line_end {
            match buf[at] {
                b' ' | b'\t' => at += 1,
                quote @ (b'"' | b'\'') => {
                    let close = buf[at + 1..line_end]
                        .iter()
                        .position(|&byte| byte == quote)
                        .map(|offset| at + 1 + offset)
                        .ok_or(ProtocolError::UnbalancedQuotes)?;
                    self.args.push(at + 1..close);
                    at = close + 1;
                }
                _ => {
                    let word_end = buf[at..line_end]
                        .iter()
                        .position(|&byte| byte == b' ' || byte == b'\t')
                        .map_or(line_end, |offset| at + offset);
                    self.args.push(at..word_end);
                    at = word_end;
                }
            }
            if self.args.len() > self.limits.args_max {
                return Err(ProtocolError::InvalidMultibulkLength);
            }
        }
        let end = newline + 1;
        Ok(if self.args.is_empty() { Parsed::Empty { end } } else { Parsed::Complete { end } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_all(buf: &[u8]) -> Result<Vec<Vec<Vec<u8>>>, ProtocolError> {
        let mut parser = RequestParser::new(Limits::default());
        let mut commands = Vec::new();
        let mut start = 0;
        loop {
            match parser.parse(buf, start)? {
                Parsed::Complete { end } => {
                    commands.push(Request::new(buf, parser.args()).args().map(<[u8]>::to_vec).collect());
                    start = end;
                }
                Parsed::Empty { end } => start = end,
                Parsed::Incomplete => return Ok(commands),
            }
        }
    }

    fn encode(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    #[test]
    fn parses_pipelined_multibulk_commands() {
        let buf = b"*1\r\n$4\r\nPING\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n";
        let commands = parse_all(buf).unwrap();
        assert_eq!(commands, vec![vec![b"PING".to_vec()], vec![b"SET".to_vec(), b"k".to_vec(), vec![]]]);
    }

    #[test]
    fn parses_inline_commands_with_quotes() {
        let commands = parse_all(b"set k \"hello world\"\r\nPING\n\r\n").unwrap();
        assert_eq!(
            commands,
            vec![vec![b"set".to_vec(), b"k".to_vec(), b"hello world".to_vec()], vec![b"PING".to_vec()]]
        );
    }

    #[test]
    fn rejects_malformed_frames() {
        assert_eq!(parse_all(b"*x\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parse_all(b"*1\r\n+PING\r\n"), Err(ProtocolError::ExpectedBulk('+')));
        assert_eq!(parse_all(b"*1\r\n$-5\r\n"), Err(ProtocolError::InvalidBulkLength));
        assert_eq!(parse_all(b"*1\r\n$2\r\nabXY"), Err(ProtocolError::UnterminatedBulk));
        assert_eq!(parse_all(b"set k \"open\r\n"), Err(ProtocolError::UnbalancedQuotes));
    }

    #[test]
    fn enforces_limits() {
        let limits = Limits { bulk_bytes_max: 4, args_max: 2, inline_bytes_max: 8 };
        let mut parser = RequestParser::new(limits);
        assert_eq!(parser.parse(b"*1\r\n$5\r\n", 0), Err(ProtocolError::InvalidBulkLength));
        assert_eq!(parser.parse(b"*3\r\n", 0), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parser.parse(b"aaaaaaaaaaaa", 0), Err(ProtocolError::InlineTooLong));
        // A length announcement that never ends is not buffered forever.
        assert_eq!(parser.parse(&[b'*'; 40], 0), Err(ProtocolError::InvalidMultibulkLength));
    }

    #[test]
    fn resumes_a_frame_split_across_reads_after_discarding_the_front() {
        let first = encode(&[b"GET".to_vec(), b"a".to_vec()]);
        let second = encode(&[b"SET".to_vec(), b"key".to_vec(), vec![7u8; 1000]]);
        let mut parser = RequestParser::new(Limits::default());
        let mut buf = first.clone();
        buf.extend_from_slice(&second[..500]);
        let Parsed::Complete { end } = parser.parse(&buf, 0).unwrap() else { panic!("first frame") };
        assert_eq!(parser.parse(&buf, end).unwrap(), Parsed::Incomplete);
        buf.drain(..end);
        parser.discard_front(end);
        buf.extend_from_slice(&second[500..]);
        assert_eq!(parser.parse(&buf, 0).unwrap(), Parsed::Complete { end: second.len() });
        let request = Request::new(&buf, parser.args());
        assert_eq!(request.arg(1), b"key");
        assert_eq!(request.arg(2), &[7u8; 1000][..]);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_all(&bytes);
        }

        #[test]
        fn encoded_commands_round_trip_in_any_split(
            commands in proptest::collection::vec(
                proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..5), 1..5),
            split in any::<prop::sample::Index>(),
        ) {
            let wire: Vec<u8> = commands.iter().flat_map(|args| encode(args)).collect();
            let cut = split.index(wire.len() + 1);
            let mut parser = RequestParser::new(Limits::default());
            let mut parsed = Vec::new();
            let mut buf = wire[..cut].to_vec();
            let mut start = 0;
            for round in 0..2 {
                loop {
                    match parser.parse(&buf, start).unwrap() {
                        Parsed::Complete { end } => {
                            parsed.push(Request::new(&buf, parser.args()).args().map(<[u8]>::to_vec).collect::<Vec<_>>());
                            start = end;
                        }
                        Parsed::Empty { end } => start = end,
                        Parsed::Incomplete => break,
                    }
                }
                if round == 0 {
                    buf.drain(..start);
                    parser.discard_front(start);
                    start = 0;
                    buf.extend_from_slice(&wire[cut..]);
                }
            }
            prop_assert_eq!(parsed, commands);
        }
    }
}
