//! The control messages a peer sends: the target's side of its two-sided
//! requests (validate, pin, answer or reverse operation), its answers to
//! ours, key-table traffic, and inbound SENDs matched with posted RECVs.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Arc;

use smallvec::SmallVec;

use super::backend::Backend;
use super::dev::{zero_sges, ZERO_BUF, ZERO_READ_MAX, ZERO_SGES};
use super::idhash::IdMap;
use super::lease::{may_grant, right, Grant, NewLease};
use super::mr::MrEntry;
use super::one_sided::post_steps;
use super::op::{is_atomic, local_fenced, Retry, Stage, TKind, TReq};
use super::pin::{engine_pin, pin_for_peer, temp_mr, EnginePin};
use super::qp::{QpState, RnrWait};
use super::regcache::TempMr;
use super::retire::finish;
use super::state::{At, Shared, State};
use super::two_sided::start_notify;
use super::types::PS;
use super::wrid::{WrKind, WrTag};
use crate::check::page_span;
use crate::ctrl::{AtomicRequest, FaultKind, FaultRequest, Repr, Status};
use crate::mem;
use crate::nic::{
    rnr_timer, Access, CompOp, Completion, NicMr as _, NicQp as _, PinFor, Sge, WcStatus,
    WorkRequest, WrOp,
};
use crate::plan::{AppOp, Strategy};
use crate::target::{validate, wc_status, LocalRegion};
use crate::trace::{mark, Step};
use vmem::AbsentWrite;

/// A granted target range: the MR and its checked, pinned region.
type Granted<'a, N> = (Arc<MrEntry<N>>, LocalRegion<'a, super::views::Views<N>>);

/// Target side of a two-sided READ/WRITE ([`Repr::Fault`]): validate, pin
/// and map in, then the reverse operation through a temporary MR (or, in
/// retry mode, Receiver-Ready).
fn serve_fault<N: Backend>(
    sh: &Shared<N>,
    qp: &mut QpState<N>,
    qi: usize,
    f: &FaultRequest,
    need: Access,
    r: Option<Granted<'_, N>>,
    lease_ok: bool,
) {
    let res = grant(
        sh,
        qp.remote_access,
        r.as_ref(),
        f.remote_addr,
        f.len as u64,
        need,
        false,
    );
    let pin = match res {
        Ok(g) => g,
        Err(s) => return reply(qp, sh, f.req_id, s, 0),
    };
    let (m, _) = r.expect("admitted");
    if f.len == 0 {
        return reply(qp, sh, f.req_id, Status::Ok, 0);
    }
    if f.retry_mode {
        // Pages pinned and mapped: the initiator retries one-sided
        // and releases them.
        let ok = qp
            .treqs
            .insert(TReq {
                reply: f.req_id,
                kind: TKind::Retry,
                _tmr: None,
                _pin: pin,
                _mr: m,
            })
            .is_ok();
        let status = if ok { Status::Ok } else { Status::NoResources };
        qp.send_ctrl(
            &sh.cfg.ctrl,
            &Repr::ReceiverReady {
                req_id: f.req_id,
                status,
            },
        );
        return;
    }
    let opc = if f.kind == FaultKind::Read {
        WrOp::Write
    } else {
        WrOp::Read
    };
    // A lease's registration serves the reverse operation too. A new lease
    // only when the peer comes back to these pages (as for small requests):
    // scattered operations keep the registration cache's temporary MRs.
    let lease = if lease_ok && f.want_lease {
        let again = qp.seen.again(f.remote_addr / PS);
        lease_for(
            sh,
            qp.pd,
            qi,
            &m,
            (f.remote_addr, f.len as u64),
            need,
            again,
        )
    } else {
        None
    };
    let tmr = match &lease {
        Some((mr, _)) => mr.clone(),
        None => match temp_mr(
            &sh.nic,
            &sh.cache,
            f.remote_addr,
            f.len as u64,
            Access::LOCAL_WRITE,
            0,
        ) {
            Ok(t) => t,
            Err(()) => return reply(qp, sh, f.req_id, Status::NoResources, 0),
        },
    };
    let lkey = tmr.lkey();
    let Ok(tid) = qp.treqs.insert(TReq {
        reply: f.req_id,
        kind: TKind::Fault { len: f.len },
        _tmr: Some(tmr),
        _pin: pin,
        _mr: m,
    }) else {
        return reply(qp, sh, f.req_id, Status::NoResources, 0);
    };
    let sge = [Sge {
        addr: f.remote_addr,
        length: f.len,
        lkey,
    }];
    let wr = WorkRequest::new(
        WrTag::new(qi, qp.gen, WrKind::Rev, 0, tid).wr_id(),
        opc,
        &sge,
    )
    .remote(f.local_addr, f.local_key);
    if let Err(e) = qp.data.post_send(&[wr]) {
        tracing::warn!(error = %e.source, "reverse operation not posted");
        drop(qp.treqs.take(tid));
        reply(qp, sh, f.req_id, Status::RemoteOp, 0);
        return;
    }
    if let Some((_, g)) = lease {
        // Before the answer: the initiator keeps it when it arrives.
        send_lease(sh, qp, f.req_id, f.rkey, &g, need == Access::REMOTE_WRITE);
    }
}

/// Tell the peer of QP `qp` it may use lease `g` of its MR `rkey` (for its
/// request `req_id`; `write`: REMOTE_WRITE, else REMOTE_READ).
fn send_lease<N: Backend>(
    sh: &Shared<N>,
    qp: &mut QpState<N>,
    req_id: u32,
    rkey: u32,
    g: &Grant,
    write: bool,
) {
    qp.send_ctrl(
        &sh.cfg.ctrl,
        &Repr::Lease {
            req_id,
            rkey,
            key: g.key,
            addr: g.start,
            len: g.len,
            write,
            ms: sh.leases.ms(),
            seq: g.seq,
        },
    );
}

