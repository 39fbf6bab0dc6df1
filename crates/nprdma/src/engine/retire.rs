//! The one exit of an operation ([`finish`]) and of a QP's work: failing a
//! QP whose peer vanished ([`fail_qp`]), moving it to ERR ([`set_error`])
//! and destroying it ([`destroy_qp`]).

use super::backend::Backend;
use super::op::comp_op;
use super::qp::QpState;
use super::state::{At, Shared, State};
use super::types::Error;
use crate::nic::{Completion, NicQp as _, WcStatus};
use crate::trace::{mark, Step};

/// Complete application operation `id` of QP `qi` and release what waits
/// behind it.
pub(super) fn finish<N: Backend>(
    st: &mut State<N>,
    qi: usize,
    id: u32,
    status: WcStatus,
    byte_len: u32,
) {
    let Some(At {
        qp,
        ready,
        released,
        ..
    }) = st.at(qi)
    else {
        return;
    };
    // What the completion needs; the op itself is dropped in place at the
    // end (it is a few hundred bytes: not moved out).
    let Some(op) = qp.ops.get_mut(id) else {
        return;
    };
    let s = op.scratch.take();
    let (wr_id, wr_op, len, seq, ticket) = (op.wr.wr_id, op.wr.op, op.len, op.seq, op.ticket);
    // Nothing of the responder's comes back on an unreliable connection: the WR
    // completes as sent.
    let (status, byte_len) = if qp.unreliable && status.is_remote() {
        (WcStatus::Success, len as u32)
    } else {
        (status, byte_len)
    };
    qp.release_scratch(s);
    qp.key_wait.retain(|x| *x != id);
    let c = Completion {
        wr_id,
        status: status.code(),
        op: comp_op(wr_op),
        byte_len: if status == WcStatus::Success {
            byte_len
        } else {
            0
        },
        imm: None,
        qp_num: qp.qpn,
    };
    if let Err(e) = qp.rob.finish(seq, status == WcStatus::Success, c) {
        tracing::error!(error = %e, "reorder buffer");
    }
    qp.deliver();
    mark(Step::IDone);
    if let Some(t) = ticket {
        released.clear();
        if qp.order.complete_into(t, released).is_ok() {
            ready.extend(released.drain(..).map(|(_, nid)| (qi, nid)));
        }
    }
    qp.ops.remove(id);
}

/// The QP fails (its peer is gone, or its NIC work broke): every
/// outstanding operation completes with an error — the oldest with `first`
/// (RETRY_EXC_ERR for a vanished peer), the rest WR_FLUSH_ERR.
pub(super) fn fail_qp<N: Backend>(st: &mut State<N>, qi: usize, first: WcStatus) {
    let Some(qp) = st.qp(qi) else { return };
    qp.dead = true;
    qp.flush_ops_after(first);
    for (_, t) in qp.treqs.drain() {
        drop(t);
    }
}

/// Destroy QP `qi`: NIC QPs to ERR, every outstanding WR and RECV completes
/// with WR_FLUSH_ERR, pins drop. Returns the state to drop outside the lock.
pub(crate) fn destroy_qp<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    gen: u8,
) -> Option<QpState<N>> {
    if st.gens.get(qi) != Some(&gen) {
        return None;
    }
    let mut qp = st.qps.get_mut(qi)?.take()?;
    st.gens[qi] = st.gens[qi].wrapping_add(1);
    st.ready.retain(|(q, _)| *q != qi);
    let _ = qp.data.set_error();
    if let Some(c) = &qp.ctrl {
        let _ = c.set_error();
    }
    qp.flush_ops();
    qp.flush_recvs();
    drop(qp.treqs.drain());
    // What the peer was lent through this QP closes with it.
    sh.leases.drop_qp(qi);
    Some(qp)
}

/// Move QP `qi` to ERR (`ibv_modify_qp(IBV_QPS_ERR)`): the NIC data and
/// control QPs go to ERR (the peer's requests to this QP fail at its NIC
/// and its outstanding operations complete with an error), every
/// outstanding WR — issued, parked in the ordering table, waiting for keys,
/// two-sided or with a deferred read-back — and every posted RECV completes
/// once with WR_FLUSH_ERR in post order, and pins drop. Later posts are
/// accepted and flushed (rdma-core semantics). Idempotent.
pub(crate) fn set_error<N: Backend>(st: &mut State<N>, qi: usize, gen: u8) -> Result<(), Error> {
    if st.gens.get(qi) != Some(&gen) {
        return Err(Error::QpState);
    }
    st.ready.retain(|(q, _)| *q != qi);
    st.flush_qps.retain(|q| *q != qi);
    let qp = st.qp(qi).ok_or(Error::QpState)?;
    // Done already (this call, or a failure plus RC's error rule). A QP errored only
    // by the error rule still has operations out and NIC QPs up: move them to ERR and
    // flush what is outstanding now.
    if qp.errored && qp.dead {
        return Ok(());
    }
    if let Err(e) = qp.data.set_error() {
        tracing::warn!(error = %e, "data QP to ERR");
    }
    if let Some(Err(e)) = qp.ctrl.as_ref().map(|c| c.set_error()) {
        tracing::warn!(error = %e, "control QP to ERR");
    }
    qp.errored = true;
    qp.dead = true;
    qp.flush_ops();
    qp.flush_recvs();
    qp.inbound.clear();
    qp.backlog.clear();
    qp.rdv_busy = false;
    drop(qp.treqs.drain());
    Ok(())
}
