//! The completer (rxe's `rxe_comp`): takes the answers of ring requests (landing
//! READ and atomic results in local memory), frees the ring slots of abandoned
//! requests, handles NAKs (RNR retry timers; the ODP model's remote-fault NAK, with the
//! later WRs it executes behind it until the send queue goes back N), and retires
//! the send queue in post order: completions into the send CQ, the flush behind an
//! error.

use crate::hw::dma::{self, passthrough, Port, Side};
use crate::hw::segment;
use crate::nic::cq_ring;
use crate::nic::qp_ctx::{EState, Entry, QpCtx, Sq};
use crate::nic::requester::{self, advance_ring, local_spans, part, ring_parts, window, Outcome};
use crate::nic::responder;
use crate::sys;
use crate::verbs::*;
use std::sync::atomic::Ordering;

impl QpCtx {
    /// Count WR `e` in the host's stats and, if it is signaled or failed, push its
    /// completion into the send CQ (an overflowing CQ moves the QP to ERR).
    pub(crate) fn complete(&self, e: &Entry, status: WcStatus, byte_len: u32) {
        let h = &*self.nic;
        let s = h.seg.stats();
        s.wrs.fetch_add(1, Ordering::Relaxed);
        if status.is_ok() {
            s.bytes.fetch_add(byte_len as u64, Ordering::Relaxed);
            s.atoms.fetch_add(e.atoms, Ordering::Relaxed);
        } else if status != WcStatus::WrFlushErr {
            s.errors.fetch_add(1, Ordering::Relaxed);
        }
        if e.signaled || !status.is_ok() {
            let wc = Wc {
                wr_id: e.wr_id,
                status,
                opcode: e.op.wc_opcode(),
                byte_len: if status.is_ok() { byte_len } else { 0 },
                qp_num: self.qpn,
                ..Default::default()
            };
            if cq_ring::push(&h.seg, &h.self_peer, self.send_cq.idx, &wc, false).is_err() {
                tracing::warn!(qpn = self.qpn, "send CQ overflow");
                self.rec().state.store(QpState::Err as u32, Ordering::Release);
            }
        }
    }

    /// Flush every remaining WR (QP in ERR): completed ones keep their status, the
    /// rest complete with WR_FLUSH_ERR.
    pub(crate) fn flush_all(&self, sq: &mut Sq) {
        while let Some(e) = sq.entries.pop_front() {
            match e.st {
                EState::Done { .. } if e.inflight => self.complete(&e, WcStatus::WrFlushErr, 0),
                EState::Done { status, byte_len } => self.complete(&e, status, byte_len),
                EState::Issued { .. } => {
                    let mut e = e;
                    e.abandon_parts(&mut sq.zombies, sys::now_ns());
                    self.complete(&e, WcStatus::WrFlushErr, 0);
                }
                _ => self.complete(&e, WcStatus::WrFlushErr, 0),
            }
        }
    }

    /// Complete finished WRs from the head, in order. Returns whether anything changed.
    pub(crate) fn retire(&self, sq: &mut Sq, now: u64) -> bool {
        let mut changed = false;
        while let Some(front) = sq.entries.front() {
            match front.st {
                EState::Issued { .. } => match finish_ring(self, sq, now) {
                    Some(RingDone::Done(status, byte_len)) => {
                        let (status, byte_len) = self.sent_status(status, byte_len, sq.entries[0].len());
                        sq.entries[0].st = EState::Done { status, byte_len };
                        changed = true;
                    }
                    Some(RingDone::Rnr(timer)) => {
                        self.rnr(sq, 0, timer, now);
                        return true;
                    }
                    Some(RingDone::OdpNak) => {
                        self.odp_nak(sq, 0, now);
                        return true;
                    }
                    Some(RingDone::Resend) => {
                        sq.entries[0].st = EState::Pending;
                        self.rewind_after(sq, 0, now);
                        return true;
                    }
                    Some(RingDone::Unanswered) => {
                        self.unanswered(sq, 0, now);
                        return true;
                    }
                    None => break,
                },
                EState::Done { status, byte_len } => {
                    let e = sq.entries.pop_front().expect("front exists");
                    self.complete(&e, status, byte_len);
                    changed = true;
                    if !status.is_ok() {
                        let h = &*self.nic;
                        responder::qp_error(&h.seg, &h.self_peer, self.idx);
                        self.flush_all(sq);
                        return true;
                    }
                }
                _ => break,
            }
        }
        changed
    }

