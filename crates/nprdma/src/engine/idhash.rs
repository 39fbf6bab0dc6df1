//! A cheap hasher for the engine's `u32`-keyed tables (local MR keys): one
//! folded 64×64→128 multiply instead of SipHash. The keys are produced by
//! the engine itself (`(index + 1) << 8 | gen`), not by a peer, so hash
//! flooding is not a concern; the fold keeps the low bits (bucket index)
//! and the high bits (hashbrown's tag) both dependent on every key bit.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// `HashMap` keyed by engine-generated `u32` ids.
pub(crate) type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// See the module documentation.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl IdHasher {
    fn mix(&mut self, x: u64) {
        let p = u128::from(self.0 ^ x) * u128::from(K);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.mix(u64::from_le_bytes(b));
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.mix(u64::from(x));
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn engine_keys_spread_over_buckets_and_tags() {
        let b = BuildHasherDefault::<IdHasher>::default();
        let mut low = std::collections::HashSet::new();
        let mut top = std::collections::HashSet::new();
        // Keys as the engine makes them: (index + 1) << 8 | gen.
        for i in 0..64u32 {
            let h = b.hash_one((i + 1) << 8 | 3);
            low.insert(h & 63);
            top.insert(h >> 57);
        }
        assert!(low.len() >= 32, "bucket bits collide: {}", low.len());
        assert!(top.len() >= 32, "tag bits collide: {}", top.len());
    }

    #[test]
    fn map_round_trip() {
        let mut m: IdMap<u32> = IdMap::default();
        for k in 0..1000u32 {
            m.insert(k << 8 | (k & 0xff), k);
        }
        for k in 0..1000u32 {
            assert_eq!(m.get(&(k << 8 | (k & 0xff))), Some(&k));
        }
        assert_eq!(m.get(&1), None);
    }
}