/// The lease of the pages of a request's validated range `(addr, len)` (in
/// MR `m`, through QP `qi` of application PD `pd`): renewed if the QP has it,
/// else (if `new`) registered and pinned now if the budget has room. `None`:
/// no lease (the request is served all the same).
#[allow(clippy::too_many_arguments)]
fn lease_for<N: Backend>(
    sh: &Shared<N>,
    pd: u32,
    qi: usize,
    m: &Arc<MrEntry<N>>,
    (addr, len): (u64, u64),
    need: Access,
    new: bool,
) -> Option<(TempMr<N>, Grant)> {
    let write = need == Access::REMOTE_WRITE;
    // Whole pages, but never a byte outside the MR.
    let start = (addr & !(PS - 1)).max(m.addr);
    let end = (addr + len).next_multiple_of(PS).min(m.addr + m.len);
    if let Some(x) = sh.leases.renew(qi, m, start, end, write) {
        return Some(x);
    }
    if !new {
        return None;
    }
    let limit = sh
        .leases
        .limit(sh.mm.0.budget().map(|pages| pages as u64 * PS));
    if !sh.leases.room(end - start, limit) {
        return None;
    }
    let pin = pin_for_peer(
        &sh.mm,
        m,
        start,
        end - start,
        PinFor::for_request(need, false),
    )
    .ok()?;
    let acc = if write {
        Access::REMOTE_WRITE | Access::LOCAL_WRITE
    } else {
        Access::REMOTE_READ
    };
    #[allow(unsafe_code)]
    // SAFETY: `[start, end)` lies inside the registered application MR `m`
    // (clamped to its bounds) and is pinned by `pin`, which the lease holds
    // and drops only after this registration; the lease is dropped before
    // `m` is deregistered or re-registered (`Leases::drop_mr`) and when the
    // memory is unmapped (`Leases` is a swap listener).
    let mr = unsafe { sh.nic.reg_mr_in_domain(start, end - start, acc, pd) }
        .map_err(|e| tracing::debug!(error = %e, "lease registration failed"))
        .ok()?;
    let mr = Arc::new(mr);
    let g = sh.leases.insert(
        qi,
        pd,
        m,
        (start, end),
        write,
        NewLease {
            mr: mr.clone(),
            pin,
        },
        limit,
    )?;
    Some((mr, g))
}

/// Answer READ `f` of never-populated memory of `m` with zeroes: a reverse
/// WRITE from the zero source (made on first use), nothing pinned or faulted
/// in. `false` if it could not be posted (the caller serves it the ordinary
/// way).
fn answer_zero_read<N: Backend>(
    sh: &Shared<N>,
    qp: &mut QpState<N>,
    zero: &mut Option<N::Buf>,
    qi: usize,
    f: &FaultRequest,
    m: Arc<MrEntry<N>>,
) -> bool {
    if zero.is_none() {
        match sh.nic.alloc_buf(ZERO_BUF, Access::LOCAL_WRITE) {
            Ok(z) => *zero = Some(z),
            Err(e) => {
                tracing::warn!(error = %e, "zero source not registered");
                return false;
            }
        }
    }
    let Some(z) = zero.as_ref() else { return false };
    let Ok(tid) = qp.treqs.insert(TReq {
        reply: f.req_id,
        kind: TKind::Fault { len: f.len },
        _tmr: None,
        _pin: None,
        _mr: m,
    }) else {
        return false;
    };
    let per_wr = (ZERO_BUF * zero_sges(sh)) as u64;
    let total = f.len as u64;
    let nwr = total.div_ceil(per_wr);
    if nwr > 8 {
        return false;
    }
    let mut sges: Vec<[Sge; ZERO_SGES]> = Vec::with_capacity(nwr as usize);
    let mut lens = Vec::with_capacity(nwr as usize);
    for w in 0..nwr {
        let len = (total - w * per_wr).min(per_wr);
        let mut a = [Sge {
            addr: z.addr(),
            length: 0,
            lkey: z.lkey(),
        }; ZERO_SGES];
        let n = len.div_ceil(ZERO_BUF as u64) as usize; // ≤ zero_sges
        for (k, sg) in a.iter_mut().enumerate().take(n) {
            sg.length = (len - k as u64 * ZERO_BUF as u64).min(ZERO_BUF as u64) as u32;
        }
        sges.push(a);
        lens.push(n);
    }
    let wrs: Vec<WorkRequest<'_>> = sges
        .iter()
        .zip(&lens)
        .enumerate()
        .map(|(w, (sg, &n))| {
            let last = w as u64 == nwr - 1;
            WorkRequest::new(
                WrTag::new(qi, qp.gen, WrKind::Rev, 0, tid).wr_id(),
                WrOp::Write,
                &sg[..n],
            )
            .remote(f.local_addr + w as u64 * per_wr, f.local_key)
            .signaled(last)
        })
        .collect();
    match qp.data.post_send(&wrs) {
        Ok(()) => true,
        Err(e) if e.bad_index == 0 => {
            tracing::debug!(error = %e.source, "zero answer not posted");
            drop(qp.treqs.take(tid));
            false
        }
        Err(e) => {
            // Part of it is out without its signaled last WR: the QP fails
            // like on a NIC error.
            tracing::error!(error = %e.source, "zero answer partly posted");
            drop(qp.treqs.take(tid));
            reply(qp, sh, f.req_id, Status::RemoteOp, 0);
            true
        }
    }
}

/// Target side: validate like the NIC would — the QP's access flags first
/// (`qp_access`: REM_INV_REQ, as rxe/mlx5 and the pinned NIC), then key,
/// bounds and the MR's rights — then pin and map in.
fn grant<N: Backend>(
    sh: &Shared<N>,
    qp_access: Access,
    r: Option<&Granted<'_, N>>,
    addr: u64,
    len: u64,
    need: Access,
    atomic: bool,
) -> Result<Option<EnginePin<N>>, Status> {
    if !qp_access.contains(need) {
        return Err(Status::RemoteInvalid);
    }
    validate(r.map(|x| &x.1), addr, len, need, atomic)?;
    mark(Step::TValidated);
    let (m, _) = r.ok_or(Status::RemoteAccess)?;
    if len == 0 {
        return Ok(None);
    }
    pin_for_peer(&sh.mm, m, addr, len, PinFor::for_request(need, atomic)).map(Some)
}