    /// WR `i` met a receiver not ready: retry after the responder's timer, or fail
    /// once the QP's `rnr_retry` count is used up (7 = forever). An unreliable
    /// connection has no RNR NAK: the responder dropped the message, the WR
    /// completes as sent.
    pub(crate) fn rnr(&self, sq: &mut Sq, i: usize, timer: u32, now: u64) {
        if self.qp_type == QpType::Uc {
            sq.entries[i].complete_as_sent();
            return;
        }
        self.nic.seg.stats().rnr_naks.fetch_add(1, Ordering::Relaxed);
        let e = &mut sq.entries[i];
        let left = e.rnr_left.get_or_insert(sq.attr.rnr_retry);
        if *left == 0 {
            e.st = EState::Done {
                status: WcStatus::RnrRetryExcErr,
                byte_len: 0,
            };
            return;
        }
        if *left != 7 {
            *left -= 1;
        }
        // IB's timer for the responder's code, in units of `rnr_delay` per 10 µs
        // (the default 10 µs gives IB's table).
        let d = (crate::verbs::rnr_timer(timer.min(31) as u8).as_nanos() * self.nic.cfg.rnr_delay.as_nanos() / 10_000)
            as u64;
        e.st = EState::Rnr { until: now + d };
        self.rewind_after(sq, i, now);
    }

    /// One transport timeout of the QP (IB: 4.096 µs × 2^`timeout`), at least 10 µs;
    /// `timeout` 0 (IB: wait forever) and anything over the host's transport timeout
    /// split among the tries take that share.
    fn ack_timeout_ns(&self, attr: &QpAttr) -> u64 {
        let cap = self.nic.cfg.transport_timeout.as_nanos() as u64 / (attr.retry_cnt.min(7) as u64 + 1);
        if attr.timeout == 0 {
            return cap;
        }
        (4096u64 << attr.timeout.min(31)).clamp(10_000, cap.max(10_000))
    }

    /// How long a request may go without an answer: the QP's `retry_cnt` + 1
    /// transport timeouts.
    pub(crate) fn retry_budget_ns(&self, attr: &QpAttr) -> u64 {
        self.ack_timeout_ns(attr) * (attr.retry_cnt.min(7) as u64 + 1)
    }

    /// WR `i` met no QP ready to take it (absent, not yet RTR, not connected to us —
    /// what a fabric drops without an ACK): resend it after one transport timeout,
    /// going back N as after an RNR NAK, until the QP's `retry_cnt` is used up, then
    /// RETRY_EXC_ERR. A target that becomes ready meanwhile takes the resend. On UC
    /// nothing is resent: the WR completes as sent.
    pub(crate) fn unanswered(&self, sq: &mut Sq, i: usize, now: u64) {
        if self.qp_type == QpType::Uc {
            sq.entries[i].complete_as_sent();
            return;
        }
        let until = now + self.ack_timeout_ns(&sq.attr);
        let e = &mut sq.entries[i];
        if e.retries >= sq.attr.retry_cnt.min(7) {
            e.st = EState::Done {
                status: WcStatus::RetryExcErr,
                byte_len: 0,
            };
            return;
        }
        e.retries += 1;
        e.st = EState::Rnr { until };
        self.rewind_after(sq, i, now);
    }

    /// Go back to resend everything after WR `i` (RC's go-back-N after an RNR NAK):
    /// the ring parts of later WRs already out are given up — the responder refuses
    /// them unexecuted (`RING_ST_SEQ`), as they carry the old generation — and the
    /// WRs issue again, in order, behind `i`.
    fn rewind_after(&self, sq: &mut Sq, i: usize, now: u64) {
        sq.gen = sq.gen.wrapping_add(1);
        let Sq { entries, zombies, .. } = sq;
        for e in entries.iter_mut().skip(i + 1) {
            if matches!(e.st, EState::Issued { .. }) {
                e.abandon_parts(zombies, now);
                e.st = EState::Pending;
            }
        }
    }

