//! RC queue pairs: creation with caps and chosen QPNs, the IB state machine with
//! attribute masks, post_recv into the shared RQ ring, and the requester's software
//! send queue: post-time validation, in-order execution, in-order completion, RNR
//! retry, and the flush of everything behind an error.

use crate::cq::{self, Cq};
use crate::host::{Host, HostInner};
use crate::mr::Pd;
use crate::peer::Peer;
use crate::requester::{self, Outcome};
use crate::responder;
use crate::scratch::{scratch_slot, Scratch};
use crate::segment::{self, shm_lock, QpRec};
use crate::small::Small;
use crate::verbs::*;
use crate::{sys, Error, PostError, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EState {
    Pending,
    /// In the target's request ring: parts in slots `slot..slot + sent` (of
    /// `requester::ring_parts`); `since` = when the last answer (or the first part)
    /// arrived, for the transport timeout; `alone`: nothing behind it issues until it
    /// is answered (ODP model, decided once at its first part).
    Issued {
        slot: u64,
        sent: u32,
        since: u64,
        alone: bool,
    },
    Rnr {
        until: u64,
    },
    /// ODP model: NAKed for a remote page fault; retransmit at `until`.
    OdpNak {
        until: u64,
    },
    Done {
        status: WcStatus,
        byte_len: u32,
    },
}

/// Gather-list entries a queued WR keeps without allocating.
const INLINE_SGES: usize = 4;
/// Inline payload bytes a queued WR keeps without allocating.
const INLINE_BYTES: usize = 64;

/// A send WR owned by the software send queue.
pub(crate) struct Entry {
    pub wr_id: u64,
    pub op: WrOpcode,
    pub flags: SendFlags,
    pub raddr: u64,
    pub rkey: u32,
    pub sges: Small<Sge, INLINE_SGES>,
    pub inline: Small<u8, INLINE_BYTES>,
    pub signaled: bool,
    pub st: EState,
    pub rnr_left: Option<u8>,
    pub atoms: u64,
    /// ODP model: remote page-fault NAKs received for this WR.
    pub odp_naks: u32,
    /// ODP model: executed while an earlier WR waits for its retransmission; it is
    /// redone (go-back-N) and must not complete before that.
    pub inflight: bool,
    /// Ring parts of this WR whose answers were taken (see [`EState::Issued`]).
    pub parts_done: u32,
}

impl Entry {
    /// Give up the ring parts still out (their answers go to `zombies`, freed when they
    /// arrive or time out); the next issue starts from the first part again.
    pub fn abandon_parts(&mut self, zombies: &mut Vec<(u64, u64)>, now: u64) {
        if let EState::Issued { slot, sent, .. } = self.st {
            zombies.extend((self.parts_done..sent).map(|k| (slot + k as u64, now)));
        }
        self.parts_done = 0;
    }

    pub fn len(&self) -> u64 {
        if self.flags.contains(SendFlags::INLINE) {
            self.inline.len() as u64
        } else {
            self.sges.iter().map(|s| s.length as u64).sum()
        }
    }
}

pub(crate) struct Sq {
    pub entries: VecDeque<Entry>,
    pub attr: QpAttr,
    pub peer: Option<Arc<Peer>>,
    pub tq: Option<u32>,
    pub ring_prod: u64,
    pub ring_cons: u64,
    pub zombies: Vec<(u64, u64)>,
}

pub(crate) struct QpInner {
    pub host: Host,
    pub pd: Pd,
    pub idx: u32,
    pub qpn: u32,
    pub send_cq: Cq,
    #[allow(dead_code)] // keeps the receive CQ alive while the QP exists
    pub recv_cq: Cq,
    pub cap: QpInitAttr,
    pub sq: Mutex<Sq>,
    /// Number of ring requests in flight (NIC-thread bookkeeping).
    pub outstanding: AtomicU32,
    /// Earliest RNR retry time (ns), 0 = none.
    pub deadline: AtomicU64,
    pub last_progress: AtomicU64,
    /// Whether the QP is on the host's active list (NIC-thread attention).
    pub in_active: std::sync::atomic::AtomicBool,
    /// Whether this QP counts in its send CQ's `busy_qps` (written under the SQ lock).
    busy: std::sync::atomic::AtomicBool,
    me: Weak<QpInner>,
}

/// A reliable-connected queue pair.
pub struct Qp {
    inner: Arc<QpInner>,
}

fn hi(q: &QpInner) -> &HostInner {
    q.host.inner()
}

impl Qp {
    pub(crate) fn create(pd: Pd, send_cq: &Cq, recv_cq: &Cq, attr: &QpInitAttr) -> Result<Qp> {
        let host = pd.host().clone();
        let h = host.inner().clone();
        let c = &h.cfg;
        if !Arc::ptr_eq(send_cq.inner_host(), &h) || !Arc::ptr_eq(recv_cq.inner_host(), &h) {
            return Err(Error::InvalidArgument("CQ of another host"));
        }
        if attr.max_send_wr == 0 || attr.max_send_wr > c.max_wr || attr.max_recv_wr > c.max_wr {
            return Err(Error::InvalidArgument("max_send_wr/max_recv_wr"));
        }
        if attr.max_send_sge > c.max_sge || attr.max_recv_sge > c.max_sge {
            return Err(Error::InvalidArgument("max_send_sge/max_recv_sge"));
        }
        if attr.max_inline_data > c.max_inline {
            return Err(Error::InvalidArgument("max_inline_data"));
        }
        let qpn = {
            let mut q = h.qpns.lock();
            match attr.qpn {
                Some(n) => {
                    if n == 0 || n >= 1 << 24 || q.1.contains(&n) {
                        return Err(Error::InvalidArgument("requested QPN invalid or in use"));
                    }
                    q.1.insert(n);
                    n
                }
                None => {
                    let mut n = q.0;
                    loop {
                        if n >= 1 << 23 {
                            n = 0x100;
                        }
                        if !q.1.contains(&n) {
                            break;
                        }
                        n += 1;
                    }
                    q.0 = n + 1;
                    q.1.insert(n);
                    n
                }
            }
        };
        let idx = match h.qps.lock().alloc() {
            Some(i) => i,
            None => {
                h.qpns.lock().1.remove(&qpn);
                return Err(Error::NoResources("QPs"));
            }
        };
        let r = h.seg.qp(idx).expect("allocated index");
        r.qpn.store(qpn, Ordering::Relaxed);
        r.state.store(QpState::Reset as u32, Ordering::Relaxed);
        r.pd.store(pd.id(), Ordering::Relaxed);
        r.access.store(0, Ordering::Relaxed);
        r.send_cq.store(send_cq.idx(), Ordering::Relaxed);
        r.recv_cq.store(recv_cq.idx(), Ordering::Relaxed);
        r.min_rnr_timer.store(0, Ordering::Relaxed);
        r.peer_nonce.store(0, Ordering::Relaxed);
        r.peer_qpn.store(0, Ordering::Relaxed);
        r.max_recv_sge.store(attr.max_recv_sge, Ordering::Relaxed);
        r.rq_depth.store(attr.max_recv_wr, Ordering::Relaxed);
        let t = r.rq_tail.load(Ordering::Relaxed);
        r.rq_head.store(t, Ordering::Relaxed);
        reset_ring(&h, idx, r, true);
        r.in_use.store(1, Ordering::Release);
        let inner = Arc::new_cyclic(|me| QpInner {
            host,
            pd,
            idx,
            qpn,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            cap: *attr,
            sq: Mutex::new(Sq {
                entries: VecDeque::with_capacity(attr.max_send_wr as usize),
                attr: QpAttr::default(),
                peer: None,
                tq: None,
                ring_prod: 0,
                ring_cons: 0,
                zombies: Vec::new(),
            }),
            outstanding: AtomicU32::new(0),
            deadline: AtomicU64::new(0),
            last_progress: AtomicU64::new(0),
            in_active: std::sync::atomic::AtomicBool::new(false),
            busy: std::sync::atomic::AtomicBool::new(false),
            me: me.clone(),
        });
        {
            let mut l = send_cq.inner.qps.lock();
            l.retain(|w| w.strong_count() > 0);
            l.push(Arc::downgrade(&inner));
        }
        Ok(Qp { inner })
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.inner.state()
    }

    /// The capacities the QP was created with.
    pub fn cap(&self) -> QpInitAttr {
        self.inner.cap
    }

    /// Current attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        let sq = self.inner.sq.lock();
        let mut a = sq.attr;
        a.qp_state = self.inner.state();
        a.cur_qp_state = a.qp_state;
        a
    }

    /// `ibv_modify_qp`: state transitions with IB attribute-mask rules.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.inner.modify(attr, mask)
    }

    /// Post send WRs. Errors detected at post time are returned immediately (nothing
    /// from the failing WR on is posted); everything else completes on the send CQ.
    pub fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        self.inner.post_send(wrs)
    }

    /// Post receive WRs.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.inner.post_recv(wrs)
    }

    /// Connect helper: INIT (with `access`), RTR to (`dest`, `dest_qpn`), RTS.
    pub fn connect(&self, access: Access, dest: crate::HostAddr, dest_qpn: u32, rnr_retry: u8) -> Result<()> {
        let (a, m) = QpAttr::init(access);
        self.modify(&a, m)?;
        let (a, m) = QpAttr::rtr(dest, dest_qpn);
        self.modify(&a, m)?;
        let (a, m) = QpAttr::rts(rnr_retry);
        self.modify(&a, m)
    }
}