fn region<'a, N: Backend>(
    mrs: &'a IdMap<Arc<MrEntry<N>>>,
    pd: u32,
    rkey: u32,
) -> Option<Granted<'a, N>> {
    let m = mrs.get(&rkey).filter(|m| m.pd() == pd)?;
    Some((
        m.clone(),
        LocalRegion {
            access: m.access(),
            shadow: &m.shadow,
        },
    ))
}

/// The completion status of a peer's answer `s`.
fn answered(s: Status) -> WcStatus {
    WcStatus::from_code(wc_status(s))
}

/// The one answer of a served request or delivered SEND: a
/// [`Repr::Completion`] for the initiator's request `req_id`.
pub(super) fn reply<N: Backend>(
    qp: &mut QpState<N>,
    sh: &Shared<N>,
    req_id: u32,
    status: Status,
    byte_len: u32,
) {
    qp.send_ctrl(
        &sh.cfg.ctrl,
        &Repr::Completion {
            req_id,
            status,
            byte_len,
        },
    );
}

/// Dispatch one control message from QP `qi`'s peer to its handler.
pub(super) fn handle_msg<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, msg: Repr<'_>) {
    if !st.swap_wait.is_empty() && !matches!(msg, Repr::ReadInline { .. }) {
        // Whatever follows the held-back READs is served after them.
        serve_swap_wait(sh, st);
    }
    match msg {
        Repr::KeyQuery { req_id, .. } => on_key_query(sh, st, qi, req_id),
        Repr::KeySync { .. } | Repr::KeyRevoke { .. } => on_key_update(st, qi, &msg),
        Repr::Fault(f) => on_fault(sh, st, qi, &f),
        Repr::ReadInline {
            req_id,
            remote_addr,
            rkey,
            want_lease,
            len,
        } => {
            if want_lease {
                lease_small(sh, st, qi, req_id, rkey, (remote_addr, len as u64), false);
            }
            on_read_inline(sh, st, qi, req_id, remote_addr, rkey, len, true)
        }
        Repr::WriteInline {
            req_id,
            remote_addr,
            rkey,
            want_lease,
            data,
        } => {
            if want_lease {
                let range = (remote_addr, data.len() as u64);
                lease_small(sh, st, qi, req_id, rkey, range, true);
            }
            on_write_inline(sh, st, qi, req_id, remote_addr, rkey, &data)
        }
        Repr::Atomic(a) => on_atomic(sh, st, qi, &a),
        Repr::SendInline { .. } | Repr::SendRendezvous { .. } | Repr::WriteImmNotify { .. } => {
            on_inbound(sh, st, qi, msg)
        }
        Repr::Completion {
            req_id,
            status,
            byte_len,
        } => on_completion(sh, st, qi, req_id, status, byte_len),
        Repr::ReadInlineResp {
            req_id,
            status,
            data,
        } => on_read_inline_resp(sh, st, qi, req_id, status, &data),
        Repr::AtomicResp {
            req_id,
            status,
            original,
        } => on_atomic_resp(sh, st, qi, req_id, status, original),
        Repr::Release { req_id } => on_release(st, qi, req_id),
        Repr::ReceiverReady { req_id, status } => on_receiver_ready(sh, st, qi, req_id, status),
        Repr::Lease {
            req_id,
            rkey,
            key,
            addr,
            len,
            write,
            ms,
            seq,
        } => on_lease(sh, st, qi, req_id, rkey, key, (addr, len), write, (ms, seq)),
        Repr::LeaseRelease { key, seq } => sh.leases.release(qi, key, seq),
        other => {
            if st.qp(qi).is_some() {
                tracing::debug!(op = ?other.opcode(), "control message ignored");
            }
        }
    }
}

/// [`Repr::Lease`]: the peer lends us its registration of `range` of its MR
/// `rkey` (for our request `req_id`, whose sending starts the lease's time);
/// ignored unless that request is still ours and asked for it.
/// A lease we cannot keep (the table is full) is given back at once.
#[allow(clippy::too_many_arguments)]
fn on_lease<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    rkey: u32,
    key: u32,
    range: (u64, u64),
    write: bool,
    (ms, seq): (u32, u32),
) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(op) = qp.ops.get(req_id) else { return };
    let asked = matches!(op.stage, Stage::TwoSided)
        && op.wr.rkey == rkey
        && (op.wr.op == AppOp::Read) != write;
    let back = match (asked, op.sent) {
        (true, Some(sent)) => qp.held.keep(rkey, range, write, key, ms, seq, sent),
        // Not ours to use: give it back (the peer keeps it otherwise).
        _ => Some((key, seq)),
    };
    if let Some((key, seq)) = back {
        qp.send_ctrl(&sh.cfg.ctrl, &Repr::LeaseRelease { key, seq });
    }
}

/// [`Repr::KeyQuery`]: the peer syncs our key table (from now on it is
/// told about new MRs and revocations).
fn on_key_query<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, req_id: u32) {
    let Some(At { qp, keys, .. }) = st.at(qi) else {
        return;
    };
    let ctrl = sh.cfg.ctrl;
    qp.keys_served = true;
    for m in keys.sync_messages(req_id, &ctrl) {
        qp.send_ctrl(&ctrl, &m);
    }
}

