//! The initiator's two-sided path: an operation sent as a control message
//! (inline data, a fault request with a temporary MR for the reverse
//! operation, an atomic, a SEND or its rendezvous), and the notice of a
//! WRITE_WITH_IMM done one-sided. A READ/WRITE longer than a piece
//! (`Config::two_sided_piece`, 1 MiB by default) goes as a sequence of fault
//! requests, [`PIECES_OUT`] at the target at a time ([`Pieces`]): the target
//! pins, maps in and serves it piece by piece, its other requests are served
//! in between, and no more than those pieces of it are pinned there at once.

use std::time::Instant;

use super::backend::Backend;
use super::dev::inline_max;
use super::op::{local_fenced, Op, Retry, Stage};
use super::pin::{engine_pin, temp_mr, EnginePin, Hold};
use super::retire::finish;
use super::state::{Shared, State};

use smallvec::SmallVec;

use crate::ctrl::{AtomicKind, AtomicRequest, FaultKind, FaultRequest, Repr, Status};
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
    let mut first = SmallVec::new();
    if let Repr::Fault(f) = msg {
        if let Some(mut p) = Pieces::of(f, sh.cfg.two_sided_piece) {
            p.more(&mut first);
            op.pieces = Some(p);
        }
    }
    if first.is_empty() {
        qp.send_ctrl(&sh.cfg.ctrl, &msg);
    }
    for f in first {
        qp.send_ctrl(&sh.cfg.ctrl, &Repr::Fault(f));
    }
    mark(Step::ISent);
}

/// Shortest piece of a two-sided READ/WRITE (`Config::two_sided_piece`).
const MIN_PIECE: u32 = 4096;
/// Pieces of one operation at the target at a time: one being pinned while
/// the reverse operation of the other runs.
pub(super) const PIECES_OUT: u32 = 2;

/// A READ/WRITE longer than a piece in flight as a sequence of fault
/// requests (all with the operation's id, over its one temporary MR).
#[derive(Debug)]
pub(super) struct Pieces {
    whole: FaultRequest,
    piece: u32,
    /// Offset of the next piece to send.
    next: u32,
    /// Pieces sent and not answered yet.
    out: u32,
    /// Bytes answered.
    done: u32,
    /// The first piece that failed: nothing more is sent, the operation
    /// fails once the pieces out are answered.
    err: Option<Status>,
}

impl Pieces {
    /// Pieces of `f` if it is long enough to go in pieces (not in retry mode
    /// nor with a lease wanted: those answer a range as a whole).
    fn of(f: FaultRequest, piece: u32) -> Option<Pieces> {
        let piece = piece.max(MIN_PIECE);
        (f.len > piece && !f.retry_mode && !f.want_lease && !f.inline_ok).then_some(Pieces {
            whole: f,
            piece,
            next: 0,
            out: 0,
            done: 0,
            err: None,
        })
    }

    /// The next requests to send, keeping [`PIECES_OUT`] at the target;
    /// none after a failed piece.
    fn more(&mut self, out: &mut SmallVec<[FaultRequest; 2]>) {
        let w = self.whole;
        while self.err.is_none() && self.out < PIECES_OUT && self.next < w.len {
            let n = (w.len - self.next).min(self.piece);
            out.push(FaultRequest {
                local_addr: w.local_addr + u64::from(self.next),
                remote_addr: w.remote_addr + u64::from(self.next),
                len: n,
                ..w
            });
            self.next += n;
            self.out += 1;
        }
    }

    /// Send nothing more: the operation fails with `status` (unless a piece
    /// failed first) once the pieces out are answered.
    fn stop(&mut self, status: Status) {
        self.err.get_or_insert(status);
    }

    /// A piece was answered with `status` (`len` bytes): the operation's
    /// result once every piece sent is answered and nothing is left to
    /// send (the whole length, or the first failure).
    fn answered(&mut self, status: Status, len: u32) -> Option<(Status, u32)> {
        self.out = self.out.saturating_sub(1);
        if status == Status::Ok {
            self.done = self.done.saturating_add(len);
        } else if self.err.is_none() {
            self.err = Some(status);
        }
        let over = self.err.is_some() || self.next >= self.whole.len;
        let result = match self.err {
            Some(e) => (e, 0),
            None => (Status::Ok, self.done),
        };
        (self.out == 0 && over).then_some(result)
    }
}

