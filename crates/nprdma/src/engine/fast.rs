//! The lean path of a QP with nothing else outstanding: a signaled
//! optimistic READ or WRITE (magic check, read-back or page versions) is posted
//! straight to the NIC and completed straight into the application CQ,
//! without the ordering table, reorder buffer or pending table — with
//! nothing else in flight on the QP all three are trivially satisfied. As
//! soon as anything else happens on the QP (another post, an error, a failed
//! check, a flush) the operation is *promoted* ([`QpState::promote_fast`]):
//! it enters those structures exactly as if it had been posted through the
//! general path, and the general path takes over.

use super::backend::Backend;
use super::one_sided::eval_one_sided;
use super::op::{
    comp_op, local_versions, prefill_before, versions_pass, versions_unchanged, FastOp, Scratch,
    VersionsAt,
};
use super::qp::QpState;
use super::retire::fail_qp;
use super::state::{At, Shared, State};
use super::types::{SendWr, PS};
use super::wrid::{WrKind, WrTag};
use crate::check::{check_read, check_readback, precheck_local};
use crate::mem;
use crate::nic::{Access, Completion, NicQp as _, Sge, WcStatus, WorkRequest};
use crate::plan::{choose, nic_steps_small, probes_first, AppOp, LocalBuf, Strategy};

/// Post `wr` on the lean path if QP `qi` is idle and `wr` qualifies;
/// `false` (nothing done) sends it down the general path.
#[inline]
pub(super) fn try_post<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    gen: u8,
    wr: &SendWr,
) -> bool {
    if !wr.signaled {
        return false;
    }
    let Some(At { qp, mrs, stats, .. }) = st.at_gen(qi, gen) else {
        return false;
    };
    if qp.errored
        || qp.dead
        || !qp.connected
        || qp.fast.is_some()
        || !qp.ops.is_empty()
        || !qp.order.is_idle()
        || !qp.deferred.is_empty()
        || !qp.key_wait.is_empty()
        || qp.rob.outstanding() != 0
    {
        return false;
    }
    let Some(sge) = wr.sge else { return false };
    let (laddr, len) = (sge.addr, sge.length as u64);
    if len == 0 || len > i32::MAX as u64 {
        return false;
    }
    if qp.probe_hint && probes_first(wr.op, len, &sh.cfg.plan) {
        // A large READ of a QP whose last large READ met a page out: the
        // general path probes the versions first.
        return false;
    }
    let strat = choose(wr.op, len, true, &sh.cfg.plan);
    let need = match (wr.op, strat) {
        (AppOp::Read, Strategy::ReadMagic) => 0,
        (AppOp::Write, Strategy::WriteReadback { deferred: false }) => len,
        (AppOp::Read, Strategy::ReadVersioned) | (AppOp::Write, Strategy::WriteVersioned) => {
            // Both version snapshots in one scratch slot.
            2 * len.div_ceil(PS).saturating_add(1) * crate::keymap::VERSION_WORD
        }
        _ => return false,
    };
    if need > 0 && (need as usize > qp.slot_size || qp.scratch_free.is_empty()) {
        return false;
    }
    let Some(lmr) = mrs.get(&sge.lkey) else {
        return false;
    };
    if lmr.pd() != qp.pd
        || !lmr.contains(laddr, len)
        || (wr.op == AppOp::Read && !lmr.access().contains(Access::LOCAL_WRITE))
    {
        return false;
    }
    let Ok(t) = qp.peer.lookup(wr.rkey, wr.remote_addr, len) else {
        return false;
    };
    if t.version_rkey == 0 {
        // A peer in user-space mode: two-sided only (the ordinary path).
        return false;
    }
    if precheck_local(laddr, len, PS as usize, |p| lmr.shadow.is_mapped(p)).is_err() {
        return false;
    }
    let lmr = lmr.clone();
    let scratch = if need > 0 {
        qp.scratch_free.pop().map(Scratch::Slot)
    } else {
        None
    };
    let vlen = t.version_len;
    let (saddr, skey) = scratch
        .as_ref()
        .map(|s| qp.scratch_addr(s))
        .unwrap_or((0, 0));
    let mut steps = nic_steps_small(strat, wr.remote_addr, len, &t);
    let ver = VersionsAt::of(&t);
    if matches!(strat, Strategy::WriteVersioned | Strategy::ReadVersioned)
        && prefill_before(&qp.peer_versions, ver, vlen, saddr)
    {
        // The "before" READ is the first step.
        steps.remove(0);
        stats.versions_seen += 1;
    }
    let mut sges = [[Sge::default(); 1]; 3];
    for (s, g) in steps.iter().zip(sges.iter_mut()) {
        let (addr, length, lkey) = match s.local {
            LocalBuf::AppRead => (laddr, len, lmr.read_lkey()),
            LocalBuf::AppWrite => (laddr, len, lmr.write_lkey()),
            LocalBuf::Temp => (saddr + (wr.remote_addr & (PS - 1)), len, skey),
            LocalBuf::VersionsBefore => (saddr, vlen, skey),
            LocalBuf::VersionsAfter => (saddr + vlen, vlen, skey),
        };
        g[0] = Sge {
            addr,
            length: length as u32,
            lkey,
        };
    }
    let n = steps.len();
    let last = n - 1;
    let mk = |k: usize| {
        let s = &steps[k];
        WorkRequest::new(
            WrTag::new(qi, gen, WrKind::Fast, k as u8, 0).wr_id(),
            s.op,
            &sges[k],
        )
        .remote(s.remote_addr, s.rkey)
        .signaled(k == last)
    };
    let lver = local_versions(&lmr.shadow, laddr, len);
    let res = match n {
        1 => qp.data.post_send(&[mk(0)]),
        2 => qp.data.post_send(&[mk(0), mk(1)]),
        _ => qp.data.post_send(&[mk(0), mk(1), mk(2)]),
    };
    let posted = match res {
        Ok(()) => n,
        Err(e) => {
            tracing::debug!(error = %e.source, "data QP post failed");
            e.bad_index
        }
    };
    if posted == 0 {
        // Nothing went out: the general path posts (and reports) it.
        qp.release_scratch(scratch);
        return false;
    }
    qp.fast_promoted = None;
    qp.fast = Some(FastOp {
        wr: *wr,
        laddr,
        len,
        lmr,
        strat,
        steps: posted as u8,
        left: posted as u8,
        err: WcStatus::Success,
        vlen,
        ver,
        scratch,
        lver,
    });
    if posted < n {
        // As in `post_steps`: unsignaled WRs without their signaled last
        // one; the QP fails (every operation completes, flushed).
        tracing::error!(posted, "partial post of an operation's NIC WRs");
        qp.promote_fast();
        fail_qp(st, qi, WcStatus::WrFlushErr);
    }
    true
}

