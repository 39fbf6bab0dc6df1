//! Responder semantics shared by both data paths: checks the target QP and rkey exactly
//! as the target NIC would, moves a target QP to ERR (flushing its RQ), delivers
//! SEND / WRITE_WITH_IMM into posted receives, and serves request-ring slots (run by
//! the target's NIC thread).

use crate::hw::dma::{self, check_key, AtomicOp, DmaErr, MrView, Port, Side, Span};
use crate::hw::peer::Peer;
use crate::hw::scratch::{scratch_slot, Scratch};
use crate::hw::segment::{self, shm_lock, QpRec, Segment, ShmGuard};
use crate::nic::cq_ring;
use crate::nic::inbound::{window, Blocked, Inbound, RecvSge, RingServer};
use crate::verbs::{grh, Access, HostAddr, QpState, Wc, WcFlags, WcOpcode, WcStatus, GRH_LEN, PORT_MTU};
use std::sync::atomic::Ordering;

scratch_slot!(RECV_SPANS: Span);

/// The spans a receive WQE's SGEs give (empty ones skipped), each checked against
/// PD `pd` for LOCAL_WRITE, and their total length; `Err` at the first SGE that
/// fails its check.
fn wqe_spans(seg: &Segment, pd: u32, sges: &[segment::SgeRec]) -> Result<(Scratch<Span>, u64), ()> {
    let mut spans = Scratch::take(&RECV_SPANS);
    let mut total = 0u64;
    for s in sges {
        let (a, l, k) = (
            s.addr.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed) as u64,
            s.lkey.load(Ordering::Relaxed),
        );
        if l == 0 {
            continue;
        }
        let mr = check_key(seg, k, pd, None, a, l, Access::LOCAL_WRITE).map_err(|_| ())?;
        spans.push(Span { mr, addr: a, len: l });
        total += l;
    }
    Ok((spans, total))
}

/// The receive queue QP `r` (table index `idx`) takes its receives from: its own, or
/// its shared receive queue's — (index, record, the SRQ's lock, taken). The caller
/// holds `r.rq_lock`, which covers the QP's own queue; an SRQ's lock is taken after
/// it (QP before SRQ, always).
fn lock_rq_of<'a>(seg: &'a Segment, idx: u32, r: &'a QpRec) -> (u32, &'a QpRec, Option<ShmGuard<'a>>) {
    let srq = match r.srq.load(Ordering::Acquire) {
        0 => None,
        s => seg
            .qp(s - 1)
            .filter(|q| q.in_use.load(Ordering::Acquire) == segment::SRQ_IN_USE)
            .map(|q| (s - 1, q)),
    };
    match srq {
        Some((i, q)) => (i, q, Some(shm_lock(&q.rq_lock))),
        None => (idx, r, None),
    }
}

/// Result of delivering a message that needs a receive WQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    Done(WcStatus),
    /// Receiver not ready: the responder's min_rnr_timer.
    Rnr(u32),
}

/// The target QP record if it accepts packets from (src_nonce, src_qpn).
pub(crate) fn target_qp(seg: &Segment, idx: u32, qpn: u32, src_nonce: u64, src_qpn: u32) -> Option<&QpRec> {
    let r = seg.qp(idx)?;
    if r.in_use.load(Ordering::Acquire) != 1 || r.qpn.load(Ordering::Acquire) != qpn {
        return None;
    }
    let st = QpState::from_u32(r.state.load(Ordering::Acquire));
    if st != QpState::Rtr && st != QpState::Rts {
        return None;
    }
    if r.peer_nonce.load(Ordering::Acquire) != src_nonce || r.peer_qpn.load(Ordering::Acquire) != src_qpn {
        return None;
    }
    Some(r)
}

/// Flush every posted receive of QP `idx` with WR_FLUSH_ERR (RQ lock held by caller).
pub(crate) fn flush_rq_locked(seg: &Segment, via: &Peer, idx: u32, r: &QpRec) {
    let qpn = r.qpn.load(Ordering::Relaxed);
    let cqi = r.recv_cq.load(Ordering::Relaxed);
    let tail = r.rq_tail.load(Ordering::Acquire);
    let mut head = r.rq_head.load(Ordering::Acquire);
    while head < tail {
        let (w, _) = seg.wqe(idx, head);
        let wc = Wc {
            wr_id: w.wr_id.load(Ordering::Relaxed),
            status: WcStatus::WrFlushErr,
            opcode: WcOpcode::Recv,
            qp_num: qpn,
            ..Default::default()
        };
        let _ = cq_ring::push(seg, via, cqi, &wc, false);
        head += 1;
        r.rq_head.store(head, Ordering::Release);
    }
}