/// Restart QP `idx`'s request ring at slot 0. A new QP (`fresh`) starts with every
/// slot free. A QP moved to RESET keeps the answers it already gave (its initiator may
/// still be taking them: a SEND delivered before the reset completes as delivered) and
/// answers the requests it had not served with RETRY_EXC_ERR, as a RESET QP drops
/// packets; the initiator frees those slots (`requester::issue_ring` frees an answer
/// left in a slot it is about to use). Excludes the thread serving the rings.
fn reset_ring(h: &HostInner, idx: u32, r: &QpRec, fresh: bool) {
    let _srv = h.ring_server.lock();
    for s in 0..h.seg.p.ring_slots as u64 {
        let slot = h.seg.slot(idx, s).0;
        let st = slot.state.load(Ordering::Acquire);
        if fresh {
            slot.state.store(segment::SLOT_FREE, Ordering::Release);
        } else if st == segment::SLOT_REQ || st == segment::SLOT_BUSY {
            slot.status.store(WcStatus::RetryExcErr as u32, Ordering::Relaxed);
            slot.state.store(segment::SLOT_DONE, Ordering::Release);
        }
    }
    r.ring_cons.0.store(0, Ordering::Release);
}

impl Drop for QpInner {
    fn drop(&mut self) {
        let h = hi(self);
        if let Some(r) = h.seg.qp(self.idx) {
            r.state.store(QpState::Reset as u32, Ordering::Release);
            r.in_use.store(0, Ordering::Release);
            r.incarnation.fetch_add(1, Ordering::Relaxed);
        }
        h.qps.lock().release(self.idx);
        h.qpns.lock().1.remove(&self.qpn);
        if *self.busy.get_mut() {
            self.send_cq.inner.busy_qps.fetch_sub(1, Ordering::Release);
        }
    }
}

