//! The QP handle: creation on a PD, the IB state machine with attribute masks
//! (`modify`), `post_send` (post-time validation into the software send queue) and
//! `post_recv` (into the shared RQ ring). The QP's engines live in `nic`.

use crate::error::{Error, PostError, Result};
use crate::hw::segment::shm_lock;
use crate::nic::qp_ctx::{reset_ring, EState, Entry, QpCtx, UdTarget};
use crate::nic::responder;
use crate::nic::small::Small;
use crate::objects::cq::Cq;
use crate::objects::pd::Pd;
use crate::objects::srq::Srq;
use crate::verbs::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Pd {
    /// Create an RC QP on this PD.
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, attr: &QpInitAttr) -> Result<Qp> {
        Qp::create(self.clone(), send_cq, recv_cq, None, attr, QpType::Rc)
    }

    /// Create a connected QP of `qp_type` (RC or UC) on this PD, taking its receives
    /// from `srq` if given (then `post_recv` on the QP is refused).
    pub fn create_qp_of(
        &self,
        qp_type: QpType,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: Option<&Srq>,
        attr: &QpInitAttr,
    ) -> Result<Qp> {
        Qp::create(self.clone(), send_cq, recv_cq, srq, attr, qp_type)
    }
}

/// A connected queue pair (reliable, or unreliable: [`QpType`]).
pub struct Qp {
    inner: Arc<QpCtx>,
    // The handles the QP was created with, alive while it is.
    _pd: Pd,
    _send_cq: Cq,
    _recv_cq: Cq,
    _srq: Option<Srq>,
}

impl Qp {
    fn create(pd: Pd, send_cq: &Cq, recv_cq: &Cq, srq: Option<&Srq>, attr: &QpInitAttr, qp_type: QpType) -> Result<Qp> {
        let host = pd.host();
        if srq.is_some_and(|s| s.pd().host().addr() != host.addr()) {
            return Err(Error::InvalidArgument("SRQ of another host"));
        }
        let inner = QpCtx::create(
            host.inner().clone(),
            host.qps().clone(),
            pd.id(),
            &send_cq.inner.ring,
            &recv_cq.inner.ring,
            attr,
            qp_type,
        )?;
        {
            let mut l = send_cq.inner.qps.lock();
            l.retain(|w| w.strong_count() > 0);
            l.push(Arc::downgrade(&inner));
        }
        if let Some(s) = srq {
            inner.rec().srq.store(s.idx() + 1, Ordering::Release);
        }
        Ok(Qp {
            inner,
            _pd: pd,
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            _srq: srq.cloned(),
        })
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Put the QP in protection sub-domain `domain` (0 = none): with an rkey, its
    /// peer reaches only MRs of the PD without a domain or of this one
    /// ([`crate::Pd::reg_mr_iova_in_domain`]). Set it before the QP is connected.
    pub fn set_domain(&self, domain: u32) {
        self.inner.rec().domain.store(domain, Ordering::Release);
    }

    /// Transport service.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.inner.state()
    }