/// Append receive WQEs to the receive queue at table index `idx` (a QP's own or an
/// SRQ's; its RQ lock held by the caller), at most `depth` outstanding and
/// `max_sge` SGEs each. Err(i, what) = WR `i` and those after it were not posted.
pub(crate) fn post_wqes(
    seg: &Segment,
    idx: u32,
    rq: &QpRec,
    depth: u32,
    max_sge: u32,
    wrs: &[crate::verbs::RecvWr],
) -> Result<(), (usize, crate::error::Error)> {
    use crate::error::Error;
    for (i, wr) in wrs.iter().enumerate() {
        if wr.sg_list.len() > max_sge as usize {
            return Err((i, Error::InvalidArgument("too many SGEs")));
        }
        let tail = rq.rq_tail.load(Ordering::Acquire);
        if tail - rq.rq_head.load(Ordering::Acquire) >= depth as u64 {
            return Err((i, Error::QueueFull("receive queue")));
        }
        let (w, sges) = seg.wqe(idx, tail);
        w.wr_id.store(wr.wr_id, Ordering::Relaxed);
        w.nsge.store(wr.sg_list.len() as u32, Ordering::Relaxed);
        for (d, s) in sges.iter().zip(wr.sg_list) {
            d.addr.store(s.addr, Ordering::Relaxed);
            d.len.store(s.length, Ordering::Relaxed);
            d.lkey.store(s.lkey, Ordering::Relaxed);
        }
        rq.rq_tail.store(tail + 1, Ordering::Release);
    }
    Ok(())
}

/// Move QP `idx` of `seg` to ERR and flush its receive queue.
pub(crate) fn qp_error(seg: &Segment, via: &Peer, idx: u32) {
    let Some(r) = seg.qp(idx) else { return };
    let _g = shm_lock(&r.rq_lock);
    qp_error_locked(seg, via, idx, r);
}

fn qp_error_locked(seg: &Segment, via: &Peer, idx: u32, r: &QpRec) {
    let st = QpState::from_u32(r.state.load(Ordering::Acquire));
    if st == QpState::Reset {
        return;
    }
    r.state.store(QpState::Err as u32, Ordering::Release);
    flush_rq_locked(seg, via, idx, r);
    // Let the owner's NIC thread flush the owner's send queue.
    seg.kick();
}

/// Responder check of an RDMA access: QP access flags (waived for an
/// [`Access::ANY_QP`] MR), alignment, rkey.
pub(crate) fn remote_check(
    seg: &Segment,
    r: &QpRec,
    rkey: u32,
    addr: u64,
    len: u64,
    need: Access,
) -> Result<MrView, WcStatus> {
    let qacc = Access::from_bits_truncate(r.access.load(Ordering::Acquire));
    if !qacc.contains(need) && !crate::hw::dma::key_any_qp(seg, rkey) {
        return Err(WcStatus::RemInvReqErr);
    }
    if need == Access::REMOTE_ATOMIC && (addr % 8 != 0 || len != 8) {
        return Err(WcStatus::RemInvReqErr);
    }
    if len > 1 << 31 {
        return Err(WcStatus::RemInvReqErr);
    }
    if len == 0 {
        return Ok(dma::passthrough(addr, 0).mr);
    }
    let (pd, domain) = (r.pd.load(Ordering::Relaxed), r.domain.load(Ordering::Relaxed));
    check_key(seg, rkey, pd, Some(domain), addr, len, need).map_err(|_| WcStatus::RemAccessErr)
}

/// Whether QP `r` is unreliable-connected: its responder drops a message it refuses
/// (the receive stays posted, the QP stays up, the requester never hears of it).
pub(crate) fn drops_refused(r: &QpRec) -> bool {
    r.unreliable.load(Ordering::Relaxed) != 0
}

/// The receive WQE at `head` of QP `idx` cannot take a message: it completes with
/// `wc` (an error) and the QP fails (RQ lock held by the caller) — on RC; a UC
/// responder drops the message and keeps the WQE.
fn refuse_recv(seg: &Segment, via: &Peer, idx: u32, r: &QpRec, rq: Option<(&QpRec, u64)>, wc: &Wc) {
    if drops_refused(r) {
        return;
    }
    if let Some((rq, head)) = rq {
        rq.rq_head.store(head + 1, Ordering::Release);
    }
    let _ = cq_ring::push(seg, via, r.recv_cq.load(Ordering::Relaxed), wc, false);
    qp_error_locked(seg, via, idx, r);
}

/// What the initiator sends for a message that consumes a receive WQE.
pub(crate) struct Message<'a> {
    pub src: Side<'a>,
    pub len: u64,
    /// The receive completion's byte_len (the whole message; for the last part of a
    /// WRITE_WITH_IMM sent in parts, more than `len`).
    pub wc_len: u64,
    pub imm: Option<u32>,
    /// For WRITE_WITH_IMM: the RDMA target (rkey, remote address).
    pub write_to: Option<(u32, u64)>,
    pub src_qpn: u32,
    pub solicited: bool,
    pub section: usize,
}

