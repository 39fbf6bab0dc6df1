//! Registration without pinning: one application MR = a Read MR and a
//! Write MR over two IOVA ranges (mapped from residency) + a pinned Version
//! MR, a swap listener, a pager registration and a frame-map range.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::core::Shared;
use super::Error;
use crate::adapt::{rnic_access, RnicIommu, VmemMm};
use crate::ctrl::KeyMapping;
use crate::nic::{self, Access, IommuControl, MemoryManager, NicMr};
use crate::shadow::MrShadow;

/// Everything behind one application MR. Operations hold an `Arc` of it;
/// deregistration *fences* it first ([`MrEntry::fence`]): its NIC MRs go at
/// once, so no DMA reaches the memory after `Mr` drop returns, and the
/// operations still in flight complete with an error.
pub(crate) struct MrEntry {
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub key: u32,
    pub mapping: KeyMapping,
    /// The NIC MRs; `None` once fenced (or before registration finished).
    nic: Mutex<Option<NicMrs>>,
    read_lkey: u32,
    write_lkey: u32,
    fenced: AtomicBool,
    pub shadow: Arc<MrShadow<RnicIommu>>,
    listener: nic::ListenerId,
    mm: VmemMm,
    region: vmem::RegionId,
    host: rnic::Host,
    track: usize,
    /// The pages with no pte and no kernel swap entry when the MR was
    /// registered (read after the pager's userfaultfd registration), as runs
    /// of page indices (nothing per page): see [`MrEntry::reads_as_zero`].
    unpopulated: crate::adapt::PageRuns,
}

struct NicMrs {
    _read: rnic::Mr,
    _write: rnic::Mr,
    _ver: rnic::Mr,
}

