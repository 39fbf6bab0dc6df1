//! Posting: the application's send WRs (admission, local checks, the
//! ordering table) and receive WRs, and starting the admitted operations.

use super::backend::Backend;
use super::fast;
use super::one_sided::{flush_deferred, start_op};
use super::op::{is_atomic, Op, Retry, Stage, Versions};
use super::pin::{engine_pin, EnginePin, Hold};
use super::qp::SrqShared;
use super::reg::mr_to_pin;
use super::serve::deliver_inbound;
use super::state::{At, Shared, State};
use super::types::{Error, RecvWr, SendWr, PS};
use crate::check::precheck_local;
use crate::nic::Access;
use crate::nic::WcStatus;
use crate::ordering::{Admit, Range};
use crate::plan::{order_desc, AppOp};
use std::sync::Arc;

/// Post application send WRs (see `Qp::post_send`).
pub(crate) fn post_send<N: Backend>(
    _sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    gen: u8,
    wrs: &[SendWr],
) -> Result<(), (usize, Error)> {
    for (i, wr) in wrs.iter().enumerate() {
        if (matches!(wr.op, AppOp::Read) || is_atomic(wr.op))
            && st.qp_mut(qi, gen).is_some_and(|q| q.unreliable)
        {
            return Err((
                i,
                Error::Invalid("READ and atomics need a reliable connection (UC QP)"),
            ));
        }
        if fast::try_post(_sh, st, qi, gen, wr) {
            continue;
        }
        let Some(At { qp, mrs, ready, .. }) = st.at_gen(qi, gen) else {
            return Err((i, Error::QpState));
        };
        // Anything posted behind a lean-path operation is ordered after it.
        qp.promote_fast();
        if qp.errored {
            qp.flush_posted_send(wr);
            continue;
        }
        if !qp.connected || qp.dead {
            return Err((i, Error::QpState));
        }
        if qp.ops.len() >= qp.depth as usize {
            return Err((i, Error::QueueFull));
        }
        let (laddr, len, lkey) = wr
            .sge
            .map(|s| (s.addr, s.length as u64, s.lkey))
            .unwrap_or((0, 0, 0));
        let lmr = wr.sge.and_then(|_| mrs.get(&lkey).cloned());
        let mut status = WcStatus::Success;
        let local_write = matches!(wr.op, AppOp::Read) || is_atomic(wr.op);
        if wr.sge.is_some() {
            match &lmr {
                None => status = WcStatus::LocProtErr,
                Some(m) => {
                    if m.pd() != qp.pd
                        || !m.contains(laddr, len)
                        || (local_write && !m.access().contains(Access::LOCAL_WRITE))
                    {
                        status = WcStatus::LocProtErr;
                    }
                }
            }
        }
        if is_atomic(wr.op) && len != 8 {
            status = WcStatus::LocLenErr;
        }
        if len > i32::MAX as u64 {
            status = WcStatus::LocLenErr;
        }
        let rlen = if is_atomic(wr.op) { 8 } else { len };
        let one_sided =
            matches!(wr.op, AppOp::Read | AppOp::Write | AppOp::WriteImm(_)) || is_atomic(wr.op);
        if status == WcStatus::Success && one_sided && wr.remote_addr.checked_add(rlen).is_none() {
            // A remote range past the end of the address space lies in no MR:
            // the target refuses it (REM_ACCESS_ERR, as rxe and the pinned NIC).
            status = WcStatus::RemAccessErr;
        }
        let seq = qp.rob.post(wr.signaled);
        qp.next_seq = seq + 1;
        let op = Op {
            sent: None,
            wr: *wr,
            laddr,
            len,
            seq,
            ticket: None,
            lmr,
            stage: Stage::Queued,
            key_req: 0,
            key_answered: false,
            retry: Retry::NotTried,
            stale: false,
            restart: false,
            scratch: None,
            lver: Versions::new(),
            hold: Hold::default(),
            lease: None,
            pieces: None,
        };
        let id = match qp.ops.insert(op) {
            Ok(id) => id,
            Err(_) => return Err((i, Error::QueueFull)),
        };
        let mut issue = false;
        if status == WcStatus::Success {
            let desc = order_desc(
                wr.op,
                Range::new(laddr, len),
                Range::new(wr.remote_addr, rlen),
                wr.order_before,
                wr.order_after,
                qp.inline_max,
            );
            let (ticket, now) = match qp.order.submit(desc, id) {
                Ok(Admit::Issue(t, _)) => (Some(t), true),
                Ok(Admit::Parked(t)) => (Some(t), false),
                Err(_) => {
                    status = WcStatus::LocProtErr;
                    (None, false)
                }
            };
            issue = now;
            if let Some(o) = qp.ops.get_mut(id) {
                o.ticket = ticket;
            }
        }
        if status != WcStatus::Success {
            if let Some(o) = qp.ops.get_mut(id) {
                o.stage = Stage::Failed(status);
            }
            issue = true;
        }
        if issue {
            ready.push_back((qi, id));
        }
        if wr.signaled {
            qp.flush_seq = seq;
            if !qp.deferred.is_empty() {
                flush_deferred(_sh, st, qi);
            }
        }
    }
    Ok(())
}

