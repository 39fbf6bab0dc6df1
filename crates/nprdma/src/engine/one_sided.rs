//! The initiator's optimistic one-sided path: starting an admitted
//! operation (key lookup, local pre-check, strategy), posting its NIC
//! steps, evaluating its check when they complete, and the deferred
//! read-backs of unsignaled small WRITEs.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use super::backend::Backend;
use super::mr::MrEntry;
use super::op::{
    local_fenced, local_versions, versions_pass, versions_unchanged, RbBatch, Retry, Scratch,
    Stage, VersionsAt,
};
use super::pin::{engine_pin, temp_mr, Hold};
use super::replay;
use super::retire::{fail_qp, finish};
use super::state::{At, Shared, State};
use super::two_sided::{local_access, pin_local, start_notify};
use super::types::PS;
use super::wrid::{WrKind, WrTag};
use crate::check::{check_read, check_readback, precheck_local};
use crate::ctrl::Repr;
use crate::keymap::{KeyMapError, SyncState, Translation};
use crate::mem;
use crate::nic::{Access, NicMr as _, NicQp as _, Sge, WcStatus, WorkRequest, WrOp};
use crate::plan::{choose, nic_steps_small, probes_first, AppOp, LocalBuf, Strategy};

pub(super) fn start_op<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32) {
    let Some(At {
        qp,
        stats,
        next_req,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    let Some(op) = qp.ops.get_mut(id) else {
        return;
    };
    if op.stale {
        // Replayed while its old NIC WRs are out: start when they are done.
        op.restart = true;
        return;
    }
    match op.stage {
        Stage::Failed(s) => {
            finish(st, qi, id, s, 0);
            return;
        }
        Stage::HeldOk(len) => {
            finish(st, qi, id, WcStatus::Success, len);
            return;
        }
        _ if qp.errored => {
            // RC: behind a failed WR the QP is in ERR; an operation not sent yet is
            // flushed, never sent (it could land at the peer while reported flushed).
            finish(st, qi, id, WcStatus::WrFlushErr, 0);
            return;
        }
        Stage::HeldTwoSided => {
            replay::two_sided(sh, st, qi, id);
            return;
        }
        _ => {}
    }
    match op.wr.op {
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) => {}
        _ => {
            replay::two_sided(sh, st, qi, id);
            return;
        }
    }
    if op.len == 0 {
        // A zero-length RDMA operation touches no remote memory: its R_Key and VA
        // are not validated (IBTA o9-20, rxe's check_rkey). UCX's rc_verbs flushes
        // with a WRITE of no bytes to address 0, rkey 0.
        if let AppOp::WriteImm(_) = op.wr.op {
            start_notify(sh, st, qi, id);
        } else {
            finish(st, qi, id, WcStatus::Success, 0);
        }
        return;
    }
    let t = match qp.peer.lookup(op.wr.rkey, op.wr.remote_addr, op.len) {
        Ok(t) => t,
        Err(KeyMapError::UnknownKey(rkey)) if !op.key_answered => {
            op.stage = Stage::KeyWait;
            // Timed like a two-sided request: a peer that dies before it
            // answers the key query must not leave the op waiting forever.
            op.sent.get_or_insert_with(Instant::now);
            qp.key_wait.push(id);
            if op.key_req != 0 {
                // Our query is still out; a push of other keys woke us.
                return;
            }
            match qp.peer.state() {
                // The pending query's answer proves a key unknown only if
                // the query left after this WR was posted (the peer had
                // registered the key by then); an answer to an older query
                // may be a snapshot from before the registration.
                SyncState::Pending { req_id } if op.seq < qp.sync_cover => op.key_req = req_id,
                s => {
                    let req_id = *next_req;
                    *next_req = next_req.wrapping_add(1).max(1);
                    let rkey = if s == SyncState::Unsynced {
                        qp.peer.begin_sync(req_id);
                        qp.sync_cover = qp.next_seq;
                        None
                    } else {
                        Some(rkey)
                    };
                    op.key_req = req_id;
                    stats.key_queries += 1;
                    qp.send_ctrl(&sh.cfg.ctrl, &Repr::KeyQuery { req_id, rkey });
                }
            }
            return;
        }
        Err(_) => {
            finish(st, qi, id, WcStatus::RemAccessErr, 0);
            return;
        }
    };
    if t.version_rkey == 0 {
        // The peer runs user-space mode (no Version MR, key-only views):
        // nothing of it is reachable one-sided — but what it lent us.
        let write = op.wr.op != AppOp::Read;
        if let Some((key, used)) = qp.held.find(op.wr.rkey, op.wr.remote_addr, op.len, write) {
            op.lease = Some(used);
            post_leased(sh, st, qi, id, key);
            return;
        }
        replay::two_sided(sh, st, qi, id);
        return;
    }
    let lmr = op.lmr.clone().expect("len > 0 has a local MR");
    if local_fenced(&sh.mm, op) {
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    }
    let (laddr, len) = (op.laddr, op.len);
    if precheck_local(laddr, len, PS as usize, |p| lmr.shadow.is_mapped(p)).is_err() {
        stats.local_fixups += 1;
        match engine_pin(&sh.mm, &lmr, laddr, len, op.wr.op.local_pin()) {
            Ok(p) => drop(p),
            Err(()) => {
                finish(st, qi, id, WcStatus::LocProtErr, 0);
                return;
            }
        }
    }
    let large = probes_first(op.wr.op, len, &sh.cfg.plan);
    let strat = if op.retry == Retry::NotTried && large && qp.probe_hint {
        Strategy::VersionProbe
    } else {
        choose(op.wr.op, len, op.wr.signaled, &sh.cfg.plan)
    };
    if let Strategy::TwoSided(_) = strat {
        replay::two_sided(sh, st, qi, id);
        return;
    }
    post_steps(sh, st, qi, id, strat, &t, &lmr);
}

/// User-space mode: operation `id` of QP `qi` one-sided through the peer's
/// lease `key`, from a temporary MR over the pinned local range (both held
/// until it completes); if the WR cannot be posted, two-sided after all.
fn post_leased<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32, key: u32) {
    let Some(qp) = st.qp(qi) else { return };
    let (domain, gen) = (qp.pd, qp.gen);
    let Some(op) = qp.ops.get_mut(id) else { return };
    if local_fenced(&sh.mm, op) {
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    }
    let read = op.wr.op == AppOp::Read;
    let mut hold = Hold::default();
    let mr = pin_local(sh, op).and_then(|pin| {
        hold.pin = pin;
        temp_mr(
            &sh.nic,
            &sh.cache,
            op.laddr,
            op.len,
            local_access(read),
            domain,
        )
    });
    let Ok(mr) = mr else {
        drop(hold);
        finish(st, qi, id, WcStatus::LocProtErr, 0);
        return;
    };
    let sge = [Sge {
        addr: op.laddr,
        length: op.len as u32,
        lkey: mr.lkey(),
    }];
    hold.mr = Some(mr);
    let wr = WorkRequest::new(
        WrTag::new(qi, gen, WrKind::Op, 0, id).wr_id(),
        if read { WrOp::Read } else { WrOp::Write },
        &sge,
    )
    .remote(op.wr.remote_addr, key);
    if let Err(e) = qp.data.post_send(&[wr]) {
        tracing::debug!(error = %e.source, "leased operation not posted");
        drop(hold);
        op.lease = None;
        replay::two_sided(sh, st, qi, id);
        return;
    }
    op.hold = hold;
    op.sent = None;
    op.stage = Stage::OneSided {
        strat: Strategy::Leased,
        steps: 1,
        left: 1,
        err: WcStatus::Success,
        vlen: 0,
        ver: VersionsAt::default(),
    };
    let first = op.retry == Retry::NotTried;
    st.stats.leased_ops += 1;
    if first {
        replay::on_nic(st, qi, id);
    }
}

