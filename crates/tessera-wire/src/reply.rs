//! Writes replies in RESP2 or RESP3, whichever the connection negotiated with
//! HELLO. Types RESP2 lacks (maps, sets, doubles, booleans, null) fall back to
//! their RESP2 spellings, as Redis does.

/// The protocol version a connection speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Protocol {
    #[default]
    Resp2,
    Resp3,
}

/// An output buffer of replies, optionally bounded: past its limit, values
/// are no longer appended and the writer says it overflowed (its owner then
/// drops it, as Redis closes a client over its output-buffer limit).
#[derive(Debug)]
pub struct ReplyWriter {
    buf: Vec<u8>,
    protocol: Protocol,
    limit: usize,
    overflowed: bool,
}

impl Default for ReplyWriter {
    fn default() -> Self {
        Self::new(Protocol::default())
    }
}

impl ReplyWriter {
    pub fn new(protocol: Protocol) -> Self {
        Self { buf: Vec::with_capacity(16 << 10), protocol, limit: usize::MAX, overflowed: false }
    }

    /// Bounds the buffer to about `bytes` (0: no bound).
    pub fn limit_to(&mut self, bytes: usize) {
        self.limit = if bytes == 0 { usize::MAX } else { bytes };
    }

    /// Whether a value was left out for want of room.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Whether `bytes` more fit; if not, the writer has overflowed.
    fn room_for(&mut self, bytes: usize) -> bool {
        if self.buf.len().saturating_add(bytes) > self.limit {
            self.overflowed = true;
        }
        !self.overflowed
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    pub fn set_protocol(&mut self, protocol: Protocol) {
        self.protocol = protocol;
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn clear(&mut self) {
        self.buf.clear();
        self.overflowed = false;
    }

    /// Gives memory back after an unusually large reply.
    pub fn shrink_to(&mut self, capacity: usize) {
        if self.buf.capacity() > capacity && self.buf.len() <= capacity {
            self.buf.shrink_to(capacity);
        }
    }

    /// Drops what was written after `mark` (a length taken earlier with [`len`](Self::len)).
    pub fn truncate(&mut self, mark: usize) {
        self.buf.truncate(mark);
    }

    /// Appends replies already encoded (relayed from another server, or kept
    /// aside while a rewrite replaces the ones between).
    pub fn raw(&mut self, encoded: &[u8]) {
        if self.room_for(encoded.len()) {
            self.buf.extend_from_slice(encoded);
        }
    }

    fn line(&mut self, prefix: u8, body: &[u8]) {
        self.buf.push(prefix);
        self.buf.extend_from_slice(body);
        self.buf.extend_from_slice(b"\r\n");
    }

    fn number_line(&mut self, prefix: u8, value: i64) {
        let mut digits = itoa::Buffer::new();
        self.line(prefix, digits.format(value).as_bytes());
    }

    pub fn ok(&mut self) {
        self.buf.extend_from_slice(b"+OK\r\n");
    }

    /// A simple string; it must not contain CR or LF.
    pub fn simple(&mut self, text: &str) {
        debug_assert!(!text.contains(['\r', '\n']));
        self.line(b'+', text.as_bytes());
    }

    /// An error; `message` starts with its code (`ERR`, `WRONGTYPE`, ...). Line
    /// breaks are replaced so that the reply stays one frame.
    pub fn error(&mut self, message: &str) {
        if message.contains(['\r', '\n']) {
            self.line(b'-', message.replace(['\r', '\n'], " ").as_bytes());
        } else {
            self.line(b'-', message.as_bytes());
        }
    }

    pub fn integer(&mut self, value: i64) {
        self.number_line(b':', value);
    }

    pub fn bulk(&mut self, value: &[u8]) {
        if !self.room_for(value.len()) {
            return;
        }
        self.number_line(b'$', value.len() as i64);
        self.buf.extend_from_slice(value);
        self.buf.extend_from_slice(b"\r\n");
    }

    pub fn bulk_or_null(&mut self, value: Option<&[u8]>) {
        match value {
            Some(value) => self.bulk(value),
            None => self.null(),
        }
    }

    /// The null bulk string (RESP2) or null (RESP3).
    pub fn null(&mut self) {
        match self.protocol {
            Protocol::Resp2 => self.buf.extend_from_slice(b"$-1\r\n"),
            Protocol::Resp3 => self.buf.extend_from_slice(b"_\r\n"),
        }
    }

    /// The null array (RESP2) or null (RESP3).
    pub fn null_array(&mut self) {
        match self.protocol {
            Protocol::Resp2 => self.buf.extend_from_slice(b"*-1\r\n"),
            Protocol::Resp3 => self.buf.extend_from_slice(b"_\r\n"),
        }
    }

    pub fn array(&mut self, length: usize) {
        self.number_line(b'*', length as i64);
    }

    /// A map of `length` pairs; in RESP2 a flat array of twice the length.
    pub fn map(&mut self, length: usize) {
        match self.protocol {
            Protocol::Resp2 => self.number_line(b'*', 2 * length as i64),
            Protocol::Resp3 => self.number_line(b'%', length as i64),
        }
    }

    /// An out-of-band message of `length` parts (pub/sub): a push in RESP3,
    /// an array in RESP2.
    pub fn push(&mut self, length: usize) {
        match self.protocol {
            Protocol::Resp2 => self.number_line(b'*', length as i64),
            Protocol::Resp3 => self.number_line(b'>', length as i64),
        }
    }

    pub fn set(&mut self, length: usize) {
        match self.protocol {
            Protocol::Resp2 => self.number_line(b'*', length as i64),
            Protocol::Resp3 => self.number_line(b'~', length as i64),
        }
    }

    pub fn boolean(&mut self, value: bool) {
        match self.protocol {
            Protocol::Resp2 => self.integer(i64::from(value)),
            Protocol::Resp3 => self.buf.extend_from_slice(if value { b"#t\r\n" } else { b"#f\r\n" }),
        }
    }

    /// A double; in RESP2 a bulk string.
    pub fn double(&mut self, value: f64) {
        let text = format_double(value);
        match self.protocol {
            Protocol::Resp2 => self.bulk(text.as_bytes()),
            Protocol::Resp3 => self.line(b',', text.as_bytes()),
        }
    }

    /// Human-readable text (INFO): a verbatim string in RESP3, a bulk string in RESP2.
    pub fn verbatim(&mut self, text: &str) {
        match self.protocol {
            Protocol::Resp2 => self.bulk(text.as_bytes()),
            Protocol::Resp3 => {
                self.number_line(b'=', text.len() as i64 + 4);
                self.buf.extend_from_slice(b"txt:");
                self.buf.extend_from_slice(text.as_bytes());
                self.buf.extend_from_slice(b"\r\n");
            }
        }
    }
}

/// Formats a double the way Redis prints scores: integers without a fraction,
/// infinities as `inf` / `-inf`.
pub fn format_double(value: f64) -> String {
    if value.is_infinite() {
        return if value > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if value.is_nan() {
        return "nan".into();
    }
    if value.fract() == 0.0 && value.abs() < 1e17 {
        return format!("{}", value as i64);
    }
    format!("{value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_writer_stops_at_its_limit_and_says_so() {
        let mut out = ReplyWriter::new(Protocol::Resp2);
        out.limit_to(100);
        out.bulk(&[b'x'; 60]);
        assert!(!out.overflowed());
        out.bulk(&[b'y'; 60]);
        assert!(out.overflowed(), "past the limit");
        assert!(out.len() <= 100, "the value that did not fit was left out: {}", out.len());
        out.clear();
        assert!(!out.overflowed(), "a cleared writer starts over");
        out.limit_to(0);
        out.bulk(&[b'z'; 1000]);
        assert!(!out.overflowed(), "0 is no limit");
    }

    #[test]
    fn resp2_and_resp3_spell_types_differently() {
        let mut two = ReplyWriter::new(Protocol::Resp2);
        let mut three = ReplyWriter::new(Protocol::Resp3);
        for writer in [&mut two, &mut three] {
            writer.map(1);
            writer.bulk(b"k");
            writer.null();
            writer.boolean(true);
            writer.double(1.5);
        }
        assert_eq!(two.as_bytes(), b"*2\r\n$1\r\nk\r\n$-1\r\n:1\r\n$3\r\n1.5\r\n");
        assert_eq!(three.as_bytes(), b"%1\r\n$1\r\nk\r\n_\r\n#t\r\n,1.5\r\n");
    }

    #[test]
    fn errors_stay_on_one_line() {
        let mut writer = ReplyWriter::new(Protocol::Resp2);
        writer.error("ERR bad\r\nthing");
        assert_eq!(writer.as_bytes(), b"-ERR bad  thing\r\n");
    }
}