/// Deliver a SEND / SEND_WITH_IMM / WRITE_WITH_IMM into target QP `idx` of `peer`.
/// The returned status is the requester's.
pub(crate) fn deliver(peer: &Peer, idx: u32, r: &QpRec, m: &Message) -> Delivery {
    let seg = &*peer.seg;
    let _g = shm_lock(&r.rq_lock);
    let st = QpState::from_u32(r.state.load(Ordering::Acquire));
    if st != QpState::Rtr && st != QpState::Rts {
        return Delivery::Done(WcStatus::RetryExcErr);
    }
    let (qi, rq, _srq) = lock_rq_of(seg, idx, r);
    let head = rq.rq_head.load(Ordering::Acquire);
    if head >= rq.rq_tail.load(Ordering::Acquire) {
        return Delivery::Rnr(r.min_rnr_timer.load(Ordering::Relaxed));
    }
    let qpn = r.qpn.load(Ordering::Relaxed);
    // Receive buffers are checked against the PD of the queue they were posted to.
    let pd = rq.pd.load(Ordering::Relaxed);
    let cqi = r.recv_cq.load(Ordering::Relaxed);
    let (w, sges) = seg.wqe(qi, head);
    let wr_id = w.wr_id.load(Ordering::Relaxed);
    let mut recv_wc = Wc {
        wr_id,
        qp_num: qpn,
        src_qp: m.src_qpn,
        opcode: WcOpcode::Recv,
        ..Default::default()
    };
    let fail = |recv_status: WcStatus, req: WcStatus, wc: &mut Wc| {
        wc.status = recv_status;
        refuse_recv(seg, peer, idx, r, Some((rq, head)), wc);
        Delivery::Done(req)
    };
    let result = if let Some((rkey, raddr)) = m.write_to {
        recv_wc.opcode = WcOpcode::RecvRdmaWithImm;
        let mr = match remote_check(seg, r, rkey, raddr, m.len, Access::REMOTE_WRITE) {
            Ok(mr) => mr,
            Err(s) => {
                // The receive WQE is not consumed by a NAKed (on UC: dropped) write.
                if !drops_refused(r) {
                    qp_error_locked(seg, peer, idx, r);
                }
                return Delivery::Done(s);
            }
        };
        let spans = [Span {
            mr,
            addr: raddr,
            len: m.len,
        }];
        let dst = Side {
            seg,
            port: peer.port,
            spans: &spans,
        };
        dma::copy(&m.src, &dst, m.len, m.section)
    } else {
        let n = (w.nsge.load(Ordering::Relaxed) as usize).min(sges.len());
        let Ok((spans, total)) = wqe_spans(seg, pd, &sges[..n]) else {
            return fail(WcStatus::LocProtErr, WcStatus::RemOpErr, &mut recv_wc);
        };
        if total < m.len {
            return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr, &mut recv_wc);
        }
        let dst = Side {
            seg,
            port: peer.port,
            spans: &spans,
        };
        dma::copy(&m.src, &dst, m.len, m.section)
    };
    match result {
        Ok(_) => {}
        Err(DmaErr::Src(_)) => return Delivery::Done(WcStatus::LocProtErr),
        Err(_) => {
            let s = if m.write_to.is_some() {
                WcStatus::RemAccessErr
            } else {
                WcStatus::RemOpErr
            };
            return fail(WcStatus::LocProtErr, s, &mut recv_wc);
        }
    }
    recv_wc.byte_len = m.wc_len as u32;
    if let Some(i) = m.imm {
        recv_wc.imm_data = i;
        recv_wc.wc_flags = WcFlags::WITH_IMM;
    }
    rq.rq_head.store(head + 1, Ordering::Release);
    if cq_ring::push(seg, peer, cqi, &recv_wc, m.solicited).is_err() {
        qp_error_locked(seg, peer, idx, r);
    }
    Delivery::Done(WcStatus::Success)
}

/// A UD datagram as the responder receives it.
pub(crate) struct Datagram<'a> {
    /// The GRH then the payload.
    pub src: Side<'a>,
    /// Bytes of `src` (the GRH included): the receive's byte_len.
    pub len: u64,
    pub imm: Option<u32>,
    pub src_qpn: u32,
    /// The destination QP number it carries.
    pub qpn: u32,
    /// The Q_Key it presents.
    pub qkey: u32,
    pub solicited: bool,
    pub section: usize,
}

