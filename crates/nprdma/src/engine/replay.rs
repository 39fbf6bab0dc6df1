//! Engine side of pipelining overlapping one-sided ops (see the ordering
//! module docs, "replay"): telling the ordering table when an op's NIC WRs
//! are out, holding results until earlier conflicting ops are done, and
//! discarding + re-queueing the ops a failed optimistic check replays.

use super::backend::Backend;
use super::op::Stage;
use super::retire::finish;
use super::state::{At, Shared, State};
use super::two_sided::go_two_sided;
use crate::nic::WcStatus;

/// Op `id` of QP `qi` has its NIC WRs posted: ops parked behind it that
/// may pipeline now go to the ready queue.
pub(super) fn on_nic<N: Backend>(st: &mut State<N>, qi: usize, id: u32) {
    let Some(At {
        qp,
        ready,
        released,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    let Some(t) = qp.ops.get(id).and_then(|o| o.ticket) else {
        return;
    };
    released.clear();
    if qp.order.on_nic(t, released).is_ok() {
        ready.extend(released.drain(..).map(|(_, nid)| (qi, nid)));
    }
}

/// If an earlier conflicting op of op `id` is still in flight, park the
/// op's result as `held` (the ordering table hands it back) and say so.
fn hold<N: Backend>(st: &mut State<N>, qi: usize, id: u32, held: Stage) -> bool {
    let Some(qp) = st.qp(qi) else {
        return false;
    };
    let Some(op) = qp.ops.get_mut(id) else {
        return false;
    };
    let Some(t) = op.ticket else { return false };
    if qp.order.must_wait(t) == Ok(true) {
        op.stage = held;
        return true;
    }
    false
}

/// A result of op `id` arrived after a replay made it stale (another
/// member of the same read-back batch failed first): drop it.
fn stale<N: Backend>(st: &mut State<N>, qi: usize, id: u32) -> bool {
    let is = st.op_mut(qi, id).is_some_and(|o| o.stale);
    if is {
        stale_done(st, qi, id);
    }
    is
}

/// Op `id` passed its optimistic check: complete it, or hold it until the
/// earlier ops it overlaps are done (one of them may still fail and
/// replay it).
pub(super) fn finish_ok<N: Backend>(st: &mut State<N>, qi: usize, id: u32, len: u32) {
    if stale(st, qi, id) {
        return;
    }
    if !hold(st, qi, id, Stage::HeldOk(len)) {
        finish(st, qi, id, WcStatus::Success, len);
    }
}

/// Op `id` needs the two-sided path (failed check, or not one-sided): once
/// no earlier conflicting op is in flight, replay every later op issued
/// behind it (transitively) and send it two-sided.
pub(super) fn two_sided<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, id: u32) {
    if stale(st, qi, id) {
        return;
    }
    if hold(st, qi, id, Stage::HeldTwoSided) {
        return;
    }
    let Some(qp) = st.qp(qi) else { return };
    if let Some(t) = qp.ops.get(id).and_then(|o| o.ticket) {
        let mut replay = Vec::new();
        if qp.order.fail(t, &mut replay).is_ok() {
            for (_, rid) in replay {
                discard(st, qi, rid);
            }
        }
    }
    go_two_sided(sh, st, qi, id);
}

/// Forget what replayed op `id` did so far: it waits (parked in the
/// ordering table) to be started afresh. NIC WRs or a read-back still out
/// mark it stale: their completion is dropped ([`stale_done`]).
fn discard<N: Backend>(st: &mut State<N>, qi: usize, id: u32) {
    st.stats.replayed += 1;
    st.ready.retain(|&(q, i)| !(q == qi && i == id));
    let Some(qp) = st.qp(qi) else {
        return;
    };
    qp.key_wait.retain(|x| *x != id);
    qp.deferred.retain(|x| *x != id);
    let Some(op) = qp.ops.get_mut(id) else { return };
    op.restart = false;
    tracing::debug!(qi, id, "replaying an op pipelined behind a failed check");
    if matches!(op.stage, Stage::OneSided { .. } | Stage::Checking) {
        op.stale = true;
        return;
    }
    op.stage = Stage::Queued;
    let s = op.scratch.take();
    qp.release_scratch(s);
}

/// The NIC is done with stale op `id`'s old WRs (or read-back): drop the
/// result; start it again if the ordering table re-issued it meanwhile.
pub(super) fn stale_done<N: Backend>(st: &mut State<N>, qi: usize, id: u32) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    op.stale = false;
    op.stage = Stage::Queued;
    let restart = std::mem::take(&mut op.restart);
    let s = op.scratch.take();
    qp.release_scratch(s);
    if restart {
        st.ready.push_back((qi, id));
    }
}
