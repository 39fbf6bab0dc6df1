//! `NPRDMA_MODE=pinned`: standard RDMA on the software RNIC (one rnic `Host` per
//! process over the shared-memory transport; `reg_mr` registers normally).
//!
//! Registration is charged against `RLIMIT_MEMLOCK` exactly as the kernel's
//! `ib_umem_get` charges a real RDMA registration: the pages an MR covers are added
//! to the process's pinned count (overlapping MRs count again), and if the total
//! exceeds the limit and the calling thread lacks `CAP_IPC_LOCK` the registration
//! fails with ENOMEM; deregistration uncharges. (Root normally holds CAP_IPC_LOCK,
//! so — as with real NICs — `ulimit -l` binds only processes without it.)
//!
//! Registered memory is what the MR names, not whatever is mapped at its address
//! later: a NIC holds the pages it pinned, while this NIC reaches the MR through its
//! address. So each MR's range is watched ([`vmem::UnmapWatch`], one per process):
//! when the application unmaps it or moves it away with mremap, the MR is
//! deregistered in the NIC at once (its keys then fail as a deregistered MR's do:
//! remote access error, local protection error) and `ibv_dereg_mr` later only
//! uncharges it. While the watch reads and handles an unmap, the DMA of every host
//! with watched MRs is held (`Iommu::hold_dma`), so no copy can meet memory the
//! application maps at the old address before the MR is gone. Memory userfaultfd
//! cannot follow (a file mapping, or a range the application attached to its own
//! userfaultfd) is registered unwatched.

use super::{ours, Ah, Cq, Device, Mr, Pd, Qp, Result, Srq};
use crate::error::ShimError;
use rnic::{
    Access, DeviceAttr, PostError, QpAttr, QpAttrMask, QpInitAttr, QpType, RecvWr, SendWr, Wc,
};
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Work requests per queue this mode grants (rxe's `RXE_MAX_QP_WR`).
pub const PINNED_MAX_WR: u32 = 16384;
/// SGEs per work request this mode grants (rxe's `RXE_MAX_SGE`).
pub const PINNED_MAX_SGE: u32 = 32;

/// Entries per CQ this mode grants.
pub const PINNED_MAX_CQE: u32 = 1 << 20;

pub struct PinnedDevice {
    ctx: rnic::Context,
}

impl PinnedDevice {
    pub fn new() -> Result<PinnedDevice> {
        let mut cfg = super::host_config_from_env()?;
        // What rxe advertises: 16384 WRs per queue and 32 SGEs per WR (unused depth
        // costs nothing: the receive rings are sparse shared memory).
        cfg.max_wr = PINNED_MAX_WR;
        cfg.max_sge = PINNED_MAX_SGE;
        // libfabric's rxm asks for 262144-entry CQs (mlx5 offers 4M); sparse too.
        cfg.max_cqe = PINNED_MAX_CQE;
        let host = rnic::Host::new(cfg)?;
        Ok(PinnedDevice {
            ctx: host.open_context()?,
        })
    }
}

impl Device for PinnedDevice {
    fn mode(&self) -> &'static str {
        "pinned"
    }
    fn attr(&self) -> DeviceAttr {
        self.ctx.query_device()
    }
    fn gid(&self) -> [u8; 16] {
        self.ctx.host().addr().to_bytes()
    }
    fn stats(&self) -> String {
        let mut line = String::from("mode=pinned");
        if let Some(w) = self.ctx.host().wire_stats() {
            line.push_str(&crate::backend::roce_stats(&w));
        }
        line
    }
    fn wire_peer(&self, local: [u8; 16], remote: [u8; 16]) -> Result<rnic::HostAddr> {
        Ok(self.ctx.host().wire_peer(local, remote)?)
    }
    fn lid(&self) -> u16 {
        self.ctx.host().lid()
    }
    fn alloc_pd(&self) -> Result<Arc<dyn Pd>> {
        Ok(Arc::new(PinnedPd(self.ctx.alloc_pd()?)))
    }
    fn create_cq(&self, depth: u32, events: bool) -> Result<Box<dyn Cq>> {
        // One private channel per CQ: the C layer multiplexes them per ibv_comp_channel.
        let chan = if events {
            Some(self.ctx.create_comp_channel()?)
        } else {
            None
        };
        let cq = self.ctx.create_cq(depth, chan.as_ref())?;
        Ok(Box::new(PinnedCq { cq, chan }))
    }
    fn srq_limits(&self) -> Option<(u32, u32)> {
        // An SRQ is a QP table entry: its RQ has a QP's depth.
        let a = self.attr();
        Some((a.max_qp_wr, a.max_sge))
    }
    fn address_handles(&self) -> bool {
        true
    }
}

