//! Responder semantics shared by both data paths: checks the target QP and rkey exactly
//! as the target NIC would, moves a target QP to ERR (flushing its RQ), delivers
//! SEND / WRITE_WITH_IMM into posted receives, and serves request-ring slots (run by
//! the target's NIC thread).

use crate::cq;
use crate::dma::{self, check_key, AtomicOp, DmaErr, MrView, Port, Side, Span, MR_PASSTHROUGH};
use crate::peer::Peer;
use crate::scratch::{scratch_slot, Scratch};
use crate::segment::{self, shm_lock, QpRec, Segment};
use crate::verbs::{Access, QpState, Wc, WcFlags, WcOpcode, WcStatus};
use std::sync::atomic::Ordering;

scratch_slot!(RECV_SPANS: Span);

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
        let _ = cq::push(seg, via, cqi, &wc, false);
        head += 1;
        r.rq_head.store(head, Ordering::Release);
    }
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
    if !qacc.contains(need) && !crate::dma::key_any_qp(seg, rkey) {
        return Err(WcStatus::RemInvReqErr);
    }
    if need == Access::REMOTE_ATOMIC && (addr % 8 != 0 || len != 8) {
        return Err(WcStatus::RemInvReqErr);
    }
    if len > 1 << 31 {
        return Err(WcStatus::RemInvReqErr);
    }
    if len == 0 {
        return Ok(MrView {
            kind: MR_PASSTHROUGH,
            va: addr,
            len: 0,
            iova_base: 0,
            iova_slot: 0,
            odp: false,
        });
    }
    check_key(seg, rkey, r.pd.load(Ordering::Relaxed), addr, len, need).map_err(|_| WcStatus::RemAccessErr)
}

