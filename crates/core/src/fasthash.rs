//! A fast hasher for the small keys of kiln's hot-path maps (kernel names, block sizes, variable
//! ids): FNV-1a style, a multiply-xor round per 8 bytes of the key. std's SipHash resists hash
//! flooding, which these maps, keyed by values kiln itself makes, do not need, and costs several
//! times more per lookup — paid on every kernel launch and every backward node.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// FNV-1a's constants, applied to 64-bit words rather than bytes.
#[derive(Clone, Copy, Debug)]
pub struct FnvHasher(u64);

impl Default for FnvHasher {
    fn default() -> Self {
        FnvHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for FnvHasher {
    fn finish(&self) -> u64 {
        // murmur3's finalizer: every input bit reaches the low bits (bucket index) and the top
        // ones (hashbrown's control bytes).
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        // Eight bytes per round (a kernel name hashes in a handful of rounds).
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let mut tail = [0u8; 8];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        self.write_u64(u64::from_le_bytes(tail) ^ (rest.len() as u64) << 56);
    }
    fn write_u64(&mut self, v: u64) {
        // One multiply-xor round per word instead of eight byte rounds.
        self.0 = (self.0 ^ v).wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// A `HashMap` with [`FnvHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FnvHasher>>;
/// A `HashSet` with [`FnvHasher`].
pub type FastSet<K> = HashSet<K, BuildHasherDefault<FnvHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_work_and_spread_keys() {
        let mut m: FastMap<usize, usize> = FastMap::default();
        for i in 0..1000 {
            m.insert(i * 512, i);
        }
        assert!((0..1000).all(|i| m[&(i * 512)] == i));
        let h = |v: usize| {
            let mut s = FnvHasher::default();
            s.write_usize(v);
            s.finish()
        };
        assert_ne!(h(512) & 0xff, h(1024) & 0xff);
        let mut s: FastSet<[&str; 2]> = FastSet::default();
        assert!(s.insert(["unary", "exp"]) && !s.insert(["unary", "exp"]));
    }
}