/// [`Repr::KeySync`] / [`Repr::KeyRevoke`]: the peer's key table changed;
/// the last message answering a query retries the ops waiting for keys.
fn on_key_update<N: Backend>(st: &mut State<N>, qi: usize, msg: &Repr<'_>) {
    let Some(At { qp, ready, .. }) = st.at(qi) else {
        return;
    };
    let answer = match msg {
        Repr::KeySync {
            more: false,
            req_id,
            ..
        } => Some(*req_id),
        _ => None,
    };
    if let Err(e) = qp.peer.apply(msg) {
        tracing::warn!(error = %e, "bad key message from peer");
    }
    // A version seen under keys that changed stands in for nothing.
    qp.peer_versions.clear();
    if let Repr::KeyRevoke { rkey, .. } = msg {
        // Its leases went with the MR.
        qp.held.forget(*rkey);
    }
    if let Some(r) = answer {
        // Retry every waiting op; those whose query this answers
        // fail if their key is still unknown.
        for id in qp.key_wait.drain(..) {
            if let Some(op) = qp.ops.get_mut(id) {
                if r != 0 && op.key_req == r {
                    op.key_answered = true;
                }
                op.stage = Stage::Queued;
                ready.push_back((qi, id));
            }
        }
    }
}

/// [`Repr::Fault`]: a two-sided READ/WRITE through a temporary MR (a READ
/// of never-populated memory from the zero source).
fn on_fault<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, f: &FaultRequest) {
    let lease_ok = f.want_lease && lease_allowed(sh, st, qi, fault_right(f.kind));
    let Some(At {
        qp,
        mrs,
        stats,
        zero,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    stats.served += 1;
    let need = fault_right(f.kind);
    let r = region(mrs, qp.pd, f.rkey);
    // A READ of memory that was never populated reads zeroes: it is
    // answered from the zero source at once, nothing faulted in (as
    // Linux maps no page for a read of untouched anonymous memory);
    // the READ linearises at the proof, like the inline answer.
    if f.kind == FaultKind::Read
        && !f.retry_mode
        && qp.remote_access.contains(Access::REMOTE_READ)
        && f.len as u64 <= ZERO_READ_MAX
        && validate(
            r.as_ref().map(|x| &x.1),
            f.remote_addr,
            f.len as u64,
            Access::REMOTE_READ,
            false,
        )
        .is_ok()
        && r.as_ref()
            .is_some_and(|(m, _)| m.range_reads_as_zero(&sh.mm.0, f.remote_addr, f.len as u64))
    {
        let (m, _) = r.expect("checked");
        if answer_zero_read(sh, qp, zero, qi, f, m) {
            return;
        }
        let r = region(mrs, qp.pd, f.rkey);
        return serve_fault(sh, qp, qi, f, need, r, false);
    }
    serve_fault(sh, qp, qi, f, need, r, lease_ok)
}

/// Whether a lease with right `need` may be lent through QP `qi`: leases are
/// on, and every QP of the context is in its PD and grants `need` (see the
/// `lease` module).
fn lease_allowed<N: Backend>(sh: &Shared<N>, st: &State<N>, qi: usize, need: Access) -> bool {
    sh.leases.enabled()
        && st.qps.get(qi).and_then(Option::as_ref).is_some_and(|q| {
            may_grant(
                q.pd,
                need,
                st.qps.iter().flatten().map(|o| (o.pd, o.remote_access)),
            )
        })
}

/// A small (inline) READ (`write`: WRITE) of `range` of MR `rkey` that asked
/// for a lease: if it comes back to a page the peer's recent small requests
/// reached, lend the page(s) before the answer goes out (the answer follows
/// the ordinary way). Nothing happens for a request that would fail.
fn lease_small<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    rkey: u32,
    (addr, len): (u64, u64),
    write: bool,
) {
    let need = right(write);
    if len == 0 || !sh.leases.enabled() {
        return;
    }
    // The cheap test first (every small request passes here), then the
    // scan of the context's QPs.
    let again = st.qp(qi).is_some_and(|q| q.seen.again(addr / PS));
    if !again || !lease_allowed(sh, st, qi, need) {
        return;
    }
    // (`lease_allowed` checked this QP's rights too.)
    let Some(At { qp, mrs, .. }) = st.at(qi) else {
        return;
    };
    let Some((m, r)) = region(mrs, qp.pd, rkey) else {
        return;
    };
    if validate(Some(&r), addr, len, need, false).is_err() {
        return;
    }
    if let Some((_, g)) = lease_for(sh, qp.pd, qi, &m, (addr, len), need, true) {
        send_lease(sh, qp, req_id, rkey, &g, write);
    }
}

/// The right a two-sided READ (`kind`) or WRITE needs at the target.
fn fault_right(kind: FaultKind) -> Access {
    right(kind == FaultKind::Write)
}

/// A small READ of a swapped-out page held back for the rest of the
/// progress pass ([`serve_swap_wait`]).
pub(super) struct SwapWait {
    qi: usize,
    req_id: u32,
    remote_addr: u64,
    rkey: u32,
    len: u32,
}

/// How many READs of swapped-out pages one pass holds back at most.
const SWAP_WAIT_MAX: usize = 256;

/// Serve the READs of swapped-out pages held back by this progress pass:
/// with two or more, their pages are first swapped in together, the swap
/// reads issued concurrently (`vmem::Pager::swap_in_pages`), so a batch of
/// major faults uses the device's queue depth instead of one read at a
/// time; a lone one is answered from its swap slot as before.
pub(super) fn serve_swap_wait<N: Backend>(sh: &Shared<N>, st: &mut State<N>) {
    let waits = std::mem::take(&mut st.swap_wait);
    if waits.len() >= 2 {
        let addrs: Vec<usize> = waits.iter().map(|w| w.remote_addr as usize).collect();
        let n = sh.mm.0.swap_in_pages(&addrs);
        st.stats.batched_swap_ins += n as u64;
    }
    for w in waits {
        on_read_inline(sh, st, w.qi, w.req_id, w.remote_addr, w.rkey, w.len, false);
    }
}

/// [`Repr::ReadInline`]: a small READ answered with its data. `hold`: a
/// READ of one swapped-out page may be held back until the end of the
/// progress pass ([`serve_swap_wait`]).
#[allow(clippy::too_many_arguments)]
fn on_read_inline<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    remote_addr: u64,
    rkey: u32,
    len: u32,
    hold: bool,
) {
    if hold
        && len > 0
        && st.swap_wait.len() < SWAP_WAIT_MAX
        && page_span(remote_addr, len as u64, PS as usize).is_some_and(|(_, k)| k == 1)
        && sh.mm.0.is_swapped_out(remote_addr as usize)
    {
        st.swap_wait.push(SwapWait {
            qi,
            req_id,
            remote_addr,
            rkey,
            len,
        });
        return;
    }
    let Some(At {
        qp,
        mrs,
        stats,
        post_answer,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    let ctrl = sh.cfg.ctrl;
    mark(Step::TParsed);
    stats.served += 1;
    let r = region(mrs, qp.pd, rkey);
    // Pages whose content the target gets without pinning them —
    // never populated (a remote minor fault: zeroes, proven by
    // `MrEntry::reads_as_zero`), swapped out by the pager (a major
    // fault: the bytes are read from the swap slot) or resident (a
    // lazy swap-in: a CPU copy) — are answered first; the pin
    // (zero-fill / swap-in) and map-in follow, off the initiator's
    // critical path. Validation is the same as below, and
    // the READ linearises at the proof / slot read (a racing local
    // write may follow it).
    let early = r.as_ref().filter(|_| {
        len > 0
            && qp.remote_access.contains(Access::REMOTE_READ)
            && len as usize <= mem::STACK_COPY
            && validate(
                r.as_ref().map(|x| &x.1),
                remote_addr,
                len as u64,
                Access::REMOTE_READ,
                false,
            )
            .is_ok()
    });
    if let Some((m, _)) = early {
        let mut data = [0u8; mem::STACK_COPY];
        let n = len as usize;
        let known = m.reads_as_zero(&sh.mm.0, remote_addr, len as u64)
            || matches!(
                sh.mm.0.read_swapped(remote_addr as usize, &mut data[..n]),
                Ok(true)
            )
            || (page_span(remote_addr, len as u64, PS as usize)
                .is_some_and(|(p, k)| (0..k).all(|i| sh.mm.0.is_resident((p + i * PS) as usize)))
                && {
                    // Resident (a lazy swap-in: the NIC views are
                    // still unmapped): the CPU copies it now; were
                    // it evicted meanwhile, the copy faults it back
                    // in through the pager (slow, still exact).
                    // (Unmapped meanwhile: answered by the checked path below.)
                    mem::read_into(remote_addr, &mut data[..n]).is_ok()
                });
        if known {
            mark(Step::TValidated);
            mark(Step::TCopied);
            let status = Status::Ok;
            let data = Cow::Borrowed(&data[..n]);
            qp.send_ctrl(
                &ctrl,
                &Repr::ReadInlineResp {
                    req_id,
                    status,
                    data,
                },
            );
            mark(Step::TSent);
            // Then fault them in and map them for the NIC, as the
            // pinned path would have, so that later READs go
            // one-sided: at the next idle progress pass (a bounded
            // queue; beyond it, now).
            owe_map_in(sh, post_answer, m, remote_addr, len as u64);
            return;
        }
    }
    let res = grant(
        sh,
        qp.remote_access,
        r.as_ref(),
        remote_addr,
        len as u64,
        Access::REMOTE_READ,
        false,
    );
    let mut stack = [0u8; mem::STACK_COPY];
    let (status, data) = match res {
        Ok(g) => {
            let d = mem::copy_out(remote_addr, len as usize, &mut stack);
            drop(g);
            match d {
                Ok(d) => (Status::Ok, d),
                Err(_) => (Status::RemoteAccess, Cow::Borrowed(&[][..])),
            }
        }
        Err(s) => (s, Cow::Borrowed(&[][..])),
    };
    mark(Step::TCopied);
    qp.send_ctrl(
        &ctrl,
        &Repr::ReadInlineResp {
            req_id,
            status,
            data,
        },
    );
    mark(Step::TSent);
}

/// Queue the pin + map-in of `[addr, addr+len)` owed after an answer that
/// went out before it (done at the next idle progress pass,
/// `progress::map_in_owed`); with 256 already owed, do it now.
fn owe_map_in<N: Backend>(
    sh: &Shared<N>,
    post_answer: &mut VecDeque<(Arc<MrEntry<N>>, u64, u64)>,
    m: &Arc<MrEntry<N>>,
    addr: u64,
    len: u64,
) {
    if post_answer.len() < 256 {
        post_answer.push_back((m.clone(), addr, len));
    } else {
        drop(engine_pin(&sh.mm, m, addr, len, PinFor::Read));
    }
}

/// [`Repr::WriteInline`]: a small WRITE carrying its data.
fn on_write_inline<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    remote_addr: u64,
    rkey: u32,
    data: &[u8],
) {
    let Some(At {
        qp,
        mrs,
        stats,
        post_answer,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    stats.served += 1;
    let r = region(mrs, qp.pd, rkey);
    // Into a page that is not resident (never touched, or swapped out): the
    // page is locked, the reply goes out, then one fill of the page with
    // zeroes or its swap slot's contents and the data over them (no zero
    // fill or swap-in, pin, copy and unpin first; the device read leaves the
    // writer's critical path). Until the fill every access to the page waits
    // for it (the pager's page lock; the NIC's views map it only after), so
    // whatever the writer does after the reply sees the data. The page is
    // mapped in for the NIC after the reply, as after an answer-first READ.
    let mut answered = false;
    if let Some((m, _)) = r.as_ref().filter(|_| {
        qp.remote_access.contains(Access::REMOTE_WRITE)
            && validate(
                r.as_ref().map(|x| &x.1),
                remote_addr,
                data.len() as u64,
                Access::REMOTE_WRITE,
                false,
            )
            .is_ok()
    }) {
        mark(Step::TValidated);
        let announce = || {
            reply(qp, sh, req_id, Status::Ok, data.len() as u32);
            answered = true;
        };
        match sh
            .mm
            .0
            .write_absent_then(remote_addr as usize, data, announce)
        {
            Ok(AbsentWrite::Written) => {
                mark(Step::TCopied);
                owe_map_in(sh, post_answer, m, remote_addr, data.len() as u64);
                return;
            }
            Ok(AbsentWrite::Refused(e)) => {
                tracing::debug!(error = %e, "page fill after the answer refused; writing the ordinary way");
            }
            Ok(AbsentWrite::Skipped) | Err(_) => {}
        }
    }
    let res = grant(
        sh,
        qp.remote_access,
        r.as_ref(),
        remote_addr,
        data.len() as u64,
        Access::REMOTE_WRITE,
        false,
    );
    let status = match res {
        Ok(g) => {
            let written = mem::write(remote_addr, data);
            drop(g);
            match written {
                Ok(()) => Status::Ok,
                Err(_) => Status::RemoteAccess,
            }
        }
        Err(s) => s,
    };
    if !answered {
        reply(qp, sh, req_id, status, data.len() as u32);
    } else if status != Status::Ok {
        // Answered already: the memory went away under the write (unmapped).
        tracing::debug!(?status, "WRITE into a page unmapped after its answer");
    }
}

/// [`Repr::Atomic`]: a compare-and-swap or fetch-and-add, done by this CPU.
fn on_atomic<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, a: &AtomicRequest) {
    let Some(At { qp, mrs, stats, .. }) = st.at(qi) else {
        return;
    };
    stats.served += 1;
    let r = region(mrs, qp.pd, a.rkey);
    let res = grant(
        sh,
        qp.remote_access,
        r.as_ref(),
        a.remote_addr,
        8,
        Access::REMOTE_ATOMIC,
        true,
    );
    let (status, original) = match res {
        Ok(g) => match mem::atomic(a.remote_addr, a.kind, a.compare_add, a.swap) {
            Some(Ok(v)) => {
                drop(g);
                (Status::Ok, v)
            }
            Some(Err(_)) => (Status::RemoteAccess, 0),
            None => (Status::RemoteInvalid, 0),
        },
        Err(s) => (s, 0),
    };
    qp.send_ctrl(
        &sh.cfg.ctrl,
        &Repr::AtomicResp {
            req_id: a.req_id,
            status,
            original,
        },
    );
}

/// Messages a QP holds for its RECVs at most: a peer's QP has at most its
/// depth (≤ 1000) of them outstanding.
const MAX_INBOUND: usize = 1024;

/// [`Repr::SendInline`], [`Repr::SendRendezvous`],
/// [`Repr::WriteImmNotify`]: queued for the posted RECVs.
fn on_inbound<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, msg: Repr<'_>) {
    let Some(qp) = st.qp(qi) else {
        return;
    };
    if qp.rnr_failed {
        // Sent behind a message that ran out of RNR retries: its sender's QP
        // failed and flushed it (see `rnr_expire`).
        return;
    }
    if qp.inbound.len() >= MAX_INBOUND {
        // More than any peer's QP can have outstanding: a peer that does not
        // play by the protocol gets an error answer, not our memory.
        tracing::warn!(qpn = qp.qpn, "inbound message queue full: dropped");
        reply(qp, sh, inbound_req_id(&msg), Status::RemoteOp, 0);
        return;
    }
    qp.inbound.push_back(msg.into_owned());
    deliver_inbound(sh, st, qi);
}

/// [`Repr::Completion`]: the peer's answer to our two-sided READ/WRITE/SEND
/// or WRITE_WITH_IMM notice.
fn on_completion<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    status: Status,
    byte_len: u32,
) {
    let Some(op) = st.op_mut(qi, req_id) else {
        return;
    };
    if status == Status::RnrWait {
        // Still held by the receiver for a RECV: the peer is there, the real
        // answer follows; the two-sided timeout starts again.
        if matches!(op.stage, Stage::TwoSided | Stage::ImmNotify) {
            op.sent = Some(std::time::Instant::now());
        }
        return;
    }
    let (status, byte_len) = if matches!(op.stage, Stage::TwoSided) && op.pieces.is_some() {
        // One answer a piece: the operation's own once all of them are in.
        match super::two_sided::piece_answered(sh, st, qi, req_id, status, byte_len) {
            Some(whole) => whole,
            None => return,
        }
    } else {
        (status, byte_len)
    };
    let Some(op) = st.op_mut(qi, req_id) else {
        return;
    };
    match op.stage {
        Stage::TwoSided => {
            if matches!(op.wr.op, AppOp::WriteImm(_)) && status == Status::Ok {
                start_notify(sh, st, qi, req_id);
            } else if matches!(
                op.wr.op,
                AppOp::Read | AppOp::Write | AppOp::Send | AppOp::SendImm(_)
            ) {
                let len = if status == Status::Ok { byte_len } else { 0 };
                finish(st, qi, req_id, answered(status), len);
            }
        }
        Stage::ImmNotify => {
            let len = op.len as u32;
            finish(st, qi, req_id, answered(status), len);
        }
        _ => {}
    }
}