/// A piece of operation `id` of QP `qi` was answered: send the next ones;
/// the operation's result once all are in (see [`Pieces::answered`]).
/// `None` also for an operation not sent in pieces.
pub(super) fn piece_answered<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    id: u32,
    status: Status,
    len: u32,
) -> Option<(Status, u32)> {
    let qp = st.qp(qi)?;
    let op = qp.ops.get_mut(id)?;
    // Deregistered meanwhile: its temporary MR is gone (`fence_mr`), so no
    // further piece may name it (its key could be another MR's by then).
    let fenced = local_fenced(&sh.mm, op) || op.hold.mr.is_none();
    let p = op.pieces.as_mut()?;
    if fenced {
        p.stop(Status::RemoteAccess);
    }
    let done = p.answered(status, len);
    let mut next = SmallVec::new();
    p.more(&mut next);
    // The peer is there and working: the two-sided timeout starts again.
    op.sent = Some(Instant::now());
    for f in next {
        qp.send_ctrl(&sh.cfg.ctrl, &Repr::Fault(f));
    }
    done
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

#[cfg(test)]
mod tests {
    use super::*;

    const PIECE: u32 = 1 << 20;

    fn req(len: u32) -> FaultRequest {
        FaultRequest {
            req_id: 7,
            kind: FaultKind::Read,
            local_addr: 0x10_0000,
            local_key: 3,
            remote_addr: 0x90_0005,
            rkey: 9,
            len,
            inline_ok: false,
            retry_mode: false,
            want_lease: false,
        }
    }

    fn more(p: &mut Pieces) -> Vec<(u64, u64, u32)> {
        let mut v = SmallVec::new();
        p.more(&mut v);
        v.iter()
            .map(|f| (f.local_addr, f.remote_addr, f.len))
            .collect()
    }

    /// A request up to one piece long, or one answered as a whole (retry
    /// mode, a lease wanted), is not cut; a longer one goes in pieces that
    /// tile it, [`PIECES_OUT`] at a time, and completes with its length
    /// once the last is answered.
    #[test]
    fn pieces_tile_the_request_and_complete_once() {
        assert!(Pieces::of(req(PIECE), PIECE).is_none());
        // A piece is at least a page long.
        assert_eq!(Pieces::of(req(8192), 1).map(|p| p.piece), Some(4096));
        let (mut retry, mut lease) = (req(3 * PIECE), req(3 * PIECE));
        retry.retry_mode = true;
        lease.want_lease = true;
        for whole in [retry, lease] {
            assert!(Pieces::of(whole, PIECE).is_none(), "{whole:?}");
        }
        let len = 2 * PIECE + 5;
        let mut p = Pieces::of(req(len), PIECE).expect("in pieces");
        let (l, r) = (0x10_0000u64, 0x90_0005u64);
        let p1 = u64::from(PIECE);
        assert_eq!(more(&mut p), [(l, r, PIECE), (l + p1, r + p1, PIECE)]);
        assert_eq!(more(&mut p), [], "two out already");
        assert_eq!(p.answered(Status::Ok, PIECE), None);
        assert_eq!(more(&mut p), [(l + 2 * p1, r + 2 * p1, 5)]);
        assert_eq!(p.answered(Status::Ok, PIECE), None);
        assert_eq!(more(&mut p), []);
        assert_eq!(p.answered(Status::Ok, 5), Some((Status::Ok, len)));
    }

    /// After a failed piece nothing more is sent, and the operation fails
    /// only once the pieces still out are answered (their reverse
    /// operations may still reach the local buffer until then).
    #[test]
    fn a_failed_piece_stops_the_rest_and_waits_for_those_out() {
        let mut p = Pieces::of(req(4 * PIECE), PIECE).expect("in pieces");
        assert_eq!(more(&mut p).len(), 2);
        assert_eq!(p.answered(Status::RemoteAccess, 0), None);
        assert_eq!(more(&mut p), [], "nothing after a failure");
        assert_eq!(
            p.answered(Status::Ok, PIECE),
            Some((Status::RemoteAccess, 0))
        );
        // Stopped from outside (the local MR was deregistered): the same.
        let mut p = Pieces::of(req(4 * PIECE), PIECE).expect("in pieces");
        assert_eq!(more(&mut p).len(), 2);
        p.stop(Status::RemoteAccess);
        assert_eq!(p.answered(Status::Ok, PIECE), None);
        assert_eq!(more(&mut p), []);
        assert_eq!(
            p.answered(Status::Ok, PIECE),
            Some((Status::RemoteAccess, 0))
        );
    }
}
