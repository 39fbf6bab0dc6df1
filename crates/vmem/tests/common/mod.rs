//! Shared test helpers: timeouts, /proc readers and anonymous test mappings.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Runs `f` on a thread and fails the test if it takes longer than `secs`.
pub fn with_timeout<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!(),
        },
        Err(_) => panic!("test timed out after {secs} s"),
    }
}

/// Polls `cond` until true or `secs` pass.
pub fn wait_until(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

/// Anonymous RSS of this process in bytes (from /proc/self/status RssAnon).
pub fn rss_anon() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    let kb: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Present bits of the pages of `[addr, addr+len)` from /proc/self/pagemap.
pub fn pagemap_present(addr: usize, len: usize) -> Vec<bool> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let n = len / 4096;
    let mut buf = vec![0u8; n * 8];
    f.read_exact_at(&mut buf, (addr / 4096 * 8) as u64).unwrap();
    buf.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()) >> 63 == 1)
        .collect()
}

/// "Exclusively mapped" bits (bit 56) of the pages of `[addr, addr+len)`
/// from /proc/self/pagemap: set for a page of this process's own, clear
/// for a hole and for the kernel's shared zero page.
pub fn pagemap_exclusive(addr: usize, len: usize) -> Vec<bool> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut buf = vec![0u8; len / 4096 * 8];
    f.read_exact_at(&mut buf, (addr / 4096 * 8) as u64).unwrap();
    buf.chunks(8)
        .map(|c| (u64::from_le_bytes(c.try_into().unwrap()) >> 56) & 1 == 1)
        .collect()
}

pub fn small_cfg() -> vmem::PagerConfig {
    vmem::PagerConfig {
        swap_size: 64 << 20,
        ..Default::default()
    }
}

/// Deterministic byte for (seed, index).
pub fn pat(seed: u64, i: usize) -> u8 {
    let x =
        (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
    (x >> 29) as u8
}

/// A fresh private anonymous read-write mapping of `len` bytes, as an address
/// (`MAP_FAILED` as usize on failure, as `mmap` returns it). The caller owns it
/// (application memory: it unmaps it itself).
pub fn mmap_anon(len: usize) -> usize {
    vmem::AnonMapping::new(len).map_or(libc::MAP_FAILED as usize, |m| m.into_raw().0)
}

/// Like [`mmap_anon`], but at `addr` with `MAP_FIXED_NOREPLACE`: the kernel never
/// replaces an existing mapping (the result differs from `addr` if one is there).
pub fn mmap_anon_at(addr: usize, len: usize) -> usize {
    // SAFETY: MAP_FIXED_NOREPLACE never clobbers an existing mapping.
    let m = unsafe {
        libc::mmap(
            addr as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    m as usize
}
