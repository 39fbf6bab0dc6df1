//! The NIC-side shadow of one application MR: its page-version table and the
//! IOMMU views (Read range: absent → signature; Write range: absent → black
//! hole), with the two state transitions NP-RDMA makes — swap-out (the swap
//! listener) and map-in (the two-sided path, after pinning).
//!
//! Ordering of the steps is what makes the optimistic checks sound:
//!
//! * **swap-out**: bump the version to even, *then* remap to the special
//!   frames, then flush. A DMA atom that hits a special frame translated
//!   after the remap, hence after the bump, and the version READ that follows
//!   it on the same RC QP sees the new version. Atoms translated before the
//!   remap finish before `flush` returns, i.e. before the page is reclaimed,
//!   so their data is in the page that gets written to swap.
//! * **map-in**: remap to the real frame, *then* bump the version to odd. A
//!   peer that reads an odd version before and after its data operation knows
//!   the data operation translated after the remap.
//!
//! Transitions of one MR are serialised by a lock; flushing happens once per
//! swap-out batch. The version table is plain heap memory (never managed by
//! the pager) for registration as the pinned Version MR.
//!
//! **State per page** is the paper's 12 B: one IOMMU entry in each view (4 B
//! each on the software RNIC, [`IommuControl::ENTRY_BYTES`]) and the 4-byte
//! version ([`STATE_BYTES_PER_PAGE`]). Nothing else is kept per page: the
//! ranges the layer holds pinned are few and short-lived (the two-sided path's
//! temporary pins), so they live in a short list beside the lock.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::nic::{Frame, IommuControl, SwapListener};

/// Bytes of one page's version word.
pub const VERSION_BYTES: usize = std::mem::size_of::<AtomicU32>();

/// Bytes NP-RDMA keeps per page of an MR shadowed over IOMMU `I`: an entry in
/// each of the two views (Read, Write) and the version word (see the module
/// docs; the pager's own per-page state is not NP-RDMA's).
pub const fn state_bytes_per_page<I: IommuControl>() -> usize {
    2 * I::ENTRY_BYTES + VERSION_BYTES
}

/// [`state_bytes_per_page`] on the software RNIC: the paper's 12 B.
pub const STATE_BYTES_PER_PAGE: usize = state_bytes_per_page::<crate::adapt::RnicIommu>();
const _: () = assert!(
    STATE_BYTES_PER_PAGE <= 12,
    "NP-RDMA's per-page state must stay within the paper's 12 B"
);

/// One `u32` version per page: odd = resident, even = absent.
#[derive(Debug)]
pub struct VersionTable {
    words: Box<[AtomicU32]>,
}

impl VersionTable {
    /// Versions 1 (resident) / 0 (absent).
    pub fn new(resident: impl IntoIterator<Item = bool>) -> Self {
        VersionTable {
            words: resident
                .into_iter()
                .map(|r| AtomicU32::new(r as u32))
                .collect(),
        }
    }
    /// Number of pages.
    pub fn len(&self) -> usize {
        self.words.len()
    }
    /// No pages.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }
    /// Address of the first word (to register as the Version MR).
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }
    /// Bytes of the table.
    pub fn byte_len(&self) -> u64 {
        self.words.len() as u64 * 4
    }
    /// Version of page `i`.
    #[inline]
    pub fn get(&self, i: usize) -> Option<u32> {
        self.words.get(i).map(|w| w.load(Ordering::Acquire))
    }
    /// Copy versions of pages `first..first + out.len()` (local version
    /// snapshots around an operation). False if out of range.
    #[inline]
    pub fn snapshot(&self, first: usize, out: &mut [u32]) -> bool {
        let Some(ws) = first
            .checked_add(out.len())
            .and_then(|end| self.words.get(first..end))
        else {
            return false;
        };
        for (o, w) in out.iter_mut().zip(ws) {
            *o = w.load(Ordering::Acquire);
        }
        true
    }
    /// Make page `i`'s parity `odd`; returns whether it changed.
    fn set_parity(&self, i: usize, odd: bool) -> bool {
        let w = &self.words[i];
        if (w.load(Ordering::Acquire) % 2 == 1) == odd {
            return false;
        }
        w.fetch_add(1, Ordering::SeqCst);
        true
    }
}

