//! The host IOMMU: a page table per host mapping IOVA pages to frames (RAM pages or
//! the shared signature / black-hole frames), IOVA range allocation, and the
//! SRCU-style flush epochs that let `flush()` wait for every in-flight DMA atom
//! that could have used an old entry.

use crate::error::{Error, Result};
use crate::hw::segment::{IommuEntry, IovaRec, Segment, EPOCH_SLOTS, FRAME_WINDOWS, PAGE, PAGE_SHIFT};
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an IOVA page maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// No mapping: a DMA through it fails the WR.
    Unmapped,
    /// A page of this host's process memory (page-aligned virtual address).
    Ram(usize),
    /// The shared signature page: reads return the magic word, writes are dropped.
    Signature,
    /// The shared black-hole page: writes are absorbed, reads return zeros.
    BlackHole,
}

// Entry encoding (one `u32` per IOVA page, like a real IOMMU's 4-byte PTE):
// bits 0-1 kind; for RAM frames bits 2-3 name one of the range's frame windows
// (an aligned block of 2^27 pages = 512 GiB of address space, see `IovaRec`),
// bit 4 is the accessed bit ([`ACCESSED`]) and bits 5-31 the page inside the
// window.
const K_RAM: u32 = 1;
const K_SIG: u32 = 2;
const K_HOLE: u32 = 3;
const WIN_SHIFT: u32 = 2;
/// The accessed bit of a RAM entry: set by the DMA engine when it translates an
/// atom through the entry, cleared by [`Iommu::test_and_clear_young`] and by
/// every (re)mapping — the accessed bit of AMD/Intel IOMMU page tables.
pub(crate) const ACCESSED: u32 = 1 << 4;
const OFF_SHIFT: u32 = 5;
/// Pages per frame window.
const WIN_PAGE_BITS: u32 = 32 - OFF_SHIFT;
const _: () = assert!(FRAME_WINDOWS <= 4 && ACCESSED < 1 << OFF_SHIFT && ACCESSED >= 1 << (WIN_SHIFT + 2));

impl Frame {
    /// The entry for `self` in a range with record `rec`; claims a frame window
    /// of the range for a RAM frame in a window it does not name yet.
    pub(crate) fn encode(self, rec: &IovaRec) -> Result<u32> {
        Ok(match self {
            Frame::Unmapped => 0,
            Frame::Ram(a) => {
                let page = (a >> PAGE_SHIFT) as u64;
                let w = window_slot(rec, (page >> WIN_PAGE_BITS) + 1)?;
                ((page as u32 & ((1 << WIN_PAGE_BITS) - 1)) << OFF_SHIFT) | ((w as u32) << WIN_SHIFT) | K_RAM
            }
            Frame::Signature => K_SIG,
            Frame::BlackHole => K_HOLE,
        })
    }
    /// The frame entry `e` of a range with record `rec` names. Load `e` (Acquire)
    /// before calling: the window it names was set before it was stored.
    pub(crate) fn decode(e: u32, rec: Option<&IovaRec>) -> Frame {
        match e & 3 {
            K_RAM => {
                let win = rec.map_or(0, |r| {
                    r.windows[((e >> WIN_SHIFT) & 3) as usize].load(Ordering::Acquire)
                });
                match win.checked_sub(1) {
                    Some(w) => Frame::Ram((((w << WIN_PAGE_BITS) | (e >> OFF_SHIFT) as u64) << PAGE_SHIFT) as usize),
                    None => Frame::Unmapped,
                }
            }
            K_SIG => Frame::Signature,
            K_HOLE => Frame::BlackHole,
            _ => Frame::Unmapped,
        }
    }
}

/// The slot of `rec` holding window tag `tag` (window number + 1), claiming a
/// free slot for it if none does.
fn window_slot(rec: &IovaRec, tag: u64) -> Result<usize> {
    for (i, w) in rec.windows.iter().enumerate() {
        // A plain load first: the window is almost always claimed already, and
        // a (failing) CAS would take the line exclusive on every map.
        let cur = w.load(Ordering::Acquire);
        if cur == tag {
            return Ok(i);
        }
        if cur == 0 {
            match w.compare_exchange(0, tag, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(i),
                Err(cur) if cur == tag => return Ok(i),
                Err(_) => {}
            }
        }
    }
    Err(Error::NoResources(
        "frame windows of the IOVA range (its frames span more than 4 aligned 512-GiB blocks)",
    ))
}

