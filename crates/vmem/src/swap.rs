//! The swap device: a swap file of page-sized slots, a slot allocator, and
//! page reads/writes (buffered or O_DIRECT).

use crate::error::{Error, Result};
use crate::sys::PAGE;
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Slot index in the swap file.
pub type Slot = u32;

struct SlotAlloc {
    bits: Vec<u64>,
    free: usize,
    cursor: usize,
}

impl SlotAlloc {
    fn new(slots: usize) -> SlotAlloc {
        let mut bits = vec![0u64; slots.div_ceil(64)];
        // Mark the tail beyond `slots` as used so it is never handed out.
        for s in slots..bits.len() * 64 {
            bits[s / 64] |= 1 << (s % 64);
        }
        SlotAlloc {
            bits,
            free: slots,
            cursor: 0,
        }
    }

    /// Next-fit allocation of one slot.
    fn alloc(&mut self) -> Option<Slot> {
        if self.free == 0 {
            return None;
        }
        let words = self.bits.len();
        let (start_w, start_b) = (self.cursor / 64, self.cursor % 64);
        for i in 0..=words {
            let idx = (start_w + i) % words;
            let mut avail = !self.bits[idx];
            if i == 0 {
                avail &= !0u64 << start_b;
            }
            if avail != 0 {
                let bit = avail.trailing_zeros() as usize;
                self.bits[idx] |= 1 << bit;
                self.free -= 1;
                let slot = idx * 64 + bit;
                self.cursor = if slot + 1 >= words * 64 { 0 } else { slot + 1 };
                return Some(slot as Slot);
            }
        }
        None
    }

    fn release(&mut self, slot: Slot) -> bool {
        let s = slot as usize;
        let (w, b) = (s / 64, s % 64);
        if w >= self.bits.len() || self.bits[w] & (1 << b) == 0 {
            return false;
        }
        self.bits[w] &= !(1 << b);
        self.free += 1;
        // Reuse low slots first: they are likely still in the page cache,
        // which makes buffered write-out a plain copy.
        self.cursor = self.cursor.min(s);
        true
    }
}

/// A swap file with page-sized slots.
pub struct SwapDevice {
    file: File,
    path: PathBuf,
    remove_on_drop: bool,
    slots: usize,
    alloc: Mutex<SlotAlloc>,
    used: AtomicUsize,
    /// Fault injection for unit tests: fail every write.
    #[cfg(test)]
    pub fail_writes: std::sync::atomic::AtomicBool,
}

static SWAP_SEQ: AtomicUsize = AtomicUsize::new(0);