pub(super) fn post_steps<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    id: u32,
    strat: Strategy,
    t: &Translation,
    lmr: &Arc<MrEntry<N>>,
) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(op) = qp.ops.get(id) else { return };
    let (laddr, len, raddr) = (op.laddr, op.len, op.wr.remote_addr);
    let steps = nic_steps_small(strat, raddr, len, t);
    let vlen = t.version_len;
    let ver = VersionsAt::of(t);
    let need = match strat {
        Strategy::WriteReadback { deferred: false } => len,
        Strategy::ReadVersioned | Strategy::WriteVersioned => 2 * vlen,
        Strategy::VersionProbe => vlen,
        _ => 0,
    };
    let scratch = if need == 0 {
        None
    } else if need as usize <= qp.slot_size && !qp.scratch_free.is_empty() {
        qp.scratch_free.pop().map(Scratch::Slot)
    } else {
        match sh
            .nic
            .alloc_buf(need as usize + PS as usize, Access::LOCAL_WRITE)
        {
            Ok(m) => Some(Scratch::Own(m)),
            Err(e) => {
                tracing::warn!(error = %e, "scratch MR failed");
                finish(st, qi, id, WcStatus::LocProtErr, 0);
                return;
            }
        }
    };
    let (saddr, skey) = scratch
        .as_ref()
        .map(|s| qp.scratch_addr(s))
        .unwrap_or((0, 0));
    // Seen versions stand in for the "before" READ on an idle QP only (the
    // lean path, `fast.rs`), not here: in a pipeline that READ costs no
    // measurable time, and WRITE-READ pairs back to back ran slower through
    // the software NIC's request ring than READ-WRITE-READ triples
    // (BENCHMARKS.md, session 14). The versions read after are recorded.
    let sges: SmallVec<[[Sge; 1]; 3]> = steps
        .iter()
        .map(|s| {
            let (addr, length, lkey) = match s.local {
                LocalBuf::AppRead => (laddr, len, lmr.read_lkey()),
                LocalBuf::AppWrite => (laddr, len, lmr.write_lkey()),
                LocalBuf::Temp => (saddr + (raddr & (PS - 1)), len, skey),
                LocalBuf::VersionsBefore => (saddr, vlen, skey),
                LocalBuf::VersionsAfter => (saddr + vlen, vlen, skey),
            };
            [Sge {
                addr,
                length: length as u32,
                lkey,
            }]
        })
        .collect();
    let gen = qp.gen;
    let last = steps.len().saturating_sub(1);
    let wrs: SmallVec<[WorkRequest<'_>; 3]> = steps
        .iter()
        .zip(&sges)
        .enumerate()
        .map(|(k, (s, sge))| {
            // One NIC completion per operation: on the RC QP the last WR
            // completes after the others; a failing WR and the flushed
            // ones behind it still complete (errors are always reported).
            WorkRequest::new(
                WrTag::new(qi, gen, WrKind::Op, k as u8, id).wr_id(),
                s.op,
                sge,
            )
            .remote(s.remote_addr, s.rkey)
            .signaled(k == last)
        })
        .collect();
    let lver = local_versions(&lmr.shadow, laddr, len);
    let (posted, err) = match qp.data.post_send(&wrs) {
        Ok(()) => (wrs.len(), WcStatus::Success),
        Err(e) => {
            tracing::debug!(error = %e.source, "data QP post failed");
            (e.bad_index, WcStatus::LocProtErr)
        }
    };
    if posted == 0 {
        qp.release_scratch(scratch);
        finish(st, qi, id, err, 0);
        return;
    }
    if posted < wrs.len() {
        // A prefix of unsignaled WRs went out without its signaled last
        // WR: no completion may ever come for them. Unreachable with the
        // SQ sized for 4 WRs per operation; if it happens, the QP fails
        // like on a NIC error (every operation completes, flushed).
        tracing::error!(posted, "partial post of an operation's NIC WRs");
        qp.release_scratch(scratch);
        fail_qp(st, qi, WcStatus::WrFlushErr);
        return;
    }
    let Some(op) = qp.ops.get_mut(id) else { return };
    op.lver = lver;
    op.scratch = scratch;
    op.sent = None;
    op.stage = Stage::OneSided {
        strat,
        steps: posted as u8,
        left: posted as u8,
        err,
        vlen,
        ver,
    };
    // A probe moves no data: nothing may pipeline behind it until the
    // operation's data WRs are out (then `on_nic`).
    if op.retry == Retry::NotTried && strat != Strategy::VersionProbe {
        replay::on_nic(st, qi, id);
    }
}

