//! The ODP model (a *model* of a ConnectX-5-style on-demand-paging NIC, the baseline
//! NP-RDMA is compared with): the host's page-fault handler, the NIC->host page-fault
//! hand-off (the "interrupt": a request served by the owning host's NIC thread), the
//! present-page scan of ON_DEMAND spans, and invalidation.
//!
//! * An MR registered with [`Access::ON_DEMAND`](crate::Access) pins nothing
//!   (registration is instant). The NIC's page table of ODP memory is the host's
//!   residency map ([`FrameMap`](crate::FrameMap)): the NIC mirrors the host-declared
//!   residency (pages outside tracked ranges are present), [`Host::odp_invalidate`]
//!   (the MMU-notifier invalidation) clears entries and flushes in-flight DMA like the
//!   IOMMU flush, and a resolved fault sets them again.
//! * A DMA atom hitting a non-present page of an ODP MR never touches it: it raises a
//!   fault to the owning host's handler ([`Host::set_odp_fault_handler`]), run on that
//!   host's NIC thread (a real cross-thread hand-off = the interrupt).
//! * **Local fault** (initiator memory): the WR stalls for the interrupt round trip
//!   (all of its non-present pages are handed over at once) and continues.
//! * **Remote fault** (target memory of a READ/WRITE): the responder NAKs and raises
//!   the fault on its host without waiting; the initiator waits `odp_timeout`
//!   (default 2 ms) and retransmits the WR and every later WR it had already executed
//!   (go-back-N: their effects are redone; they complete only after it).
//!
//! Across processes the initiator raises remote faults through a mailbox in the
//! target's segment, and READ/WRITE to a target ODP MR never use the NIC-thread ring
//! (they go direct, so the initiator's DMA engine sees the fault).
//!
//! Limits of the model: SEND receive buffers, and atomics served by a remote NIC thread
//! (cross-process), on ODP memory that is not present at the target fail as on a
//! non-ODP MR (REM_ACCESS_ERR / receive error) instead of faulting; a fault the host
//! never resolves NAKs [`max_naks`] times, then the WR fails with RETRY_EXC_ERR.
//!
//! [`Host::odp_invalidate`]: crate::Host::odp_invalidate
//! [`Host::set_odp_fault_handler`]: crate::Host::set_odp_fault_handler

use crate::hw::device::Device;
use crate::hw::dma::{translate, Fault, Span};
use crate::hw::segment::{Segment, ODP_MAIL_SLOTS, PAGE};
use parking_lot::{Condvar, Mutex, ReentrantMutex, RwLock};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// The host's page-fault handler: make `[addr, addr+len)` of the host's process
/// resident (e.g. vmem's pin/prefetch). Called on the host's NIC thread.
pub type OdpFaultHandler = Arc<dyn Fn(usize, usize) -> crate::error::Result<()> + Send + Sync>;

/// Least number of remote-fault NAKs of one WR after which it fails with
/// RETRY_EXC_ERR (see [`max_naks`]).
pub const ODP_MAX_NAKS: u32 = 64;

/// NAKs of one WR after which it fails: `ODP_MAX_NAKS`, or more so that an unresolved
/// fault is retried for at least `transport_timeout` (a loaded host may take a while).
pub fn max_naks(cfg: &crate::config::HostConfig) -> u32 {
    let n = cfg.transport_timeout.as_nanos() / cfg.odp_timeout.as_nanos().max(1);
    ODP_MAX_NAKS.max(n.min(u32::MAX as u128) as u32)
}

/// Page ranges `(addr, len)` of host virtual memory.
pub(crate) type Ranges = Vec<(usize, usize)>;

#[derive(Default)]
pub(crate) struct Done {
    result: Mutex<Option<bool>>,
    cv: Condvar,
}

struct FaultReq {
    ranges: Ranges,
    done: Option<Arc<Done>>,
}

