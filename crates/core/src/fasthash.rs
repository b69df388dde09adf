//! A fast hasher for the small keys of kiln's hot-path maps (kernel names, block sizes, variable
//! ids): FNV-1a style, a multiply-xor round per 8 bytes of the key. std's SipHash resists hash
//! flooding, which these maps, keyed by values kiln itself makes, do not need, and costs several
//! times more per lookup — paid on every kernel launch and every backward node.
//!
//! The other FNV hashes of kiln live here too, so that each is written once: [`fnv1a_64`] and
//! [`fnv1a_128`] (the classic byte-at-a-time FNV-1a, stable across Rust versions and
//! platforms: conformance seeds, on-disk kernel cache keys) and [`mix_word`] (the word round of
//! [`FnvHasher`], also what a program's fingerprint is made of).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// FNV-1a's 64-bit offset basis: the state before any input.
pub const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a's 64-bit prime.
pub const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

/// One round of [`FnvHasher`]: folds the word `w` into the state `h` (xor, multiply by FNV's
/// prime, rotate so that high bits feed the next multiply). Start from [`FNV64_OFFSET`].
#[inline]
pub fn mix_word(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(FNV64_PRIME).rotate_left(29)
}

/// 64-bit FNV-1a of `bytes`, byte by byte: a stable hash of a string (the conformance suite
/// derives each check's seed from its name with it).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV64_OFFSET, |h, &b| {
        (h ^ b as u64).wrapping_mul(FNV64_PRIME)
    })
}

/// 128-bit FNV-1a of `parts`, each followed by a `0xff` byte so that where one part ends
/// counts (`["ab", "c"]` and `["a", "bc"]` differ): a content hash stable across Rust versions
/// and platforms, for keys of caches kept on disk.
pub fn fnv1a_128(parts: &[&[u8]]) -> u128 {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h = OFFSET;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h ^= b as u128;
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// FNV-1a's constants, applied to 64-bit words rather than bytes.
#[derive(Clone, Copy, Debug)]
pub struct FnvHasher(u64);

impl Default for FnvHasher {
    fn default() -> Self {
        FnvHasher(FNV64_OFFSET)
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
        self.0 = mix_word(self.0, v);
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
    fn byte_hashes_keep_their_values() {
        // Seeds and on-disk cache keys depend on these values: they must never change.
        assert_eq!(fnv1a_64(b""), FNV64_OFFSET);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"kiln"), 0xef95_80d7_2160_ee33);
        assert_eq!(
            fnv1a_128(&[b"ab", b"c"]),
            0x3276_3e66_4083_d94f_7081_4487_f805_ad59
        );
        assert_ne!(fnv1a_128(&[b"ab", b"c"]), fnv1a_128(&[b"a", b"bc"]));
    }

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