/// Shadow errors.
#[derive(Debug, thiserror::Error)]
pub enum ShadowError<E: std::error::Error + 'static> {
    #[error("IOMMU: {0}")]
    /// The IOMMU refused.
    Iommu(#[source] E),
    #[error("page size {0} is not a power of two")]
    /// Page size not a power of two.
    BadPageSize(u64),
    #[error("residency has {got} entries, the region has {want} pages")]
    /// The residency vector does not match the region.
    ResidencyLen {
        /// What was found.
        got: usize,
        /// What was expected.
        want: usize,
    },
    #[error("range {addr:#x}+{len} outside the region")]
    /// A range outside the region.
    OutOfRange {
        /// Address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
}

/// Shadow of one application MR (see module docs).
pub struct MrShadow<I: IommuControl> {
    iommu: Arc<I>,
    addr: u64,
    len: u64,
    first_page: u64,
    page_size: u64,
    read: I::Range,
    write: I::Range,
    versions: Arc<VersionTable>,
    /// Serialises transitions; holds the pins the layer itself holds (see
    /// [`MrShadow::pinned_map_in`]).
    lock: Mutex<Pins>,
    /// Some of the MR's memory was unmapped by the application
    /// ([`SwapListener::after_unmap`]): which pages, the pager knows.
    unmapped: std::sync::atomic::AtomicBool,
}

/// The page-index ranges `[start, end)` the layer holds pinned, one entry per
/// [`MrShadow::pinned_map_in`] not yet undone (a multiset: ranges may repeat
/// and overlap).
type Pins = Vec<(usize, usize)>;

/// A pin list emptied back to this capacity or less keeps its allocation.
const PINS_KEEP: usize = 64;

/// Whether some pinned range holds page `i`.
fn pinned(pins: &Pins, i: usize) -> bool {
    pins.iter().any(|&(s, e)| s <= i && i < e)
}

impl<I: IommuControl> std::fmt::Debug for MrShadow<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrShadow")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("read", &self.read)
            .field("write", &self.write)
            .finish()
    }
}

type Res<T, I> = Result<T, ShadowError<<I as IommuControl>::Error>>;

impl<I: IommuControl> MrShadow<I> {
    /// Allocate the Read and Write IOVA ranges of `[addr, addr+len)` and map
    /// them from `resident` (one entry per page, from the pager's scan).
    pub fn new(
        iommu: Arc<I>,
        addr: u64,
        len: u64,
        page_size: u64,
        resident: &[bool],
    ) -> Res<Self, I> {
        if !page_size.is_power_of_two() {
            return Err(ShadowError::BadPageSize(page_size));
        }
        let (first_page, npages) = crate::check::page_span(addr, len, page_size as usize)
            .ok_or(ShadowError::OutOfRange { addr, len })?;
        if resident.len() as u64 != npages {
            return Err(ShadowError::ResidencyLen {
                got: resident.len(),
                want: npages as usize,
            });
        }
        let read = iommu.alloc_range(npages).map_err(ShadowError::Iommu)?;
        let write = match iommu.alloc_range(npages) {
            Ok(w) => w,
            Err(e) => {
                let _ = iommu.free_range(read);
                return Err(ShadowError::Iommu(e));
            }
        };
        let s = MrShadow {
            iommu,
            addr,
            len,
            first_page,
            page_size,
            read,
            write,
            versions: Arc::new(VersionTable::new(resident.iter().copied())),
            lock: Mutex::new(Pins::new()),
            unmapped: std::sync::atomic::AtomicBool::new(false),
        };
        for (i, &r) in resident.iter().enumerate() {
            let page = first_page + i as u64 * page_size;
            s.iommu
                .set_resident(page, page_size, r)
                .map_err(ShadowError::Iommu)?;
            let (rf, wf) = if r {
                (Frame::Ram(page), Frame::Ram(page))
            } else {
                (Frame::Signature, Frame::BlackHole)
            };
            s.iommu
                .map(&s.read, i as u64, rf)
                .map_err(ShadowError::Iommu)?;
            s.iommu
                .map(&s.write, i as u64, wf)
                .map_err(ShadowError::Iommu)?;
        }
        Ok(s)
    }