/// [`Repr::ReadInlineResp`]: the data of our inline READ.
fn on_read_inline_resp<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    status: Status,
    data: &[u8],
) {
    let Some(qp) = st.qp(qi) else {
        return;
    };
    let Some(op) = qp.ops.get_mut(req_id) else {
        return;
    };
    if !matches!(op.stage, Stage::TwoSided) || op.wr.op != AppOp::Read {
        return;
    }
    let mut s = answered(status);
    // A later READ of the same destination may already have landed
    // (it did not wait for this one): this answer is dead then.
    let dead = op.ticket.is_some_and(|t| qp.order.data_dead(t));
    if local_fenced(&sh.mm, op) {
        // Deregistered meanwhile: its memory is not ours to write.
        s = WcStatus::LocProtErr;
    } else if status == Status::Ok {
        if data.len() as u64 == op.len {
            if !dead && mem::write(op.laddr, data).is_err() {
                s = WcStatus::LocProtErr;
            }
        } else {
            s = answered(Status::RemoteInvalid);
        }
    }
    let len = op.len as u32;
    finish(st, qi, req_id, s, len);
}

/// [`Repr::AtomicResp`]: the original value of our atomic.
fn on_atomic_resp<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    status: Status,
    original: u64,
) {
    let Some(op) = st.op_mut(qi, req_id) else {
        return;
    };
    if !matches!(op.stage, Stage::TwoSided) || !is_atomic(op.wr.op) {
        return;
    }
    let mut s = answered(status);
    // Deregistered meanwhile, or unmapped under the write: not ours to write.
    if local_fenced(&sh.mm, op)
        || (status == Status::Ok && mem::write(op.laddr, &original.to_le_bytes()).is_err())
    {
        s = WcStatus::LocProtErr;
    }
    finish(st, qi, req_id, s, 8);
}