/// Per-host ODP state (lives in `nic::state::Nic`).
#[derive(Default)]
pub(crate) struct OdpState {
    handler: RwLock<Option<OdpFaultHandler>>,
    queue: Mutex<VecDeque<FaultReq>>,
    pending: AtomicBool,
    /// Serialises fault resolution (handler + present) with invalidation (non-present +
    /// flush + the host's swap-out), like the MMU-notifier sequence check. Re-entrant:
    /// a handler may invalidate (evict) other pages.
    pub(crate) inval: ReentrantMutex<()>,
    nic_thread: OnceLock<ThreadId>,
}

impl OdpState {
    pub fn set_handler(&self, h: Option<OdpFaultHandler>) {
        *self.handler.write() = h;
    }

    /// Called once by the NIC thread when it starts.
    pub fn set_nic_thread(&self) {
        let _ = self.nic_thread.set(std::thread::current().id());
    }

    /// Queue a fault without a waiter or a wake-up (the NIC thread itself).
    fn enqueue_quiet(&self, ranges: Ranges) {
        let mut q = self.queue.lock();
        if !q.iter().any(|r| r.ranges == ranges) {
            q.push_back(FaultReq { ranges, done: None });
        }
        self.pending.store(true, Ordering::Release);
    }

    pub(crate) fn enqueue(&self, h: &Device, ranges: Ranges, done: Option<Arc<Done>>) {
        {
            let mut q = self.queue.lock();
            // A NAKed retransmission re-raises the same fault: keep one request.
            if done.is_none() && q.iter().any(|r| r.ranges == ranges) {
                return;
            }
            q.push_back(FaultReq { ranges, done });
        }
        self.pending.store(true, Ordering::Release);
        h.kick_nic();
    }
}

/// Run the handler for `ranges` and mark them present on success.
fn resolve(h: &Device, odp: &OdpState, ranges: &Ranges) -> bool {
    let Some(handler) = odp.handler.read().clone() else {
        return false;
    };
    let _g = odp.inval.lock();
    for &(addr, len) in ranges {
        if let Err(e) = handler(addr, len) {
            tracing::warn!(addr, len, "ODP fault handler failed: {e}");
            return false;
        }
        h.frames.set_resident(addr, len, true);
    }
    true
}

/// NIC thread: serve raised page faults. Returns whether there was any.
pub(crate) fn serve(h: &Device, odp: &OdpState) -> bool {
    drain_mail(h, odp);
    if !odp.pending.load(Ordering::Acquire) {
        return false;
    }
    odp.pending.store(false, Ordering::Release);
    let mut work = false;
    loop {
        let Some(req) = odp.queue.lock().pop_front() else {
            break;
        };
        work = true;
        let ok = resolve(h, odp, &req.ranges);
        if let Some(d) = req.done {
            *d.result.lock() = Some(ok);
            d.cv.notify_all();
        }
    }
    work
}

/// Local fault: raise `ranges` to this host's NIC thread and wait for the handler
/// (the interrupt round trip). On the NIC thread itself it runs inline.
pub(crate) fn fault_local(h: &Device, odp: &OdpState, ranges: Ranges, timeout: Duration) -> bool {
    if odp.handler.read().is_none() {
        return false;
    }
    if odp.nic_thread.get() == Some(&std::thread::current().id()) {
        return resolve(h, odp, &ranges);
    }
    let done = Arc::new(Done::default());
    odp.enqueue(h, ranges, Some(done.clone()));
    let deadline = Instant::now() + timeout;
    let mut r = done.result.lock();
    while r.is_none() {
        if done.cv.wait_until(&mut r, deadline).timed_out() {
            break;
        }
    }
    r.unwrap_or(false)
}

/// Remote fault across processes: leave `ranges` (as one bounding range) in the
/// mailbox of the host owning `seg` (see `nic::state::fault_remote`).
pub(crate) fn post_mail(seg: &Segment, ranges: Ranges) {
    let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
        return;
    };
    let (addr, len) = (first.0, last.0 + last.1 - first.0);
    let m = &*seg.hdr().odp_mail;
    for i in 0..ODP_MAIL_SLOTS {
        if m.state[i]
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            m.addr[i].store(addr as u64, Ordering::Relaxed);
            m.len[i].store(len as u64, Ordering::Relaxed);
            m.state[i].store(2, Ordering::Release);
            m.pending.store(1, Ordering::SeqCst);
            seg.kick();
            return;
        }
    }
}