/// Pages pinned by this process's registrations (the kernel's `mm->pinned_vm`).
static PINNED_PAGES: AtomicU64 = AtomicU64::new(0);

/// Pages this process's pinned-mode MRs have charged against RLIMIT_MEMLOCK now.
pub fn pinned_pages() -> u64 {
    PINNED_PAGES.load(Ordering::Acquire)
}

const PAGE: u64 = 4096;

/// Pages of `[addr, addr+len)` (`ib_umem_num_pages`).
fn pages_of(addr: usize, len: usize) -> u64 {
    let (a, l) = (addr as u64, len as u64);
    (a.saturating_add(l).div_ceil(PAGE)).saturating_sub(a / PAGE)
}

/// The soft `RLIMIT_MEMLOCK` in pages (`u64::MAX`: unlimited).
fn memlock_limit_pages() -> u64 {
    match rustix::process::getrlimit(rustix::process::Resource::Memlock).current {
        Some(bytes) => bytes / PAGE,
        None => u64::MAX,
    }
}

/// Whether the calling thread has CAP_IPC_LOCK in its effective set (`capable()`).
fn has_cap_ipc_lock() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| {
        c.effective
            .contains(rustix::thread::CapabilitySet::IPC_LOCK)
    })
}

/// The `ib_umem_get` rule: may a process with `pinned_after` pages pinned (this
/// registration included) keep them, given the limit and the capability (asked
/// only when over the limit)?
fn memlock_admits(
    pinned_after: u64,
    limit_pages: u64,
    cap_ipc_lock: impl FnOnce() -> bool,
) -> bool {
    pinned_after <= limit_pages || cap_ipc_lock()
}

/// This MR's share of [`PINNED_PAGES`]; uncharged on drop.
struct MemlockCharge(u64);

impl MemlockCharge {
    fn charge(addr: usize, len: usize) -> Result<MemlockCharge> {
        let n = pages_of(addr, len);
        let after = PINNED_PAGES
            .fetch_add(n, Ordering::AcqRel)
            .saturating_add(n);
        let c = MemlockCharge(n);
        if !memlock_admits(after, memlock_limit_pages(), has_cap_ipc_lock) {
            drop(c);
            return Err(ShimError::Nic(rnic::Error::NoResources(
                "RLIMIT_MEMLOCK (ulimit -l) would be exceeded and the thread lacks CAP_IPC_LOCK",
            )));
        }
        Ok(c)
    }
}

impl Drop for MemlockCharge {
    fn drop(&mut self) {
        PINNED_PAGES.fetch_sub(self.0, Ordering::AcqRel);
    }
}

struct PinnedPd(rnic::Pd);