fn allowed(from: QpState, to: QpState) -> Option<(QpAttrMask, QpAttrMask)> {
    use QpAttrMask as M;
    use QpState::*;
    let none = M::empty();
    match (from, to) {
        (_, Reset) | (_, Err) => Some((none, none)),
        (Reset, Init) => Some((M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none)),
        (Init, Init) => Some((none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS)),
        (Init, Rtr) => Some((
            M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
            M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
        )),
        (Rtr, Rts) => Some((
            M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
            M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
        )),
        (Rts, Rts) => Some((
            none,
            M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
        )),
        _ => None,
    }
}

impl QpInner {
    pub fn rec(&self) -> &QpRec {
        hi(self).seg.qp(self.idx).expect("own QP index")
    }

    pub fn state(&self) -> QpState {
        QpState::from_u32(self.rec().state.load(Ordering::Acquire))
    }

    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let h = hi(self);
        let mut sq = self.sq.lock();
        let cur = self.state();
        if mask.contains(QpAttrMask::CUR_STATE) && attr.cur_qp_state != cur {
            return Err(Error::InvalidArgument("cur_qp_state does not match"));
        }
        let new = if mask.contains(QpAttrMask::STATE) {
            attr.qp_state
        } else {
            cur
        };
        let (req, opt) = allowed(cur, new).ok_or(Error::IllegalTransition { from: cur, to: new })?;
        let given = mask - QpAttrMask::STATE - QpAttrMask::CUR_STATE;
        if !given.contains(req) {
            return Err(Error::InvalidMask("required attribute missing"));
        }
        if !(req | opt).contains(given) {
            return Err(Error::InvalidMask("attribute not allowed in this transition"));
        }
        let r = self.rec();
        if mask.contains(QpAttrMask::AV) {
            let dest = attr.dest.ok_or(Error::InvalidArgument("AV without destination"))?;
            let peer = Peer::resolve(h, dest)?;
            sq.tq = peer.seg.find_qp(attr.dest_qp_num);
            sq.peer = Some(peer);
            sq.attr.dest = Some(dest);
            sq.attr.dest_qp_num = attr.dest_qp_num;
            r.peer_nonce.store(dest.nonce, Ordering::Release);
            r.peer_qpn.store(attr.dest_qp_num, Ordering::Release);
        }
        if mask.contains(QpAttrMask::ACCESS_FLAGS) {
            r.access.store(attr.qp_access_flags.bits(), Ordering::Release);
            sq.attr.qp_access_flags = attr.qp_access_flags;
        }
        if mask.contains(QpAttrMask::MIN_RNR_TIMER) {
            r.min_rnr_timer.store(attr.min_rnr_timer as u32, Ordering::Release);
            sq.attr.min_rnr_timer = attr.min_rnr_timer;
        }
        if mask.contains(QpAttrMask::RNR_RETRY) {
            sq.attr.rnr_retry = attr.rnr_retry.min(7);
        }
        macro_rules! keep {
            ($m:ident, $f:ident) => {
                if mask.contains(QpAttrMask::$m) {
                    sq.attr.$f = attr.$f;
                }
            };
        }
        keep!(PKEY_INDEX, pkey_index);
        keep!(PORT, port_num);
        keep!(PATH_MTU, path_mtu);
        keep!(RQ_PSN, rq_psn);
        keep!(SQ_PSN, sq_psn);
        keep!(MAX_QP_RD_ATOMIC, max_rd_atomic);
        keep!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
        keep!(TIMEOUT, timeout);
        keep!(RETRY_CNT, retry_cnt);
        match new {
            QpState::Reset => {
                let _g = shm_lock(&r.rq_lock);
                r.state.store(QpState::Reset as u32, Ordering::Release);
                let t = r.rq_tail.load(Ordering::Acquire);
                r.rq_head.store(t, Ordering::Release);
                reset_ring(h, self.idx, r, false);
                r.peer_nonce.store(0, Ordering::Release);
                r.peer_qpn.store(0, Ordering::Release);
                r.incarnation.fetch_add(1, Ordering::Relaxed);
                sq.entries.clear();
                sq.peer = None;
                sq.tq = None;
                sq.ring_prod = 0;
                sq.ring_cons = 0;
                sq.zombies.clear();
                sq.attr = QpAttr::default();
                self.outstanding.store(0, Ordering::Relaxed);
                self.deadline.store(0, Ordering::Relaxed);
                self.note_busy(&sq);
            }
            QpState::Err => {
                responder::qp_error(&h.seg, &h.self_peer, self.idx);
                self.progress_locked(&mut sq);
            }
            s => r.state.store(s as u32, Ordering::Release),
        }
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let mut sq = self.sq.lock();
        let st = self.state();
        let mut res = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |err| Err(PostError { bad_wr_index: i, err });
            if !matches!(st, QpState::Rts | QpState::Err) {
                res = bad(Error::WrongQpState(st));
                break;
            }
            if sq.entries.len() >= self.cap.max_send_wr as usize {
                res = bad(Error::QueueFull("send queue"));
                break;
            }
            let inline = wr.flags.contains(SendFlags::INLINE);
            if inline {
                if wr.inline_data.len() > self.cap.max_inline_data as usize {
                    res = bad(Error::InvalidArgument("inline data too large"));
                    break;
                }
                if matches!(wr.opcode, WrOpcode::Read) || wr.opcode.is_atomic() {
                    res = bad(Error::InvalidArgument("inline READ/atomic"));
                    break;
                }
            } else if wr.sg_list.len() > self.cap.max_send_sge as usize {
                res = bad(Error::InvalidArgument("too many SGEs"));
                break;
            }
            sq.entries.push_back(Entry {
                wr_id: wr.wr_id,
                op: wr.opcode,
                flags: wr.flags,
                raddr: wr.remote_addr,
                rkey: wr.rkey,
                sges: if inline {
                    Small::new()
                } else {
                    Small::from_slice(wr.sg_list)
                },
                inline: if inline {
                    Small::from_slice(wr.inline_data)
                } else {
                    Small::new()
                },
                signaled: wr.flags.contains(SendFlags::SIGNALED) || self.cap.sq_sig_all,
                st: EState::Pending,
                rnr_left: None,
                atoms: 0,
                odp_naks: 0,
                inflight: false,
                parts_done: 0,
            });
        }
        self.progress_locked(&mut sq);
        res
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let h = hi(self);
        let r = self.rec();
        let _g = shm_lock(&r.rq_lock);
        let st = self.state();
        let mut res = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |err| Err(PostError { bad_wr_index: i, err });
            if st == QpState::Reset {
                res = bad(Error::WrongQpState(st));
                break;
            }
            if wr.sg_list.len() > self.cap.max_recv_sge as usize {
                res = bad(Error::InvalidArgument("too many SGEs"));
                break;
            }
            let tail = r.rq_tail.load(Ordering::Acquire);
            if tail - r.rq_head.load(Ordering::Acquire) >= self.cap.max_recv_wr as u64 {
                res = bad(Error::QueueFull("receive queue"));
                break;
            }
            let (w, sges) = h.seg.wqe(self.idx, tail);
            w.wr_id.store(wr.wr_id, Ordering::Relaxed);
            w.nsge.store(wr.sg_list.len() as u32, Ordering::Relaxed);
            for (d, s) in sges.iter().zip(wr.sg_list) {
                d.addr.store(s.addr, Ordering::Relaxed);
                d.len.store(s.length, Ordering::Relaxed);
                d.lkey.store(s.lkey, Ordering::Relaxed);
            }
            r.rq_tail.store(tail + 1, Ordering::Release);
        }
        if self.state() == QpState::Err {
            responder::flush_rq_locked(&h.seg, &h.self_peer, self.idx, r);
        }
        res
    }

    /// Progress the send queue if nobody else is doing it right now.
    pub fn progress(&self) {
        if let Some(mut sq) = self.sq.try_lock() {
            self.progress_locked(&mut sq);
        }
    }

    fn complete(&self, e: &Entry, status: WcStatus, byte_len: u32) {
        let h = hi(self);
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
            if cq::push(&h.seg, &h.self_peer, self.send_cq.idx(), &wc, false).is_err() {
                tracing::warn!(qpn = self.qpn, "send CQ overflow");
                self.rec().state.store(QpState::Err as u32, Ordering::Release);
            }
        }
    }

    /// Flush every remaining WR (QP in ERR): completed ones keep their status, the
    /// rest complete with WR_FLUSH_ERR.
    fn flush_all(&self, sq: &mut Sq) {
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

    pub(crate) fn progress_locked(&self, sq: &mut Sq) {
        if sq.entries.is_empty()
            && sq.zombies.is_empty()
            && self.outstanding.load(Ordering::Relaxed) == 0
            && self.deadline.load(Ordering::Relaxed) == 0
        {
            // Nothing queued, issued or waiting: no clock read, no bookkeeping (this
            // runs on every CQ poll of a spinning application). An ERR/RESET QP with an
            // empty SQ has nothing to flush either.
            self.note_busy(sq);
            return;
        }
        let now = sys::now_ns();
        self.last_progress.store(now, Ordering::Relaxed);
        requester::reap_zombies(self, sq, now);
        loop {
            if matches!(self.state(), QpState::Err | QpState::Reset) {
                self.flush_all(sq);
                break;
            }
            let mut changed = self.issue(sq, now);
            changed |= self.retire(sq, now);
            if !changed {
                break;
            }
        }
        let issued = sq
            .entries
            .iter()
            .filter(|e| matches!(e.st, EState::Issued { .. }))
            .count()
            + sq.zombies.len();
        self.outstanding.store(issued as u32, Ordering::Relaxed);
        let dl = sq
            .entries
            .iter()
            .find_map(|e| {
                if let EState::Rnr { until } | EState::OdpNak { until } = e.st {
                    Some(until)
                } else {
                    None
                }
            })
            .unwrap_or(0);
        let old_dl = self.deadline.swap(dl, Ordering::Relaxed);
        if (issued > 0 || dl != 0) && !self.in_active.swap(true, Ordering::AcqRel) {
            if let Some(me) = self.me.upgrade() {
                hi(self).activate(&me);
            }
        }
        if dl != 0 && dl != old_dl {
            // A new RNR timer: make the NIC thread recompute its sleep.
            hi(self).kick_nic();
        }
        self.note_busy(sq);
    }

    /// Keep the send CQ's `busy_qps` count in step with this SQ (call under the SQ
    /// lock after any change): busy while WRs are queued, issued or waiting on a timer
    /// (all in `entries`) or zombie ring slots remain; otherwise `progress` is a no-op
    /// and an idle `Cq::poll` may skip this QP.
    fn note_busy(&self, sq: &Sq) {
        let busy = !sq.entries.is_empty() || !sq.zombies.is_empty();
        if busy != self.busy.load(Ordering::Relaxed) {
            self.busy.store(busy, Ordering::Relaxed);
            let n = &self.send_cq.inner.busy_qps;
            if busy {
                n.fetch_add(1, Ordering::Release);
            } else {
                n.fetch_sub(1, Ordering::Release);
            }
        }
    }

    /// Start every WR that may start now. Returns whether anything changed.
    fn issue(&self, sq: &mut Sq, now: u64) -> bool {
        let mut changed = false;
        let mut i = 0;
        let mut earlier_issued = false;
        // An issued READ/atomic writes local memory only when it completes; a ring WR
        // that gathers local memory when issued waits for those whose local ranges it
        // overlaps (an implicit fence where the data would be stale; IB needs FENCE).
        let mut local_writes = Scratch::take(&LOCAL_WRITES);
        let mut odp_retries = 0;
        let slots = hi(self).seg.p.ring_slots as u64;
        while i < sq.entries.len() {
            match sq.entries[i].st {
                EState::Done { status, .. } => {
                    if !status.is_ok() {
                        break;
                    }
                    i += 1;
                    continue;
                }
                EState::Issued { sent, alone, .. } => {
                    earlier_issued = true;
                    note_local_writes(&sq.entries[i], &mut local_writes);
                    let parts = requester::ring_parts(&sq.entries[i], chunk(sq));
                    if sent < parts {
                        // Partly issued: its next parts first, nothing behind it before
                        // its last part.
                        match requester::issue_ring(self, sq, i, now, alone) {
                            requester::Issue::Issued => changed = true,
                            requester::Issue::Full => {}
                            requester::Issue::Failed(status) => {
                                self.fail_issued(sq, i, status, now);
                                return true;
                            }
                        }
                        if matches!(sq.entries[i].st, EState::Issued { sent, .. } if sent < parts) {
                            break;
                        }
                    }
                    if alone {
                        break;
                    }
                    i += 1;
                    continue;
                }
                EState::Rnr { until } | EState::OdpNak { until } if now < until => break,
                _ => {}
            }
            if requester::uses_ring(self, sq, &sq.entries[i]) {
                let op = sq.entries[i].op;
                // A ring WR gathers its payload from local memory when issued: it waits
                // for earlier READs/atomics into the same memory, whose data lands when
                // they complete.
                let gathers = !writes_local(&op);
                let odp = requester::ring_odp(sq, &sq.entries[i]);
                if (sq.entries[i].flags.contains(SendFlags::FENCE) && earlier_issued)
                    || (gathers && overlaps_local(&sq.entries[i], &local_writes))
                    || (odp && earlier_issued)
                {
                    break;
                }
                if sq.ring_prod - sq.ring_cons >= slots {
                    break;
                }
                if matches!(sq.entries[i].st, EState::OdpNak { .. }) {
                    self.go_back_n(sq, i);
                }
                match requester::issue_ring(self, sq, i, now, odp) {
                    requester::Issue::Issued => {
                        earlier_issued = true;
                        note_local_writes(&sq.entries[i], &mut local_writes);
                        changed = true;
                        let parts = requester::ring_parts(&sq.entries[i], chunk(sq));
                        if odp || matches!(sq.entries[i].st, EState::Issued { sent, .. } if sent < parts) {
                            break;
                        }
                    }
                    requester::Issue::Failed(status) => {
                        self.fail_issued(sq, i, status, now);
                        return true;
                    }
                    requester::Issue::Full => break,
                }
            } else {
                if earlier_issued {
                    break;
                }
                changed = true;
                if matches!(sq.entries[i].st, EState::OdpNak { .. }) {
                    self.go_back_n(sq, i);
                }
                match requester::exec_direct(self, sq, i) {
                    Outcome::OdpNak => {
                        self.odp_nak(sq, i, now);
                        return true;
                    }
                    Outcome::OdpRetry => {
                        odp_retries += 1;
                        if odp_retries > ODP_MAX_RETRIES {
                            sq.entries[i].st = EState::Done {
                                status: WcStatus::LocProtErr,
                                byte_len: 0,
                            };
                            return true;
                        }
                        continue;
                    }
                    Outcome::Done(status, byte_len) => {
                        sq.entries[i].st = EState::Done { status, byte_len };
                        if !status.is_ok() {
                            return true;
                        }
                    }
                    Outcome::Rnr(timer) => {
                        self.rnr(sq, i, timer, now);
                        return true;
                    }
                }
            }
            i += 1;
        }
        changed
    }

    /// WR `i` met a receiver not ready: retry after the responder's timer, or fail
    /// once the QP's `rnr_retry` count is used up (7 = forever).
    fn rnr(&self, sq: &mut Sq, i: usize, timer: u32, now: u64) {
        hi(self).seg.stats().rnr_naks.fetch_add(1, Ordering::Relaxed);
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
        let d = hi(self).cfg.rnr_delay.as_nanos() as u64 * timer.max(1) as u64;
        e.st = EState::Rnr { until: now + d };
    }

    /// Ring WR `i` failed locally (before or between its parts): the parts still out
    /// are answered into zombie slots.
    fn fail_issued(&self, sq: &mut Sq, i: usize, status: WcStatus, now: u64) {
        let Sq { entries, zombies, .. } = sq;
        let e = &mut entries[i];
        e.abandon_parts(zombies, now);
        e.st = EState::Done { status, byte_len: 0 };
    }

    /// ODP model: WR `i` was NAKed for a remote page fault. It waits `odp_timeout`;
    /// the later WRs already posted are on the wire behind it and execute at the
    /// target (READ/WRITE; they are redone after its retransmission, go-back-N).
    fn odp_nak(&self, sq: &mut Sq, i: usize, now: u64) {
        let e = &mut sq.entries[i];
        e.odp_naks += 1;
        if e.odp_naks > crate::odp::max_naks(&hi(self).cfg) {
            e.st = EState::Done {
                status: WcStatus::RetryExcErr,
                byte_len: 0,
            };
            return;
        }
        e.st = EState::OdpNak {
            until: now + hi(self).cfg.odp_timeout.as_nanos() as u64,
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

    /// ODP model: retransmit WR `i` after its NAK timeout together with every later
    /// WR already executed behind it (they go back to pending and are redone).
    fn go_back_n(&self, sq: &mut Sq, i: usize) {
        let mut n = 1;
        for e in sq.entries.iter_mut().skip(i + 1) {
            if !e.inflight {
                break;
            }
            e.inflight = false;
            e.atoms = 0;
            e.st = EState::Pending;
            n += 1;
        }
        hi(self).seg.stats().retransmissions.fetch_add(n, Ordering::Relaxed);
    }

    /// Complete finished WRs from the head, in order. Returns whether anything changed.
    fn retire(&self, sq: &mut Sq, now: u64) -> bool {
        let mut changed = false;
        while let Some(front) = sq.entries.front() {
            match front.st {
                EState::Issued { .. } => match requester::finish_ring(self, sq, now) {
                    Some(requester::RingDone::Done(status, byte_len)) => {
                        sq.entries[0].st = EState::Done { status, byte_len };
                        changed = true;
                    }
                    Some(requester::RingDone::Rnr(timer)) => {
                        self.rnr(sq, 0, timer, now);
                        return true;
                    }
                    Some(requester::RingDone::OdpNak) => {
                        self.odp_nak(sq, 0, now);
                        return true;
                    }
                    None => break,
                },
                EState::Done { status, byte_len } => {
                    let e = sq.entries.pop_front().expect("front exists");
                    self.complete(&e, status, byte_len);
                    changed = true;
                    if !status.is_ok() {
                        let h = hi(self);
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
}

/// Whether a WR writes local memory when it completes (READ, atomics): a later WR
/// that gathers local memory at issue waits for it.
fn writes_local(op: &WrOpcode) -> bool {
    matches!(op, WrOpcode::Read) || op.is_atomic()
}

scratch_slot!(LOCAL_WRITES: (u64, u64));

/// Record the local ranges an issued READ / atomic `e` writes when it completes.
fn note_local_writes(e: &Entry, out: &mut Vec<(u64, u64)>) {
    if writes_local(&e.op) && !e.flags.contains(SendFlags::INLINE) {
        out.extend(
            e.sges
                .iter()
                .filter(|s| s.length > 0)
                .map(|s| (s.addr, s.length as u64)),
        );
    }
}

/// Whether a WR that gathers local memory (`e`'s gather list) reads any of `writes`.
fn overlaps_local(e: &Entry, writes: &[(u64, u64)]) -> bool {
    !writes.is_empty()
        && !e.flags.contains(SendFlags::INLINE)
        && e.sges.iter().any(|s| {
            writes
                .iter()
                .any(|&(a, l)| s.addr < a + l && a < s.addr + s.length as u64)
        })
}

/// Bytes per ring part towards the SQ's peer.
fn chunk(sq: &Sq) -> u64 {
    sq.peer.as_ref().map_or(1, |p| p.seg.p.ring_max as u64)
}

/// The host of a CQ (for same-host checks).
impl Cq {
    pub(crate) fn inner_host(&self) -> &Arc<HostInner> {
        self.host_ref().inner()
    }
}

/// Re-executions of one WR whose local ODP pages were invalidated mid-copy.
const ODP_MAX_RETRIES: u32 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_table_matches_ib_rc_rules() {
        use QpState::*;
        for s in [Reset, Init, Rtr, Rts, Err] {
            assert!(allowed(s, Reset).is_some());
            assert!(allowed(s, Err).is_some());
        }
        assert!(allowed(Reset, Rtr).is_none());
        assert!(allowed(Reset, Rts).is_none());
        assert!(allowed(Init, Rts).is_none());
        assert!(allowed(Rtr, Init).is_none());
        assert!(allowed(Rts, Rtr).is_none());
        assert!(allowed(Err, Rts).is_none());
        assert!(allowed(Rts, Sqd).is_none(), "SQD is not modelled");
        let (req, _) = allowed(Init, Rtr).unwrap();
        assert!(req.contains(QpAttrMask::AV | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN));
        let (_, m) = QpAttr::rtr(
            crate::HostAddr {
                pid: 0,
                fd: 0,
                nonce: 1,
            },
            5,
        );
        assert!(m.contains(req));
        let (req, _) = allowed(Rtr, Rts).unwrap();
        assert!(QpAttr::rts(7).1.contains(req));
        let (req, _) = allowed(Reset, Init).unwrap();
        assert!(QpAttr::init(Access::empty()).1.contains(req));
    }

    /// The send CQ's busy count tracks SQ work: raised while a SEND waits out RNR
    /// retries (and `poll` keeps retrying it), back to zero once it completes, and
    /// released when a busy QP is destroyed.
    #[test]
    fn send_cq_busy_count_follows_sq_work() {
        use crate::{Host, HostConfig};
        use std::time::Duration;
        let h = Host::new(HostConfig::default()).unwrap();
        let ctx = h.open_context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (cq, rcq) = (ctx.create_cq(16, None).unwrap(), ctx.create_cq(16, None).unwrap());
        let a = pd.create_qp(&cq, &rcq, &QpInitAttr::default()).unwrap();
        let b = pd.create_qp(&rcq, &rcq, &QpInitAttr::default()).unwrap();
        let acc = Access::LOCAL_WRITE;
        a.connect(acc, h.addr(), b.qpn(), 7).unwrap();
        b.connect(acc, h.addr(), a.qpn(), 7).unwrap();
        let busy = || cq.inner.busy_qps.load(Ordering::Acquire);
        assert_eq!(busy(), 0);
        let src = pd.reg_mr_owned(vec![7u8; 8], acc).unwrap();
        let dst = pd.reg_mr_owned(vec![0u8; 8], acc).unwrap();
        let sge = [src.sge(0, 8)];
        a.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        // No receive posted: RNR, retried forever (rnr_retry 7).
        let mut out = [Wc::default(); 1];
        for _ in 0..50 {
            assert_eq!(cq.poll(&mut out).unwrap(), 0);
            assert_eq!(busy(), 1, "RNR-waiting SQ must keep the CQ busy");
            std::thread::sleep(Duration::from_micros(50));
        }
        let rs = [dst.sge(0, 8)];
        b.post_recv(&[RecvWr { wr_id: 9, sg_list: &rs }]).unwrap();
        let wc = cq.poll_wait(1, Duration::from_secs(5)).unwrap()[0];
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
        assert_eq!(busy(), 0);
        assert_eq!(dst.to_vec(0, 8), vec![7u8; 8]);
        // A QP destroyed with work still queued gives its count back.
        a.post_send(&[SendWr::new(2, WrOpcode::Send, &sge)]).unwrap();
        assert_eq!(busy(), 1);
        drop(a);
        // The NIC thread may briefly hold its own reference (RNR timer scan).
        let t = std::time::Instant::now();
        while busy() != 0 && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(busy(), 0);
    }
}