/// Deliver a datagram into UD QP `idx` of `peer`'s host. As rxe's responder: one for
/// a QP that is not that UD QP in RTR/RTS, presenting another Q_Key, finding no
/// receive or one too small (on a shared queue that receive completes with
/// REM_INV_REQ_ERR) is dropped; a receive whose buffers fail their lkey check
/// completes with LOC_PROT_ERR and the QP fails. The receive gets `d.src` (GRH first),
/// its completion src_qp, the GRH flag and the immediate. The returned status is the
/// requester's: LOC_PROT_ERR if its own gather list failed mid-copy, else success.
pub(crate) fn deliver_ud(peer: &Peer, idx: u32, d: &Datagram) -> WcStatus {
    let seg = &*peer.seg;
    let Some(r) = seg.qp(idx) else {
        return WcStatus::Success;
    };
    let _g = shm_lock(&r.rq_lock);
    let st = QpState::from_u32(r.state.load(Ordering::Acquire));
    if r.in_use.load(Ordering::Acquire) != 1
        || r.qpn.load(Ordering::Acquire) != d.qpn
        || r.unreliable.load(Ordering::Acquire) != segment::QP_UD
        || !matches!(st, QpState::Rtr | QpState::Rts)
        || r.qkey.load(Ordering::Acquire) != d.qkey
    {
        return WcStatus::Success;
    }
    let (qi, rq, srq) = lock_rq_of(seg, idx, r);
    let head = rq.rq_head.load(Ordering::Acquire);
    if head >= rq.rq_tail.load(Ordering::Acquire) {
        return WcStatus::Success;
    }
    let pd = rq.pd.load(Ordering::Relaxed);
    let cqi = r.recv_cq.load(Ordering::Relaxed);
    let (w, sges) = seg.wqe(qi, head);
    let mut wc = Wc {
        wr_id: w.wr_id.load(Ordering::Relaxed),
        qp_num: d.qpn,
        src_qp: d.src_qpn,
        opcode: WcOpcode::Recv,
        ..Default::default()
    };
    // The receive completes with `status` (consumed); LOC_PROT_ERR also fails the QP.
    let fail = |wc: &mut Wc, status: WcStatus| {
        wc.status = status;
        rq.rq_head.store(head + 1, Ordering::Release);
        let _ = cq_ring::push(seg, peer, cqi, wc, false);
        if status == WcStatus::LocProtErr {
            qp_error_locked(seg, peer, idx, r);
        }
        WcStatus::Success
    };
    let n = (w.nsge.load(Ordering::Relaxed) as usize).min(sges.len());
    let Ok((spans, total)) = wqe_spans(seg, pd, &sges[..n]) else {
        return fail(&mut wc, WcStatus::LocProtErr);
    };
    if total < d.len {
        // rxe: class D (dropped, the receive stays) on the QP's own queue, class E
        // (the receive completes REM_INV_REQ_ERR) on a shared one.
        if srq.is_some() {
            return fail(&mut wc, WcStatus::RemInvReqErr);
        }
        return WcStatus::Success;
    }
    let dst = Side {
        seg,
        port: peer.port,
        spans: &spans,
    };
    match dma::copy(&d.src, &dst, d.len, d.section) {
        Ok(_) => {}
        Err(DmaErr::Src(_)) => return WcStatus::LocProtErr,
        Err(_) => return fail(&mut wc, WcStatus::LocProtErr),
    }
    wc.byte_len = d.len as u32;
    wc.wc_flags = WcFlags::GRH;
    if let Some(i) = d.imm {
        wc.imm_data = i;
        wc.wc_flags |= WcFlags::WITH_IMM;
    }
    rq.rq_head.store(head + 1, Ordering::Release);
    if cq_ring::push(seg, peer, cqi, &wc, d.solicited).is_err() {
        qp_error_locked(seg, peer, idx, r);
    }
    WcStatus::Success
}

/// Serve the datagrams waiting in UD QP `idx`'s request ring (this host is `own`),
/// oldest claim first; each slot is freed once served (nothing is answered). Every
/// field is a peer's word, read once; `deliver_ud` checks the QP, Q_Key and receive.
/// Returns whether there was any.
fn serve_ud(seg: &Segment, me: &Peer, own: &HostAddr, idx: u32, section: usize) -> bool {
    let slots = seg.p.ring_slots as u64;
    let mut reqs: Vec<(u64, u64)> = (0..slots)
        .filter_map(|s| {
            let h = seg.slot(idx, s).0;
            (h.state.load(Ordering::Acquire) == segment::SLOT_REQ).then(|| (h.swp.load(Ordering::Relaxed), s))
        })
        .collect();
    if reqs.is_empty() {
        return false;
    }
    reqs.sort_unstable();
    for (_, s) in reqs {
        let (h, data) = seg.slot(idx, s);
        let op = h.op.load(Ordering::Relaxed);
        let len = h.len.load(Ordering::Relaxed) as u64;
        let raddr = h.raddr.load(Ordering::Relaxed);
        let cmp = h.cmp.load(Ordering::Relaxed);
        if op & segment::RING_OP_MASK == segment::RING_UD && len <= seg.p.ring_max as u64 && len <= PORT_MTU as u64 {
            let imm = (op & segment::RING_F_IMM != 0).then_some(cmp as u32);
            let sgid = HostAddr {
                pid: (raddr >> 32) as u32,
                fd: raddr as u32,
                nonce: h.src_nonce.load(Ordering::Relaxed),
            };
            let g = grh(&sgid, own, len as u32, imm.is_some());
            let src = [
                dma::passthrough(g.as_ptr() as u64, GRH_LEN as u64),
                dma::passthrough(data as u64, len),
            ];
            let d = Datagram {
                src: Side {
                    seg,
                    port: Port::Local,
                    spans: &src,
                },
                len: GRH_LEN as u64 + len,
                imm,
                src_qpn: h.src_qpn.load(Ordering::Relaxed),
                qpn: (cmp >> 32) as u32,
                qkey: h.rkey.load(Ordering::Relaxed),
                solicited: op & segment::RING_F_SOLICITED != 0,
                section,
            };
            // Check and copy inside one epoch section (a deregistered receive buffer
            // is refused, one being deregistered waits for the copy).
            let _g = crate::hw::iommu::enter(seg);
            deliver_ud(me, idx, &d);
        }
        h.state.store(segment::SLOT_FREE, Ordering::Release);
        seg.stats().ring_requests.fetch_add(1, Ordering::Relaxed);
    }
    true
}