    /// Region start.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Region length.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// IOVA range of the Read MR.
    pub fn read_range(&self) -> &I::Range {
        &self.read
    }
    /// IOVA range of the Write MR.
    pub fn write_range(&self) -> &I::Range {
        &self.write
    }
    /// The version table (register it as the Version MR).
    pub fn versions(&self) -> &Arc<VersionTable> {
        &self.versions
    }
    /// Index of the page holding `addr`, if inside the region's pages.
    pub fn page_index(&self, addr: u64) -> Option<usize> {
        let i = addr.checked_sub(self.first_page)? / self.page_size;
        (i < self.versions.len() as u64).then_some(i as usize)
    }

    /// Whether the NIC views map the real page holding `addr` (version
    /// odd): the local pre-check's predicate
    /// (`check::precheck_local(addr, len, ps, |p| shadow.is_mapped(p))`).
    pub fn is_mapped(&self, addr: u64) -> bool {
        self.page_index(addr)
            .and_then(|i| self.versions.get(i))
            .is_some_and(|v| v % 2 == 1)
    }

    /// Swap-out of `pages` (page-aligned addresses; others are ignored):
    /// version → even, remap to signature / black hole, flush. Returns the
    /// number of pages that changed state.
    ///
    /// The flush runs *without* the MR's lock: the lock is never held while
    /// waiting for DMA sections, so a thread that takes it (a map-in under a
    /// pin on the polling thread, an eager map-in on the pager's fault
    /// thread) never waits for the DMA of other threads, and no DMA section
    /// can be made to wait for a flush through it (lock order: the MR's
    /// lock is innermost; nothing waits while holding it). An `Err` (the
    /// flush timed out) means some DMA atom may still use the old frames:
    /// the caller must keep the pages resident.
    pub fn swap_out(&self, pages: &[u64]) -> Res<usize, I> {
        let mut changed = 0;
        {
            let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            for &p in pages {
                let Some(i) = self.page_index(p) else {
                    continue;
                };
                if !self.versions.set_parity(i, false) {
                    continue;
                }
                changed += 1;
                self.iommu
                    .map(&self.read, i as u64, Frame::Signature)
                    .map_err(ShadowError::Iommu)?;
                self.iommu
                    .map(&self.write, i as u64, Frame::BlackHole)
                    .map_err(ShadowError::Iommu)?;
            }
        }
        if changed == 0 {
            return Ok(0);
        }
        self.iommu.flush().map_err(ShadowError::Iommu)?;
        let pins = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        for &p in pages {
            // A page the layer holds pinned stays resident (its eviction
            // aborts), so the NIC model must keep seeing it resident:
            // temporary MRs over it are in use. So does a page mapped in
            // again meanwhile (odd version: a map-in under a pin).
            let keep =
                |i: usize| pinned(&pins, i) || self.versions.get(i).is_some_and(|v| v % 2 == 1);
            if self.page_index(p).is_some_and(|i| !keep(i)) {
                self.iommu
                    .set_resident(p & !(self.page_size - 1), self.page_size, false)
                    .map_err(ShadowError::Iommu)?;
            }
        }
        Ok(changed)
    }

    /// Record that the caller now holds a pager pin on `[addr, addr+len)` and
    /// map it in ([`MrShadow::map_in`]); also marks every page resident for
    /// the NIC model. While recorded, a swap-out announcement for these
    /// pages (which can arrive late, for an eviction the pin is aborting)
    /// still remaps the IOVA views and bumps versions, but leaves the pages
    /// resident for the NIC model, so plain (passthrough) MRs over the pinned
    /// range keep working. Undo with [`MrShadow::unpinned`] *before* the
    /// pager unpin.
    pub fn pinned_map_in(&self, addr: u64, len: u64) -> Res<usize, I> {
        let oob = ShadowError::OutOfRange { addr, len };
        let end = addr
            .checked_add(len)
            .ok_or(ShadowError::OutOfRange { addr, len })?;
        if addr < self.addr || end > self.addr + self.len {
            return Err(oob);
        }
        let (first, n) = crate::check::page_span(addr, len, self.page_size as usize).ok_or(oob)?;
        // One lock hold for both steps (the two-sided path's hot spot).
        let mut pins = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = self.page_index(first) {
            pins.push((i, i + n as usize));
        }
        // The span lies inside the region (checked above): one call for all
        // its pages.
        self.iommu
            .set_resident(first, n * self.page_size, true)
            .map_err(ShadowError::Iommu)?;
        self.map_in_locked(first, n, false)
    }

