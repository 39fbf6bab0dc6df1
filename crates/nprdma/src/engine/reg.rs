//! Registration and deregistration of application MRs: the application's
//! [`Mr`] handle, [`register`] (shadow, NIC MRs, key table, peers told) and
//! the fence that deregistration puts on everything still using the MR.

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;

use parking_lot::Mutex;

use super::backend::{Backend, DefaultNic};
use super::keysync::{broadcast_keysync, broadcast_revoke};
use super::mr::{MrEntry, NicMrs};
use super::pin::{pin_for_peer, NicPin};
use super::state::{Shared, State};
use super::types::Error;
use crate::ctrl::KeyMapping;
use crate::nic::{self, Access, IommuControl, MemoryManager, NicMr};
use crate::shadow::MrShadow;

/// The application's handle of a registered MR. Dropping it deregisters
/// (peers are told to forget its key).
pub struct Mr<N: Backend = DefaultNic> {
    pub(super) sh: Arc<Shared<N>>,
    pub(super) key: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
}

impl<N: Backend> Mr<N> {
    /// The key of local SGEs over this MR.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// The key peers use to reach this MR (the same number as the lkey).
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Start of the registered range.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the MR covers nothing (never: registration refuses it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the NIC's views map the page holding `addr` to its real
    /// frame now (its version is odd): peers reach it one-sided. A
    /// diagnostic; the page may be swapped out right after.
    pub fn is_mapped(&self, addr: u64) -> bool {
        let e = self.sh.st.lock().mrs.get(&self.key).cloned();
        e.is_some_and(|e| e.shadow.is_mapped(addr))
    }
    /// Re-register in place (`ibv_rereg_mr` without a new translation):
    /// move the MR to PD `pd` (`Pd::id` of a PD of this context)
    /// and/or give it `access`, keeping its keys and memory. The NIC views
    /// change first (the DMA already inside them finishes), so from the
    /// return on a peer's one-sided operation meets the new rights and PD at
    /// the NIC and its two-sided one at the target's check. `Error::Invalid`
    /// for REMOTE_WRITE/REMOTE_ATOMIC without LOCAL_WRITE or a deregistered MR.
    pub fn rereg(&self, pd: Option<u32>, access: Option<Access>) -> Result<(), Error> {
        let e = self
            .sh
            .st
            .lock()
            .mrs
            .get(&self.key)
            .cloned()
            .ok_or(Error::Invalid("MR deregistered"))?;
        let pd = pd.unwrap_or_else(|| e.pd());
        let access = access.unwrap_or_else(|| e.access());
        if (access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC))
            && !access.contains(Access::LOCAL_WRITE)
        {
            return Err(Error::Invalid(
                "REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE",
            ));
        }
        {
            let mut nic = e.nic.lock();
            let Some(m) = nic.as_mut() else {
                return Err(Error::Invalid("MR deregistered"));
            };
            let (ra, wa) = view_access(access);
            self.sh
                .iommu
                .set_mr_rights(&mut m._read, ra, pd)
                .map_err(N::error)?;
            self.sh
                .iommu
                .set_mr_rights(&mut m._write, wa, pd)
                .map_err(N::error)?;
        }
        e.pd.store(pd, std::sync::atomic::Ordering::Release);
        e.access
            .store(access.0, std::sync::atomic::Ordering::Release);
        // Leases were lent under the old PD and rights.
        self.sh.leases.drop_mr(&e);
        Ok(())
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

impl<N: Backend> Drop for Mr<N> {
    fn drop(&mut self) {
        let entry = {
            let mut st = self.sh.st.lock();
            let e = st.mrs.remove(&self.key);
            st.keys.remove(self.key);
            broadcast_revoke(&self.sh, &mut st, self.key);
            if let Some(e) = &e {
                fence_mr(&mut st, e);
            }
            e
        };
        // No cached temporary MR may keep the memory open to peers.
        const PS: u64 = vmem::PAGE_SIZE as u64;
        let start = self.addr & !(PS - 1);
        self.sh
            .cache
            .invalidate(start, (self.addr + self.len).next_multiple_of(PS));
        // Nor any lease lent to a peer.
        if let Some(e) = &entry {
            self.sh.leases.drop_mr(e);
        }
        drop(entry);
    }
}

/// The NIC rights of an MR's Read and Write views for the application's
/// `access`.
fn view_access(access: Access) -> (Access, Access) {
    (
        Access(access.0 & Access::REMOTE_READ.0),
        Access(Access::LOCAL_WRITE.0 | (access.0 & Access::REMOTE_WRITE.0)),
    )
}

/// See `Pd::reg_mr`.
///
/// # Safety
/// As `Pd::reg_mr`.
#[allow(unsafe_code)]
pub(crate) unsafe fn register<N: Backend>(
    sh: &Arc<Shared<N>>,
    pd: u32,
    addr: u64,
    len: u64,
    access: Access,
) -> Result<Mr<N>, Error> {
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
    // SAFETY: forwarded contract (memory that stays mapped).
    let region = match unsafe { sh.mm.0.register_raw(addr as usize, len as usize) } {
        Ok(r) => r,
        // Memory the pager cannot page (hugetlbfs, file mappings outside
        // tmpfs): as a NIC that pins takes it — always resident, so every
        // operation on it goes one-sided.
        Err(vmem::Error::NotAnonymous { .. } | vmem::Error::OtherKind { .. }) => {
            // SAFETY: as above.
            unsafe { sh.mm.0.register_foreign_raw(addr as usize, len as usize)? }
        }
        Err(e) => return Err(e.into()),
    };
    let unreg = |e: Error| {
        let _ = sh.mm.0.unregister(region);
        e
    };
    if let Err(e) = sh.iommu.track_frames(first, npages * PS) {
        return Err(unreg(N::error(e)));
    }
    let untrack = |e: Error| {
        let _ = sh.iommu.untrack_frames(first);
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
        pd: AtomicU32::new(pd),
        addr,
        len,
        access: AtomicU32::new(access.0),
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
        iommu: sh.iommu.clone(),
        track: first,
        unpopulated,
    };
    let vers = shadow.versions();
    let ver = if sh.iommu.is_user() {
        // User-space mode: no one-sided operation, so no peer reads versions.
        None
    } else {
        // SAFETY: the version table is heap memory owned by the shadow, which
        // the entry keeps alive until after the MR is dropped (`nic` goes first).
        Some(unsafe {
            sh.nic
                .reg_mr(
                    vers.addr(),
                    vers.byte_len(),
                    // ANY_QP: peers read versions to check their one-sided ops
                    // whatever the application's QP flags (READ-only data).
                    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::ANY_QP,
                )
                .map_err(N::error)?
        })
    };
    let (read_access, write_access) = view_access(access);
    // SAFETY: forwarded contract; the IOVA entries are maintained by the shadow.
    let read = unsafe {
        sh.iommu
            .reg_mr_iova(addr, len, read_access, shadow.read_range(), pd)
            .map_err(N::error)?
    };
    // SAFETY: as above.
    let write = unsafe {
        sh.iommu
            .reg_mr_iova(addr, len, write_access, shadow.write_range(), pd)
            .map_err(N::error)?
    };
    entry.key = read.rkey();
    entry.mapping.app_rkey = read.rkey();
    entry.mapping.write_rkey = write.rkey();
    entry.mapping.version_rkey = ver.as_ref().map_or(0, |v| v.rkey());
    entry.read_lkey = read.lkey();
    entry.write_lkey = write.lkey();
    *entry.nic.get_mut() = Some(NicMrs {
        _read: read,
        _write: write,
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
        broadcast_keysync(sh, &mut st, mapping);
    }
    Ok(Mr {
        sh: sh.clone(),
        key,
        addr,
        len,
    })
}

/// Deregistration of `mr` (its entry already left the table): the
/// temporary MRs over its memory — a two-sided op's local one, a served
/// request's target one — and its own NIC MRs are dropped now, each
/// waiting for the DMA in flight through it. Operations still in flight on
/// it complete with an error: their NIC work fails at the NIC, and their
/// answers are no longer copied in ([`MrEntry::is_fenced`]).
pub(crate) fn fence_mr<N: Backend>(st: &mut State<N>, mr: &Arc<MrEntry<N>>) {
    for qp in st.qps.iter_mut().flatten() {
        for (_, t) in qp.treqs.iter_mut() {
            if Arc::ptr_eq(&t._mr, mr) {
                t._tmr = None;
            }
        }
        for (_, op) in qp.ops.iter_mut() {
            if op.lmr.as_ref().is_some_and(|l| Arc::ptr_eq(l, mr)) {
                op.hold.mr = None;
            }
        }
    }
    st.post_answer.retain(|(m, _, _)| !Arc::ptr_eq(m, mr));
    mr.fence();
}

/// The MR of `lkey` if it covers `[addr, addr+len)` and allows what `for_` does to
/// it (LOCAL_WRITE for a pin that writes); else what is wrong.
pub(super) fn mr_to_pin<N: Backend>(
    sh: &Shared<N>,
    lkey: u32,
    addr: u64,
    len: u64,
    for_: nic::PinFor,
) -> Result<Arc<MrEntry<N>>, Error> {
    let e = sh.st.lock().mrs.get(&lkey).cloned();
    let e = e
        .filter(|e| e.contains(addr, len))
        .ok_or(Error::Invalid("no MR with this lkey covers the range"))?;
    if for_ == nic::PinFor::Write && !e.access().contains(Access::LOCAL_WRITE) {
        return Err(Error::Invalid("the MR is not locally writable"));
    }
    Ok(e)
}

/// [`super::Context::pin_for_nic`]: the MR of `lkey`, which must cover
/// `[addr, addr+len)`, pinned there for `for_`.
pub(super) fn pin_for_nic<N: Backend>(
    sh: &Shared<N>,
    lkey: u32,
    addr: u64,
    len: u64,
    for_: nic::PinFor,
) -> Result<NicPin<N>, Error> {
    let e = mr_to_pin(sh, lkey, addr, len, for_)?;
    pin_for_peer(&sh.mm, &e, addr, len, for_)
        .map(NicPin::new)
        .map_err(|s| Error::Other(format!("pin failed: {s:?}")))
}