impl MrEntry {
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

impl Drop for MrEntry {
    fn drop(&mut self) {
        // Listener first (waits for a running call), then the NIC MRs (wait
        // for DMA), then the IOVA ranges (shadow), frame map, pager.
        self.mm.remove_swap_listener(self.listener);
        drop(self.nic.get_mut().take());
        if let Err(e) = self.host.frames().untrack(self.track) {
            tracing::warn!(error = %e, "untrack failed");
        }
        if let Err(e) = self.mm.0.unregister(self.region) {
            tracing::warn!(error = %e, "pager unregister failed");
        }
    }
}

/// The application's handle of a registered MR. Dropping it deregisters
/// (peers are told to forget its key).
pub struct Mr {
    sh: Arc<Shared>,
    key: u32,
    addr: u64,
    len: u64,
}

impl Mr {
    pub fn lkey(&self) -> u32 {
        self.key
    }
    pub fn rkey(&self) -> u32 {
        self.key
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// An SGE over `[addr()+off, +len)`.
    pub fn sge(&self, off: u64, len: u32) -> nic::Sge {
        nic::Sge {
            addr: self.addr + off,
            length: len,
            lkey: self.key,
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let entry = {
            let mut st = self.sh.st.lock();
            let e = st.mrs.remove(&self.key);
            st.keys.remove(self.key);
            super::core::broadcast_revoke(&self.sh, &mut st, self.key);
            if let Some(e) = &e {
                super::core::fence_mr(&mut st, e);
            }
            e
        };
        drop(entry);
    }
}

/// See `Pd::reg_mr`.
///
/// # Safety
/// As `Pd::reg_mr`.
#[allow(unsafe_code)]
pub(crate) unsafe fn register(
    sh: &Arc<Shared>,
    pd: u32,
    addr: u64,
    len: u64,
    access: Access,
) -> Result<Mr, Error> {
    const PS: u64 = vmem::PAGE_SIZE as u64;
    if len == 0 || addr == 0 || addr.checked_add(len).is_none() {
        return Err(Error::Invalid("empty or wrapping MR"));
    }
    // As ibv_reg_mr (and the NIC's own registration): remote writes and
    // atomics need local write access too.
    if (access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC))
        && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(Error::Invalid(
            "REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE",
        ));
    }
    let first = addr & !(PS - 1);
    let npages = (addr + len - 1) / PS - addr / PS + 1;
    // SAFETY: forwarded contract (private anonymous memory that stays mapped).
    let region = unsafe { sh.mm.0.register_raw(addr as usize, len as usize)? };
    let unreg = |e: Error| {
        let _ = sh.mm.0.unregister(region);
        e
    };
    if let Err(e) = sh
        .host
        .frames()
        .track(first as usize, (npages * PS) as usize, false)
    {
        return Err(unreg(e.into()));
    }
    let untrack = |e: Error| {
        let _ = sh.host.frames().untrack(first as usize);
        unreg(e)
    };
    let mut resident = Vec::new();
    if let Err(e) = sh.mm.residency(first, npages * PS, &mut resident) {
        return Err(untrack(e.into()));
    }
    let unpopulated = crate::adapt::unpopulated_runs(first, npages);
    let shadow = match MrShadow::new(sh.iommu.clone(), addr, len, PS, &resident) {
        Ok(s) => Arc::new(s),
        Err(e) => return Err(untrack(Error::Other(e.to_string()))),
    };
    let listener = sh
        .mm
        .add_swap_listener(shadow.clone() as Arc<dyn nic::SwapListener>);
    // Pages evicted between the residency scan and the listener: treat as a
    // swap-out now (a page announced absent that is resident just goes
    // two-sided on its first access).
    let mut again = Vec::new();
    if sh.mm.residency(first, npages * PS, &mut again).is_ok() {
        let gone: Vec<u64> = resident
            .iter()
            .zip(&again)
            .enumerate()
            .filter(|(_, (a, b))| **a && !**b)
            .map(|(i, _)| first + i as u64 * PS)
            .collect();
        if !gone.is_empty() {
            let _ = shadow.swap_out(&gone);
        }
    }
    let mut entry = MrEntry {
        pd,
        addr,
        len,
        access,
        key: 0,
        mapping: KeyMapping {
            app_rkey: 0,
            write_rkey: 0,
            version_rkey: 0,
            page_count: npages as u32,
            region_va: addr,
            region_len: len,
            version_va: shadow.versions().addr(),
        },
        nic: Mutex::new(None),
        read_lkey: 0,
        write_lkey: 0,
        fenced: AtomicBool::new(false),
        shadow: shadow.clone(),
        listener,
        mm: sh.mm.clone(),
        region,
        host: sh.host.clone(),
        track: first as usize,
        unpopulated,
    };
    let vers = shadow.versions();
    // SAFETY: the version table is heap memory owned by the shadow, which
    // the entry keeps alive until after the MR is dropped (`nic` goes first).
    let ver = unsafe {
        sh.pd.reg_mr(
            vers.addr() as usize,
            vers.byte_len() as usize,
            // ANY_QP: peers read versions to check their one-sided ops
            // whatever the application's QP flags (READ-only data).
            rnic::Access::LOCAL_WRITE | rnic::Access::REMOTE_READ | rnic::Access::ANY_QP,
        )?
    };
    let read_access = Access(access.0 & Access::REMOTE_READ.0);
    let write_access = Access(Access::LOCAL_WRITE.0 | (access.0 & Access::REMOTE_WRITE.0));
    // SAFETY: forwarded contract; the IOVA entries are maintained by the shadow.
    let read = unsafe {
        sh.iommu
            .reg_mr_iova(addr, len, read_access, shadow.read_range())?
    };
    // SAFETY: as above.
    let write = unsafe {
        sh.iommu
            .reg_mr_iova(addr, len, write_access, shadow.write_range())?
    };
    let _ = rnic_access;
    entry.key = read.rkey();
    entry.mapping.app_rkey = read.rkey();
    entry.mapping.write_rkey = write.rkey();
    entry.mapping.version_rkey = ver.rkey();
    entry.read_lkey = read.lkey();
    entry.write_lkey = write.lkey();
    *entry.nic.get_mut() = Some(NicMrs {
        _read: read.0,
        _write: write.0,
        _ver: ver,
    });
    let key = entry.key;
    let mapping = entry.mapping;
    {
        let mut st = sh.st.lock();
        st.keys
            .insert(mapping)
            .map_err(|e| Error::Other(e.to_string()))?;
        st.mrs.insert(key, Arc::new(entry));
        super::core::broadcast_keysync(sh, &mut st, mapping);
    }
    Ok(Mr {
        sh: sh.clone(),
        key,
        addr,
        len,
    })
}