/// A contiguous range of IOVA pages (made by [`Iommu::alloc_range`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IovaRange {
    /// First IOVA page.
    pub base: u64,
    /// Number of pages.
    pub npages: u64,
    /// Slot of the range's record in the host segment.
    pub slot: u32,
}

impl IovaRange {
    /// Whether IOVA page `page` lies in the range.
    pub fn contains(&self, page: u64) -> bool {
        page >= self.base && page < self.base + self.npages
    }
}

/// First-fit allocator of page ranges.
#[derive(Debug)]
pub(crate) struct RangeAlloc {
    free: Vec<(u64, u64)>,
}

impl RangeAlloc {
    pub fn new(start: u64, len: u64) -> Self {
        RangeAlloc {
            free: if len > 0 { vec![(start, len)] } else { vec![] },
        }
    }
    pub fn alloc(&mut self, n: u64) -> Option<u64> {
        if n == 0 {
            return None;
        }
        let i = self.free.iter().position(|&(_, l)| l >= n)?;
        let (b, l) = self.free[i];
        if l == n {
            self.free.remove(i);
        } else {
            self.free[i] = (b + n, l - n);
        }
        Some(b)
    }
    pub fn release(&mut self, b: u64, n: u64) {
        let i = self.free.partition_point(|&(fb, _)| fb < b);
        self.free.insert(i, (b, n));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// The per-host IOMMU. Remap from any thread of the host process at any time.
pub struct Iommu {
    seg: Arc<Segment>,
    book: RwLock<Book>,
    flush_lock: Mutex<()>,
    flush_timeout: Duration,
}

/// Allocation state of the IOVA space and the range records.
struct Book {
    pages: RangeAlloc,
    slots: RangeAlloc,
    /// Live ranges by base page: (npages, slot).
    live: BTreeMap<u64, (u64, u32)>,
}

impl Iommu {
    pub(crate) fn new(seg: Arc<Segment>, flush_timeout: Duration) -> Iommu {
        let pages = seg.p.iova_pages;
        let slots = seg.p.max_mr as u64;
        Iommu {
            seg,
            // IOVA page 0 is never handed out.
            book: RwLock::new(Book {
                pages: RangeAlloc::new(1, pages.saturating_sub(1)),
                slots: RangeAlloc::new(0, slots),
                live: BTreeMap::new(),
            }),
            flush_lock: Mutex::new(()),
            flush_timeout,
        }
    }

    /// Allocate `npages` IOVA pages, all unmapped.
    pub fn alloc_range(&self, npages: u64) -> Result<IovaRange> {
        let mut b = self.book.write();
        let base = b.pages.alloc(npages).ok_or(Error::NoResources("IOVA space"))?;
        let Some(slot) = b.slots.alloc(1) else {
            b.pages.release(base, npages);
            return Err(Error::NoResources("IOVA ranges"));
        };
        let slot = slot as u32;
        for p in base..base + npages {
            self.entry(p)?.store(0, Ordering::Release);
        }
        for w in &self.rec(slot)?.windows {
            w.store(0, Ordering::Release);
        }
        b.live.insert(base, (npages, slot));
        Ok(IovaRange { base, npages, slot })
    }

    /// Unmap every page of `range`, flush, and return it to the allocator.
    pub fn free_range(&self, range: IovaRange) -> Result<()> {
        self.check(&range)?;
        for p in range.base..range.base + range.npages {
            self.entry(p)?.store(0, Ordering::Release);
        }
        self.flush()?;
        let mut b = self.book.write();
        if b.live.remove(&range.base).is_none() {
            return Err(Error::InvalidArgument("IOVA range freed twice"));
        }
        for w in &self.rec(range.slot)?.windows {
            w.store(0, Ordering::Release);
        }
        b.pages.release(range.base, range.npages);
        b.slots.release(range.slot as u64, 1);
        Ok(())
    }

    /// Whether `range` is a live range of this IOMMU, exactly as allocated.
    pub fn check(&self, range: &IovaRange) -> Result<()> {
        match self.book.read().live.get(&range.base) {
            Some(&(n, s)) if n == range.npages && s == range.slot => Ok(()),
            _ => Err(Error::InvalidArgument("not a live IOVA range of this host")),
        }
    }

    /// The live range holding IOVA page `page`.
    fn range_of(&self, page: u64) -> Result<IovaRange> {
        let b = self.book.read();
        match b.live.range(..=page).next_back() {
            Some((&base, &(npages, slot))) if page < base + npages => Ok(IovaRange { base, npages, slot }),
            _ => Err(Error::InvalidArgument("IOVA page outside every allocated range")),
        }
    }

    fn entry(&self, page: u64) -> Result<&IommuEntry> {
        self.seg
            .iommu_entry(page)
            .ok_or(Error::InvalidArgument("IOVA page out of range"))
    }

    fn rec(&self, slot: u32) -> Result<&IovaRec> {
        self.seg
            .iova_rec(slot)
            .ok_or(Error::InvalidArgument("IOVA range slot out of range"))
    }

    /// Point IOVA page `iova_page` (of an allocated range) at `frame`. The old
    /// mapping may still be used by in-flight DMA until [`Iommu::flush`] returns.
    ///
    /// # Safety
    /// For `Frame::Ram(addr)`, the page at `addr` must be memory of this process that
    /// stays valid (mapped, and acceptable to be read/written by DMA at any time) until
    /// it is unmapped again and a subsequent `flush()` has returned.
    pub unsafe fn map(&self, iova_page: u64, frame: Frame) -> Result<()> {
        let r = self.range_of(iova_page)?;
        // SAFETY: forwarded contract.
        unsafe { self.map_at(&r, iova_page - r.base, frame) }
    }

    /// Point page `index` of `range` at `frame` (as [`Iommu::map`], without
    /// looking the range up). A range's RAM frames may lie in at most
    /// [`FRAME_WINDOWS`] aligned 512-GiB blocks of the address space.
    ///
    /// # Safety
    /// As for [`Iommu::map`].
    pub unsafe fn map_at(&self, range: &IovaRange, index: u64, frame: Frame) -> Result<()> {
        if index >= range.npages {
            return Err(Error::InvalidArgument("IOVA index outside the range"));
        }
        if let Frame::Ram(a) = frame {
            if a % PAGE != 0 || a == 0 {
                return Err(Error::InvalidArgument("frame address must be page aligned"));
            }
        }
        let e = frame.encode(self.rec(range.slot)?)?;
        let page = range.base + index;
        // A new entry starts not accessed (as a freshly written PTE).
        self.entry(page)?.store(e, Ordering::Release);
        Ok(())
    }

    /// Map consecutive pages of `range` starting at page offset `first`.
    ///
    /// # Safety
    /// As for [`Iommu::map`], for every frame.
    pub unsafe fn map_range(&self, range: &IovaRange, first: u64, frames: &[Frame]) -> Result<()> {
        if first + frames.len() as u64 > range.npages {
            return Err(Error::InvalidArgument("frames exceed range"));
        }
        for (i, f) in frames.iter().enumerate() {
            // SAFETY: forwarded contract.
            unsafe { self.map_at(range, first + i as u64, *f)? };
        }
        Ok(())
    }

    /// Whether DMA translated an atom through page `index` of `range` to a
    /// RAM frame since the page was last mapped or asked, clearing the
    /// record (the accessed bit of AMD/Intel IOMMU page tables, which
    /// Linux's `mmu_notifier` `clear_young` reads for secondary MMUs). No
    /// flush: an atom translating concurrently may set it again, which
    /// only makes the page look young one round longer.
    pub fn test_and_clear_young(&self, range: &IovaRange, index: u64) -> Result<bool> {
        if index >= range.npages {
            return Err(Error::InvalidArgument("IOVA index outside the range"));
        }
        let e = self
            .seg
            .iommu_entry(range.base + index)
            .ok_or(Error::InvalidArgument("IOVA page out of range"))?;
        // A plain load first: an idle page's entry is not written. Clearing
        // the bit leaves the rest of the entry as it is, whatever a
        // concurrent remap stored.
        Ok(e.load(Ordering::Relaxed) & ACCESSED != 0 && e.fetch_and(!ACCESSED, Ordering::Relaxed) & ACCESSED != 0)
    }

    /// Remove the mapping of one page (DMA through it then fails).
    pub fn unmap(&self, iova_page: u64) -> Result<()> {
        self.entry(iova_page)?.store(0, Ordering::Release);
        Ok(())
    }

    /// Current mapping of an IOVA page.
    pub fn lookup(&self, iova_page: u64) -> Result<Frame> {
        let e = self.entry(iova_page)?.load(Ordering::Acquire);
        let rec = self.range_of(iova_page).ok().and_then(|r| self.seg.iova_rec(r.slot));
        Ok(Frame::decode(e, rec))
    }

    /// Hold this host's DMA: no DMA section may begin until [`Iommu::release_dma`],
    /// and those in flight have ended when this returns. For a change to the address
    /// space the NIC only hears of after the fact (an munmap, reported by
    /// userfaultfd once the pages are gone): hold, let the change proceed, fix the
    /// NIC's tables, release — no copy can meet the new memory in between. Holds
    /// nest (they are counted); each successful hold needs one release. A failed
    /// hold (a peer's section outlived the flush timeout) has already released.
    pub fn hold_dma(&self) -> Result<()> {
        self.seg.hdr().epoch.fetch_add(HELD_ONE, Ordering::SeqCst);
        self.flush().inspect_err(|_| self.release_dma())
    }

    /// Ends one [`Iommu::hold_dma`].
    pub fn release_dma(&self) {
        self.seg.hdr().epoch.fetch_sub(HELD_ONE, Ordering::SeqCst);
    }

    /// Return once no DMA atom that could have used a mapping replaced before this
    /// call is still in flight (on any transport, any process).
    pub fn flush(&self) -> Result<()> {
        let _g = self.flush_lock.lock();
        flush_epoch(&self.seg, self.flush_timeout)
    }

    /// DMA sections counted now in this host's epoch slots, its own and peers'
    /// (a diagnostic: a dead peer's section stays counted until a flush clears it).
    pub fn sections_counted(&self) -> u64 {
        self.seg
            .hdr()
            .inflight
            .iter()
            .flatten()
            .map(|c| c.0.load(Ordering::SeqCst))
            .sum()
    }

    /// Bytes in an IOVA page.
    pub const PAGE_SIZE: usize = PAGE;
    /// Bytes of IOMMU page table per mapped IOVA page (one entry).
    pub const ENTRY_BYTES: usize = std::mem::size_of::<IommuEntry>();
    /// `log2` of the IOMMU page size.
    pub const PAGE_SHIFT: u32 = PAGE_SHIFT;
}

/// An active DMA section of a host (see [`enter`]).
pub struct EpochGuard<'a> {
    ctr: &'a AtomicU64,
}

pub use crate::hw::segment::{FOREIGN_SLOTS, OWN_SLOTS};
const SHARED_SLOT: usize = EPOCH_SLOTS - 1;

/// The epoch word's hold count (bits 48 and up; see [`Iommu::hold_dma`]): while it
/// is not 0, DMA sections wait to begin. The low bits count epochs, bit 0 their parity.
const HELD_ONE: u64 = 1 << 48;

/// Waits (spinning briefly, then yielding) until no hold is left on `seg`'s DMA.
#[cold]
fn wait_released(seg: &Segment) {
    let mut spins = 0u32;
    while seg.hdr().epoch.load(Ordering::SeqCst) >= HELD_ONE {
        spins += 1;
        if spins < 200 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Enter a DMA section of the host owning `seg`: translations made and copies done
/// before the guard drops are waited for by that host's `flush()`.
pub fn enter(seg: &Segment) -> EpochGuard<'_> {
    let h = seg.hdr();
    let i = if seg.own {
        epoch_slot()
    } else {
        *seg.foreign_slot.get_or_init(|| claim_foreign_slot(seg))
    };
    let slot = &h.inflight[i];
    loop {
        let e = h.epoch.load(Ordering::SeqCst);
        if e >= HELD_ONE {
            wait_released(seg);
            continue;
        }
        let ctr = &slot[(e & 1) as usize].0;
        ctr.fetch_add(1, Ordering::SeqCst);
        if h.epoch.load(Ordering::SeqCst) == e {
            return EpochGuard { ctr };
        }
        ctr.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for EpochGuard<'_> {
    fn drop(&mut self) {
        self.ctr.fetch_sub(1, Ordering::SeqCst);
    }
}

/// This thread's epoch counter slot: spread over threads and processes, so the
/// sections of one host's own threads and of peer initiators use different cache lines.
fn epoch_slot() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = {
            let pid = std::process::id() as usize;
            (pid.wrapping_mul(0x9e37_79b9) >> 7).wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
                % OWN_SLOTS
        };
    }
    SLOT.try_with(|s| *s).unwrap_or(0)
}

/// Claim a free foreign slot of `seg` for this process (a slot of a dead owner
/// is cleared and taken), or the shared one.
fn claim_foreign_slot(seg: &Segment) -> usize {
    let h = seg.hdr();
    let me = crate::sys::my_process_token();
    for pass in 0..2 {
        for i in FOREIGN_SLOTS {
            if pass == 1 {
                clear_if_dead(seg, i);
            }
            if h.slot_owner[i]
                .0
                .compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return i;
            }
        }
    }
    SHARED_SLOT
}