impl SwapDevice {
    /// Creates (truncates) the swap file. Unless `keep`, the file is unlinked
    /// right away so that nothing is left behind, even after a crash.
    pub fn create(
        path: Option<&Path>,
        size: u64,
        o_direct: bool,
        keep: bool,
    ) -> Result<SwapDevice> {
        let slots = (size / PAGE as u64) as usize;
        if slots == 0 || slots > u32::MAX as usize - 1 {
            return Err(Error::Config(format!(
                "swap_size {size} must be 1 page .. 16 TiB"
            )));
        }
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => std::env::temp_dir().join(format!(
                "vmem-swap-{}-{}",
                std::process::id(),
                SWAP_SEQ.fetch_add(1, Ordering::Relaxed)
            )),
        };
        let mut oo = OpenOptions::new();
        oo.read(true).write(true).create(true).truncate(true);
        if o_direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo.open(&path).map_err(Error::SwapIo)?;
        file.set_len(slots as u64 * PAGE as u64)
            .map_err(Error::SwapIo)?;
        // Reserve the blocks up front: cheaper writes, and no ENOSPC at
        // eviction time. Filesystems without fallocate keep a sparse file.
        // SAFETY: plain syscall on our own descriptor.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, (slots * PAGE) as libc::off_t) };
        if r != 0 {
            tracing::debug!(err = %io::Error::last_os_error(), "fallocate of swap file failed; sparse file");
        }
        let mut remove_on_drop = false;
        if !keep {
            // Unlink now; the open descriptor keeps the blocks alive.
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(?path, %e, "could not unlink swap file; will retry on drop");
                remove_on_drop = true;
            }
        }
        tracing::debug!(?path, slots, o_direct, keep, "swap device created");
        Ok(SwapDevice {
            file,
            path,
            remove_on_drop,
            slots,
            alloc: Mutex::new(SlotAlloc::new(slots)),
            used: AtomicUsize::new(0),
            #[cfg(test)]
            fail_writes: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Allocates `n` slots (next-fit, so mostly consecutive), all or nothing.
    pub fn alloc(&self, n: usize, out: &mut Vec<Slot>) -> Result<()> {
        let mut a = self.alloc.lock();
        if a.free < n {
            return Err(Error::SwapFull(self.slots));
        }
        for _ in 0..n {
            out.push(a.alloc().expect("free count checked"));
        }
        self.used.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    pub fn free(&self, slot: Slot) {
        if self.alloc.lock().release(slot) {
            self.used.fetch_sub(1, Ordering::Relaxed);
        } else {
            tracing::error!(slot, "double free of swap slot");
        }
    }

    fn off(slot: Slot) -> u64 {
        slot as u64 * PAGE as u64
    }

    /// Writes `data` (whole pages) to consecutive slots starting at `slot`.
    pub fn write(&self, slot: Slot, data: &[u8]) -> io::Result<()> {
        debug_assert_eq!(data.len() % PAGE, 0);
        #[cfg(test)]
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected write failure"));
        }
        self.file.write_all_at(data, Self::off(slot))
    }

    /// Reads consecutive slots starting at `slot` into `buf` (whole pages).
    pub fn read(&self, slot: Slot, buf: &mut [u8]) -> io::Result<()> {
        debug_assert_eq!(buf.len() % PAGE, 0);
        self.file.read_exact_at(buf, Self::off(slot))
    }
}

impl Drop for SwapDevice {
    fn drop(&mut self) {
        if self.remove_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_full() {
        let d = SwapDevice::create(None, 3 * PAGE as u64, false, false).unwrap();
        assert!(!d.path().exists(), "unlinked at creation");
        let mut v = Vec::new();
        d.alloc(3, &mut v).unwrap();
        assert_eq!(v, vec![0, 1, 2]);
        assert!(matches!(
            d.alloc(1, &mut Vec::new()),
            Err(Error::SwapFull(3))
        ));
        d.free(1);
        let mut w = Vec::new();
        d.alloc(1, &mut w).unwrap();
        assert_eq!(w, vec![1]);
        assert_eq!(d.used(), 3);
    }

    #[test]
    fn roundtrip_and_keep() {
        let p = std::env::temp_dir().join(format!("vmem-test-keep-{}", std::process::id()));
        {
            let d = SwapDevice::create(Some(&p), 4 * PAGE as u64, false, true).unwrap();
            let data: Vec<u8> = (0..2 * PAGE).map(|i| (i % 251) as u8).collect();
            d.write(2, &data).unwrap();
            let mut back = vec![0u8; 2 * PAGE];
            d.read(2, &mut back).unwrap();
            assert_eq!(back, data);
        }
        assert!(p.exists(), "kept on request");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn o_direct_roundtrip() {
        let d = SwapDevice::create(None, 4 * PAGE as u64, true, false).unwrap();
        let mut b = crate::sys::PageBuf::new(1);
        b.as_mut_slice().fill(0x5a);
        d.write(3, b.as_slice()).unwrap();
        let mut c = crate::sys::PageBuf::new(1);
        d.read(3, c.as_mut_slice()).unwrap();
        assert!(c.as_slice().iter().all(|&x| x == 0x5a));
    }

    proptest::proptest! {
        #[test]
        fn allocator_never_double_allocates(ops in proptest::collection::vec(0u8..3, 1..200)) {
            let mut a = SlotAlloc::new(37);
            let mut live = std::collections::BTreeSet::new();
            for op in ops {
                if op < 2 {
                    match a.alloc() {
                        Some(s) => proptest::prop_assert!(live.insert(s) && (s as usize) < 37),
                        None => proptest::prop_assert_eq!(live.len(), 37),
                    }
                } else if let Some(&s) = live.iter().next() {
                    live.remove(&s);
                    proptest::prop_assert!(a.release(s));
                }
                proptest::prop_assert_eq!(a.free, 37 - live.len());
            }
        }
    }
}