pub(super) fn eval_one_sided<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    let Stage::OneSided {
        strat,
        err,
        vlen,
        ver,
        ..
    } = op.stage
    else {
        return;
    };
    if op.stale {
        replay::stale_done(st, qi, id);
        return;
    }
    if strat == Strategy::Leased {
        // Pinned at both ends: nothing to check. (Its lease may be given
        // back now.)
        op.hold = Hold::default();
        op.lease = None;
        let (len, wop) = (op.len, op.wr.op);
        if err != WcStatus::Success {
            finish(st, qi, id, err, 0);
        } else if let AppOp::WriteImm(_) = wop {
            start_notify(sh, st, qi, id);
        } else {
            replay::finish_ok(st, qi, id, len as u32);
        }
        return;
    }
    if strat == (Strategy::WriteReadback { deferred: true }) && err == WcStatus::Success {
        // The read-back waits for the next signaled WR (or an idle QP).
        op.stage = Stage::Deferred;
        let due = op.seq < qp.flush_seq;
        st.stats.deferred_writes += 1;
        let Some(qp) = st.qp(qi) else { return };
        qp.deferred.push(id);
        if due && !st.flush_qps.contains(&qi) {
            // After this poll batch, so that neighbours share a READ.
            st.flush_qps.push(qi);
        }
        return;
    }
    let scratch = op.scratch.take();
    let lver = std::mem::take(&mut op.lver);
    let (laddr, len, raddr, wop) = (op.laddr, op.len, op.wr.remote_addr, op.wr.op);
    let lmr = op.lmr.clone().expect("one-sided ops have a local MR");
    if err != WcStatus::Success {
        qp.release_scratch(scratch);
        finish(st, qi, id, err, 0);
        return;
    }
    let mut ok = versions_unchanged(&lmr.shadow, laddr, len, &lver);
    if ok {
        ok = match strat {
            Strategy::ReadMagic => mem::with_slice(laddr, len as usize, |d| {
                check_read(d, laddr, raddr, &sh.check).is_ok()
            }),
            Strategy::WriteReadback { .. } => {
                let s = scratch.as_ref().expect("read-back buffer");
                let sa = qp.readback_addr(s, raddr);
                mem::with_slice(sa, len as usize, |rb| {
                    mem::with_slice(laddr, len as usize, |src| {
                        check_readback(src, rb, raddr, &sh.check).is_ok()
                    })
                })
            }
            Strategy::ReadVersioned | Strategy::WriteVersioned => {
                let s = scratch.as_ref().expect("version buffer");
                let (sa, _) = qp.scratch_addr(s);
                versions_pass(&mut qp.peer_versions, ver, sa, vlen)
            }
            Strategy::VersionProbe => {
                let s = scratch.as_ref().expect("version buffer");
                let (sa, _) = qp.scratch_addr(s);
                mem::with_slice(sa, vlen as usize, |b| {
                    b.chunks_exact(4)
                        .all(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]) % 2 == 1)
                })
            }
            Strategy::TwoSided(_) | Strategy::Leased => false,
        };
    }
    qp.release_scratch(scratch);
    if strat == Strategy::VersionProbe {
        // Every page in: the real one-sided attempt (checked as usual);
        // else two-sided at once.
        qp.probe_hint = !ok;
        if ok {
            if let Some(op) = qp.ops.get(id) {
                let real = choose(op.wr.op, len, op.wr.signaled, &sh.cfg.plan);
                match qp.peer.lookup(op.wr.rkey, raddr, len) {
                    Ok(t) => return post_steps(sh, st, qi, id, real, &t, &lmr),
                    Err(_) => return finish(st, qi, id, WcStatus::RemAccessErr, 0),
                }
            }
            return;
        }
        st.stats.probed_out += 1;
        replay::two_sided(sh, st, qi, id);
        return;
    }
    if let Some(op) = qp.ops.get_mut(id) {
        if op.retry == Retry::InFlight {
            op.retry = Retry::Done;
            qp.send_ctrl(&sh.cfg.ctrl, &Repr::Release { req_id: id });
        }
    }
    if !ok {
        if probes_first(wop, len, &sh.cfg.plan) {
            qp.probe_hint = true;
        }
        replay::two_sided(sh, st, qi, id);
        return;
    }
    st.stats.optimistic_ok += 1;
    if let AppOp::WriteImm(_) = wop {
        start_notify(sh, st, qi, id);
    } else {
        replay::finish_ok(st, qi, id, len as u32);
    }
}

