//! Key → shard routing (docs/design.md §9): jump consistent hash (Lamping & Veach 2014) of XXH64
//! (seed 0) of the partition key's UTF-8 bytes, over `shardCount`.
//!
//! The algorithm is written out, with test vectors, in the README's "Routing" section so that
//! producers in other languages can route exactly like this one. The vectors are pinned by the
//! unit tests below.

/// The multiplier of the 64-bit linear congruential generator of the jump consistent hash
/// (Lamping & Veach 2014, "A Fast, Minimal Memory, Consistent Hash Algorithm", arXiv:1406.2294).
pub const JUMP_LCG_MULTIPLIER: u64 = 2_862_933_555_777_941_757;

/// The XXH64 seed of the partition key hash: 0.
pub const KEY_HASH_SEED: u64 = 0;

/// XXH64 with seed 0 of the key's UTF-8 bytes: the 64-bit input of the jump consistent hash.
///
/// For example `key_hash("")` is `0xef46db3751d8e999` and `key_hash("a")` is
/// `0xd24ec4f1a98c6e5b`.
pub fn key_hash(partition_key: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(partition_key.as_bytes(), KEY_HASH_SEED)
}

/// The jump consistent hash of `key` over `num_buckets` buckets: a bucket in
/// `0..num_buckets`, exactly as the C++ code of Lamping & Veach (2014), figure 1:
///
/// ```c++
/// int32_t JumpConsistentHash(uint64_t key, int32_t num_buckets) {
///     int64_t b = -1, j = 0;
///     while (j < num_buckets) {
///         b = j;
///         key = key * 2862933555777941757ULL + 1;
///         j = (b + 1) * (double(1LL << 31) / double((key >> 33) + 1));
///     }
///     return b;
/// }
/// ```
///
/// Growing `num_buckets` from `n` to `n + 1` moves about `1/(n + 1)` of the keys, all of them to
/// the new bucket `n`; no key moves between two buckets that exist before and after.
///
/// `num_buckets == 0` has no bucket: the paper's code returns `-1`; this function returns `0`.
/// Callers must refuse zero buckets themselves ([`crate::producer::Publisher`] does, with
/// [`crate::producer::PublishError::NoShards`]).
pub fn jump_consistent_hash(key: u64, num_buckets: u32) -> u32 {
    let mut key = key;
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    let buckets = i64::from(num_buckets);
    while j < buckets {
        b = j;
        key = key.wrapping_mul(JUMP_LCG_MULTIPLIER).wrapping_add(1);
        // Same arithmetic as the C++: double division, double product, truncation to int64.
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    // `b` is in `-1..num_buckets`, so it fits a u32 once `-1` (no bucket) is mapped to 0.
    u32::try_from(b).unwrap_or(0)
}

/// The shard of `partition_key` when a stream has `shard_count` ACTIVE shards `0..shard_count`
/// (docs/design.md §9): `jump_consistent_hash(key_hash(partition_key), shard_count)`.
///
/// Any string is a valid key, including the empty string (it hashes like any other).
/// `shard_count == 0` (a fully drained stream) returns `0`, which is not a shard: the
/// [`crate::producer::Publisher`] refuses to publish to a stream without shards with
/// [`crate::producer::PublishError::NoShards`] before routing.
pub fn shard_for_key(partition_key: &str, shard_count: u32) -> u32 {
    jump_consistent_hash(key_hash(partition_key), shard_count)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's test vectors: key, XXH64 (seed 0) of its UTF-8 bytes, and its shard for
    /// shard counts 1..=16. Computed with this implementation and, independently, with Python
    /// (`xxhash.xxh64_intdigest(key.encode(), seed=0)` and a line-by-line transcription of the
    /// paper's C++).
    #[rustfmt::skip]
    const VECTORS: &[(&str, u64, [u32; 16])] = &[
        ("", 0xef46_db37_51d8_e999, [0, 1, 2, 2, 2, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7]),
        ("a", 0xd24e_c4f1_a98c_6e5b, [0, 1, 1, 1, 1, 1, 6, 6, 8, 8, 8, 8, 8, 8, 8, 8]),
        ("order-1", 0x3baf_4120_aa43_a0ad, [0, 0, 0, 3, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]),
        ("order-2", 0x8f8f_6c2e_829b_9f6d, [0, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 11, 11, 11, 11, 11]),
        ("customer:42", 0xeae7_0e89_1218_91b7, [0, 0, 0, 3, 4, 5, 5, 5, 5, 5, 5, 11, 11, 11, 11, 11]),
        ("user@example.com", 0xe92a_4a9e_39fe_3d60, [0, 0, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 12, 12, 12, 12]),
        ("ключ", 0xa17d_2dd1_3d89_d19c, [0, 0, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 10, 10]),
        ("日本語", 0x7179_a19f_3719_f5e1, [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
        ("a partition key longer than thirty-two bytes", 0xb980_1129_81c2_3f51, [0, 0, 0, 0, 0, 0, 0, 7, 7, 7, 7, 7, 7, 7, 7, 7]),
    ];

    #[test]
    fn readme_test_vectors_are_pinned() {
        for (key, hash, shards) in VECTORS {
            assert_eq!(key_hash(key), *hash, "XXH64 of {key:?}");
            for (count, expected) in (1..=16).zip(shards) {
                assert_eq!(
                    shard_for_key(key, count),
                    *expected,
                    "key {key:?}, {count} shards"
                );
            }
        }
    }

    #[test]
    fn jump_hash_of_raw_keys_matches_the_paper_transcription() {
        // (key, [(buckets, bucket)]), computed with a Python transcription of the paper's C++.
        let cases: &[(u64, &[(u32, u32)])] = &[
            (0, &[(1, 0), (2, 0), (1000, 0), (i32::MAX as u32, 0)]),
            (
                1,
                &[
                    (5, 0),
                    (8, 6),
                    (100, 55),
                    (1000, 549),
                    (i32::MAX as u32, 262_355_607),
                ],
            ),
            (
                u64::MAX,
                &[
                    (3, 2),
                    (5, 2),
                    (8, 7),
                    (16, 10),
                    (100, 92),
                    (1000, 313),
                    (i32::MAX as u32, 699_554_662),
                ],
            ),
            (
                123_456_789,
                &[
                    (8, 7),
                    (100, 34),
                    (1000, 294),
                    (i32::MAX as u32, 1_234_790_967),
                ],
            ),
        ];
        for (key, expectations) in cases {
            for (buckets, bucket) in *expectations {
                assert_eq!(
                    jump_consistent_hash(*key, *buckets),
                    *bucket,
                    "key {key}, {buckets} buckets"
                );
            }
        }
    }

    #[test]
    fn zero_shards_is_documented_as_zero_and_never_panics() {
        assert_eq!(jump_consistent_hash(42, 0), 0);
        assert_eq!(shard_for_key("anything", 0), 0);
        assert!(jump_consistent_hash(u64::MAX, u32::MAX) < u32::MAX);
    }

    #[test]
    fn every_shard_is_below_the_count() {
        for count in 1..=64 {
            for i in 0..2_000 {
                assert!(shard_for_key(&format!("k{i}"), count) < count);
            }
        }
    }

    #[test]
    fn hundred_thousand_keys_over_16_shards_land_within_5_percent_of_even() {
        let mut counts = [0u32; 16];
        for i in 0..100_000 {
            counts[shard_for_key(&format!("key-{i}"), 16) as usize] += 1;
        }
        let even = 100_000.0 / 16.0;
        for (shard, count) in counts.iter().enumerate() {
            let deviation = (f64::from(*count) - even).abs() / even;
            assert!(
                deviation <= 0.05,
                "shard {shard}: {count} keys, {:.2}% off even ({even})",
                deviation * 100.0
            );
        }
    }

    #[test]
    fn resharding_8_to_9_moves_about_a_ninth_and_only_to_the_new_shard() {
        let total = 100_000;
        let mut moved = 0;
        for i in 0..total {
            let key = format!("key-{i}");
            let before = shard_for_key(&key, 8);
            let after = shard_for_key(&key, 9);
            if before != after {
                assert_eq!(
                    after, 8,
                    "{key} moved between surviving shards {before}→{after}"
                );
                moved += 1;
            }
        }
        let fraction = f64::from(moved) / f64::from(total);
        assert!(
            (0.09..=0.13).contains(&fraction),
            "{moved} of {total} keys moved ({:.2}%), expected about 1/9",
            fraction * 100.0
        );
    }

    #[test]
    fn scale_in_moves_only_the_keys_of_removed_shards() {
        for i in 0..20_000 {
            let key = format!("key-{i}");
            let before = shard_for_key(&key, 9);
            let after = shard_for_key(&key, 8);
            if before < 8 {
                assert_eq!(before, after, "{key} left a surviving shard");
            } else {
                assert!(after < 8);
            }
        }
    }
}