/// A NIC completion of a lean-path WR (step `step`). Returns the pending
/// id to handle it as a general one-sided completion when the operation
/// has been promoted meanwhile.
pub(super) fn on_wc<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    step: u8,
    wc: &Completion,
) -> Option<u32> {
    let At {
        qp, direct, stats, ..
    } = st.at(qi)?;
    let Some(f) = qp.fast.as_mut() else {
        return qp.fast_promoted;
    };
    let behind = (f.steps as u64).saturating_sub(u64::from(step) + 1) as u8;
    f.left = f.left.min(behind);
    let status = WcStatus::from_code(wc.status);
    if status != WcStatus::Success && f.err == WcStatus::Success {
        f.err = status;
    }
    if f.left > 0 {
        return None;
    }
    crate::trace::mark(crate::trace::Step::IOptDone);
    let err = f.err;
    if err == WcStatus::Success && passes(sh, qp) {
        // What the completion needs, then the operation dropped in place (not
        // moved out: it is a few hundred bytes).
        let (wr_id, op, len, scratch) = {
            let f = qp.fast.as_mut().expect("checked above");
            (f.wr.wr_id, f.wr.op, f.len, f.scratch.take())
        };
        qp.fast = None;
        qp.release_scratch(scratch);
        let c = Completion {
            wr_id,
            status: 0,
            op: comp_op(op),
            byte_len: len as u32,
            imm: None,
            qp_num: qp.qpn,
        };
        if !direct.offer(&qp.send_cq, c) && !qp.send_cq.push(c) {
            // CQ overrun: the QP moves to ERR (later completions flush).
            qp.errored = true;
        }
        stats.optimistic_ok += 1;
        return None;
    }
    // An error or a failed check: the general path decides (two-sided).
    qp.promote_fast();
    let id = qp.fast_promoted?;
    eval_one_sided(sh, st, qi, id);
    None
}

/// The optimistic check of a finished lean-path operation (the same as
/// `eval_one_sided`'s): local page versions unchanged and odd, then the
/// magic check of a READ or the read-back comparison of a WRITE.
fn passes<N: Backend>(sh: &Shared<N>, qp: &mut QpState<N>) -> bool {
    let Some(f) = qp.fast.as_ref() else {
        return false;
    };
    if !versions_unchanged(&f.lmr.shadow, f.laddr, f.len, &f.lver) {
        return false;
    }
    let (laddr, len, raddr) = (f.laddr, f.len as usize, f.wr.remote_addr);
    match f.strat {
        Strategy::ReadMagic => mem::with_slice(laddr, len, |d| {
            check_read(d, laddr, raddr, &sh.check).is_ok()
        }),
        Strategy::WriteReadback { .. } => {
            let Some(s) = f.scratch.as_ref() else {
                return false;
            };
            let sa = qp.readback_addr(s, raddr);
            mem::with_slice(sa, len, |rb| {
                mem::with_slice(laddr, len, |src| {
                    check_readback(src, rb, raddr, &sh.check).is_ok()
                })
            })
        }
        Strategy::ReadVersioned | Strategy::WriteVersioned => {
            let Some(s) = f.scratch.as_ref() else {
                return false;
            };
            let (ver, vlen) = (f.ver, f.vlen);
            let (sa, _) = qp.scratch_addr(s);
            versions_pass(&mut qp.peer_versions, ver, sa, vlen)
        }
        _ => false,
    }
}