/// Execute an atomic on target memory of *this* process (in-process initiator or the
/// target's NIC thread). Returns (status, original value).
pub(crate) fn atomic_here(seg: &Segment, r: &QpRec, rkey: u32, addr: u64, op: AtomicOp) -> (WcStatus, u64) {
    // Check and execute inside one epoch section: a deregistration (or a held DMA,
    // `Iommu::hold_dma`) that returned before it is seen, one after it waits for it.
    let _g = crate::hw::iommu::enter(seg);
    let mr = match remote_check(seg, r, rkey, addr, 8, Access::REMOTE_ATOMIC) {
        Ok(m) => m,
        Err(s) => return (s, 0),
    };
    match dma::translate(seg, &mr, addr, true) {
        Ok(dma::Loc::Drop) => {
            // Special frame: read the pattern, drop the write.
            match dma::translate(seg, &mr, addr, false) {
                Ok(l) => dma::atomic_local(l, op).map_or((WcStatus::RemAccessErr, 0), |v| (WcStatus::Success, v)),
                Err(_) => (WcStatus::RemAccessErr, 0),
            }
        }
        Ok(l) => dma::atomic_local(l, op).map_or((WcStatus::RemAccessErr, 0), |v| (WcStatus::Success, v)),
        Err(_) => (WcStatus::RemAccessErr, 0),
    }
}

/// Serve the next pending request slot of QP `idx` (NIC thread of the target host, or
/// the thread serving its rings). Every field of the slot is a peer's word: it is read
/// once, and the QP, rkey, bounds and rights are checked here, by the target, whatever
/// the peer checked. Returns false if there was none.
pub(crate) fn serve_one(
    seg: &Segment,
    me: &Peer,
    own: &HostAddr,
    idx: u32,
    section: usize,
    srv: &mut RingServer,
) -> bool {
    let Some(r) = seg.qp(idx) else { return false };
    if r.unreliable.load(Ordering::Acquire) == segment::QP_UD {
        return serve_ud(seg, me, own, idx, section);
    }
    let cons = r.ring_cons.load(Ordering::Acquire);
    let (h, data) = seg.slot(idx, cons);
    if h.state.load(Ordering::Acquire) != segment::SLOT_REQ {
        return false;
    }
    let op = h.op.load(Ordering::Relaxed);
    let len = h.len.load(Ordering::Relaxed) as u64;
    let raddr = h.raddr.load(Ordering::Relaxed);
    let rkey = h.rkey.load(Ordering::Relaxed);
    let src_qpn = h.src_qpn.load(Ordering::Relaxed);
    let src_nonce = h.src_nonce.load(Ordering::Relaxed);
    let qpn = r.qpn.load(Ordering::Relaxed);
    if op == segment::RING_HELP_READ || op == segment::RING_HELP_WRITE {
        if !seg.p.trusted_by_owner() {
            // A shared copy has this thread copy between addresses the initiator chose:
            // only between hosts that trust each other. Refused like a malformed request.
            tracing::warn!(
                qpn,
                src_qpn,
                "refused a shared-copy job: this host does not trust its peers"
            );
            finish_slot(seg, me, idx, r, h, cons, WcStatus::RemInvReqErr as u32, 0);
            return true;
        }
        // Sharing the initiator's CPU would only serialize the copy: leave the job to
        // the initiator (it cancels it when done).
        if rustix::thread::sched_getcpu() as u64 == h.swp.load(Ordering::Relaxed) {
            return false;
        }
        // Take the job unless the initiator already did everything and cancelled it.
        if h.state
            .compare_exchange(
                segment::SLOT_REQ,
                segment::SLOT_BUSY,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return false;
        }
        // Re-read the job now that it is ours: between our first look and the CAS the
        // initiator may have cancelled that job and posted a different request in the
        // same slot (ABA on REQ). Serving it with the stale op / unit count copied
        // stale units (wrong memory, or REM_ACCESS_ERR when they no longer
        // translate), or "completed" a small READ / atomic without executing it.
        let op = h.op.load(Ordering::Relaxed);
        if op != segment::RING_HELP_READ && op != segment::RING_HELP_WRITE {
            // A regular request: hand it back (only we consume REQ slots).
            h.state.store(segment::SLOT_REQ, Ordering::Release);
            tracing::debug!("help job replaced by a regular request before we took it");
            return true;
        }
        let len = h.len.load(Ordering::Relaxed) as u64;
        let src_qpn = h.src_qpn.load(Ordering::Relaxed);
        let src_nonce = h.src_nonce.load(Ordering::Relaxed);
        let ok = target_qp(seg, idx, qpn, src_nonce, src_qpn).is_some()
            && serve_help(
                op,
                h,
                data,
                len as usize,
                h.cmp.load(Ordering::Relaxed) as u32,
                seg.p.ring_max as usize,
            );
        h.status
            .store(if ok { 0 } else { WcStatus::RemAccessErr as u32 }, Ordering::Relaxed);
        h.state.store(segment::SLOT_DONE, Ordering::Release);
        r.ring_cons.store(cons + 1, Ordering::Release);
        return true;
    }
    let gen_of = Blocked {
        qpn,
        src_nonce,
        src_qpn,
        gen: (op >> segment::RING_GEN_SHIFT) as u16,
    };
    if srv.refuses(idx, gen_of) {
        finish_slot(seg, me, idx, r, h, cons, segment::RING_ST_SEQ, 0);
        return true;
    }
    let req = Request {
        code: op & segment::RING_OP_MASK,
        flags: op & segment::RING_FLAGS_MASK,
        len,
        raddr,
        rkey,
        src_qpn,
        src_nonce,
        cmp: h.cmp.load(Ordering::Relaxed),
        swp: h.swp.load(Ordering::Relaxed),
    };
    let ring_max = seg.p.ring_max as u64;
    let (status, result) = if target_qp(seg, idx, qpn, src_nonce, src_qpn).is_none() {
        (WcStatus::RetryExcErr as u32, 0)
    } else {
        match req.code {
            // Payloads of up to 8 bytes travel in the slot header's own cache line, so
            // `ring_max` < 8 still serves atomics and tiny READ/WRITEs.
            segment::RING_READ | segment::RING_WRITE if len > 8 && len > ring_max => (WcStatus::RemInvReqErr as u32, 0),
            segment::RING_SEND | segment::RING_WRITE_IMM if len > ring_max => (WcStatus::RemInvReqErr as u32, 0),
            segment::RING_READ | segment::RING_WRITE => serve_rw(seg, r, &req, data, section),
            segment::RING_CAS | segment::RING_FADD => {
                let aop = if req.code == segment::RING_CAS {
                    AtomicOp::CmpSwap {
                        compare: req.cmp,
                        swap: req.swp,
                    }
                } else {
                    AtomicOp::FetchAdd { add: req.cmp }
                };
                let (s, v) = atomic_here(seg, r, rkey, raddr, aop);
                (s as u32, v)
            }
            segment::RING_SEND => (serve_send(seg, me, idx, r, &req, data, section, srv), 0),
            segment::RING_WRITE_IMM => {
                let slot_span = [dma::passthrough(data as u64, len)];
                let m = Message {
                    src: Side {
                        seg,
                        port: Port::Local,
                        spans: &slot_span,
                    },
                    len,
                    wc_len: req.swp,
                    imm: Some(req.cmp as u32),
                    write_to: Some((rkey, raddr)),
                    src_qpn,
                    solicited: req.flags & segment::RING_F_SOLICITED != 0,
                    section,
                };
                // Check and copy inside one epoch section: a deregistration that
                // returned before it is refused, one after it waits for the copy.
                let _g = crate::hw::iommu::enter(seg);
                (delivery_code(deliver(me, idx, r, &m)), 0)
            }
            _ => (WcStatus::RemInvReqErr as u32, 0),
        }
    };
    if status & !0xffff == segment::RING_ST_RNR {
        srv.block(idx, gen_of);
    }
    finish_slot(seg, me, idx, r, h, cons, status, result);
    true
}