    /// Whether the connected peer's process is gone (checked through its liveness
    /// token, which PID reuse cannot fool). `false` while not connected, and for a
    /// peer in this process. For layers above the NIC that wait on a peer outside
    /// any work request (an answer to a control message): the NIC itself notices a
    /// dead peer only on a request it has outstanding.
    pub fn peer_gone(&self) -> bool {
        let peer = self.inner.sq.lock().peer.clone();
        peer.is_some_and(|p| !p.alive())
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

    /// Connect helper: INIT (with `access`), RTR to (`dest`, `dest_qpn`), RTS (a UC
    /// QP without the attributes only RC has).
    pub fn connect(&self, access: Access, dest: HostAddr, dest_qpn: u32, rnr_retry: u8) -> Result<()> {
        use QpAttrMask as M;
        let (rc_rtr, rc_rts) = if self.qp_type() == QpType::Uc {
            (
                M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
                M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
            )
        } else {
            (M::empty(), M::empty())
        };
        let (a, m) = QpAttr::init(access);
        self.modify(&a, m)?;
        let (a, m) = QpAttr::rtr(dest, dest_qpn);
        self.modify(&a, m - rc_rtr)?;
        let (a, m) = QpAttr::rts(rnr_retry);
        self.modify(&a, m - rc_rts)
    }
}

/// The (required, optional) attributes of a transition (IB's QP state table), `None`
/// if it is illegal; UC has no responder resources, timeouts or retries to set. Public
/// for other implementations of the verbs state machine (the verbs shim's NP-RDMA mode).
pub fn transition_attrs(qp_type: QpType, from: QpState, to: QpState) -> Option<(QpAttrMask, QpAttrMask)> {
    use QpAttrMask as M;
    use QpState::*;
    let none = M::empty();
    if qp_type == QpType::Ud {
        // IB's UD column (the kernel's ib_modify_qp_is_ok): a Q_Key instead of access
        // flags, no path, no responder resources, timeouts or retries.
        return match (from, to) {
            (_, Reset) | (_, Err) => Some((none, none)),
            (Reset, Init) => Some((M::PKEY_INDEX | M::PORT | M::QKEY, none)),
            (Init, Init) => Some((none, M::PKEY_INDEX | M::PORT | M::QKEY)),
            (Init, Rtr) => Some((none, M::PKEY_INDEX | M::QKEY)),
            (Rtr, Rts) => Some((M::SQ_PSN, M::CUR_STATE | M::QKEY)),
            (Rts, Rts) => Some((none, M::CUR_STATE | M::QKEY)),
            _ => None,
        };
    }
    if qp_type == QpType::Uc {
        return match (from, to) {
            (Init, Rtr) => Some((
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            )),
            (Rtr, Rts) => Some((
                M::SQ_PSN,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
            )),
            (Rts, Rts) => Some((none, M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE)),
            _ => transition_attrs(QpType::Rc, from, to),
        };
    }
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

impl QpCtx {
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let h = &*self.nic;
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
        let (req, opt) =
            transition_attrs(self.qp_type, cur, new).ok_or(Error::IllegalTransition { from: cur, to: new })?;
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
            let peer = h.resolve_peer(dest)?;
            sq.tq = match &peer.link {
                // Across the network: the shadow record standing for the peer's QP.
                Some(l) => l.shadow_qp(attr.dest_qp_num, h.addr.nonce, self.qpn),
                None => peer.seg.find_qp(attr.dest_qp_num),
            };
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
        if mask.contains(QpAttrMask::QKEY) {
            r.qkey.store(attr.qkey, Ordering::Release);
            sq.attr.qkey = attr.qkey;
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
        if let Some(link) = sq.peer.as_ref().and_then(|p| p.link.clone()) {
            // A QP connected across the network: its transport follows its state.
            match new {
                QpState::Rtr | QpState::Rts if new != cur => link.connect(&crate::hw::peer::LinkConn {
                    idx: self.idx,
                    qpn: self.qpn,
                    dest_qpn: sq.attr.dest_qp_num,
                    tq: sq.tq,
                    rts: new == QpState::Rts,
                    rq_psn: sq.attr.rq_psn,
                    sq_psn: sq.attr.sq_psn,
                    mtu: sq.attr.path_mtu,
                    timeout: sq.attr.timeout,
                    retry_cnt: sq.attr.retry_cnt,
                    max_rd_atomic: sq.attr.max_rd_atomic,
                })?,
                QpState::Reset | QpState::Err => link.disconnect(self.qpn),
                _ => {}
            }
        }
        match new {
            QpState::Reset => {
                self.end_inbound();
                let _g = shm_lock(&r.rq_lock);
                r.state.store(QpState::Reset as u32, Ordering::Release);
                let t = r.rq_tail.load(Ordering::Acquire);
                r.rq_head.store(t, Ordering::Release);
                reset_ring(h, self.idx, r, false);
                r.peer_nonce.store(0, Ordering::Release);
                r.peer_qpn.store(0, Ordering::Release);
                r.qkey.store(0, Ordering::Release);
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
                // Its completions still queued go with its state.
                self.send_cq.discard_qp(self.qpn);
                self.recv_cq.discard_qp(self.qpn);
            }
            QpState::Err => {
                if cur == QpState::Reset {
                    // RESET -> ERR is legal (qp_error leaves a RESET QP alone,
                    // as a responder error must).
                    r.state.store(QpState::Err as u32, Ordering::Release);
                }
                responder::qp_error(&h.seg, &h.self_peer, self.idx);
                self.end_inbound();
                self.progress_locked(&mut sq);
            }
            s => r.state.store(s as u32, Ordering::Release),
        }
        Ok(())
    }

    /// End a message that was arriving in parts: a receive it took off a shared queue
    /// completes (flushed) now, as the message never will.
    fn end_inbound(&self) {
        let h = &*self.nic;
        let mut srv = h.ring_server.lock();
        if let Some(cell) = srv.inbound(self.idx) {
            responder::abandon(&h.seg, &h.self_peer, self.rec(), cell);
        }
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
            if self.qp_type == QpType::Uc && (matches!(wr.opcode, WrOpcode::Read) || wr.opcode.is_atomic()) {
                res = bad(Error::InvalidArgument(
                    "READ and atomics need a reliable connection (UC QP)",
                ));
                break;
            }
            let ud = if self.qp_type == QpType::Ud {
                if !matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendImm(_)) {
                    res = bad(Error::InvalidArgument("a UD QP sends only SEND / SEND_WITH_IMM"));
                    break;
                }
                let Some(d) = wr.ud else {
                    res = bad(Error::InvalidArgument("a UD send needs a destination (address handle)"));
                    break;
                };
                let peer = match self.nic.resolve_peer(d.dest) {
                    Ok(p) => p,
                    Err(e) => {
                        res = bad(e);
                        break;
                    }
                };
                let qkey = if d.remote_qkey & 0x8000_0000 != 0 {
                    self.rec().qkey.load(Ordering::Relaxed)
                } else {
                    d.remote_qkey
                };
                Some(UdTarget {
                    peer,
                    dest: d.dest,
                    qpn: d.remote_qpn,
                    qkey,
                })
            } else {
                None
            };
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
                retries: 0,
                ud,
            });
        }
        self.progress_locked(&mut sq);
        res
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let h = &*self.nic;
        let r = self.rec();
        if wrs.is_empty() {
            return Ok(());
        }
        if r.srq.load(Ordering::Relaxed) != 0 {
            return Err(PostError {
                bad_wr_index: 0,
                err: Error::InvalidArgument("the QP receives from a shared receive queue"),
            });
        }
        let _g = shm_lock(&r.rq_lock);
        let st = self.state();
        if st == QpState::Reset {
            return Err(PostError {
                bad_wr_index: 0,
                err: Error::WrongQpState(st),
            });
        }
        let res = responder::post_wqes(&h.seg, self.idx, r, self.cap.max_recv_wr, self.cap.max_recv_sge, wrs)
            .map_err(|(bad_wr_index, err)| PostError { bad_wr_index, err });
        if self.state() == QpState::Err {
            responder::flush_rq_locked(&h.seg, &h.self_peer, self.idx, r);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_table_matches_ib_rc_rules() {
        use QpState::*;
        for s in [Reset, Init, Rtr, Rts, Err] {
            assert!(transition_attrs(QpType::Rc, s, Reset).is_some());
            assert!(transition_attrs(QpType::Rc, s, Err).is_some());
        }
        assert!(transition_attrs(QpType::Rc, Reset, Rtr).is_none());
        assert!(transition_attrs(QpType::Rc, Reset, Rts).is_none());
        assert!(transition_attrs(QpType::Rc, Init, Rts).is_none());
        assert!(transition_attrs(QpType::Rc, Rtr, Init).is_none());
        assert!(transition_attrs(QpType::Rc, Rts, Rtr).is_none());
        assert!(transition_attrs(QpType::Rc, Err, Rts).is_none());
        assert!(transition_attrs(QpType::Rc, Rts, Sqd).is_none(), "SQD is not modelled");
        let (req, _) = transition_attrs(QpType::Rc, Init, Rtr).unwrap();
        assert!(req.contains(QpAttrMask::AV | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN));
        let (_, m) = QpAttr::rtr(
            HostAddr {
                pid: 0,
                fd: 0,
                nonce: 1,
            },
            5,
        );
        assert!(m.contains(req));
        let (req, _) = transition_attrs(QpType::Rc, Rtr, Rts).unwrap();
        assert!(QpAttr::rts(7).1.contains(req));
        let (req, _) = transition_attrs(QpType::Rc, Reset, Init).unwrap();
        assert!(QpAttr::init(Access::empty()).1.contains(req));
    }

    #[test]
    fn uc_transitions_need_no_responder_resources_timeouts_or_retries() {
        use QpAttrMask as M;
        use QpState::*;
        for (from, to) in [(Reset, Init), (Init, Init), (Rts, Err), (Init, Reset)] {
            assert_eq!(
                transition_attrs(QpType::Uc, from, to),
                transition_attrs(QpType::Rc, from, to)
            );
        }
        let (req, opt) = transition_attrs(QpType::Uc, Init, Rtr).unwrap();
        assert_eq!(req, M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN);
        assert!(!(req | opt).intersects(M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER));
        let (req, opt) = transition_attrs(QpType::Uc, Rtr, Rts).unwrap();
        assert_eq!(req, M::SQ_PSN);
        assert!(!(req | opt).intersects(M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC));
        assert!(transition_attrs(QpType::Uc, Reset, Rts).is_none());
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
        let busy = || cq.inner.ring.busy_qps.load(Ordering::Acquire);
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
