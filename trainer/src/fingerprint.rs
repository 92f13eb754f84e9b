//! A stable fingerprint of a file's bytes: 64-bit FNV-1a, written out here because std's
//! `DefaultHasher` may change between Rust versions and a fingerprint names files on disk
//! (the `--text` token cache), which must outlive the binary that wrote them.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};

/// FNV-1a's starting hash (of no bytes), for hashing in pieces with [`fnv1a_64_update`].
pub(crate) const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a (64-bit) of `bytes`, continuing from `hash` (start at [`fnv1a_64`]'s basis).
pub(crate) fn fnv1a_64_update(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// FNV-1a (64-bit) of `bytes`.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    fnv1a_64_update(FNV_OFFSET_BASIS, bytes)
}

/// FNV-1a (64-bit) of the file at `path`, read in pieces (memory independent of its size).
pub fn file_fnv1a_64(path: &Path) -> Result<u64> {
    let mut file = File::open(path).with_context(|| format!("reading input text file {}", path.display()))?;
    let mut buffer = vec![0u8; 1 << 16];
    let mut hash = FNV_OFFSET_BASIS;
    loop {
        let n = file.read(&mut buffer).with_context(|| format!("reading input text file {}", path.display()))?;
        if n == 0 {
            return Ok(hash);
        }
        hash = fnv1a_64_update(hash, &buffer[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_fnv1a_64_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