/// [`Repr::Release`]: the initiator's retry-mode retry is done; unpin.
fn on_release<N: Backend>(st: &mut State<N>, qi: usize, req_id: u32) {
    let Some(qp) = st.qp(qi) else {
        return;
    };
    let hit = qp
        .treqs
        .iter()
        .find(|(_, t)| t.reply == req_id && matches!(t.kind, TKind::Retry))
        .map(|(tid, _)| tid);
    if let Some(tid) = hit {
        drop(qp.treqs.take(tid));
    }
}

/// [`Repr::ReceiverReady`] (retry mode): the target pinned and mapped the
/// pages; retry one-sided with page versions.
fn on_receiver_ready<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    req_id: u32,
    status: Status,
) {
    let Some(At { qp, stats, .. }) = st.at(qi) else {
        return;
    };
    let Some(op) = qp.ops.get_mut(req_id) else {
        return;
    };
    if !matches!(op.stage, Stage::TwoSided) || op.retry != Retry::AwaitingReady {
        return;
    }
    if status != Status::Ok {
        finish(st, qi, req_id, answered(status), 0);
        return;
    }
    op.retry = Retry::InFlight;
    stats.retries += 1;
    let t = match qp.peer.lookup(op.wr.rkey, op.wr.remote_addr, op.len) {
        Ok(t) => t,
        Err(_) => {
            finish(st, qi, req_id, WcStatus::RemAccessErr, 0);
            return;
        }
    };
    // Both sides are pinned and mapped; page versions prove it.
    let strat = if op.wr.op == AppOp::Read {
        Strategy::ReadVersioned
    } else {
        Strategy::WriteVersioned
    };
    let lmr = op.lmr.clone().expect("READ/WRITE with data has a local MR");
    post_steps(sh, st, qi, req_id, strat, &t, &lmr);
}