/// Whether peers of other processes left faults in the mailbox (checked by the NIC
/// thread after announcing it sleeps: `fault_remote` kicks only a sleeping thread).
pub(crate) fn mail_pending(seg: &Segment) -> bool {
    seg.hdr().odp_mail.pending.load(Ordering::SeqCst) != 0
}

/// NIC thread: move faults peers of other processes left in our mailbox to the queue.
fn drain_mail(h: &Device, odp: &OdpState) {
    let m = &*h.seg.hdr().odp_mail;
    if m.pending.load(Ordering::Acquire) == 0 || m.pending.swap(0, Ordering::AcqRel) == 0 {
        return;
    }
    for i in 0..ODP_MAIL_SLOTS {
        if m.state[i].load(Ordering::Acquire) == 2 {
            let r = (
                m.addr[i].load(Ordering::Relaxed) as usize,
                m.len[i].load(Ordering::Relaxed) as usize,
            );
            m.state[i].store(0, Ordering::Release);
            odp.enqueue_quiet(vec![r]);
        }
    }
}

/// Non-present pages (as coalesced host-VA ranges) of the ON_DEMAND spans among
/// `spans` of the host owning `seg`. Nothing is touched and nothing is counted.
pub(crate) fn missing(seg: &Segment, spans: &[Span], write: bool) -> Ranges {
    let mut out: Ranges = Vec::new();
    for s in spans.iter().filter(|s| s.mr.odp && s.len > 0) {
        let mut a = s.addr & !(PAGE as u64 - 1);
        let end = s.addr + s.len;
        while a < end {
            let at = a.max(s.addr);
            if let Err(Fault::NotPresent(f)) = translate(seg, &s.mr, at, write) {
                let page = (f as usize) & !(PAGE - 1);
                match out.last_mut() {
                    Some((pa, pl)) if *pa + *pl == page => *pl += PAGE,
                    _ => out.push((page, PAGE)),
                }
            }
            a += PAGE as u64;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::dma::{MrView, MR_PASSTHROUGH};
    use crate::{Host, HostConfig};

    #[test]
    fn nak_limit_covers_the_transport_timeout() {
        let c = HostConfig::default();
        assert_eq!(max_naks(&c), 1000, "2 s / 2 ms");
        let c = HostConfig {
            transport_timeout: Duration::from_millis(1),
            ..c
        };
        assert_eq!(max_naks(&c), ODP_MAX_NAKS);
    }

    #[test]
    fn missing_coalesces_non_present_pages_of_odp_spans_only() {
        let h = Host::new(HostConfig::default()).unwrap();
        let seg = &h.inner().seg;
        let base = 0x7100_0000_0000usize;
        h.frames().track(base, 8 * PAGE, true).unwrap();
        h.frames().set_resident(base + PAGE, 2 * PAGE, false);
        h.frames().set_resident(base + 5 * PAGE, PAGE, false);
        let mr = |odp| MrView {
            kind: MR_PASSTHROUGH,
            va: base as u64,
            len: 8 * PAGE as u64,
            iova_base: 0,
            iova_slot: 0,
            odp,
        };
        let span = |odp, off: usize, len: usize| Span {
            mr: mr(odp),
            addr: (base + off) as u64,
            len: len as u64,
        };
        let m = missing(seg, &[span(true, 100, 8 * PAGE - 100)], false);
        assert_eq!(m, vec![(base + PAGE, 2 * PAGE), (base + 5 * PAGE, PAGE)]);
        assert_eq!(missing(seg, &[span(true, 3 * PAGE, 2 * PAGE)], true), vec![]);
        assert_eq!(missing(seg, &[span(false, 0, 8 * PAGE)], false), vec![]);
        assert_eq!(h.stats().nonresident_dma, 0, "the scan counts nothing");
    }
}