/// Answer slot `cons` of QP `idx` with `status` (a `WcStatus` or a `RING_ST_*` code)
/// and `result`; a responder error moves the QP to ERR, as on hardware.
#[allow(clippy::too_many_arguments)]
fn finish_slot(
    seg: &Segment,
    me: &Peer,
    idx: u32,
    r: &QpRec,
    h: &segment::SlotHdr,
    cons: u64,
    status: u32,
    result: u64,
) {
    if status != WcStatus::Success as u32
        && status != WcStatus::RetryExcErr as u32
        && status < segment::RING_ST_RNR
        && !drops_refused(r)
    {
        qp_error(seg, me, idx);
    }
    h.result.store(result, Ordering::Relaxed);
    h.status.store(status, Ordering::Relaxed);
    h.state.store(segment::SLOT_DONE, Ordering::Release);
    r.ring_cons.store(cons + 1, Ordering::Release);
    seg.stats().ring_requests.fetch_add(1, Ordering::Relaxed);
}

/// A ring request, read once from the peer-written slot header.
struct Request {
    code: u32,
    flags: u32,
    len: u64,
    raddr: u64,
    rkey: u32,
    src_qpn: u32,
    src_nonce: u64,
    cmp: u64,
    swp: u64,
}

fn delivery_code(d: Delivery) -> u32 {
    match d {
        Delivery::Done(s) => s as u32,
        Delivery::Rnr(t) => segment::RING_ST_RNR | t.min(0xffff),
    }
}

/// READ / WRITE (one part of one): the WR's whole range is checked at its first part,
/// each part's own range again inside the epoch section of its copy. Returns
/// (status, inline result of a <= 8-byte READ).
fn serve_rw(seg: &Segment, r: &QpRec, q: &Request, data: *mut u8, section: usize) -> (u32, u64) {
    let read = q.code == segment::RING_READ;
    let need = if read {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE
    };
    if q.flags & segment::RING_F_FIRST != 0 && q.swp > q.len {
        if let Err(s) = remote_check(seg, r, q.rkey, q.raddr, q.swp, need) {
            return (s as u32, 0);
        }
    }
    // This part's own range (checked again inside the copy's epoch section below).
    let target = || {
        remote_check(seg, r, q.rkey, q.raddr, q.len, need).map(|mr| Span {
            mr,
            addr: q.raddr,
            len: q.len,
        })
    };
    let t = match target() {
        Ok(t) => [t],
        Err(s) => return (s as u32, 0),
    };
    if t[0].mr.odp {
        // ODP model: a non-present page of this host's ON_DEMAND MR is a page fault
        // raised to this host; the request is NAKed (the initiator retransmits).
        let miss = crate::nic::odp::missing(seg, &t, !read);
        if !miss.is_empty() {
            crate::nic::state::fault_remote(seg, miss);
            return (segment::RING_ST_ODP_NAK, 0);
        }
    }
    // Payloads of up to 8 bytes travel in the slot header (`cmp` / `result`).
    let mut small = q.cmp.to_le_bytes();
    let inline = q.len <= 8;
    let buf = if inline { small.as_mut_ptr() } else { data };
    let slot = [dma::passthrough(buf as u64, q.len)];
    let slot_side = Side {
        seg,
        port: Port::Local,
        spans: &slot,
    };
    // Check and copy inside one epoch section: a deregistration that returned before
    // this is refused, one that starts during it waits for the copy (its flush).
    let _g = crate::hw::iommu::enter(seg);
    let t = match target() {
        Ok(t) => [t],
        Err(s) => return (s as u32, 0),
    };
    let tside = Side {
        seg,
        port: Port::Local,
        spans: &t,
    };
    let res = if read {
        dma::copy(&tside, &slot_side, q.len, section)
    } else {
        dma::copy(&slot_side, &tside, q.len, section)
    };
    match res {
        Ok(_) if inline && read => (WcStatus::Success as u32, u64::from_le_bytes(small)),
        Ok(_) => (WcStatus::Success as u32, 0),
        Err(_) => (WcStatus::RemAccessErr as u32, 0),
    }
}