/// Match inbound messages (SEND, WRITE_WITH_IMM notices) with posted RECVs.
pub(super) fn deliver_inbound<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize) {
    let Some(At { qp, mrs, .. }) = st.at(qi) else {
        return;
    };
    while !qp.rdv_busy && !qp.inbound.is_empty() && qp.has_recv() {
        let msg = qp.inbound.pop_front().expect("non-empty");
        // The next message (if any) starts its own receiver-not-ready round.
        qp.rnr_wait = RnrWait::Idle;
        let rwr = qp.take_recv().expect("a receive is posted");
        let (raddr, rlen, rkey) = rwr
            .sge
            .map(|s| (s.addr, s.length as u64, s.lkey))
            .unwrap_or((0, 0, 0));
        let pd = qp.recv_pd();
        let rmr = rwr.sge.and_then(|_| mrs.get(&rkey).cloned()).filter(|m| {
            m.pd() == pd && m.contains(raddr, rlen) && m.access().contains(Access::LOCAL_WRITE)
        });
        let valid = rwr.sge.is_none() || rmr.is_some();
        if qp.unreliable {
            // A UC responder drops a message its receive cannot take (rxe's class D
            // errors): the receive stays posted, the sender hears nothing wrong.
            let need = match &msg {
                Repr::SendInline { data, .. } => Some(data.len() as u64),
                Repr::SendRendezvous { len, .. } => Some(*len as u64),
                _ => None,
            };
            if need.is_some_and(|n| !valid || n > rlen) {
                qp.return_recv(rwr);
                reply(qp, sh, inbound_req_id(&msg), Status::Ok, 0);
                continue;
            }
        }
        let mut cqe = Completion {
            wr_id: rwr.wr_id,
            status: 0,
            op: CompOp::Recv,
            byte_len: 0,
            imm: None,
            qp_num: qp.qpn,
        };
        match msg {
            Repr::SendInline {
                req_id,
                imm,
                data,
                solicited,
                ..
            } => {
                cqe.imm = imm;
                if !valid {
                    cqe.status = WcStatus::LocProtErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::RemoteOp, 0);
                } else if data.len() as u64 > rlen {
                    cqe.status = WcStatus::LocLenErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::RemoteInvalid, 0);
                } else if mem::write(raddr, &data).is_err() {
                    // The receive buffer was unmapped under the delivery.
                    cqe.status = WcStatus::LocProtErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::RemoteOp, 0);
                } else {
                    cqe.byte_len = data.len() as u32;
                    qp.push_recv(cqe, solicited);
                    reply(qp, sh, req_id, Status::Ok, data.len() as u32);
                }
            }
            Repr::WriteImmNotify {
                req_id,
                len,
                imm,
                solicited,
                ..
            } => {
                cqe.op = CompOp::RecvWithImm;
                cqe.imm = Some(imm);
                cqe.byte_len = len;
                qp.push_recv(cqe, solicited);
                reply(qp, sh, req_id, Status::Ok, len);
            }
            Repr::SendRendezvous {
                req_id,
                addr,
                len,
                key,
                imm,
                solicited,
                ..
            } => {
                let Some(m) = rmr.filter(|_| len as u64 <= rlen) else {
                    cqe.status = if valid {
                        WcStatus::LocLenErr.code()
                    } else {
                        WcStatus::LocProtErr.code()
                    };
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::RemoteInvalid, 0);
                    continue;
                };
                if len == 0 {
                    cqe.imm = imm;
                    qp.push_recv(cqe, solicited);
                    reply(qp, sh, req_id, Status::Ok, 0);
                    continue;
                }
                let pinned =
                    engine_pin(&sh.mm, &m, raddr, len as u64, PinFor::Write).and_then(|p| {
                        temp_mr(
                            &sh.nic,
                            &sh.cache,
                            raddr,
                            len as u64,
                            Access::LOCAL_WRITE,
                            0,
                        )
                        .map(|t| (p, t))
                    });
                let Ok((pin, tmr)) = pinned else {
                    cqe.status = WcStatus::LocProtErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::NoResources, 0);
                    continue;
                };
                let lkey = tmr.lkey();
                let Ok(tid) = qp.treqs.insert(TReq {
                    reply: req_id,
                    kind: TKind::Rendezvous {
                        recv_wr_id: rwr.wr_id,
                        len,
                        imm,
                        solicited,
                    },
                    _tmr: Some(tmr),
                    _pin: Some(pin),
                    _mr: m,
                }) else {
                    cqe.status = WcStatus::LocProtErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::NoResources, 0);
                    continue;
                };
                let sge = [Sge {
                    addr: raddr,
                    length: len,
                    lkey,
                }];
                let wr = WorkRequest::new(
                    WrTag::new(qi, qp.gen, WrKind::Rev, 0, tid).wr_id(),
                    WrOp::Read,
                    &sge,
                )
                .remote(addr, key);
                if let Err(e) = qp.data.post_send(&[wr]) {
                    tracing::warn!(error = %e.source, "rendezvous READ not posted");
                    drop(qp.treqs.take(tid));
                    cqe.status = WcStatus::LocProtErr.code();
                    qp.recv_error(cqe);
                    reply(qp, sh, req_id, Status::RemoteOp, 0);
                    continue;
                }
                qp.rdv_busy = true;
            }
            _ => {}
        }
    }
    if qp.unreliable && !qp.rdv_busy && !qp.has_recv() {
        // No receive posted: on UC the message is dropped, not held for one.
        while let Some(msg) = qp.inbound.pop_front() {
            reply(qp, sh, inbound_req_id(&msg), Status::Ok, 0);
        }
    }
    if !qp.unreliable {
        rnr_hold(sh, qp);
    }
}