impl Pd for PinnedPd {
    fn as_any(&self) -> &dyn Any {
        self
    }
    unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Box<dyn Mr>> {
        check_mapped(addr, len)?;
        let charge = MemlockCharge::charge(addr, len)?;
        // SAFETY: forwarded contract: the caller keeps the memory mapped while
        // registered — and if it does not, the watch below deregisters the MR.
        let mr = unsafe { self.0.reg_mr(addr, len, access)? };
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        let mr = Arc::new(parking_lot::Mutex::new(Some(mr)));
        let watch = watch_mr(self.0.host(), &mr, lkey, addr, len);
        Ok(Box::new(PinnedMr {
            mr,
            moved: parking_lot::Mutex::new((Some(watch), charge)),
            lkey,
            rkey,
        }))
    }
    fn create_qp_of(
        &self,
        qp_type: QpType,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        srq: Option<&dyn Srq>,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        let srq = srq
            .map(|s| ours::<PinnedSrq>(s.as_any(), "SRQ").map(|p| &p.0))
            .transpose()?;
        let cq_of = |c: &dyn Cq| ours::<PinnedCq>(c.as_any(), "CQ").map(|p| p.cq.clone());
        let qp = self
            .0
            .create_qp_of(qp_type, &cq_of(send_cq)?, &cq_of(recv_cq)?, srq, attr)?;
        Ok(Box::new(PinnedQp(qp)))
    }
    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn Srq>> {
        Ok(Box::new(PinnedSrq(self.0.create_srq(max_wr, max_sge)?)))
    }
    fn create_ah(&self, gid: [u8; 16]) -> Result<Box<dyn Ah>> {
        let dest = rnic::HostAddr::from_bytes(&gid);
        let ah = self.0.create_ah(dest).map_err(|e| {
            ShimError::InvalidArgument(format!("no device has GID {}: {e}", dest.to_hex()))
        })?;
        Ok(Box::new(PinnedAh(ah)))
    }
}

/// An address handle: rnic's (the destination host resolved at creation).
struct PinnedAh(rnic::Ah);

impl Ah for PinnedAh {
    fn dest(&self) -> rnic::HostAddr {
        self.0.dest()
    }
}

/// A registration pins its pages (`ib_umem_get`): memory that is not mapped fails
/// with EFAULT (e.g. a NULL address), as on rxe/mlx5.
fn check_mapped(addr: usize, len: usize) -> Result<()> {
    let page = 4096usize;
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return Err(ShimError::InvalidArgument("address range wraps".into()));
    };
    let pages = (end - start).div_ceil(page);
    let mut vec = vec![0u8; pages.min(4096)];
    let mut at = start;
    while at < end {
        let n = ((end - at).div_ceil(page)).min(vec.len());
        // SAFETY: mincore only reads the page tables of [at, at + n pages) and
        // writes n bytes into vec (n <= vec.len()).
        let r = unsafe { libc::mincore(at as *mut libc::c_void, n * page, vec.as_mut_ptr()) };
        if r != 0 {
            return Err(ShimError::Fault(format!(
                "{len} bytes at {addr:#x} are not mapped"
            )));
        }
        at += n * page;
    }
    Ok(())
}

/// Hosts with watched MRs, and how many each has: the watch holds their DMA while it
/// handles an unmap.
static WATCHED_HOSTS: parking_lot::Mutex<Vec<(rnic::Host, usize)>> =
    parking_lot::Mutex::new(Vec::new());

/// Counts one more (`add`) or one fewer watched MR of `host`.
fn watched_host(host: &rnic::Host, add: bool) {
    let mut hosts = WATCHED_HOSTS.lock();
    let at = hosts.iter().position(|(h, _)| h.addr() == host.addr());
    match (at, add) {
        (Some(i), true) => hosts[i].1 += 1,
        (None, true) => hosts.push((host.clone(), 1)),
        (Some(i), false) => {
            hosts[i].1 -= 1;
            if hosts[i].1 == 0 {
                hosts.swap_remove(i);
            }
        }
        (None, false) => {}
    }
}

/// The DMA holds the watch takes while it handles an unmap; released on drop.
struct DmaHolds(Vec<rnic::Host>);

impl Drop for DmaHolds {
    fn drop(&mut self) {
        for h in &self.0 {
            h.iommu().release_dma();
        }
    }
}