/// One part of a SEND / SEND_WITH_IMM. A message in one part is delivered at once; a
/// longer one claims the receive WQE at its first part (RNR if none: nothing consumed),
/// lands each part at its offset (the receive buffers re-validated per part), and
/// completes the receive at its last. Parts of a message that is not in progress (its
/// first part was refused, or a flush ended it) are dropped without effect.
#[allow(clippy::too_many_arguments)]
fn serve_send(
    seg: &Segment,
    me: &Peer,
    idx: u32,
    r: &QpRec,
    q: &Request,
    data: *mut u8,
    section: usize,
    srv: &mut RingServer,
) -> u32 {
    let first = q.flags & segment::RING_F_FIRST != 0;
    let last = q.flags & segment::RING_F_LAST != 0;
    let imm = (q.flags & segment::RING_F_IMM != 0).then_some(q.cmp as u32);
    let solicited = q.flags & segment::RING_F_SOLICITED != 0;
    let open = q.flags & segment::RING_F_OPEN != 0;
    let (off, mut total) = (q.raddr, q.swp);
    let slot = [dma::passthrough(data as u64, q.len)];
    let src = Side {
        seg,
        port: Port::Local,
        spans: &slot,
    };
    let Some(cell) = srv.inbound(idx) else {
        return WcStatus::RemInvReqErr as u32;
    };
    if first {
        // A new message ends whatever its predecessor left (the initiator gave it up).
        abandon(seg, me, r, cell);
    }
    if first && last {
        if off != 0 || q.len != total {
            return WcStatus::RemInvReqErr as u32;
        }
        let m = Message {
            src,
            len: q.len,
            wc_len: total,
            imm,
            write_to: None,
            src_qpn: q.src_qpn,
            solicited,
            section,
        };
        let _g = crate::hw::iommu::enter(seg);
        return delivery_code(deliver(me, idx, r, &m));
    }
    let qpn = r.qpn.load(Ordering::Relaxed);
    let _rq = shm_lock(&r.rq_lock);
    let st = QpState::from_u32(r.state.load(Ordering::Acquire));
    if st != QpState::Rtr && st != QpState::Rts {
        abandon(seg, me, r, cell);
        return WcStatus::RetryExcErr as u32;
    }
    let (qi, rq, srq_lock) = lock_rq_of(seg, idx, r);
    // Other QPs take from a shared queue while a message arrives in parts: its WQE is
    // taken at the first part (what is left of it travels in the cell). A UC
    // responder drops instead, so it takes nothing before the last part.
    let take_first = srq_lock.is_some() && !drops_refused(r);
    let head = rq.rq_head.load(Ordering::Acquire);
    let recv_wc = |status: WcStatus, wr_id: u64| Wc {
        wr_id,
        status,
        qp_num: qpn,
        src_qp: q.src_qpn,
        opcode: WcOpcode::Recv,
        ..Default::default()
    };
    // A receive that cannot take the message completes in error and the QP fails. A
    // shared queue's WQE was taken at the message's first part already.
    let fail = |recv: WcStatus, req: WcStatus, wr_id: u64, taken: bool| {
        refuse_recv(seg, me, idx, r, (!taken).then_some((rq, head)), &recv_wc(recv, wr_id));
        req as u32
    };
    if first {
        if total > 1 << 31 {
            return WcStatus::RemInvReqErr as u32;
        }
        if head >= rq.rq_tail.load(Ordering::Acquire) {
            return segment::RING_ST_RNR | r.min_rnr_timer.load(Ordering::Relaxed).min(0xffff);
        }
        let (w, wsges) = seg.wqe(qi, head);
        let wr_id = w.wr_id.load(Ordering::Relaxed);
        let n = (w.nsge.load(Ordering::Relaxed) as usize).min(wsges.len());
        let sges: Vec<RecvSge> = wsges[..n]
            .iter()
            .map(|s| RecvSge {
                addr: s.addr.load(Ordering::Relaxed),
                len: s.len.load(Ordering::Relaxed) as u64,
                lkey: s.lkey.load(Ordering::Relaxed),
            })
            .filter(|s| s.len > 0)
            .collect();
        let room = sges.iter().map(|s| s.len).sum::<u64>();
        if open {
            total = room;
        } else if room < total {
            return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr, wr_id, false);
        }
        if take_first {
            rq.rq_head.store(head + 1, Ordering::Release);
        }
        *cell = Some(Inbound {
            qpn,
            src_nonce: q.src_nonce,
            src_qpn: q.src_qpn,
            head,
            taken: take_first,
            pd: rq.pd.load(Ordering::Relaxed),
            wr_id,
            sges,
            total,
            next_off: 0,
            imm,
            solicited,
            open,
        });
    }
    if let Some(ib) = cell
        .as_ref()
        .filter(|ib| ib.open && ib.next_off == off && off + q.len > ib.total)
    {
        // A message of unknown length outgrew its receive.
        let (wr_id, taken) = (ib.wr_id, ib.taken);
        *cell = None;
        return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr, wr_id, taken);
    }
    let Some(ib) = cell.as_mut().filter(|ib| {
        ib.qpn == qpn
            && ib.src_nonce == q.src_nonce
            && ib.src_qpn == q.src_qpn
            && (ib.taken || ib.head == head)
            && ib.next_off == off
            && off + q.len <= ib.total
    }) else {
        abandon(seg, me, r, cell);
        return segment::RING_ST_DROPPED;
    };
    let (pd, wr_id, taken) = (ib.pd, ib.wr_id, ib.taken);
    // Check and copy inside one epoch section (a deregistered receive buffer is
    // refused, one being deregistered waits for this part).
    let g = crate::hw::iommu::enter(seg);
    let mut spans = Scratch::take(&RECV_SPANS);
    for s in window(&ib.sges, off, q.len) {
        match check_key(seg, s.lkey, pd, None, s.addr, s.len, Access::LOCAL_WRITE) {
            Ok(mr) => spans.push(Span {
                mr,
                addr: s.addr,
                len: s.len,
            }),
            Err(_) => {
                drop(g);
                *cell = None;
                return fail(WcStatus::LocProtErr, WcStatus::RemOpErr, wr_id, taken);
            }
        }
    }
    let dst = Side {
        seg,
        port: Port::Local,
        spans: &spans,
    };
    let copied = dma::copy(&src, &dst, q.len, section);
    drop(g);
    if copied.is_err() {
        *cell = None;
        return fail(WcStatus::LocProtErr, WcStatus::RemOpErr, wr_id, taken);
    }
    ib.next_off += q.len;
    if !last {
        return WcStatus::Success as u32;
    }
    let Some(mut ib) = cell.take() else {
        return WcStatus::RemInvReqErr as u32;
    };
    if ib.open {
        // The last part tells the length, the immediate and the solicited bit.
        ib.total = ib.next_off;
        ib.imm = imm;
        ib.solicited = solicited;
    }
    if ib.next_off != ib.total {
        return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr, wr_id, taken);
    }
    let mut wc = recv_wc(WcStatus::Success, wr_id);
    wc.byte_len = ib.total as u32;
    if let Some(i) = ib.imm {
        wc.imm_data = i;
        wc.wc_flags = WcFlags::WITH_IMM;
    }
    if !ib.taken {
        rq.rq_head.store(head + 1, Ordering::Release);
    }
    if cq_ring::push(seg, me, r.recv_cq.load(Ordering::Relaxed), &wc, ib.solicited).is_err() {
        qp_error_locked(seg, me, idx, r);
    }
    WcStatus::Success as u32
}