    /// Undo one [`MrShadow::pinned_map_in`] of the same range.
    pub fn unpinned(&self, addr: u64, len: u64) {
        let Some((first, n)) = crate::check::page_span(addr, len, self.page_size as usize) else {
            return;
        };
        let Some(i) = self.page_index(first) else {
            return;
        };
        let mut pins = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = pins.iter().position(|&r| r == (i, i + n as usize)) {
            pins.swap_remove(k);
        }
        if pins.is_empty() && pins.capacity() > PINS_KEEP {
            pins.shrink_to(PINS_KEEP);
        }
    }

    /// Pages the layer currently holds pinned (see [`MrShadow::pinned_map_in`]).
    pub fn pinned_pages(&self) -> usize {
        let mut r = self.lock.lock().unwrap_or_else(|p| p.into_inner()).clone();
        r.sort_unstable();
        let (mut n, mut upto) = (0, 0);
        for (s, e) in r {
            let s = s.max(upto);
            if e > s {
                n += e - s;
                upto = e;
            }
        }
        n
    }

    /// Map-in of every page of `[addr, addr+len)` (the caller holds a pin on
    /// it, so the pages are resident): remap to the real frames, then version
    /// → odd. Returns the number of pages that changed state.
    ///
    /// **No IOMMU flush here**, on purpose. A flush exists to make sure no
    /// in-flight DMA atom still uses a frame that is being *taken out of
    /// use* (swap-out: the page is about to be reclaimed and reused, so a
    /// late atom would read or write someone else's memory). Map-in takes
    /// nothing out of use: the old frame is the signature or black-hole
    /// page, which stays valid forever and is never reclaimed. An atom that
    /// translated before the remap reads magic (signature) or drops its data
    /// (black hole) — both exactly what it would have done had it run a
    /// moment earlier, and both caught by the initiator's checks (magic in
    /// the data, or an even version seen before the bump below); an atom
    /// after the remap reaches the pinned real page. Ordering the remap
    /// before the version bump is all the protocol needs, so a flush (which
    /// waits for every DMA section in flight on the host) would only add
    /// latency to every fault.
    pub fn map_in(&self, addr: u64, len: u64) -> Res<usize, I> {
        let oob = ShadowError::OutOfRange { addr, len };
        let end = addr
            .checked_add(len)
            .ok_or(ShadowError::OutOfRange { addr, len })?;
        if addr < self.addr || end > self.addr + self.len {
            return Err(oob);
        }
        let (first, n) = crate::check::page_span(addr, len, self.page_size as usize).ok_or(oob)?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.map_in_locked(first, n, true)
    }

    /// [`MrShadow::map_in`] of `n` pages from `first`, under `self.lock`;
    /// `mark_resident`: also mark them resident for the NIC model (the
    /// pinned path has done so already).
    fn map_in_locked(&self, first: u64, n: u64, mark_resident: bool) -> Res<usize, I> {
        let mut changed = 0;
        for k in 0..n {
            let page = first + k * self.page_size;
            let Some(i) = self.page_index(page) else {
                continue;
            };
            if self.versions.get(i).is_some_and(|v| v % 2 == 1) {
                continue;
            }
            if mark_resident {
                self.iommu
                    .set_resident(page, self.page_size, true)
                    .map_err(ShadowError::Iommu)?;
            }
            self.iommu
                .map(&self.read, i as u64, Frame::Ram(page))
                .map_err(ShadowError::Iommu)?;
            self.iommu
                .map(&self.write, i as u64, Frame::Ram(page))
                .map_err(ShadowError::Iommu)?;
            self.versions.set_parity(i, true);
            changed += 1;
        }
        Ok(changed)
    }
}

