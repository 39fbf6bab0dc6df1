//! The host's frame-residency map: the host OS role (the pager) declares pages of its
//! address space resident or not; the DMA engine checks every frame it touches and
//! refuses (and counts) accesses to non-resident frames. Untracked memory is resident.

use crate::error::{Error, Result};
use crate::hw::iommu::RangeAlloc;
use crate::hw::segment::{Segment, PAGE, PAGE_SHIFT};
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Residency map of one host (lives in the host segment so peers' DMA engines see it).
pub struct FrameMap {
    seg: Arc<Segment>,
    bits: Mutex<RangeAlloc>,
}

impl FrameMap {
    pub(crate) fn new(seg: Arc<Segment>) -> FrameMap {
        let n = seg.p.max_tracked_pages;
        FrameMap {
            seg,
            bits: Mutex::new(RangeAlloc::new(0, n)),
        }
    }

    fn pages(addr: usize, len: usize) -> (u64, u64) {
        let first = (addr >> PAGE_SHIFT) as u64;
        let last = ((addr + len.max(1) - 1) >> PAGE_SHIFT) as u64;
        (first, last - first + 1)
    }

    /// Start tracking the pages covering `[addr, addr+len)`, initially `resident`.
    ///
    /// Ranges may overlap (applications register the same buffer more than once):
    /// pages already covered by a tracked range keep the state that range records,
    /// [`FrameMap::set_resident`] updates every range covering a page, and each
    /// `track` is undone by one [`FrameMap::untrack`] of the same start address.
    pub fn track(&self, addr: usize, len: usize, resident: bool) -> Result<()> {
        let (first, n) = Self::pages(addr, len);
        let mut bits = self.bits.lock();
        let h = self.seg.hdr();
        let slot = (0..self.seg.p.max_tracked_ranges)
            .find(|&i| self.seg.range(i).expect("in range").used.load(Ordering::Acquire) == 0)
            .ok_or(Error::NoResources("tracked ranges"))?;
        let off = bits.alloc(n).ok_or(Error::NoResources("tracked pages"))?;
        for p in 0..n {
            self.set_bit(off + p, !resident);
        }
        // Pages some tracked range already covers keep their recorded state.
        self.each_tracked(first, n, |page, bit| self.set_bit(off + (page - first), self.bit(bit)));
        let r = self.seg.range(slot).expect("in range");
        r.start_page.store(first, Ordering::Relaxed);
        r.npages.store(n, Ordering::Relaxed);
        r.bit_off.store(off, Ordering::Relaxed);
        r.used.store(1, Ordering::Release);
        if slot >= h.nranges.load(Ordering::Acquire) {
            h.nranges.store(slot + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Stop tracking the range that starts at `addr`'s page (its pages become resident).
    pub fn untrack(&self, addr: usize) -> Result<()> {
        let first = (addr >> PAGE_SHIFT) as u64;
        let mut bits = self.bits.lock();
        for i in 0..self.seg.hdr().nranges.load(Ordering::Acquire) {
            let r = self.seg.range(i).expect("in range");
            if r.used.load(Ordering::Acquire) == 1 && r.start_page.load(Ordering::Relaxed) == first {
                r.used.store(0, Ordering::Release);
                bits.release(r.bit_off.load(Ordering::Relaxed), r.npages.load(Ordering::Relaxed));
                return Ok(());
            }
        }
        Err(Error::InvalidArgument("no tracked range starts there"))
    }

    /// Declare the tracked pages covering `[addr, addr+len)` resident or not. Pages
    /// outside tracked ranges are ignored. Call `iommu().flush()` afterwards to wait for
    /// DMA that checked the old state.
    pub fn set_resident(&self, addr: usize, len: usize, resident: bool) {
        let (first, n) = Self::pages(addr, len);
        self.each_tracked(first, n, |_, bit| self.set_bit(bit, !resident));
    }

    /// `f(page, bit)` for each page of `[first, first + n)` that a tracked range
    /// covers, once per covering range (`bit`: the page's absent-bit in that range).
    fn each_tracked(&self, first: u64, n: u64, mut f: impl FnMut(u64, u64)) {
        for i in 0..self.seg.hdr().nranges.load(Ordering::Acquire) {
            let Some(r) = self.seg.range(i) else { break };
            if r.used.load(Ordering::Acquire) != 1 {
                continue;
            }
            let s = r.start_page.load(Ordering::Relaxed);
            let e = s + r.npages.load(Ordering::Relaxed);
            let roff = r.bit_off.load(Ordering::Relaxed);
            for page in first.max(s)..(first + n).min(e) {
                f(page, roff + (page - s));
            }
        }
    }

    /// Whether the page containing `addr` counts as resident.
    pub fn is_resident(&self, addr: usize) -> bool {
        page_resident(&self.seg, (addr >> PAGE_SHIFT) as u64)
    }

    fn bit(&self, bit: u64) -> bool {
        self.seg
            .bitmap_word(bit)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1 << (bit % 64)) != 0)
    }

    fn set_bit(&self, bit: u64, nonresident: bool) {
        if let Some(w) = self.seg.bitmap_word(bit) {
            let m = 1u64 << (bit % 64);
            if nonresident {
                w.fetch_or(m, Ordering::AcqRel);
            } else {
                w.fetch_and(!m, Ordering::AcqRel);
            }
        }
    }

    /// Page size of the frames.
    pub const PAGE_SIZE: usize = PAGE;
}

fn lookup_bit(seg: &Segment, page: u64) -> Option<u64> {
    for i in 0..seg.hdr().nranges.load(Ordering::Acquire) {
        let r = seg.range(i)?;
        if r.used.load(Ordering::Acquire) == 1 {
            let s = r.start_page.load(Ordering::Relaxed);
            if page >= s && page < s + r.npages.load(Ordering::Relaxed) {
                return Some(r.bit_off.load(Ordering::Relaxed) + (page - s));
            }
        }
    }
    None
}

/// Whether frame page `page` of the host owning `seg` is resident (DMA-engine check).
#[inline]
pub(crate) fn page_resident(seg: &Segment, page: u64) -> bool {
    if seg.hdr().nranges.load(Ordering::Acquire) == 0 {
        return true;
    }
    match lookup_bit(seg, page) {
        None => true,
        Some(bit) => match seg.bitmap_word(bit) {
            Some(w) => w.load(Ordering::Acquire) & (1 << (bit % 64)) == 0,
            None => true,
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::{Host, HostConfig};

    #[test]
    fn track_set_untrack() {
        let h = Host::new(HostConfig {
            max_tracked_ranges: 2,
            ..Default::default()
        })
        .unwrap();
        let f = h.frames();
        let base = 0x7000_0000_0000usize;
        assert!(f.is_resident(base), "untracked memory is resident");
        f.track(base, 8 * 4096, true).unwrap();
        f.set_resident(base + 2 * 4096 + 17, 2 * 4096, false);
        let r: Vec<bool> = (0..8).map(|p| f.is_resident(base + p * 4096)).collect();
        assert_eq!(r, [true, true, false, false, false, true, true, true]);
        f.track(base + 100 * 4096, 4096, false).unwrap();
        assert!(!f.is_resident(base + 100 * 4096));
        assert!(f.track(base + 200 * 4096, 4096, false).is_err(), "out of range slots");
        f.untrack(base).unwrap();
        assert!(f.is_resident(base + 3 * 4096));
        assert!(f.untrack(base).is_err());
        f.track(base + 200 * 4096, 4096, true).unwrap();
    }

    #[test]
    fn overlapping_ranges_agree() {
        let h = Host::new(HostConfig::default()).unwrap();
        let f = h.frames();
        let base = 0x7100_0000_0000usize;
        let pg = 4096;
        f.track(base, 8 * pg, true).unwrap();
        f.set_resident(base + 3 * pg, pg, false);
        // A second range over pages 2..10: page 3 keeps its absent state, pages
        // 8..10 (new) start as declared.
        f.track(base + 2 * pg, 8 * pg, false).unwrap();
        let r: Vec<bool> = (0..10).map(|p| f.is_resident(base + p * pg)).collect();
        assert_eq!(r, [true, true, true, false, true, true, true, true, false, false]);
        // Updates reach every covering range, whichever one a lookup consults.
        f.set_resident(base + 2 * pg, 8 * pg, true);
        f.set_resident(base + 5 * pg, pg, false);
        f.untrack(base).unwrap();
        let r: Vec<bool> = (2..10).map(|p| f.is_resident(base + p * pg)).collect();
        assert_eq!(r, [true, true, true, false, true, true, true, true]);
        f.untrack(base + 2 * pg).unwrap();
        assert!(f.is_resident(base + 5 * pg), "untracked again");
    }
}