    /// ODP model: WR `i` was NAKed for a remote page fault. It waits `odp_timeout`;
    /// the later WRs already posted are on the wire behind it and execute at the
    /// target (READ/WRITE; they are redone after its retransmission, go-back-N).
    pub(crate) fn odp_nak(&self, sq: &mut Sq, i: usize, now: u64) {
        let e = &mut sq.entries[i];
        e.odp_naks += 1;
        if e.odp_naks > crate::nic::odp::max_naks(&self.nic.cfg) {
            e.st = EState::Done {
                status: WcStatus::RetryExcErr,
                byte_len: 0,
            };
            return;
        }
        e.st = EState::OdpNak {
            until: now + self.nic.cfg.odp_timeout.as_nanos() as u64,
        };
        for j in i + 1..sq.entries.len() {
            let e = &sq.entries[j];
            if e.st != EState::Pending
                || !matches!(e.op, WrOpcode::Read | WrOpcode::Write)
                || requester::uses_ring(self, sq, e)
            {
                break;
            }
            match requester::exec_direct(self, sq, j) {
                Outcome::Done(status, byte_len) if status.is_ok() => {
                    let e = &mut sq.entries[j];
                    e.st = EState::Done { status, byte_len };
                    e.inflight = true;
                }
                // Faulted or failed behind the NAK: dropped, executed again later.
                _ => break,
            }
        }
    }
}

/// What the responses of the front WR's parts say.
pub(crate) enum RingDone {
    Done(WcStatus, u32),
    /// Receiver not ready at the first part (nothing consumed): retry after the timer.
    Rnr(u32),
    /// ODP model: the target raised a page fault and NAKed.
    OdpNak,
    /// Refused unexecuted behind an earlier RNR (`RING_ST_SEQ`): resend.
    Resend,
    /// No QP was there to take it (absent, not ready, not connected to us; a part of
    /// a message it was not receiving): on a fabric, a packet nobody acknowledges.
    Unanswered,
}

