//! Registration without pinning: one application MR = a Read MR and a
//! Write MR over two IOVA ranges (mapped from residency) + a pinned Version
//! MR, a swap listener, a pager registration and a frame-map range.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::backend::Backend;
use super::views::Views;
use crate::adapt::VmemMm;
use crate::ctrl::KeyMapping;
use crate::nic::{self, Access, IommuControl, MemoryManager};
use crate::shadow::MrShadow;

/// Everything behind one application MR. Operations hold an `Arc` of it;
/// deregistration *fences* it first ([`MrEntry::fence`]): its NIC MRs go at
/// once, so no DMA reaches the memory after `Mr` drop returns, and the
/// operations still in flight complete with an error.
pub(crate) struct MrEntry<N: Backend> {
    /// The application PD (see [`MrEntry::pd`]; `Mr::rereg` changes it).
    pub(super) pd: AtomicU32,
    pub addr: u64,
    pub len: u64,
    /// The application's rights (see [`MrEntry::access`]; `Mr::rereg`
    /// changes them).
    pub(super) access: AtomicU32,
    pub key: u32,
    pub mapping: KeyMapping,
    /// The NIC MRs; `None` once fenced (or before registration finished).
    pub(super) nic: Mutex<Option<NicMrs<N>>>,
    pub(super) read_lkey: u32,
    pub(super) write_lkey: u32,
    pub(super) fenced: AtomicBool,
    pub shadow: Arc<MrShadow<Views<N>>>,
    pub(super) listener: nic::ListenerId,
    pub(super) mm: VmemMm,
    pub(super) region: vmem::RegionId,
    /// The IOMMU whose frame tracking covers the MR's pages from `track`.
    pub(super) iommu: Arc<Views<N>>,
    pub(super) track: u64,
    /// The pages with no pte and no kernel swap entry when the MR was
    /// registered (read after the pager's userfaultfd registration), as runs
    /// of page indices (nothing per page): see [`MrEntry::reads_as_zero`].
    pub(super) unpopulated: crate::adapt::PageRuns,
}

pub(super) struct NicMrs<N: Backend> {
    pub(super) _read: <Views<N> as IommuControl>::Mr,
    pub(super) _write: <Views<N> as IommuControl>::Mr,
    /// The Version MR (none in user-space mode: peers never read versions).
    pub(super) _ver: Option<N::Mr>,
}

impl<N: Backend> MrEntry<N> {
    /// The application PD the MR is registered in.
    pub fn pd(&self) -> u32 {
        self.pd.load(Ordering::Acquire)
    }
    /// The application's access rights of the MR.
    pub fn access(&self) -> Access {
        Access(self.access.load(Ordering::Acquire))
    }
    /// The Read MR's lkey (invalid at the NIC once fenced).
    pub fn read_lkey(&self) -> u32 {
        self.read_lkey
    }
    /// The Write MR's lkey (invalid at the NIC once fenced).
    pub fn write_lkey(&self) -> u32 {
        self.write_lkey
    }
    /// Deregistered: the CPU must not copy into or out of the memory on
    /// the MR's behalf any more (inline answers, atomic results).
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }
    /// Deregistration's fence: drop the NIC MRs now (each waits for the
    /// DMA in flight through it: an IOMMU flush), whoever still holds the
    /// entry. NIC work that uses them later fails with a protection error.
    pub fn fence(&self) {
        self.fenced.store(true, Ordering::Release);
        drop(self.nic.lock().take());
    }
    /// Whether every page of `[addr, addr+len)` (inside the MR, ≤ 4 pages)
    /// provably holds zeroes now, without touching it.
    ///
    /// The proof: the page is in the pager's *untouched* state (never filled
    /// by the pager since it took the range over, not in its swap; a page
    /// the application dropped returns to it, as a hole) **and** had neither
    /// a page nor a kernel swap entry when this MR was registered, which was
    /// after the pager registered the range with userfaultfd. From then on a
    /// page without a pte can only get content through a userfaultfd fill,
    /// which leaves the untouched state; so an untouched page of this MR has
    /// never had content the pager does not know about (the case the second
    /// condition excludes: memory the kernel swapped out itself before the
    /// registration, which the pager records as untouched too) and reads as
    /// zeroes at the moment of the check. No syscall.
    pub fn reads_as_zero(&self, pager: &vmem::Pager, addr: u64, len: u64) -> bool {
        const PS: u64 = vmem::PAGE_SIZE as u64;
        if len == 0 || !self.contains(addr, len) {
            return false;
        }
        let (p0, p1) = (addr / PS, (addr + len - 1) / PS);
        let base = self.addr / PS;
        p1 - p0 < 4
            && (p0..=p1).all(|p| {
                self.unpopulated.contains(p - base) && pager.is_untouched((p * PS) as usize)
            })
    }

    /// [`MrEntry::reads_as_zero`] for a range of any length (one check per
    /// page: for the two-sided path's large READs).
    pub fn range_reads_as_zero(&self, pager: &vmem::Pager, addr: u64, len: u64) -> bool {
        const PS: u64 = vmem::PAGE_SIZE as u64;
        if len == 0 || !self.contains(addr, len) {
            return false;
        }
        let base = self.addr / PS;
        (addr / PS..=(addr + len - 1) / PS)
            .all(|p| self.unpopulated.contains(p - base) && pager.is_untouched((p * PS) as usize))
    }

    /// Whether `[addr, addr+len)` is inside the MR.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

impl<N: Backend> Drop for MrEntry<N> {
    fn drop(&mut self) {
        // Listener first (waits for a running call), then the NIC MRs (wait
        // for DMA), then the IOVA ranges (shadow), frame map, pager.
        self.mm.remove_swap_listener(self.listener);
        drop(self.nic.get_mut().take());
        if let Err(e) = self.iommu.untrack_frames(self.track) {
            tracing::warn!(error = %e, "untrack failed");
        }
        if let Err(e) = self.mm.0.unregister(self.region) {
            tracing::warn!(error = %e, "pager unregister failed");
        }
    }
}