/// End the message in progress in `cell`, if any: one whose WQE was taken off a
/// shared receive queue will never finish, so that WQE completes (flushed) on the
/// QP's receive CQ — every posted receive completes once.
pub(crate) fn abandon(seg: &Segment, via: &Peer, r: &QpRec, cell: &mut Option<Inbound>) {
    if let Some(ib) = cell.take().filter(|ib| ib.taken) {
        let wc = Wc {
            wr_id: ib.wr_id,
            status: WcStatus::WrFlushErr,
            opcode: WcOpcode::Recv,
            qp_num: ib.qpn,
            ..Default::default()
        };
        let _ = cq_ring::push(seg, via, r.recv_cq.load(Ordering::Relaxed), &wc, false);
    }
}

/// Copy units of a shared job the initiator posted (claiming them from the counter in
/// `h.result`). The units (initiator address, our address, length) were validated and
/// translated by the initiator inside both hosts' epoch sections, which it holds until
/// the job is DONE.
fn serve_help(op: u32, h: &segment::SlotHdr, data: *mut u8, n: usize, pid: u32, ring_max: usize) -> bool {
    if n == 0 || n * 24 > ring_max {
        return false;
    }
    let dir = if op == segment::RING_HELP_READ {
        crate::sys::VmDir::Write
    } else {
        crate::sys::VmDir::Read
    };
    loop {
        let i = h.result.fetch_add(1, Ordering::AcqRel) as usize;
        if i >= n {
            return true;
        }
        // SAFETY: i < n and n * 24 <= ring_max bytes of this slot's data area.
        let rd = |k: usize| unsafe { (data.add(24 * i + 8 * k) as *const u64).read_unaligned() };
        let (l, r, len) = (rd(0), rd(1), rd(2) as usize);
        let theirs = libc::iovec {
            iov_base: l as *mut libc::c_void,
            iov_len: len,
        };
        let mine = libc::iovec {
            iov_base: r as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: `mine` is an address the initiator translated from our MRs / IOMMU
        // (valid per the registration contracts while its epoch sections are held).
        match unsafe { crate::sys::process_vm(pid, dir, &[mine], &[theirs]) } {
            Ok(got) if got == len => {}
            _ => return false,
        }
    }
}