impl<I: IommuControl> MrShadow<I> {
    /// Whether the application unmapped any of the MR's memory (then ask
    /// the pager which pages: `vmem::Pager::is_gone`).
    pub fn some_unmapped(&self) -> bool {
        self.unmapped.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl<I: IommuControl> MrShadow<I> {
    /// For each of `pages` in the region, whether DMA reached it through
    /// either view since last asked (both views' accessed bits are read and
    /// cleared); ORed into `young`.
    pub fn test_and_clear_young(&self, pages: &[u64], young: &mut [bool]) -> Res<(), I> {
        for (&p, y) in pages.iter().zip(young.iter_mut()) {
            let Some(i) = self.page_index(p) else {
                continue;
            };
            let r = self
                .iommu
                .test_and_clear_young(&self.read, i as u64)
                .map_err(ShadowError::Iommu)?;
            let w = self
                .iommu
                .test_and_clear_young(&self.write, i as u64)
                .map_err(ShadowError::Iommu)?;
            *y |= r || w;
        }
        Ok(())
    }

    /// Eager map-in of pages the pager just brought in (its eager swap-in
    /// notice, on the thread that brought them in; the pager keeps them
    /// resident until this returns): the pages of the region among `pages`
    /// are mapped into both views (real frame, then odd version), so the
    /// first one-sided access after a CPU fault, pin or prefetch needs no
    /// two-sided round. Nothing is done once part of the region was
    /// unmapped (a page brought in just before its unmap must not be
    /// mapped after it; the two-sided path asks the pager).
    pub fn swapped_in(&self, pages: &[u64]) -> Res<usize, I> {
        if self.some_unmapped() {
            return Ok(0);
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut changed = 0;
        for &p in pages {
            if self.page_index(p).is_some() {
                changed += self.map_in_locked(p & !(self.page_size - 1), 1, true)?;
            }
        }
        Ok(changed)
    }
}

/// Swap-outs refused because the IOMMU could not confirm the remap (all MRs
/// of the process), reported in the stats (`remap_refusals`).
static REFUSALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many swap-outs NP-RDMA refused so far because the IOMMU flush failed.
pub fn remap_refusals() -> u64 {
    REFUSALS.load(Ordering::Relaxed)
}

/// Counts a refused swap-out; logs the first one as an error and later ones
/// at each power of two (one line, then a count, however often it recurs).
fn report_refusal(e: &dyn std::fmt::Display) {
    let n = REFUSALS.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        tracing::error!(
            error = %e,
            refusals = n,
            "NP-RDMA swap-out remap failed: the pages stay resident (logged at each power of two)"
        );
    }
}

impl<I: IommuControl> SwapListener for MrShadow<I> {
    fn before_swap_out(&self, pages: &[u64]) -> bool {
        match self.swap_out(pages) {
            Ok(_) => true,
            Err(e) => {
                // The pages stay resident (the pager evicts none of them),
                // mapped to the special frames: the next RDMA access takes the
                // two-sided path and maps them in again.
                report_refusal(&e);
                false
            }
        }
    }
    fn after_swap_in(&self, pages: &[u64]) {
        if let Err(e) = self.swapped_in(pages) {
            tracing::error!(error = %e, "NP-RDMA eager map-in failed");
        }
    }
    fn test_and_clear_young(&self, pages: &[u64], young: &mut [bool]) {
        if let Err(e) = MrShadow::test_and_clear_young(self, pages, young) {
            tracing::error!(error = %e, "NP-RDMA accessed-bit query failed");
        }
    }
    fn after_unmap(&self, start: u64, end: u64) {
        // The MR's pages inside the range leave both views as on a
        // swap-out; they never come back (a pin of a gone page fails), so
        // every later access through the MR there is an error.
        let lo = start.max(self.first_page);
        let hi = end.min(self.addr + self.len);
        let pages: Vec<u64> = (lo..hi)
            .step_by(self.page_size as usize)
            .map(|p| p & !(self.page_size - 1))
            .collect();
        if !pages.is_empty() {
            self.unmapped
                .store(true, std::sync::atomic::Ordering::Release);
        }
        if let Err(e) = self.swap_out(&pages) {
            report_refusal(&e);
        }
    }
}

impl<I: IommuControl> Drop for MrShadow<I> {
    /// Frees both IOVA ranges; the MRs made over them must be gone already.
    fn drop(&mut self) {
        for r in [self.read, self.write] {
            if let Err(e) = self.iommu.free_range(r) {
                tracing::error!(error = %e, "freeing IOVA range failed");
            }
        }
    }
}

#[cfg(test)]
mod tests;
