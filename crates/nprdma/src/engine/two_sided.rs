//! The initiator's two-sided path: an operation sent as a control message
//! (inline data, a fault request with a temporary MR for the reverse
//! operation, an atomic, a SEND or its rendezvous), and the notice of a
//! WRITE_WITH_IMM done one-sided.

use std::time::Instant;

use super::backend::Backend;
use super::dev::inline_max;
use super::op::{local_fenced, Op, Retry, Stage};
use super::pin::{engine_pin, temp_mr, EnginePin, Hold};
use super::retire::finish;
use super::state::{Shared, State};

use crate::ctrl::{AtomicKind, AtomicRequest, FaultKind, FaultRequest, Repr};
use crate::mem;
use crate::nic::{Access, NicMr as _, WcStatus};
use crate::plan::AppOp;
use crate::trace::{mark, Step};

/// Operation `id` (a WRITE_WITH_IMM whose data is written) tells the peer:
/// its RECV completes with the immediate.
pub(super) fn start_notify<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32) {
    let Some(qp) = st.qp(qi) else { return };
    let rnr_retry = qp.rnr_retry;
    let Some(op) = qp.ops.get_mut(id) else { return };
    let AppOp::WriteImm(imm) = op.wr.op else {
        return;
    };
    op.stage = Stage::ImmNotify;
    op.sent = Some(Instant::now());
    op.hold = Hold::default();
    let msg = Repr::WriteImmNotify {
        req_id: id,
        addr: op.wr.remote_addr,
        len: op.len as u32,
        rkey: op.wr.rkey,
        imm,
        solicited: op.wr.solicited,
        rnr_retry,
    };
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
}

/// Pin the local buffer and map it into the NIC views.
pub(super) fn pin_local<N: Backend>(
    sh: &Shared<N>,
    op: &Op<N>,
) -> Result<Option<EnginePin<N>>, ()> {
    match &op.lmr {
        Some(m) if op.len > 0 => {
            engine_pin(&sh.mm, m, op.laddr, op.len, op.wr.op.local_pin()).map(Some)
        }
        _ => Ok(None),
    }
}

/// Send operation `id` of QP `qi` two-sided: one control message carrying
/// it (with the local pin and temporary MR it needs held by the op).
pub(super) fn go_two_sided<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32) {
    mark(Step::ICheckFail);
    st.stats.two_sided += 1;
    let Some(qp) = st.qp(qi) else { return };
    let (rnr_retry, domain) = (qp.rnr_retry, qp.pd);
    let Some(op) = qp.ops.get_mut(id) else { return };
    if local_fenced(&sh.mm, op) {
        // Deregistered (or unmapped) since it was posted: no temporary MR
        // may open that memory to the peer again.
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    }
    let mut hold = Hold::default();
    let mut stack = [0u8; mem::STACK_COPY];
    let msg = match op.wr.op {
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) => {
            rw_request(sh, op, id, domain, &mut hold, &mut stack)
        }
        AppOp::CmpSwap { compare, swap } => {
            Ok(atomic_request(op, id, AtomicKind::CmpSwap, compare, swap))
        }
        AppOp::FetchAdd { add } => Ok(atomic_request(op, id, AtomicKind::FetchAdd, add, 0)),
        AppOp::Send | AppOp::SendImm(_) => {
            send_request(sh, op, id, rnr_retry, domain, &mut hold, &mut stack)
        }
    };
    let Ok(msg) = msg else {
        // No pin or temporary MR: a local protection error (what was
        // taken is released first).
        drop(hold);
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    };
    op.hold = hold;
    op.stage = Stage::TwoSided;
    op.sent = Some(Instant::now());
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
    mark(Step::ISent);
}