/// Marks a slot being cleared (no claim succeeds meanwhile).
const CLEARING: u64 = u64::MAX;

/// If foreign slot `i` of `seg` belongs to a process that is gone, forget its
/// sections (the dead cannot copy any more) and free the slot. Whether it did.
fn clear_if_dead(seg: &Segment, i: usize) -> bool {
    let h = seg.hdr();
    let o = h.slot_owner[i].0.load(Ordering::SeqCst);
    if o == 0 || o == CLEARING || !crate::sys::process_gone(o) {
        return false;
    }
    if h.slot_owner[i]
        .0
        .compare_exchange(o, CLEARING, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return false;
    }
    for c in &h.inflight[i] {
        c.0.store(0, Ordering::SeqCst);
    }
    h.slot_owner[i].0.store(0, Ordering::SeqCst);
    tracing::warn!(slot = i, "DMA sections of a dead peer process cleared");
    true
}

/// A flush waiting this long for DMA sections is reported ([`report_stall`]).
const STALL: Duration = Duration::from_secs(1);

/// Counts a flush that waited [`STALL`] and logs (the first, then at each power
/// of two) which epoch slots still hold sections of the old parity `par`: the
/// owner's own threads' slots, or the process (PID) that claimed a foreign one —
/// what to look at when a DMA section never ends.
#[cold]
fn report_stall(seg: &Segment, par: usize, waited: Duration) {
    let h = seg.hdr();
    let n = h.stats.flush_stalls.fetch_add(1, Ordering::Relaxed) + 1;
    if !n.is_power_of_two() {
        return;
    }
    let held: Vec<String> = (0..EPOCH_SLOTS)
        .filter(|&i| h.inflight[i][par].0.load(Ordering::SeqCst) != 0)
        .map(|i| {
            if FOREIGN_SLOTS.contains(&i) {
                format!("slot {i} (peer pid {})", h.slot_owner[i].0.load(Ordering::SeqCst) >> 42)
            } else if i == SHARED_SLOT {
                format!("slot {i} (shared by peers)")
            } else {
                format!("slot {i} (this host's threads)")
            }
        })
        .collect();
    tracing::error!(
        waited_ms = waited.as_millis() as u64,
        stalls = n,
        held = held.join(", "),
        "IOMMU flush waiting for DMA sections that do not end (logged at each power of two)"
    );
}

