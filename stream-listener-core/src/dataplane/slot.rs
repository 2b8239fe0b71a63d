//! Redis Cluster hash slots of keys, to group shards for blocking waits (one slot per call).

/// The Redis Cluster hash slot (0..16384) of `key`: CRC16 (XMODEM) of its hash tag — the part
/// between the first `{` and the next `}` when non-empty — or of the whole key, modulo 16384.
/// Shard `i` of prefix `p` (`{p:i}`) has the slot of `p:i`.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|&b| b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    crc16_xmodem(hashed) % 16384
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_redis_cluster_specification() {
        // The specification's test vector: CRC16("123456789") = 0x31C3.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot("123456789"), 0x31C3);
        // Values from CLUSTER KEYSLOT on Redis 7.0.
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("somekey"), 11058);
        assert_eq!(key_slot("foo{hash_tag}"), 2515);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("{orders:0}"), key_slot("orders:0"));
        assert_eq!(key_slot("{orders:0}:fence"), key_slot("{orders:0}"));
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(key_slot("{}orders"), crc16_xmodem(b"{}orders") % 16384);
        assert_eq!(key_slot("a{b"), crc16_xmodem(b"a{b") % 16384);
    }
}