/// Post application receive WRs.
pub(crate) fn post_recv<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    gen: u8,
    wrs: &[RecvWr],
) -> Result<(), (usize, Error)> {
    for (i, wr) in wrs.iter().enumerate() {
        let Some(qp) = st.qp_mut(qi, gen) else {
            return Err((i, Error::QpState));
        };
        if qp.errored {
            qp.recvs.push_back(*wr);
            qp.flush_recvs();
            continue;
        }
        if qp.dead {
            return Err((i, Error::QpState));
        }
        if qp.srq.is_some() {
            return Err((
                i,
                Error::Invalid("the QP receives from a shared receive queue"),
            ));
        }
        if qp.recvs.len() >= qp.depth as usize {
            return Err((i, Error::QueueFull));
        }
        qp.recvs.push_back(*wr);
    }
    deliver_inbound(sh, st, qi);
    Ok(())
}

/// Post receive WRs to a shared receive queue, then deliver what its QPs hold
/// for a receive.
pub(crate) fn post_srq_recv<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    srq: &Arc<SrqShared>,
    wrs: &[RecvWr],
) -> Result<(), (usize, Error)> {
    let mut res = Ok(());
    {
        let mut q = srq.recvs.lock();
        for (i, wr) in wrs.iter().enumerate() {
            if q.len() >= srq.depth as usize {
                res = Err((i, Error::QueueFull));
                break;
            }
            q.push_back(*wr);
        }
    }
    for qi in 0..st.qps.len() {
        let waiting = st.qp(qi).is_some_and(|q| {
            !q.inbound.is_empty() && q.srq.as_ref().is_some_and(|s| Arc::ptr_eq(s, srq))
        });
        if waiting {
            deliver_inbound(sh, st, qi);
        }
    }
    res
}

/// One-sided WRs of at least this many bytes have their local buffer brought in
/// before the engine's lock is taken ([`prefault`]).
pub(super) const PREFAULT_MIN: u64 = 64 * 1024;

/// The local buffers of `wrs`' large one-sided operations (≥ [`PREFAULT_MIN`])
/// whose pages are not all mapped in the NIC views now, pinned — brought in and
/// mapped, which may wait for the pager to evict under a budget — *before* the
/// caller takes the engine's lock, and held until its post returns: the
/// operation's start then finds them mapped, and the polling thread (which
/// serves the peers' requests under that lock) is not held up by the pager.
/// A buffer that cannot be pinned here is left to the operation's own checks.
pub(super) fn prefault<N: Backend>(sh: &Shared<N>, wrs: &[SendWr]) -> Vec<EnginePin<N>> {
    let mut pins = Vec::new();
    for wr in wrs {
        let Some(sge) = wr.sge else { continue };
        let len = u64::from(sge.length);
        if len < PREFAULT_MIN || !matches!(wr.op, AppOp::Read | AppOp::Write | AppOp::WriteImm(_)) {
            continue;
        }
        let for_ = wr.op.local_pin();
        let Ok(m) = mr_to_pin(sh, sge.lkey, sge.addr, len, for_) else {
            continue;
        };
        if precheck_local(sge.addr, len, PS as usize, |p| m.shadow.is_mapped(p)).is_ok() {
            continue;
        }
        if let Ok(p) = engine_pin(&sh.mm, &m, sge.addr, len, for_) {
            pins.push(p);
        }
    }
    pins
}

/// Start the operations admitted so far.
pub(crate) fn run_ready<N: Backend>(sh: &Shared<N>, st: &mut State<N>) {
    while let Some((qi, id)) = st.ready.pop_front() {
        start_op(sh, st, qi, id);
    }
}
