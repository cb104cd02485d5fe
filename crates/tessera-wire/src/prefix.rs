//! Key prefixes as text (table definitions in catalogs and cluster maps) and
//! the rule for table names, shared by nodes and the cluster map.

/// Renders a prefix for the catalog and for replies: printable ASCII as is,
/// other bytes as `\xNN`.
pub fn escape_prefix(prefix: &[u8]) -> String {
    prefix
        .iter()
        .map(|&byte| {
            if byte.is_ascii_graphic() && byte != b'\\' || byte == b' ' {
                (byte as char).to_string()
            } else {
                format!("\\x{byte:02x}")
            }
        })
        .collect()
}

pub fn unescape_prefix(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let hex = std::str::from_utf8(bytes.get(i + 2..i + 4)?).ok()?;
            if bytes.get(i + 1) != Some(&b'x') {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Table names: 1 to 64 letters, digits, '-' or '_'.
pub fn valid_table_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_escape_and_unescape() {
        for prefix in [&b"user:"[..], b"\x00\xff", b"a\\b", b""] {
            assert_eq!(unescape_prefix(&escape_prefix(prefix)).unwrap(), prefix);
        }
        assert_eq!(unescape_prefix("\\x4"), None);
        assert!(valid_table_name("events_2") && !valid_table_name("") && !valid_table_name("a b"));
    }
}