/// The request of a two-sided READ/WRITE: inline, or a fault request with
/// the local range pinned and opened to the peer's reverse operation.
fn rw_request<'s, N: Backend>(
    sh: &Shared<N>,
    op: &mut Op<N>,
    id: u32,
    domain: u32,
    hold: &mut Hold<N>,
    stack: &'s mut [u8; mem::STACK_COPY],
) -> Result<Repr<'s>, ()> {
    let inline_max = inline_max(sh);
    let (laddr, len, raddr, rkey) = (op.laddr, op.len, op.wr.remote_addr, op.wr.rkey);
    let read = op.wr.op == AppOp::Read;
    // Inline forms need no local pin: the NIC never touches the
    // local buffer, the CPU copies it (now for a WRITE, at the answer
    // for a READ), as for atomics and inline SENDs. A page swapped
    // out meanwhile faults on that copy and the pager's fault thread
    // brings it back (it never needs the engine lock).
    if len > inline_max {
        hold.pin = pin_local(sh, op)?;
    }
    mark(Step::ILocalPinned);
    // User-space mode: the next ones on these pages may go one-sided.
    let want_lease = sh.cfg.plan.user_space_mode && sh.cfg.lease_ms > 0;
    if len <= inline_max {
        return Ok(if read {
            Repr::ReadInline {
                req_id: id,
                remote_addr: raddr,
                rkey,
                want_lease,
                len: len as u32,
            }
        } else {
            Repr::WriteInline {
                req_id: id,
                remote_addr: raddr,
                rkey,
                want_lease,
                data: mem::copy_out(laddr, len as usize, stack).map_err(|_| ())?,
            }
        });
    }
    let mr = temp_mr(&sh.nic, &sh.cache, laddr, len, local_access(read), domain)?;
    let key = mr.rkey();
    hold.mr = Some(mr);
    let retry_mode = sh.cfg.retry_mode && op.retry == Retry::NotTried;
    if retry_mode {
        op.retry = Retry::AwaitingReady;
    }
    Ok(Repr::Fault(FaultRequest {
        req_id: id,
        kind: if read {
            FaultKind::Read
        } else {
            FaultKind::Write
        },
        local_addr: laddr,
        local_key: key,
        remote_addr: raddr,
        rkey,
        len: len as u32,
        inline_ok: false,
        retry_mode,
        want_lease,
    }))
}

/// The rights of the temporary MR over the local range of a READ (`read`)
/// or WRITE: the peer's reverse operation reaches it, and a one-sided
/// operation on a lease uses it as its local buffer.
pub(super) fn local_access(read: bool) -> Access {
    if read {
        Access::LOCAL_WRITE | Access::REMOTE_WRITE
    } else {
        Access::REMOTE_READ
    }
}

/// The request of an atomic (always two-sided: done by the target's CPU).
fn atomic_request<N: Backend>(
    op: &Op<N>,
    id: u32,
    kind: AtomicKind,
    compare_add: u64,
    swap: u64,
) -> Repr<'static> {
    Repr::Atomic(AtomicRequest {
        req_id: id,
        kind,
        remote_addr: op.wr.remote_addr,
        rkey: op.wr.rkey,
        compare_add,
        swap,
    })
}

/// The request of a SEND: inline, or a rendezvous the target completes by
/// READing the pinned local buffer.
fn send_request<'s, N: Backend>(
    sh: &Shared<N>,
    op: &mut Op<N>,
    id: u32,
    rnr_retry: u8,
    domain: u32,
    hold: &mut Hold<N>,
    stack: &'s mut [u8; mem::STACK_COPY],
) -> Result<Repr<'s>, ()> {
    let (laddr, len) = (op.laddr, op.len);
    let imm = match op.wr.op {
        AppOp::SendImm(i) => Some(i),
        _ => None,
    };
    if len <= inline_max(sh) {
        return Ok(Repr::SendInline {
            req_id: id,
            imm,
            solicited: op.wr.solicited,
            rnr_retry,
            data: mem::copy_out(laddr, len as usize, stack).map_err(|_| ())?,
        });
    }
    hold.pin = pin_local(sh, op)?;
    let mr = temp_mr(&sh.nic, &sh.cache, laddr, len, Access::REMOTE_READ, domain)?;
    let key = mr.rkey();
    hold.mr = Some(mr);
    Ok(Repr::SendRendezvous {
        req_id: id,
        addr: laddr,
        len: len as u32,
        key,
        imm,
        solicited: op.wr.solicited,
        rnr_retry,
    })
}