/// Take the answers of the front WR's parts (slots `slot..slot + sent`) that arrived;
/// None while parts are in flight or still to be issued.
pub(crate) fn finish_ring(q: &QpCtx, sq: &mut Sq, now: u64) -> Option<RingDone> {
    let peer = sq.peer.clone()?;
    let tq = sq.tq?;
    let me = &*q.nic;
    let chunk = peer.seg.p.ring_max as u64;
    let EState::Issued {
        slot,
        sent,
        since,
        alone,
    } = sq.entries[0].st
    else {
        return None;
    };
    let parts = ring_parts(&sq.entries[0], chunk);
    let len = sq.entries[0].len();
    let mut since = since;
    let mut outcome = None;
    while sq.entries[0].parts_done < sent {
        let k = sq.entries[0].parts_done;
        let (h, data) = peer.seg.slot(tq, slot + k as u64);
        if h.state.load(Ordering::Acquire) != segment::SLOT_DONE {
            let waited = now.saturating_sub(since);
            // A target process that is gone answers nothing: its WR fails once the
            // QP's retries would have run out (not later, not sooner).
            if waited > me.cfg.transport_timeout.as_nanos() as u64
                || (waited > q.retry_budget_ns(&sq.attr) && !peer.alive())
            {
                outcome = Some(RingDone::Done(WcStatus::RetryExcErr, 0));
            }
            break;
        }
        let code = h.status.load(Ordering::Relaxed);
        let mut status = match code {
            c if c & !0xffff == segment::RING_ST_RNR => {
                outcome = Some(RingDone::Rnr(c & 0xffff));
                h.state.store(segment::SLOT_FREE, Ordering::Release);
                sq.entries[0].parts_done += 1;
                break;
            }
            segment::RING_ST_ODP_NAK => {
                me.seg.stats().odp_faults_remote.fetch_add(1, Ordering::Relaxed);
                outcome = Some(RingDone::OdpNak);
                h.state.store(segment::SLOT_FREE, Ordering::Release);
                sq.entries[0].parts_done += 1;
                break;
            }
            segment::RING_ST_RETRY_EXC => {
                outcome = Some(RingDone::Done(WcStatus::RetryExcErr, 0));
                h.state.store(segment::SLOT_FREE, Ordering::Release);
                sq.entries[0].parts_done += 1;
                break;
            }
            segment::RING_ST_SEQ => {
                outcome = Some(RingDone::Resend);
                h.state.store(segment::SLOT_FREE, Ordering::Release);
                sq.entries[0].parts_done += 1;
                break;
            }
            // No QP took it, or a part of a message the target is not receiving: lost.
            c if c == WcStatus::RetryExcErr as u32 || c == segment::RING_ST_DROPPED => {
                outcome = Some(RingDone::Unanswered);
                h.state.store(segment::SLOT_FREE, Ordering::Release);
                sq.entries[0].parts_done += 1;
                break;
            }
            c => WcStatus::from_u32(c),
        };
        let e = &sq.entries[0];
        if status.is_ok() && (matches!(e.op, WrOpcode::Read) || e.op.is_atomic()) {
            let (off, plen) = part(e, k, len, chunk);
            match local_spans(q, e, Access::LOCAL_WRITE) {
                Err(s) => status = s,
                Ok(spans) => {
                    let result = h.result.load(Ordering::Relaxed).to_le_bytes();
                    let src_span = if e.op.is_atomic() || plen <= 8 {
                        [passthrough(result.as_ptr() as u64, 8)]
                    } else {
                        [passthrough(data as u64, plen)]
                    };
                    let src = Side {
                        seg: &me.seg,
                        port: Port::Local,
                        spans: &src_span,
                    };
                    let dst_spans = window(&spans, off, plen);
                    let dst = Side {
                        seg: &me.seg,
                        port: Port::Local,
                        spans: &dst_spans,
                    };
                    match dma::copy(&src, &dst, plen, me.cfg.dma_section) {
                        Ok(a) => sq.entries[0].atoms += a,
                        Err(_) => status = WcStatus::LocProtErr,
                    }
                }
            }
        }
        h.state.store(segment::SLOT_FREE, Ordering::Release);
        sq.entries[0].parts_done += 1;
        since = now;
        if !status.is_ok() {
            outcome = Some(RingDone::Done(status, 0));
            break;
        }
    }
    let e = &mut sq.entries[0];
    if outcome.is_none() && e.parts_done == parts {
        let byte_len = if e.op.is_atomic() { 8 } else { len as u32 };
        outcome = Some(RingDone::Done(WcStatus::Success, byte_len));
    }
    if outcome.is_some() {
        e.abandon_parts(&mut sq.zombies, now);
    } else {
        e.st = EState::Issued {
            slot,
            sent,
            since,
            alone,
        };
    }
    advance_ring(sq, tq);
    outcome
}

/// Free ring slots of flushed WRs once their responses arrived (or timed out).
pub(crate) fn reap_zombies(q: &QpCtx, sq: &mut Sq, now: u64) {
    if sq.zombies.is_empty() {
        return;
    }
    let (Some(peer), Some(tq)) = (sq.peer.clone(), sq.tq) else {
        sq.zombies.clear();
        return;
    };
    let timeout = q.nic.cfg.transport_timeout.as_nanos() as u64;
    sq.zombies.retain(|&(slot, since)| {
        let h = peer.seg.slot(tq, slot).0;
        // Across the network the link answers every slot it took (at the latest when
        // its retries ran out): a slot is never freed under it.
        let expired = now.saturating_sub(since) > timeout && peer.link.is_none();
        if h.state.load(Ordering::Acquire) == segment::SLOT_DONE || expired {
            h.state.store(segment::SLOT_FREE, Ordering::Release);
            false
        } else {
            true
        }
    });
    advance_ring(sq, tq);
}
