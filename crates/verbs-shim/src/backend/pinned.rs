//! `NPRDMA_MODE=pinned`: standard RDMA on the software RNIC (one rnic `Host` per
//! process over the shared-memory transport; `reg_mr` registers normally).
//!
//! Registration is charged against `RLIMIT_MEMLOCK` exactly as the kernel's
//! `ib_umem_get` charges a real RDMA registration: the pages an MR covers are added
//! to the process's pinned count (overlapping MRs count again), and if the total
//! exceeds the limit and the calling thread lacks `CAP_IPC_LOCK` the registration
//! fails with ENOMEM; deregistration uncharges. (Root normally holds CAP_IPC_LOCK,
//! so — as with real NICs — `ulimit -l` binds only processes without it.)

use super::{Cq, Device, Mr, Pd, Qp, Result};
use crate::error::ShimError;
use rnic::{Access, DeviceAttr, PostError, QpAttr, QpAttrMask, QpInitAttr, RecvWr, SendWr, Wc};
use std::any::Any;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct PinnedDevice {
    ctx: rnic::Context,
}

impl PinnedDevice {
    pub fn new() -> Result<PinnedDevice> {
        let host = rnic::Host::new(super::host_config_from_env()?)?;
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
}

/// Pages pinned by this process's registrations (the kernel's `mm->pinned_vm`).
static PINNED_PAGES: AtomicU64 = AtomicU64::new(0);

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
    unsafe fn reg_mr(&self, addr: usize, len: usize, access: Access) -> Result<Box<dyn Mr>> {
        let charge = MemlockCharge::charge(addr, len)?;
        // SAFETY: forwarded contract: the caller keeps the memory mapped while registered.
        let mr = unsafe { self.0.reg_mr(addr, len, access)? };
        Ok(Box::new(PinnedMr {
            mr,
            _charge: charge,
        }))
    }
    fn create_qp(
        &self,
        send_cq: &dyn Cq,
        recv_cq: &dyn Cq,
        attr: &QpInitAttr,
    ) -> Result<Box<dyn Qp>> {
        let cq_of = |c: &dyn Cq| -> Result<rnic::Cq> {
            c.as_any()
                .downcast_ref::<PinnedCq>()
                .map(|p| p.cq.clone())
                .ok_or_else(|| ShimError::InvalidArgument("CQ of another backend".into()))
        };
        let qp = self.0.create_qp(&cq_of(send_cq)?, &cq_of(recv_cq)?, attr)?;
        Ok(Box::new(PinnedQp(qp)))
    }
}

struct PinnedMr {
    // Field order = drop order: deregister, then uncharge.
    mr: rnic::Mr,
    _charge: MemlockCharge,
}

impl Mr for PinnedMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
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
        // The CQ is this channel's only CQ: an event means it fired.
        ch.get_event(Some(Duration::ZERO)).is_ok()
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