/// What the initiator sends for a message that consumes a receive WQE.
pub(crate) struct Message<'a> {
    pub src: Side<'a>,
    pub len: u64,
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
    let head = r.rq_head.load(Ordering::Acquire);
    if head >= r.rq_tail.load(Ordering::Acquire) {
        return Delivery::Rnr(r.min_rnr_timer.load(Ordering::Relaxed));
    }
    let qpn = r.qpn.load(Ordering::Relaxed);
    let pd = r.pd.load(Ordering::Relaxed);
    let cqi = r.recv_cq.load(Ordering::Relaxed);
    let (w, sges) = seg.wqe(idx, head);
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
        r.rq_head.store(head + 1, Ordering::Release);
        let _ = cq::push(seg, peer, cqi, wc, false);
        qp_error_locked(seg, peer, idx, r);
        Delivery::Done(req)
    };
    let result = if let Some((rkey, raddr)) = m.write_to {
        recv_wc.opcode = WcOpcode::RecvRdmaWithImm;
        let mr = match remote_check(seg, r, rkey, raddr, m.len, Access::REMOTE_WRITE) {
            Ok(mr) => mr,
            Err(s) => {
                // The receive WQE is not consumed by a NAKed write.
                qp_error_locked(seg, peer, idx, r);
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
        let mut spans = Scratch::take(&RECV_SPANS);
        let mut total = 0u64;
        for s in &sges[..n] {
            let (a, l, k) = (
                s.addr.load(Ordering::Relaxed),
                s.len.load(Ordering::Relaxed) as u64,
                s.lkey.load(Ordering::Relaxed),
            );
            if l == 0 {
                continue;
            }
            match check_key(seg, k, pd, a, l, Access::LOCAL_WRITE) {
                Ok(mr) => spans.push(Span { mr, addr: a, len: l }),
                Err(_) => return fail(WcStatus::LocProtErr, WcStatus::RemOpErr, &mut recv_wc),
            }
            total += l;
        }
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
    recv_wc.byte_len = m.len as u32;
    if let Some(i) = m.imm {
        recv_wc.imm_data = i;
        recv_wc.wc_flags = WcFlags::WITH_IMM;
    }
    r.rq_head.store(head + 1, Ordering::Release);
    if cq::push(seg, peer, cqi, &recv_wc, m.solicited).is_err() {
        qp_error_locked(seg, peer, idx, r);
    }
    Delivery::Done(WcStatus::Success)
}

/// Execute an atomic on target memory of *this* process (in-process initiator or the
/// target's NIC thread). Returns (status, original value).
pub(crate) fn atomic_here(seg: &Segment, r: &QpRec, rkey: u32, addr: u64, op: AtomicOp) -> (WcStatus, u64) {
    let mr = match remote_check(seg, r, rkey, addr, 8, Access::REMOTE_ATOMIC) {
        Ok(m) => m,
        Err(s) => return (s, 0),
    };
    let _g = crate::iommu::enter(seg);
    match dma::translate(seg, &mr, addr, true) {
        Ok(dma::Loc::Drop) => {
            // Special frame: read the pattern, drop the write.
            match dma::translate(seg, &mr, addr, false) {
                Ok(l) => (WcStatus::Success, dma::atomic_local(l, op)),
                Err(_) => (WcStatus::RemAccessErr, 0),
            }
        }
        Ok(l) => (WcStatus::Success, dma::atomic_local(l, op)),
        Err(_) => (WcStatus::RemAccessErr, 0),
    }
}

/// Serve the next pending request slot of QP `idx` (NIC thread of the target host).
/// Returns false if there was none.
pub(crate) fn serve_one(seg: &Segment, me: &Peer, idx: u32, section: usize) -> bool {
    let Some(r) = seg.qp(idx) else { return false };
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
    let mut result = 0u64;
    if op == segment::RING_HELP_READ || op == segment::RING_HELP_WRITE {
        // Sharing the initiator's CPU would only serialize the copy: leave the job to
        // the initiator (it cancels it when done).
        // SAFETY: plain libc call without arguments.
        if unsafe { libc::sched_getcpu() } as u64 == h.swp.load(Ordering::Relaxed) {
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
    let status = if target_qp(seg, idx, qpn, src_nonce, src_qpn).is_none() {
        WcStatus::RetryExcErr
    } else if (op == segment::RING_READ || op == segment::RING_WRITE) && len > 8 && len > seg.p.ring_max as u64 {
        // Only READ/WRITE payloads over 8 bytes use the slot's data area (smaller ones
        // and atomics travel in the header), so `ring_max` < 8 still serves atomics.
        WcStatus::RemInvReqErr
    } else {
        // Payloads of up to 8 bytes travel in the slot header's own cache line.
        let mut small = h.cmp.load(Ordering::Relaxed).to_le_bytes();
        let inline = len <= 8 && (op == segment::RING_READ || op == segment::RING_WRITE);
        let buf = if inline { small.as_mut_ptr() } else { data };
        let slot_span = [Span {
            mr: MrView {
                kind: MR_PASSTHROUGH,
                va: buf as u64,
                len: if inline { 8 } else { seg.p.ring_max as u64 },
                iova_base: 0,
                iova_slot: 0,
                odp: false,
            },
            addr: buf as u64,
            len,
        }];
        let slot_side = Side {
            seg,
            port: Port::Local,
            spans: &slot_span,
        };
        match op {
            segment::RING_READ | segment::RING_WRITE => {
                let need = if op == segment::RING_READ {
                    Access::REMOTE_READ
                } else {
                    Access::REMOTE_WRITE
                };
                match remote_check(seg, r, rkey, raddr, len, need) {
                    Err(s) => s,
                    Ok(mr) => {
                        let t = [Span { mr, addr: raddr, len }];
                        let tside = Side {
                            seg,
                            port: Port::Local,
                            spans: &t,
                        };
                        let res = if op == segment::RING_READ {
                            dma::copy(&tside, &slot_side, len, section)
                        } else {
                            dma::copy(&slot_side, &tside, len, section)
                        };
                        match res {
                            Ok(_) => {
                                if inline {
                                    result = u64::from_le_bytes(small);
                                }
                                WcStatus::Success
                            }
                            Err(_) => WcStatus::RemAccessErr,
                        }
                    }
                }
            }
            segment::RING_CAS | segment::RING_FADD => {
                let aop = if op == segment::RING_CAS {
                    AtomicOp::CmpSwap {
                        compare: h.cmp.load(Ordering::Relaxed),
                        swap: h.swp.load(Ordering::Relaxed),
                    }
                } else {
                    AtomicOp::FetchAdd {
                        add: h.cmp.load(Ordering::Relaxed),
                    }
                };
                let (s, v) = atomic_here(seg, r, rkey, raddr, aop);
                result = v;
                s
            }
            _ => WcStatus::RemInvReqErr,
        }
    };
    if !status.is_ok() && status != WcStatus::RetryExcErr {
        qp_error(seg, me, idx);
    }
    h.result.store(result, Ordering::Relaxed);
    h.status.store(status as u32, Ordering::Relaxed);
    h.state.store(segment::SLOT_DONE, Ordering::Release);
    r.ring_cons.store(cons + 1, Ordering::Release);
    seg.stats().ring_requests.fetch_add(1, Ordering::Relaxed);
    true
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