/// Flip the epoch and wait for the old parity to drain in every slot (callers
/// serialize flushes). Sections still counted after a short spin are checked for
/// owners that died inside them (cleared at once): a dead peer costs a flush about
/// a millisecond, not the timeout.
pub(crate) fn flush_epoch(seg: &Segment, timeout: Duration) -> Result<()> {
    let h = seg.hdr();
    let old = h.epoch.fetch_add(1, Ordering::SeqCst);
    let par = (old & 1) as usize;
    let start = Instant::now();
    let mut spins = 0u32;
    let mut next_check = Duration::from_micros(500);
    let mut stalled = false;
    while h.inflight.iter().any(|s| s[par].0.load(Ordering::SeqCst) != 0) {
        spins += 1;
        if spins < 200 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
            let t = start.elapsed();
            if t > next_check {
                next_check = t + Duration::from_millis(1);
                for i in FOREIGN_SLOTS {
                    if h.inflight[i][par].0.load(Ordering::SeqCst) != 0 {
                        clear_if_dead(seg, i);
                    }
                }
            }
            if t > STALL && !stalled {
                stalled = true;
                report_stall(seg, par, t);
            }
            if t > timeout {
                h.stats.flush_timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Timeout);
            }
        }
    }
    h.stats.flushes.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_rec() -> IovaRec {
        IovaRec {
            windows: Default::default(),
        }
    }

    #[test]
    fn frame_encoding_roundtrip() {
        let rec = empty_rec();
        for f in [
            Frame::Unmapped,
            Frame::Ram(0x7f00_0000_1000),
            Frame::Ram(0x5555_0000_2000),
            Frame::Ram(0x7fff_ffff_f000),
            Frame::Ram(0x1000),
            Frame::Signature,
            Frame::BlackHole,
        ] {
            assert_eq!(Frame::decode(f.encode(&rec).unwrap(), Some(&rec)), f);
        }
        assert_eq!(std::mem::size_of::<IommuEntry>(), 4, "a 4-byte PTE per IOVA page");
    }

    #[test]
    fn frame_windows_are_shared_and_bounded() {
        let rec = empty_rec();
        let win = 1usize << (WIN_PAGE_BITS + PAGE_SHIFT);
        assert_eq!(win, 512 << 30, "512-GiB windows");
        // Frames inside one aligned window share it.
        let a = Frame::Ram(3 * win + 0x1000).encode(&rec).unwrap();
        let b = Frame::Ram(4 * win - 0x1000).encode(&rec).unwrap();
        assert_eq!((a >> WIN_SHIFT) & 3, (b >> WIN_SHIFT) & 3);
        for k in [5, 7, 9] {
            Frame::Ram(k * win).encode(&rec).unwrap();
        }
        assert!(
            Frame::Ram(11 * win).encode(&rec).is_err(),
            "a fifth window does not fit"
        );
        assert_eq!(Frame::decode(b, Some(&rec)), Frame::Ram(4 * win - 0x1000));
        // The accessed bit is not part of the frame.
        assert_eq!(Frame::decode(b | ACCESSED, Some(&rec)), Frame::Ram(4 * win - 0x1000));
        assert_eq!(a & ACCESSED, 0, "a fresh entry is not accessed");
        assert_eq!(Frame::decode(a, None), Frame::Unmapped, "no record, no RAM frame");
    }

    #[test]
    fn range_alloc_first_fit_and_coalesce() {
        let mut a = RangeAlloc::new(1, 100);
        let x = a.alloc(10).unwrap();
        let y = a.alloc(20).unwrap();
        let z = a.alloc(70).unwrap();
        assert_eq!((x, y, z), (1, 11, 31));
        assert!(a.alloc(1).is_none());
        a.release(y, 20);
        a.release(x, 10);
        assert_eq!(a.alloc(30), Some(1));
        a.release(1, 30);
        a.release(z, 70);
        assert_eq!(a.free, vec![(1, 100)]);
    }

    #[test]
    fn a_held_host_begins_no_dma_section_until_released() {
        use std::sync::atomic::AtomicBool;
        let host = crate::Host::new(crate::HostConfig::default()).unwrap();
        let seg = host.inner().seg.clone();
        let iommu = host.iommu();
        iommu.hold_dma().unwrap();
        iommu.hold_dma().unwrap();
        let entered = std::sync::Arc::new(AtomicBool::new(false));
        let t = {
            let (seg, entered) = (seg.clone(), entered.clone());
            std::thread::spawn(move || {
                let _g = enter(&seg);
                entered.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!entered.load(Ordering::SeqCst), "a section began while held");
        iommu.release_dma();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!entered.load(Ordering::SeqCst), "holds nest");
        iommu.release_dma();
        t.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
        // A flush while nothing is held still works, and parity is intact.
        iommu.flush().unwrap();
        drop(enter(&seg));
    }
}
