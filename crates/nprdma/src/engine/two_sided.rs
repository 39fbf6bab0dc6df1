//! The initiator's two-sided path: an operation sent as a control message
//! (inline data, a fault request with a temporary MR for the reverse
//! operation, an atomic, a SEND or its rendezvous), and the notice of a
//! WRITE_WITH_IMM done one-sided.

use std::time::Instant;

use super::dev::inline_max;
use super::op::{local_fenced, Op, Retry, Stage};
use super::pin::{engine_pin, temp_mr, EnginePin, Hold};
use super::retire::finish;
use super::state::{Shared, State};

use crate::ctrl::{AtomicKind, AtomicRequest, FaultKind, FaultRequest, Repr};
use crate::mem;
use crate::nic::WcStatus;
use crate::plan::AppOp;
use crate::trace::{mark, Step};

pub(super) fn start_notify(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    let Some(qp) = st.qp(qi) else { return };
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
        solicited: false,
    };
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
}

/// Pin the local buffer and map it into the NIC views.
pub(super) fn pin_local(sh: &Shared, op: &Op) -> Result<Option<EnginePin>, ()> {
    match &op.lmr {
        Some(m) if op.len > 0 => engine_pin(&sh.mm, m, op.laddr, op.len).map(Some),
        _ => Ok(None),
    }
}

pub(super) fn go_two_sided(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    mark(Step::ICheckFail);
    st.stats.two_sided += 1;
    let Some(qp) = st.qp(qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    if local_fenced(&sh.mm, op) {
        // Deregistered (or unmapped) since it was posted: no temporary MR
        // may open that memory to the peer again.
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    }
    let inline_max = inline_max(sh);
    let (laddr, len, raddr, rkey) = (op.laddr, op.len, op.wr.remote_addr, op.wr.rkey);
    let mut hold = Hold::default();
    let mut stack = [0u8; mem::STACK_COPY];
    let msg = match op.wr.op {
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) => {
            let read = op.wr.op == AppOp::Read;
            // Inline forms need no local pin: the NIC never touches the
            // local buffer, the CPU copies it (now for a WRITE, at the answer
            // for a READ), as for atomics and inline SENDs. A page swapped
            // out meanwhile faults on that copy and the pager's fault thread
            // brings it back (it never needs the engine lock).
            if len > inline_max {
                let Ok(pin) = pin_local(sh, op) else {
                    finish(st, qi, id, WcStatus::LocProtErr, 0);
                    return;
                };
                hold.pin = pin;
            }
            mark(Step::ILocalPinned);
            if len <= inline_max {
                if read {
                    Repr::ReadInline {
                        req_id: id,
                        remote_addr: raddr,
                        rkey,
                        len: len as u32,
                    }
                } else {
                    Repr::WriteInline {
                        req_id: id,
                        remote_addr: raddr,
                        rkey,
                        data: mem::copy_out(laddr, len as usize, &mut stack),
                    }
                }
            } else {
                let acc = if read {
                    rnic::Access::LOCAL_WRITE | rnic::Access::REMOTE_WRITE
                } else {
                    rnic::Access::REMOTE_READ
                };
                let Ok(mr) = temp_mr(&sh.pd, laddr, len, acc) else {
                    drop(hold);
                    finish(st, qi, id, WcStatus::LocProtErr, 0);
                    return;
                };
                let key = mr.rkey();
                hold.mr = Some(mr);
                let retry_mode = sh.cfg.retry_mode && op.retry == Retry::NotTried;
                if retry_mode {
                    op.retry = Retry::AwaitingReady;
                }
                Repr::Fault(FaultRequest {
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
                })
            }
        }
        AppOp::CmpSwap { compare, swap } => Repr::Atomic(AtomicRequest {
            req_id: id,
            kind: AtomicKind::CmpSwap,
            remote_addr: raddr,
            rkey,
            compare_add: compare,
            swap,
        }),
        AppOp::FetchAdd { add } => Repr::Atomic(AtomicRequest {
            req_id: id,
            kind: AtomicKind::FetchAdd,
            remote_addr: raddr,
            rkey,
            compare_add: add,
            swap: 0,
        }),
        AppOp::Send | AppOp::SendImm(_) => {
            let imm = match op.wr.op {
                AppOp::SendImm(i) => Some(i),
                _ => None,
            };
            if len <= inline_max {
                Repr::SendInline {
                    req_id: id,
                    imm,
                    solicited: false,
                    data: mem::copy_out(laddr, len as usize, &mut stack),
                }
            } else {
                let Ok(pin) = pin_local(sh, op) else {
                    finish(st, qi, id, WcStatus::LocProtErr, 0);
                    return;
                };
                hold.pin = pin;
                let Ok(mr) = temp_mr(&sh.pd, laddr, len, rnic::Access::REMOTE_READ) else {
                    drop(hold);
                    finish(st, qi, id, WcStatus::LocProtErr, 0);
                    return;
                };
                let key = mr.rkey();
                hold.mr = Some(mr);
                Repr::SendRendezvous {
                    req_id: id,
                    addr: laddr,
                    len: len as u32,
                    key,
                    imm,
                    solicited: false,
                }
            }
        }
    };
    op.hold = hold;
    op.stage = Stage::TwoSided;
    op.sent = Some(Instant::now());
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
    mark(Step::ISent);
}