/// Post the read-backs of the deferred WRITEs of QP `qi` (contiguous ones
/// share a READ, [`crate::plan::batch_readbacks`]).
pub(super) fn flush_deferred<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize) {
    let Some(qp) = st.qp(qi) else { return };
    let ids: Vec<u32> = std::mem::take(&mut qp.deferred);
    let mut list = Vec::new();
    let mut members = Vec::new();
    for id in ids {
        if let Some(op) = qp.ops.get_mut(id) {
            if matches!(op.stage, Stage::Deferred) {
                op.stage = Stage::Checking;
                list.push(crate::plan::DeferredWrite {
                    id: id as u64,
                    remote_addr: op.wr.remote_addr,
                    len: op.len,
                    rkey: op.wr.rkey,
                });
                members.push(id);
            }
        }
    }
    let mut failed = Vec::new();
    let mut batches = 0;
    let mut chain = Vec::new();
    for b in crate::plan::batch_readbacks(&list, qp.slot_size as u64) {
        let ids: Vec<u32> = members[b.members.clone()].to_vec();
        let scratch = if b.len as usize <= qp.slot_size && !qp.scratch_free.is_empty() {
            qp.scratch_free.pop().map(Scratch::Slot)
        } else {
            sh.nic
                .alloc_buf(b.len as usize + PS as usize, Access::LOCAL_WRITE)
                .ok()
                .map(Scratch::Own)
        };
        let Some(scratch) = scratch else {
            failed.extend(ids);
            continue;
        };
        let (_, skey) = qp.scratch_addr(&scratch);
        let saddr = qp.readback_addr(&scratch, b.remote_addr);
        let Ok(bid) = qp.batches.insert(RbBatch {
            remote_addr: b.remote_addr,
            members: ids.clone(),
            scratch: None,
        }) else {
            qp.release_scratch(Some(scratch));
            failed.extend(ids);
            continue;
        };
        if let Some(bt) = qp.batches.get_mut(bid) {
            bt.scratch = Some(scratch);
        }
        let sge = [Sge {
            addr: saddr,
            length: b.len as u32,
            lkey: skey,
        }];
        chain.push((bid, sge, b.remote_addr, b.rkey));
    }
    // All read-backs go to the NIC as one chain (one post, one NIC
    // progress pass); a refused tail is redone two-sided.
    let gen = qp.gen;
    let wrs: Vec<WorkRequest<'_>> = chain
        .iter()
        .map(|(bid, sge, raddr, rkey)| {
            WorkRequest::new(
                WrTag::new(qi, gen, WrKind::Readback, 0, *bid).wr_id(),
                WrOp::Read,
                sge,
            )
            .remote(*raddr, *rkey)
        })
        .collect();
    let posted = match qp.data.post_send(&wrs) {
        Ok(()) => wrs.len(),
        Err(e) => e.bad_index,
    };
    drop(wrs);
    for (bid, ..) in &chain[posted..] {
        if let Some(mut bt) = qp.batches.take(*bid) {
            let s = bt.scratch.take();
            qp.release_scratch(s);
            failed.extend(bt.members);
        }
    }
    batches += posted as u64;
    st.stats.readback_batches += batches;
    // A read-back that could not be posted: redo those WRITEs two-sided.
    for id in failed {
        replay::two_sided(sh, st, qi, id);
    }
}