fn hold_watched_hosts() -> Box<dyn Any> {
    let hosts: Vec<rnic::Host> = WATCHED_HOSTS
        .lock()
        .iter()
        .map(|(h, _)| h.clone())
        .collect();
    let mut held = DmaHolds(Vec::with_capacity(hosts.len()));
    for h in hosts {
        match h.iommu().hold_dma() {
            Ok(()) => held.0.push(h),
            Err(e) => {
                tracing::warn!("could not hold the NIC's DMA while an MR's memory is unmapped: {e}")
            }
        }
    }
    Box::new(held)
}

/// The process's one watch over registered ranges (`None` if userfaultfd is not
/// available: MRs are then not followed through munmap, with a warning).
fn unmap_watch() -> Option<&'static vmem::UnmapWatch> {
    static WATCH: OnceLock<Option<vmem::UnmapWatch>> = OnceLock::new();
    WATCH
        .get_or_init(|| {
            vmem::UnmapWatch::with_hold(Box::new(hold_watched_hosts))
                .map_err(|e| {
                    tracing::warn!(
                        "userfaultfd unavailable ({e}): an MR whose memory is unmapped stays registered at its address"
                    )
                })
                .ok()
        })
        .as_ref()
}

/// How an MR's memory is followed through munmap.
enum Follow {
    /// The userfaultfd watch (anonymous, shared and hugetlbfs memory), and the host
    /// whose count in [`WATCHED_HOSTS`] it holds.
    Watch(vmem::WatchId, rnic::Host),
    /// Memory userfaultfd cannot watch (file mappings): the interposed munmap /
    /// mremap runs the callback before the system call.
    Munmap(crate::unmap::ForeignFollow),
}

/// What unmapping an MR's memory does: deregister it in the NIC.
fn on_gone(mr: &Arc<parking_lot::Mutex<Option<rnic::Mr>>>, lkey: u32) -> vmem::OnGone {
    let held = mr.clone();
    Box::new(move || {
        // Deregistered under the lock, so an `ibv_dereg_mr` racing this returns only
        // once the NIC is done with the MR.
        let mut held = held.lock();
        drop(held.take());
        tracing::debug!(
            lkey,
            "registered memory unmapped: MR deregistered in the NIC"
        );
    })
}

/// Follow `[addr, addr+len)`, registered as `mr`: unmapping it deregisters `mr` in
/// the NIC — by the userfaultfd watch where it can watch the memory, else by the
/// interposed munmap / mremap.
fn watch_mr(
    host: &rnic::Host,
    mr: &Arc<parking_lot::Mutex<Option<rnic::Mr>>>,
    lkey: u32,
    addr: usize,
    len: usize,
) -> Follow {
    if let Some(w) = unmap_watch() {
        watched_host(host, true);
        match w.watch(addr, len, on_gone(mr, lkey)) {
            Ok(id) => return Follow::Watch(id, host.clone()),
            Err(e) => {
                tracing::debug!(addr, len, "MR memory followed by the munmap wrapper: {e}");
                watched_host(host, false);
            }
        }
    }
    Follow::Munmap(crate::unmap::follow_foreign(addr, len, on_gone(mr, lkey)))
}

/// Stop following an MR's memory.
fn unwatch_mr(follow: Option<Follow>) {
    match follow {
        Some(Follow::Watch(id, host)) => {
            if let Some(w) = unmap_watch() {
                w.unwatch(id);
            }
            watched_host(&host, false);
        }
        Some(Follow::Munmap(f)) => drop(f),
        None => {}
    }
}

struct PinnedMr {
    /// The NIC's MR; `None` once its memory was unmapped (the watch took it).
    mr: Arc<parking_lot::Mutex<Option<rnic::Mr>>>,
    /// What follows the MR's range (re-registration moves both): the watch over its
    /// memory, and its memlock charge.
    moved: parking_lot::Mutex<(Option<Follow>, MemlockCharge)>,
    lkey: u32,
    rkey: u32,
}

