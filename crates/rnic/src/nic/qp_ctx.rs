//! The QP context (rxe's `rxe_qp`): a QP as the engines hold it (its record in the
//! segment, its software send queue's entries, its CQ rings), creation with caps and
//! chosen QPNs, the request-ring reset, destruction; the host's list of QPs awaiting
//! the NIC thread. The send queue's driver is `sq`, its engines `requester` and
//! `completer`; the verbs on a QP are the handle's (`objects::qp`).

use crate::error::{Error, Result};
use crate::hw::peer::Peer;
use crate::hw::segment::{self, QpRec};
use crate::nic::cq_ring::CqRing;
use crate::nic::small::Small;
use crate::nic::state::Nic;
use crate::verbs::*;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
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
    /// Transport retries used: sends that met no QP ready to take them (what a fabric
    /// drops, unacknowledged), see `QpCtx::unanswered`.
    pub retries: u8,
    /// A UD send's destination, resolved at post time.
    pub ud: Option<UdTarget>,
}

/// Where a UD send goes: the resolved peer host, its address (the GRH's `dgid`), the
/// destination QPN and the Q_Key presented (the QP's own already substituted for one
/// with the high bit set).
pub(crate) struct UdTarget {
    pub peer: Arc<Peer>,
    pub dest: HostAddr,
    pub qpn: u32,
    pub qkey: u32,
}

impl Entry {
    /// Complete as sent: what an unreliable connection reports for a WR once it left,
    /// whatever the responder did with it.
    pub fn complete_as_sent(&mut self) {
        let len = self.len();
        self.st = EState::Done {
            status: WcStatus::Success,
            byte_len: len as u32,
        };
    }

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
    /// Rewind generation carried by every ring request (see `segment::RING_ST_SEQ`):
    /// moves on when the requester goes back to resend after an RNR.
    pub gen: u16,
    /// Ring requests whose doorbell bits are set but whose target NIC thread was not
    /// yet woken for them (`QpCtx::issue` wakes it once per pass, see
    /// `requester::BELL_BATCH`).
    pub bells: u32,
}

/// A host's QPs as its NIC thread and ring servers find them.
#[derive(Default)]
pub(crate) struct HostQps {
    /// The QPs with deferred work (outstanding ring requests, RNR waits), attended by
    /// the NIC thread. A QP joins without a wakeup: the NIC thread looks at this list
    /// at least every `thread::MAX_SLEEP_NS`; RNR deadlines kick it explicitly, and
    /// arming a CQ too. Waking it for every request would put a futex wake on the
    /// latency path.
    pub active: Mutex<Vec<Weak<QpCtx>>>,
    /// Every QP of the host by its index (a later QP at the same index replaces a
    /// destroyed one): whoever serves a QP's incoming requests retires that QP's
    /// answered requests first, listed as active or not yet.
    by_idx: Mutex<HashMap<u32, Weak<QpCtx>>>,
}

impl HostQps {
    /// The live QP at index `idx`, if any.
    pub fn get(&self, idx: u32) -> Option<Arc<QpCtx>> {
        self.by_idx.lock().get(&idx)?.upgrade()
    }
}

/// A QP as the engines hold it (rxe's `rxe_qp`); the public handle is `Qp`.
pub(crate) struct QpCtx {
    pub nic: Arc<Nic>,
    /// The host's QP lists (this QP joins `active` when it has deferred work).
    pub qps: Arc<HostQps>,
    /// The PD number.
    pub pd: u32,
    pub idx: u32,
    pub qpn: u32,
    pub send_cq: Arc<CqRing>,
    /// Keeps the receive CQ's ring alive while the QP exists; a RESET drops the QP's
    /// completions queued in it.
    pub recv_cq: Arc<CqRing>,
    pub cap: QpInitAttr,
    pub qp_type: QpType,
    pub sq: Mutex<Sq>,
    /// Number of ring requests in flight (NIC-thread bookkeeping).
    pub outstanding: AtomicU32,
    /// Earliest RNR retry time (ns), 0 = none.
    pub deadline: AtomicU64,
    pub last_progress: AtomicU64,
    /// Whether the QP is on the host's active list (NIC-thread attention).
    pub in_active: std::sync::atomic::AtomicBool,
    /// Whether this QP counts in its send CQ's `busy_qps` (written under the SQ lock).
    pub busy: std::sync::atomic::AtomicBool,
    pub me: Weak<QpCtx>,
}

