//! Memory the CLI owns directly: pinned (mlock'ed, resident) anonymous buffers for
//! the standard-RDMA baseline, and resident-set readings from /proc.

use crate::error::{CliError, Result};

/// An anonymous mapping locked in RAM (`mlock`): every page resident, as a pinned
/// RDMA registration requires.
pub struct PinnedBuf {
    map: vmem::AnonMapping,
}

impl PinnedBuf {
    /// Map `len` bytes (rounded up to pages), lock and write them.
    pub fn new(len: usize) -> Result<PinnedBuf> {
        let mut b = Self::locked(len)?;
        // mlock already faulted the pages in; write them so they hold a pattern.
        b.as_mut_slice().fill(0x5a);
        Ok(b)
    }

    /// Map `len` bytes (rounded up to pages) and lock them (mlock faults every page
    /// in: this is the pinning cost of a standard registration).
    pub fn locked(len: usize) -> Result<PinnedBuf> {
        let map = vmem::AnonMapping::new(len)?;
        // SAFETY: locking the mapping created above, owned by `map`.
        unsafe { rustix::mm::mlock(map.as_ptr().cast(), map.len()) }
            .map_err(|e| CliError::Io(e.into()))?;
        Ok(PinnedBuf { map })
    }
    pub fn addr(&self) -> usize {
        self.map.addr()
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is valid for `len` bytes and exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.map.len()) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping locked in `locked`; MRs over it are dropped first by
        // their owners (field order), so the NIC no longer uses it. `map` unmaps it
        // after this.
        let _ = unsafe { rustix::mm::munlock(self.map.as_ptr().cast(), self.map.len()) };
    }
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

pub fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Resident set size of this process in bytes (/proc/self/statm).
pub fn rss_bytes() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .ok_or_else(|| CliError::Peer("unreadable /proc/self/statm".into()))?;
    Ok(pages * page_size() as u64)
}

/// MemAvailable from /proc/meminfo in bytes.
pub fn mem_available() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/meminfo")?;
    for l in s.lines() {
        if let Some(rest) = l.strip_prefix("MemAvailable:") {
            let kb: u64 = rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .map_err(|_| CliError::Peer("unreadable /proc/meminfo".into()))?;
            return Ok(kb * 1024);
        }
    }
    Err(CliError::Peer("no MemAvailable in /proc/meminfo".into()))
}

/// Parse a size like `4096`, `64K`, `8M`, `16G` (binary units).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t.trim_end_matches(['b', 'B']), 1),
    };
    let n: u64 = num
        .trim_end_matches("i")
        .parse()
        .map_err(|_| format!("not a size: {s:?} (examples: 4096, 64K, 8M, 16G)"))?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("size too large: {s}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("8M"), Ok(8 << 20));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn pinned_buffer_is_resident() {
        let mut b = PinnedBuf::new(3 * page_size() + 1).unwrap();
        assert_eq!(b.len(), 4 * page_size());
        assert!(b.as_mut_slice().iter().all(|&x| x == 0x5a));
        assert!(rss_bytes().unwrap() >= b.len() as u64);
    }
}