impl Drop for PinnedMr {
    fn drop(&mut self) {
        unwatch_mr(self.moved.get_mut().0.take());
        // Deregister (if the watch has not; if it is, wait for it), then uncharge
        // (the field's own drop).
        let mut mr = self.mr.lock();
        drop(mr.take());
    }
}

impl Mr for PinnedMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    unsafe fn rereg(
        &self,
        pd: Option<&dyn Pd>,
        range: Option<(usize, usize)>,
        access: Option<Access>,
    ) -> Result<()> {
        let pd = pd
            .map(|p| ours::<PinnedPd>(p.as_any(), "PD").map(|p| &p.0))
            .transpose()?;
        let mut moved = self.moved.lock();
        let charge = range
            .map(|(a, l)| MemlockCharge::charge(a, l))
            .transpose()?;
        let mut held = self.mr.lock();
        let Some(mr) = held.as_mut() else {
            return Err(ShimError::InvalidArgument(
                "the MR's memory was unmapped (it is deregistered)".into(),
            ));
        };
        // SAFETY: forwarded contract: the application keeps a new range mapped while
        // registered — and the watch set below deregisters it if it does not.
        unsafe { mr.rereg(pd, range, access)? };
        let host = mr.pd().host().clone();
        drop(held);
        if let (Some((addr, len)), Some(charge)) = (range, charge) {
            unwatch_mr(moved.0.take());
            moved.0 = Some(watch_mr(&host, &self.mr, self.lkey, addr, len));
            moved.1 = charge;
        }
        Ok(())
    }
}

struct PinnedCq {
    cq: rnic::Cq,
    chan: Option<rnic::CompChannel>,
}

impl Cq for PinnedCq {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn resize(&self, cqe: u32) -> Result<()> {
        Ok(self.cq.resize(cqe)?)
    }
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        Ok(self.cq.poll(out)?)
    }
    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        Ok(self.cq.req_notify(solicited_only)?)
    }
    fn event_fd(&self) -> Option<RawFd> {
        self.chan.as_ref().map(|c| c.fd())
    }
    fn take_event(&self) -> bool {
        let Some(ch) = &self.chan else { return false };
        // SAFETY: the channel's own eventfd, open while `ch` lives.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(ch.fd()) };
        let _ = rustix::io::read(fd, &mut [0u8; 8]);
        // The channel is this CQ's alone (see `create_cq`).
        self.cq.take_event()
    }
}

struct PinnedSrq(rnic::Srq);

impl Srq for PinnedSrq {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.0.post_recv(wrs)
    }
    fn max_wr(&self) -> u32 {
        self.0.max_wr()
    }
    fn max_sge(&self) -> u32 {
        self.0.max_sge()
    }
}

struct PinnedQp(rnic::Qp);

impl Qp for PinnedQp {
    fn qpn(&self) -> u32 {
        self.0.qpn()
    }
    fn cap(&self) -> QpInitAttr {
        self.0.cap()
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        Ok(self.0.modify(attr, mask)?)
    }
    fn query(&self) -> QpAttr {
        self.0.query()
    }
    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        self.0.post_send(wrs)
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.0.post_recv(wrs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_rule_and_page_count() {
        assert_eq!(pages_of(4096, 4096), 1);
        assert_eq!(pages_of(4095, 2), 2);
        assert_eq!(pages_of(100, 1), 1);
        assert_eq!(pages_of(0, 3 * 4096 + 1), 4);
        assert!(memlock_admits(16, 16, || false));
        assert!(!memlock_admits(17, 16, || false));
        assert!(
            memlock_admits(17, 16, || true),
            "CAP_IPC_LOCK lifts the limit"
        );
        assert!(
            memlock_admits(u64::MAX - 1, u64::MAX, || false),
            "unlimited"
        );
    }
}