impl QpCtx {
    /// Claim a QP of `h` on PD `pd` completing into `send_cq` / `recv_cq`.
    pub fn create(
        h: Arc<Nic>,
        qps: Arc<HostQps>,
        pd: u32,
        send_cq: &Arc<CqRing>,
        recv_cq: &Arc<CqRing>,
        attr: &QpInitAttr,
        qp_type: QpType,
    ) -> Result<Arc<QpCtx>> {
        let c = &h.cfg;
        if !Arc::ptr_eq(&send_cq.nic, &h) || !Arc::ptr_eq(&recv_cq.nic, &h) {
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
                    let (lo, hi) = h.qpn_range;
                    let mut n = q.0;
                    loop {
                        if n >= hi {
                            n = lo;
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
        r.pd.store(pd, Ordering::Relaxed);
        r.access.store(0, Ordering::Relaxed);
        r.send_cq.store(send_cq.idx, Ordering::Relaxed);
        r.recv_cq.store(recv_cq.idx, Ordering::Relaxed);
        r.min_rnr_timer.store(0, Ordering::Relaxed);
        r.peer_nonce.store(0, Ordering::Relaxed);
        r.peer_qpn.store(0, Ordering::Relaxed);
        r.max_recv_sge.store(attr.max_recv_sge, Ordering::Relaxed);
        let kind = match qp_type {
            QpType::Rc => 0,
            QpType::Uc => segment::QP_UC,
            QpType::Ud => segment::QP_UD,
        };
        r.unreliable.store(kind, Ordering::Relaxed);
        r.qkey.store(0, Ordering::Relaxed);
        r.domain.store(0, Ordering::Relaxed);
        r.srq.store(0, Ordering::Relaxed);
        r.rq_depth.store(attr.max_recv_wr, Ordering::Relaxed);
        let t = r.rq_tail.load(Ordering::Relaxed);
        r.rq_head.store(t, Ordering::Relaxed);
        reset_ring(&h, idx, r, true);
        r.in_use.store(1, Ordering::Release);
        let q = Arc::new_cyclic(|me| QpCtx {
            nic: h.clone(),
            qps: qps.clone(),
            pd,
            idx,
            qpn,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            cap: *attr,
            qp_type,
            sq: Mutex::new(Sq {
                entries: VecDeque::with_capacity(attr.max_send_wr as usize),
                attr: QpAttr::default(),
                peer: None,
                tq: None,
                ring_prod: 0,
                ring_cons: 0,
                zombies: Vec::new(),
                gen: 0,
                bells: 0,
            }),
            outstanding: AtomicU32::new(0),
            deadline: AtomicU64::new(0),
            last_progress: AtomicU64::new(0),
            in_active: std::sync::atomic::AtomicBool::new(false),
            busy: std::sync::atomic::AtomicBool::new(false),
            me: me.clone(),
        });
        qps.by_idx.lock().insert(idx, Arc::downgrade(&q));
        Ok(q)
    }

    /// A request of this QP is about to reach its peer (call under the SQ lock,
    /// before the request is visible). It can be answered, and the peer's reply to
    /// it reach this host, before `QpCtx::progress_locked` recounts `outstanding` at its
    /// end: raised now (the request's Release store publishes it), whoever
    /// delivers that reply sees a QP to retire first and waits for our lock
    /// (`thread::retire_answered`), so our completion precedes the reply's.
    pub(crate) fn note_issuing(&self) {
        self.outstanding.fetch_max(1, Ordering::Relaxed);
    }

    /// The status a WR that ended with `status` completes with: on an unreliable
    /// connection nothing comes back from the responder, so its refusals (and a
    /// missing answer) complete the WR successfully, as sent.
    pub(crate) fn sent_status(&self, status: WcStatus, byte_len: u32, len: u64) -> (WcStatus, u32) {
        if self.qp_type != QpType::Rc && status.is_remote() {
            (WcStatus::Success, len as u32)
        } else {
            (status, byte_len)
        }
    }

    pub fn rec(&self) -> &QpRec {
        self.nic.seg.qp(self.idx).expect("own QP index")
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        QpState::from_u32(self.rec().state.load(Ordering::Acquire))
    }
}

/// Restart QP `idx`'s request ring at slot 0. A new QP (`fresh`) starts with every
/// slot free. A QP moved to RESET keeps the answers it already gave (its initiator may
/// still be taking them: a SEND delivered before the reset completes as delivered) and
/// answers the requests it had not served with RETRY_EXC_ERR, as a RESET QP drops
/// packets; the initiator frees those slots (`requester::issue_ring` frees an answer
/// left in a slot it is about to use). A UD QP's ring is emptied (datagrams are never
/// answered). Excludes the thread serving the rings.
pub(crate) fn reset_ring(h: &Nic, idx: u32, r: &QpRec, fresh: bool) {
    let _srv = h.ring_server.lock();
    let ud = r.unreliable.load(Ordering::Relaxed) == segment::QP_UD;
    for s in 0..h.seg.p.ring_slots as u64 {
        let slot = h.seg.slot(idx, s).0;
        if ud || fresh {
            // A new QP starts with every slot free. Datagrams are never answered:
            // what waits is dropped, and a slot left claimed by a producer that died
            // mid-fill is recovered (one still filling publishes a datagram the
            // server checks like any other).
            slot.state.store(segment::SLOT_FREE, Ordering::Release);
            continue;
        }
        let st = slot.state.load(Ordering::Acquire);
        if st == segment::SLOT_REQ || st == segment::SLOT_BUSY {
            slot.status.store(WcStatus::RetryExcErr as u32, Ordering::Relaxed);
            slot.state.store(segment::SLOT_DONE, Ordering::Release);
        }
    }
    r.ring_cons.0.store(0, Ordering::Release);
}

impl Drop for QpCtx {
    fn drop(&mut self) {
        if let Some(l) = self.sq.get_mut().peer.as_ref().and_then(|p| p.link.as_ref()) {
            l.disconnect(self.qpn);
        }
        let h = &*self.nic;
        if let Some(r) = h.seg.qp(self.idx) {
            r.state.store(QpState::Reset as u32, Ordering::Release);
            r.in_use.store(0, Ordering::Release);
            r.incarnation.fetch_add(1, Ordering::Relaxed);
        }
        h.qps.lock().release(self.idx);
        h.qpns.lock().1.remove(&self.qpn);
        if *self.busy.get_mut() {
            self.send_cq.busy_qps.fetch_sub(1, Ordering::Release);
        }
    }
}