/// RC's receiver-not-ready rule for the message at the head of `inbound`
/// when no RECV is posted. A NIC's responder NAKs it and the requester
/// resends it every `min_rnr_timer` of the responder, `rnr_retry` times
/// (7: forever), then fails it with RNR_RETRY_EXC_ERR. Here the receiver
/// holds the message for that long instead (a RECV posted meanwhile takes
/// it, as a resend would find it): `rnr_retry` × the timer, then
/// [`rnr_expire`] (at once for `rnr_retry` 0), or forever for 7. Meanwhile
/// [`rnr_refresh`] keeps the senders from timing out.
fn rnr_hold<N: Backend>(sh: &Shared<N>, qp: &mut QpState<N>) {
    if qp.rdv_busy || qp.rnr_wait != RnrWait::Idle || qp.has_recv() {
        return;
    }
    let Some(head) = qp.inbound.front() else {
        return;
    };
    let retry = match head {
        Repr::SendInline { rnr_retry, .. }
        | Repr::SendRendezvous { rnr_retry, .. }
        | Repr::WriteImmNotify { rnr_retry, .. } => *rnr_retry,
        _ => return,
    };
    if retry >= 7 {
        qp.rnr_wait = RnrWait::Forever;
        return;
    }
    let budget = rnr_timer(qp.min_rnr_timer) * u32::from(retry);
    if budget.is_zero() {
        rnr_expire(sh, qp);
    } else {
        qp.rnr_wait = RnrWait::Until(std::time::Instant::now() + budget);
    }
}

/// How often the senders of held messages hear that they are still held.
const RNR_REFRESH: std::time::Duration = std::time::Duration::from_millis(25);

/// Tell the senders of the messages held for a RECV (at most every
/// [`RNR_REFRESH`]) that they still are ([`Status::RnrWait`]): a held
/// message is not lost, so its sender's two-sided timeout starts again. If
/// this QP is destroyed, or its process stops or dies, the refreshes stop
/// and the sender's WRs fail at its timeout (RETRY_EXC_ERR), as an RC
/// requester's whose resends go unanswered.
pub(super) fn rnr_refresh<N: Backend>(
    sh: &Shared<N>,
    qp: &mut QpState<N>,
    now: std::time::Instant,
) {
    if qp.inbound.is_empty() || qp.unreliable || qp.errored || qp.dead {
        return;
    }
    if now.duration_since(qp.rnr_refreshed) < RNR_REFRESH {
        return;
    }
    qp.rnr_refreshed = now;
    let ids: SmallVec<[u32; 8]> = qp.inbound.iter().map(inbound_req_id).collect();
    for id in ids {
        reply(qp, sh, id, Status::RnrWait, 0);
    }
}

/// The message at the head of `inbound` ran out of RNR retries: answered
/// RNR_RETRY_EXC_ERR, which fails its sender's QP (RC's error rule); the
/// messages behind it, and any still on their way, are dropped — the sender
/// flushes them, as RC's responder drops what follows a NAKed packet.
pub(super) fn rnr_expire<N: Backend>(sh: &Shared<N>, qp: &mut QpState<N>) {
    qp.rnr_wait = RnrWait::Idle;
    let Some(head) = qp.inbound.pop_front() else {
        return;
    };
    tracing::debug!(qpn = qp.qpn, "receiver not ready: RNR retries exhausted");
    reply(qp, sh, inbound_req_id(&head), Status::RnrNoRecv, 0);
    qp.inbound.clear();
    qp.rnr_failed = true;
}

/// The request id of an inbound message (answered when it is taken or dropped).
fn inbound_req_id(msg: &Repr<'_>) -> u32 {
    match msg {
        Repr::SendInline { req_id, .. }
        | Repr::SendRendezvous { req_id, .. }
        | Repr::WriteImmNotify { req_id, .. } => *req_id,
        _ => 0,
    }
}