/// A deferred read-back completed: check each WRITE it covers.
pub(super) fn check_batch<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    bid: u32,
    status: WcStatus,
) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(mut b) = qp.batches.take(bid) else {
        return;
    };
    let scratch = b.scratch.take();
    let saddr = scratch
        .as_ref()
        .map(|s| qp.readback_addr(s, b.remote_addr))
        .unwrap_or(0);
    let mut results = Vec::new();
    let mut stale = Vec::new();
    for &id in &b.members {
        let Some(op) = qp.ops.get_mut(id) else {
            continue;
        };
        if op.stale {
            stale.push(id);
            continue;
        }
        if status != WcStatus::Success {
            results.push((id, Err(status)));
            continue;
        }
        let lmr = op.lmr.clone().expect("WRITE with data");
        let off = op.wr.remote_addr - b.remote_addr;
        let (laddr, len, raddr) = (op.laddr, op.len, op.wr.remote_addr);
        let now = local_versions(&lmr.shadow, laddr, len);
        let ok = now == op.lver
            && now.iter().all(|v| v % 2 == 1)
            && mem::with_slice(saddr + off, len as usize, |rb| {
                mem::with_slice(laddr, len as usize, |src| {
                    check_readback(src, rb, raddr, &sh.check).is_ok()
                })
            });
        results.push((id, Ok((ok, len))));
    }
    qp.release_scratch(scratch);
    for id in stale {
        replay::stale_done(st, qi, id);
    }
    for (id, r) in results {
        match r {
            Err(e) => finish(st, qi, id, e, 0),
            Ok((true, len)) => {
                st.stats.optimistic_ok += 1;
                replay::finish_ok(st, qi, id, len as u32);
            }
            Ok((false, _)) => replay::two_sided(sh, st, qi, id),
        }
    }
}
