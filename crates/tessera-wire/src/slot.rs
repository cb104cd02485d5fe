//! Redis Cluster's key slots: which of the 16384 slots a key hashes to.

/// The number of hash slots.
pub const SLOTS: usize = 16384;

/// CRC16/XMODEM, the checksum Redis Cluster hashes keys with.
const fn crc16_table() -> [u16; 256] {
    let mut table = [0u16; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut crc = (byte as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
            bit += 1;
        }
        table[byte] = crc;
        byte += 1;
    }
    table
}

const CRC16: [u16; 256] = crc16_table();

fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &byte| (crc << 8) ^ CRC16[((crc >> 8) as u8 ^ byte) as usize])
}

/// The slot of a key: the CRC of its hash tag (`{...}`) if it has a non-empty
/// one, else of the whole key.
pub fn key_slot(key: &[u8]) -> usize {
    let hashed = key
        .iter()
        .position(|&byte| byte == b'{')
        .and_then(|open| {
            let close = key[open + 1..].iter().position(|&byte| byte == b'}')?;
            (close > 0).then(|| &key[open + 1..open + 1 + close])
        })
        .unwrap_or(key);
    crc16(hashed) as usize % SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") as usize % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }
}
