//! Per-QP state ([`QpState`]): the NIC data and control QPs, the command
//! ring, the ordering table, the reorder buffer, outstanding operations and
//! target requests; sending control messages, delivering completions in
//! post order (RC's error rule), flushing, and promoting the lean-path
//! operation into the general structures.

use std::collections::VecDeque;
use std::sync::Arc;

use smallvec::SmallVec;

use super::backend::Backend;
use super::dev::{inline_max, zero_sges, Dev};
use super::lease::{HeldLeases, SeenPages};
use super::op::{comp_op, FastOp, Op, RbBatch, Retry, Scratch, Stage, TReq};
use super::types::{Endpoint, Error, RecvWr, SendWr, PS};
use super::ucq::UCq;
use super::wrid::{WrKind, WrTag};
use crate::cmdq::{self, Reassembler};
use crate::ctrl::{Repr, SLOT};
use crate::keymap::PeerKeys;
use crate::nic::{
    Access, CompOp, Completion, NicBuf as _, NicMr as _, NicQp as _, PeerAddr, QpSpec, RecvRequest,
    Sge, WcStatus, WorkRequest, WrOp,
};
use crate::ordering::{Admit, OrderTable, Range};
use crate::pending::Pending;
use crate::plan::order_desc;
use crate::rob::CompletionOrder;
use crate::seen_versions::SeenVersions;
use crate::trace::{mark, Step};

/// Slots of a QP's [`SeenVersions`] (version words of 64 recent pages).
const SEEN_SLOTS: usize = 64;

/// The SGE of an inline SEND's payload `s` (copied at post time: no key).
fn inline_sge(s: &[u8]) -> [Sge; 1] {
    [Sge {
        addr: s.as_ptr() as u64,
        length: s.len() as u32,
        lkey: 0,
    }]
}

/// A QP's NIC resources: what [`QpState::renew`] keeps.
struct NicParts<N: Backend> {
    data: N::Qp,
    ctrl: Option<N::Qp>,
    ring: N::Buf,
    scratch: N::Buf,
    nslots: u32,
    slot_size: usize,
}

/// How long the inbound message at the head of a QP's queue waits for a RECV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RnrWait {
    /// Not waiting (no message, or a RECV is there).
    Idle,
    /// Until then; answered RNR_RETRY_EXC_ERR if no RECV came.
    Until(std::time::Instant),
    /// Until a RECV comes (the sender's `rnr_retry` is 7).
    Forever,
}

/// The control QP's number: the data QP's with this bit set.
pub const CTRL_QPN_BIT: u32 = 1 << 23;

/// Deepest QP (application WRs per queue): 1024, what qperf and libfabric ask of a
/// device. Each WR of the depth holds a read-back scratch slot of the QP (two pages
/// by default: 8 MiB of NIC buffer at full depth).
pub const MAX_QP_DEPTH: u32 = 1024;

/// A shared receive queue's WQEs (`Pd::create_srq`): the QPs attached to it
/// take their receives from here, in post order, under the engine lock like
/// the rest of the state (the mutex is never contended).
pub(crate) struct SrqShared {
    pub(super) recvs: parking_lot::Mutex<VecDeque<RecvWr>>,
    pub(super) depth: u32,
    pub(super) pd: u32,
}

pub(crate) struct QpState<N: Backend> {
    pub(super) data: N::Qp,
    /// The control QP; `None`: the control channel rides on the data QP
    /// (`Config::ctrl_on_data_qp`, see [`QpState::ctrl_qp`]).
    pub(super) ctrl: Option<N::Qp>,
    /// Command-slot receive ring (from the NIC-shared DMA pool if possible:
    /// `Nic::alloc_ring_buf`).
    pub(super) ring: N::Buf,
    pub(super) scratch: N::Buf,
    pub(super) idx: usize,
    pub(super) gen: u8,
    pub(super) qpn: u32,
    pub(super) pd: u32,
    /// The application's remote access flags of this QP (`qp_access_flags`):
    /// the data QP's NIC access flags (one-sided requests) and checked by the
    /// target CPU for two-sided ones (see `serve::grant`).
    pub(super) remote_access: Access,
    /// User-space mode: the data QP grants every right at the NIC whatever
    /// `remote_access` says — only the peer's reverse operations into
    /// temporary MRs reach it (a NIC there cannot honour `Access::ANY_QP`),
    /// and the application's flags are enforced by the target's check.
    nic_all_rights: bool,
    pub(super) depth: u32,
    pub(super) nslots: u32,
    pub(super) slot_size: usize,
    pub(super) scratch_free: Vec<u32>,
    pub(super) send_cq: Arc<UCq>,
    pub(super) recv_cq: Arc<UCq>,
    pub(super) connected: bool,
    /// An unreliable-connected QP (`Qp::set_unreliable`): READ and atomics are
    /// refused at post; what the responder refuses is dropped there, and the
    /// requester's WR completes successfully (nothing comes back on UC).
    pub(super) unreliable: bool,
    pub(super) dead: bool,
    /// Moved to ERR by the application (`retire::set_error`): later posts are
    /// accepted and complete with WR_FLUSH_ERR, as on verbs hardware.
    pub(super) errored: bool,
    pub(super) peer: PeerKeys,
    /// The peer's page versions the last checks read ([`SeenVersions`]);
    /// cleared whenever `peer` changes.
    pub(super) peer_versions: SeenVersions,
    /// The peer has queried our key table (its initial sync happened): from
    /// then on new MRs and revocations are pushed to it. Before that its QP
    /// may not even be connected, and its first use syncs everything.
    pub(super) keys_served: bool,
    pub(super) key_wait: Vec<u32>,
    /// Sequence number the next posted WR gets.
    pub(super) next_seq: u64,
    /// WRs posted before the pending initial KeyQuery was sent (`seq` below
    /// this) may wait for its answer; later ones need their own query.
    pub(super) sync_cover: u64,
    pub(super) reasm: Reassembler,
    /// Emit buffer of [`QpState::send_ctrl`] (reused: no allocation per message).
    pub(super) emit_buf: Vec<u8>,
    pub(super) backlog: VecDeque<[u8; SLOT]>,
    pub(super) ctrl_out: u32,
    pub(super) order: OrderTable<u32>,
    pub(super) rob: CompletionOrder<Completion>,
    pub(super) ops: Pending<Op<N>>,
    pub(super) recvs: VecDeque<RecvWr>,
    /// The shared receive queue this QP takes its receives from instead of
    /// `recvs` (`Qp::attach_srq`).
    pub(super) srq: Option<Arc<SrqShared>>,
    pub(super) inbound: VecDeque<Repr<'static>>,
    /// The message at the head of `inbound` waits for a RECV (RC's
    /// receiver-not-ready rule, `serve::rnr_hold`): until when.
    pub(super) rnr_wait: RnrWait,
    /// When the senders of held messages were last told so
    /// (`serve::rnr_refresh`).
    pub(super) rnr_refreshed: std::time::Instant,
    /// A message of the peer ran out of RNR retries: its QP failed, so what it
    /// sent after is dropped, as RC's responder discards the packets behind
    /// the one it NAKed.
    pub(super) rnr_failed: bool,
    /// This QP's `rnr_retry` as a requester (0–7, 7 = forever): carried by
    /// its SENDs and WRITE_WITH_IMM notices to the receiver.
    pub(super) rnr_retry: u8,
    /// This QP's `min_rnr_timer` as a responder (IB's 5-bit code, see
    /// [`crate::nic::rnr_timer`]).
    pub(super) min_rnr_timer: u8,
    pub(super) rdv_busy: bool,
    pub(super) treqs: Pending<TReq<N>>,
    /// Unsignaled WRITEs waiting for their read-back, in post order.
    pub(super) deferred: Vec<u32>,
    /// Read-backs of deferred WRITEs are due for ops posted before this
    /// sequence number (the last signaled WR's).
    pub(super) flush_seq: u64,
    pub(super) batches: Pending<RbBatch<N>>,
    /// The operation on the lean path, if any (the `fast` file).
    pub(super) fast: Option<FastOp<N>>,
    /// Pending id of the last lean-path operation promoted to the general
    /// path (its NIC completions are routed there).
    pub(super) fast_promoted: Option<u32>,
    /// Largest READ/WRITE the two-sided path carries inline.
    pub(super) inline_max: u64,
    /// The last large READ (≥ `PlanConfig::probe_min`) of this QP found a
    /// target page out: the next ones probe versions first. A probe that
    /// finds every page in clears it, so a QP without faults never probes.
    pub(super) probe_hint: bool,
    /// When the last liveness probe of the peer went out
    /// ([`QpState::probe_peer`]).
    pub(super) probed: Option<std::time::Instant>,
    /// The leases the peer lent this QP (user-space mode): READs/WRITEs of
    /// their ranges go one-sided.
    pub(super) held: HeldLeases,
    /// First pages of the peer's recent requests that asked for a lease
    /// (target side).
    pub(super) seen: SeenPages,
}

impl<N: Backend> QpState<N> {
    /// A new QP of PD `pd`; `qpn`: the number its data QP must have (a QP
    /// reset to RESET keeps its number), `None` = the NIC's choice.
    pub fn create(
        sh: &Dev<N>,
        pd: u32,
        send_cq: Arc<UCq>,
        recv_cq: Arc<UCq>,
        depth: u32,
        qpn: Option<u32>,
    ) -> Result<QpState<N>, Error> {
        if depth == 0 || depth > MAX_QP_DEPTH {
            return Err(Error::Invalid("QP depth must be 1..=MAX_QP_DEPTH (1024)"));
        }
        // The NIC QPs' depths below (data: 4 WRs per application WR + 16;
        // control: its slot ring; both on the data QP when it carries the
        // control channel) must fit the device: a clear error here, not the
        // device's bare EINVAL.
        let shared = sh.cfg.ctrl_on_data_qp;
        let (ops_wr, mut nslots) = (4 * depth + 16, (16 * depth).clamp(256, 4000));
        if shared {
            // The command ring takes what the device leaves beside the data WRs
            // (down to 64 slots: a shorter ring only makes control SENDs wait
            // for receive credits).
            nslots = nslots.min(sh.caps.max_qp_wr.saturating_sub(ops_wr)).max(64);
        }
        let data_wr = ops_wr + if shared { nslots } else { 0 };
        let need = data_wr.max(nslots);
        if need > sh.caps.max_qp_wr {
            return Err(Error::Other(format!(
                "a QP of depth {depth} needs {need} WRs per NIC QP; the device allows {}",
                sh.caps.max_qp_wr
            )));
        }
        // Carrying the control channel, the data QP receives the command
        // slots (on `rcq`, as the control QP would) and sends them inline.
        let data = sh
            .nic
            .create_qp(
                &QpSpec {
                    qpn,
                    max_send_wr: data_wr,
                    max_recv_wr: if shared { nslots } else { 4 },
                    max_sge: zero_sges(sh) as u32,
                    max_inline: if shared { SLOT.max(64) as u32 } else { 64 },
                    // Peers reach, one-sided, only the views of this QP's
                    // PD's MRs (the application PD as a NIC protection
                    // domain).
                    domain: pd,
                },
                &sh.ncq,
                if shared { &sh.rcq } else { &sh.ncq },
            )
            .map_err(N::error)?;
        let qpn = data.qpn();
        // The control QP completes sends and receives on `rcq`: `ncq` then
        // holds data-QP completions only, and an application thread waiting
        // for a one-sided operation polls (and progresses) just that.
        let ctrl = if shared {
            None
        } else {
            Some(
                sh.nic
                    .create_qp(
                        &QpSpec {
                            // A device that numbers its QPs itself (user-space
                            // mode over libibverbs): the endpoint carries the
                            // number.
                            qpn: (!sh.iommu.is_user()).then_some(qpn | CTRL_QPN_BIT),
                            max_send_wr: nslots,
                            max_recv_wr: nslots,
                            max_sge: 1,
                            max_inline: SLOT as u32,
                            domain: 0,
                        },
                        &sh.rcq,
                        &sh.rcq,
                    )
                    .map_err(N::error)?,
            )
        };
        let ring = sh
            .nic
            .alloc_ring_buf(nslots as usize * SLOT, Access::LOCAL_WRITE)
            .map_err(N::error)?;
        // Small WRITEs are read back into a per-op scratch slot of the QP.
        // Slots are page-aligned with a page of slack: a read-back lands at
        // the remote address's page offset (see `readback_addr`).
        const MAX_SCRATCH: u64 = 1 << 30;
        let slot_size = sh.cfg.plan.write_version_threshold.max(4096);
        let scratch_len = (slot_size.div_ceil(PS) + 1)
            .checked_mul(PS)
            .and_then(|n| n.checked_mul(u64::from(depth)))
            .and_then(|n| n.checked_add(PS))
            .filter(|&n| n <= MAX_SCRATCH)
            .ok_or(Error::Invalid(
                "QP depth x plan.write_version_threshold exceeds the 1 GiB read-back scratch limit",
            ))?;
        let slot_size = slot_size as usize;
        let scratch = sh
            .nic
            .alloc_buf(scratch_len as usize, Access::LOCAL_WRITE)
            .map_err(N::error)?;
        let nic = NicParts {
            data,
            ctrl,
            ring,
            scratch,
            nslots,
            slot_size,
        };
        Self::assemble(sh, pd, send_cq, recv_cq, depth, nic)
    }

    /// A QP in RESET again (`Qp::reset`): the state of a new QP over this
    /// one's NIC resources — its NIC QPs, moved to RESET here (they keep
    /// their numbers, and a peer's NIC its way to them), rings and scratch —
    /// with its PD, CQs, depth, SRQ and service. Its operations and RECVs
    /// were flushed by the caller (`retire::destroy_qp`).
    pub fn renew(self, sh: &Dev<N>) -> Result<QpState<N>, Error> {
        self.data.reset().map_err(N::error)?;
        if let Some(c) = &self.ctrl {
            c.reset().map_err(N::error)?;
        }
        let (unreliable, srq) = (self.unreliable, self.srq.clone());
        let nic = NicParts {
            data: self.data,
            ctrl: self.ctrl,
            ring: self.ring,
            scratch: self.scratch,
            nslots: self.nslots,
            slot_size: self.slot_size,
        };
        let mut qs = Self::assemble(sh, self.pd, self.send_cq, self.recv_cq, self.depth, nic)?;
        qs.unreliable = unreliable;
        qs.srq = srq;
        Ok(qs)
    }

    /// The state of a QP in RESET over `nic`.
    fn assemble(
        sh: &Dev<N>,
        pd: u32,
        send_cq: Arc<UCq>,
        recv_cq: Arc<UCq>,
        depth: u32,
        nic: NicParts<N>,
    ) -> Result<QpState<N>, Error> {
        let NicParts {
            data,
            ctrl,
            ring,
            scratch,
            nslots,
            slot_size,
        } = nic;
        let qpn = data.qpn();
        Ok(QpState {
            data,
            ctrl,
            ring,
            scratch,
            idx: 0,
            gen: 0,
            qpn,
            pd,
            // Until the application says otherwise (`set_remote_access`):
            // every remote right, as before the flags were modelled.
            remote_access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            nic_all_rights: sh.iommu.is_user(),
            depth,
            nslots,
            slot_size,
            scratch_free: (0..depth).rev().collect(),
            send_cq,
            recv_cq,
            connected: false,
            dead: false,
            errored: false,
            unreliable: false,
            peer: PeerKeys::new(PS as usize).expect("page size"),
            peer_versions: SeenVersions::new(SEEN_SLOTS),
            keys_served: false,
            key_wait: Vec::new(),
            next_seq: 0,
            sync_cover: 0,
            reasm: Reassembler::new(&sh.cfg.ctrl),
            emit_buf: Vec::with_capacity(sh.cfg.ctrl.max_message_slots() * SLOT),
            backlog: VecDeque::new(),
            ctrl_out: 0,
            order: OrderTable::new(sh.cfg.order),
            rob: CompletionOrder::new(),
            ops: Pending::new(depth as usize).map_err(|e| Error::Other(e.to_string()))?,
            recvs: VecDeque::new(),
            srq: None,
            inbound: VecDeque::new(),
            rnr_wait: RnrWait::Idle,
            rnr_refreshed: std::time::Instant::now(),
            rnr_failed: false,
            rnr_retry: 7,
            min_rnr_timer: 12,
            rdv_busy: false,
            treqs: Pending::new(4096).map_err(|e| Error::Other(e.to_string()))?,
            deferred: Vec::new(),
            flush_seq: 0,
            batches: Pending::new(depth as usize).map_err(|e| Error::Other(e.to_string()))?,
            fast: None,
            fast_promoted: None,
            inline_max: inline_max(sh),
            probe_hint: false,
            probed: None,
            held: HeldLeases::default(),
            seen: SeenPages::default(),
        })
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The control QP's number for the endpoint: 0 when derived from the
    /// data QP's, the data QP's own when that carries the control channel
    /// ([`super::Endpoint::ctrl_qpn`]).
    pub fn ctrl_qpn_for_peer(&self) -> u32 {
        match self.ctrl_qp().qpn() {
            n if n == self.qpn | CTRL_QPN_BIT => 0,
            n => n,
        }
    }

    /// The NIC QP of the control channel: the control QP, or the data QP
    /// when it carries the channel (`Config::ctrl_on_data_qp`).
    pub(super) fn ctrl_qp(&self) -> &N::Qp {
        self.ctrl.as_ref().unwrap_or(&self.data)
    }

    pub fn outstanding(&self) -> usize {
        self.ops.len() + self.fast_outstanding()
    }

    /// Whether the application moved this QP to ERR.
    pub fn is_error(&self) -> bool {
        self.errored
    }

    /// Complete every outstanding operation with WR_FLUSH_ERR in post
    /// order (ops already finished out of order keep their status) and
    /// release their pins, scratch and ordering state.
    pub(super) fn flush_ops(&mut self) {
        self.flush_ops_after(WcStatus::WrFlushErr);
    }

    /// [`QpState::flush_ops`], the oldest outstanding operation completing
    /// with `first` instead (RETRY_EXC_ERR when the peer vanished, as an RC
    /// transport reports it).
    pub(super) fn flush_ops_after(&mut self, first: WcStatus) {
        self.promote_fast();
        let mut ops: Vec<(u32, Op<N>)> = self.ops.drain();
        ops.sort_by_key(|(_, o)| o.seq);
        for (k, (_, mut op)) in ops.into_iter().enumerate() {
            let c = Completion {
                wr_id: op.wr.wr_id,
                status: if k == 0 { first } else { WcStatus::WrFlushErr }.code(),
                op: comp_op(op.wr.op),
                byte_len: 0,
                imm: None,
                qp_num: self.qpn,
            };
            let _ = self.rob.finish(op.seq, false, c);
            let s = op.scratch.take();
            self.release_scratch(s);
            // The op's hold (temporary MR, then pin) drops here.
        }
        self.deliver();
        for (_, _) in self.order.drain_parked() {}
        self.order = OrderTable::new(*self.order.config());
        self.key_wait.clear();
        self.deferred.clear();
    }

    /// Complete every posted RECV with WR_FLUSH_ERR in post order.
    /// Whether a receive is posted for the next inbound message.
    pub(super) fn has_recv(&self) -> bool {
        match &self.srq {
            Some(s) => !s.recvs.lock().is_empty(),
            None => !self.recvs.is_empty(),
        }
    }

    /// Take the receive the next inbound message lands in.
    pub(super) fn take_recv(&mut self) -> Option<RecvWr> {
        match &self.srq {
            Some(s) => s.recvs.lock().pop_front(),
            None => self.recvs.pop_front(),
        }
    }

    /// Give back a receive taken for a message that was dropped (UC).
    pub(super) fn return_recv(&mut self, r: RecvWr) {
        match &self.srq {
            Some(s) => s.recvs.lock().push_front(r),
            None => self.recvs.push_front(r),
        }
    }

    /// The PD receive buffers are checked against: the receive queue's.
    pub(super) fn recv_pd(&self) -> u32 {
        self.srq.as_ref().map_or(self.pd, |s| s.pd)
    }

    /// Complete the QP's own posted receives with WR_FLUSH_ERR (a shared
    /// receive queue's stay for its other QPs).
    pub(super) fn flush_recvs(&mut self) {
        for r in self.recvs.drain(..) {
            // (A CQ overrun here changes nothing: the QP is in ERR already.)
            let _ = self.recv_cq.push(Completion {
                wr_id: r.wr_id,
                status: WcStatus::WrFlushErr.code(),
                op: CompOp::Recv,
                byte_len: 0,
                imm: None,
                qp_num: self.qpn,
            });
        }
    }

    /// A RECV completed in error (`cqe`: its buffer could not take the
    /// message). As on RC the QP goes to ERR: the RECVs behind it flush now,
    /// every later send completion and post is flushed (the error rule of
    /// [`Self::deliver`]); the NIC QPs stay up, so the answer to the sender
    /// and those to sends still out are delivered.
    pub(super) fn recv_error(&mut self, cqe: Completion) {
        let _ = self.recv_cq.push(cqe);
        self.errored = true;
        self.flush_recvs();
    }

    /// Deliver the completions the reorder buffer has in post order, with
    /// RC's error rule: the first one that failed (other than a flush) moves
    /// the QP to ERR, and every completion behind it is WR_FLUSH_ERR — its
    /// operation may have run on another channel (two-sided) and succeeded,
    /// but on RC a WR behind a failed one never completes successfully.
    /// Later posts, and the posted RECVs, are flushed as for
    /// `retire::set_error`.
    /// Queue receive completion `c` on the receive CQ; an overrun of that CQ
    /// moves the QP to ERR ([`UCq::push_se`]).
    pub(super) fn push_recv(&mut self, c: Completion, solicited: bool) {
        if !self.recv_cq.push_se(c, solicited) && !self.errored {
            self.errored = true;
            self.flush_recvs();
        }
    }

    pub(super) fn deliver(&mut self) {
        let was = self.errored;
        let cq = &self.send_cq;
        let errored = &mut self.errored;
        self.rob.drain_ready_with(|mut c| {
            if *errored {
                c.status = WcStatus::WrFlushErr.code();
                c.byte_len = 0;
            } else if c.status != WcStatus::Success.code()
                && c.status != WcStatus::WrFlushErr.code()
            {
                *errored = true;
            }
            if !cq.push(c) {
                // CQ overrun: the QP moves to ERR (later completions flush).
                *errored = true;
            }
        });
        if self.errored && !was {
            self.flush_recvs();
        }
    }

    /// A WR posted to a QP in ERR: accepted, completed with WR_FLUSH_ERR.
    pub(super) fn flush_posted_send(&mut self, wr: &SendWr) {
        let seq = self.rob.post(wr.signaled);
        self.next_seq = seq + 1;
        let c = Completion {
            wr_id: wr.wr_id,
            status: WcStatus::WrFlushErr.code(),
            op: comp_op(wr.op),
            byte_len: 0,
            imm: None,
            qp_num: self.qpn,
        };
        let _ = self.rob.finish(seq, false, c);
        self.deliver();
    }

    pub fn connect(&mut self, peer: &Endpoint) -> Result<(), Error> {
        if self.connected {
            return Err(Error::Invalid("already connected"));
        }
        let dest = PeerAddr(peer.addr);
        let acc = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        // Both ends must agree on where the control channel runs: our SENDs
        // must reach the peer's command ring, and its SENDs ours.
        let peer_shared = peer.ctrl_qpn == peer.qpn;
        if peer_shared != self.ctrl.is_none() {
            return Err(Error::Invalid(if peer_shared {
                "the peer carries its control channel on its data QP; \
                 this context does not (Config::ctrl_on_data_qp)"
            } else {
                "this context carries the control channel on the data QP \
                 (Config::ctrl_on_data_qp); the peer does not"
            }));
        }
        // The peer's one-sided requests reach the application's MR views
        // through the data QP: its NIC enforces the application's flags (the
        // protocol's own MRs are `ANY_QP`). The control QP only receives SENDs.
        self.data
            .connect(dest, peer.qpn, self.nic_access())
            .map_err(N::error)?;
        if let Some(ctrl) = &self.ctrl {
            let ctrl_qpn = match peer.ctrl_qpn {
                0 => peer.qpn | CTRL_QPN_BIT,
                n => n,
            };
            ctrl.connect(dest, ctrl_qpn, acc).map_err(N::error)?;
        }
        for s in 0..self.nslots {
            self.post_slot(s)?;
        }
        self.connected = true;
        Ok(())
    }

    /// Set the application's remote access flags (`ibv_modify_qp` with
    /// `IBV_QP_ACCESS_FLAGS`): enforced from now on, by the data QP's NIC for
    /// one-sided requests and by `serve::grant` for two-sided ones.
    pub fn set_remote_access(&mut self, access: Access) -> Result<(), Error> {
        let rights = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        self.remote_access = Access(access.0 & rights.0);
        if self.connected && !self.dead && !self.errored && !self.nic_all_rights {
            self.data.set_access(self.nic_access()).map_err(N::error)?;
        }
        Ok(())
    }

    /// The rights the data QP grants at the NIC.
    fn nic_access(&self) -> Access {
        if self.nic_all_rights {
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC
        } else {
            self.remote_access
        }
    }

    /// Ask the NIC whether the peer QP is still there: a zero-length RDMA
    /// WRITE on the control QP (no key is checked for zero bytes; the peer's
    /// control QP grants every right), which a live peer's NIC acknowledges
    /// and a vanished one's does not — the NIC then fails it after its retry
    /// budget (RETRY_EXC_ERR) and the QP fails with it (`progress`). For a
    /// device that cannot tell the engine of a peer's death otherwise
    /// (user-space mode over libibverbs). Not when the channel rides on a data
    /// QP that may lack REMOTE_WRITE (the probe would fail a live peer).
    pub(super) fn probe_peer(&mut self) {
        if !self.connected || self.dead || self.errored {
            return;
        }
        if self.ctrl.is_none() && !self.nic_all_rights {
            return;
        }
        self.probed = Some(std::time::Instant::now());
        let wr = WorkRequest::new(
            WrTag::new(self.idx, self.gen, WrKind::Probe, 0, 0).wr_id(),
            WrOp::Write,
            &[],
        )
        .remote(0, 0);
        if let Err(e) = self.ctrl_qp().post_send(&[wr]) {
            tracing::debug!(error = %e.source, "liveness probe not posted");
        }
    }

    pub(super) fn post_slot(&self, s: u32) -> Result<(), Error> {
        let sge = self.ring.sge(s as usize * SLOT, SLOT as u32);
        self.ctrl_qp()
            .post_recv(&[RecvRequest {
                wr_id: WrTag::new(self.idx, self.gen, WrKind::CtrlRecv, 0, s).wr_id(),
                sg_list: &[sge],
            }])
            .map_err(|e| N::error(e.source))
    }

    /// Send one control message. With nothing queued ahead and enough send
    /// credits (the common case) its slots are posted straight from the
    /// reused emit buffer as one chain of inline SENDs: no allocation, no
    /// copy through the backlog.
    pub(super) fn send_ctrl(&mut self, ctrl: &crate::ctrl::CtrlConfig, msg: &Repr<'_>) {
        let mut buf = std::mem::take(&mut self.emit_buf);
        buf.resize(msg.buffer_len(), 0);
        if let Err(e) = msg.emit(&mut buf, ctrl) {
            tracing::error!(error = %e, "control message not emitted");
            self.emit_buf = buf;
            return;
        }
        mark(Step::CtrlEmitted);
        let n = buf.len() / SLOT;
        if self.backlog.is_empty() && n <= (self.nslots - self.ctrl_out) as usize && n <= 8 {
            let wr_id = WrTag::new(self.idx, self.gen, WrKind::CtrlSend, 0, 0).wr_id();
            let sges: SmallVec<[[Sge; 1]; 8]> = cmdq::slots(&buf).map(inline_sge).collect();
            let wrs: SmallVec<[WorkRequest<'_>; 8]> = sges
                .iter()
                .map(|s| WorkRequest::new(wr_id, WrOp::Send, s).inline())
                .collect();
            match self.ctrl_qp().post_send(&wrs) {
                Ok(()) => self.ctrl_out += n as u32,
                Err(e) => {
                    // The first `bad_index` slots went out; queue the
                    // rest in order and let `flush_ctrl` decide.
                    self.ctrl_out += e.bad_index as u32;
                    for sl in cmdq::slots(&buf).skip(e.bad_index) {
                        let mut a = [0u8; SLOT];
                        a.copy_from_slice(sl);
                        self.backlog.push_back(a);
                    }
                    self.flush_ctrl();
                }
            }
        } else {
            for sl in cmdq::slots(&buf) {
                let mut a = [0u8; SLOT];
                a.copy_from_slice(sl);
                self.backlog.push_back(a);
            }
            self.flush_ctrl();
        }
        self.emit_buf = buf;
    }

    pub(super) fn flush_ctrl(&mut self) {
        while !self.backlog.is_empty() && self.ctrl_out < self.nslots {
            let n = self
                .backlog
                .len()
                .min((self.nslots - self.ctrl_out) as usize)
                .min(64);
            let slots: Vec<[u8; SLOT]> = self.backlog.drain(..n).collect();
            let wr_id = WrTag::new(self.idx, self.gen, WrKind::CtrlSend, 0, 0).wr_id();
            let sges: Vec<[Sge; 1]> = slots.iter().map(|s| inline_sge(s)).collect();
            let wrs: Vec<WorkRequest<'_>> = sges
                .iter()
                .map(|s| WorkRequest::new(wr_id, WrOp::Send, s).inline())
                .collect();
            match self.ctrl_qp().post_send(&wrs) {
                Ok(()) => self.ctrl_out += n as u32,
                Err(e) => {
                    self.ctrl_out += e.bad_index as u32;
                    for s in slots[e.bad_index..].iter().rev() {
                        self.backlog.push_front(*s);
                    }
                    if e.bad_index == 0 && self.ctrl_out == 0 {
                        tracing::error!(error = %e.source, "control QP refuses sends");
                        self.dead = true;
                        self.backlog.clear();
                    }
                    break;
                }
            }
        }
    }

    pub(super) fn scratch_addr(&self, s: &Scratch<N>) -> (u64, u32) {
        match s {
            Scratch::Slot(i) => {
                let base = self.scratch.addr().next_multiple_of(PS);
                let stride = (self.slot_size as u64).div_ceil(PS) * PS + PS;
                (base + *i as u64 * stride, self.scratch.lkey())
            }
            Scratch::Own(m) => (m.addr(), m.lkey()),
        }
    }

    /// Where the read-back of remote `raddr` lands in scratch `s`: at the
    /// same page offset as `raddr` (slots and own buffers have a page of
    /// slack for it). Source and destination then share their alignment
    /// modulo the page, which keeps the NIC's copy on this CPU's fast path
    /// (`rep movsb` here is ~30× slower for some relative misalignments,
    /// e.g. a page-aligned source and a destination 16 bytes into a page,
    /// which is exactly what a heap scratch buffer gave).
    pub(super) fn readback_addr(&self, s: &Scratch<N>, raddr: u64) -> u64 {
        self.scratch_addr(s).0 + (raddr & (PS - 1))
    }

    pub(super) fn release_scratch(&mut self, s: Option<Scratch<N>>) {
        if let Some(Scratch::Slot(i)) = s {
            self.scratch_free.push(i);
        }
    }
}

impl<N: Backend> QpState<N> {
    /// Move the lean-path operation (if any) into the general structures,
    /// as if it had been posted there: pending table (stage `OneSided`),
    /// reorder buffer, ordering table (it issues: nothing else is in flight).
    pub(super) fn promote_fast(&mut self) {
        let Some(f) = self.fast.take() else { return };
        let seq = self.rob.post(true);
        self.next_seq = seq + 1;
        let op = Op {
            hold: Default::default(),
            sent: None,
            wr: f.wr,
            laddr: f.laddr,
            len: f.len,
            seq,
            ticket: None,
            lmr: Some(f.lmr),
            stage: Stage::OneSided {
                strat: f.strat,
                steps: f.steps,
                left: f.left,
                err: f.err,
                vlen: f.vlen,
                ver: f.ver,
            },
            key_req: 0,
            key_answered: false,
            scratch: f.scratch,
            lver: f.lver,
            retry: Retry::NotTried,
            stale: false,
            restart: false,
            lease: None,
            pieces: None,
        };
        let id = match self.ops.insert(op) {
            Ok(id) => id,
            Err(e) => {
                // Unreachable: the table was empty when the op was posted.
                tracing::error!(error = %e, "promoting a lean-path op");
                return;
            }
        };
        self.fast_promoted = Some(id);
        let desc = order_desc(
            f.wr.op,
            Range::new(f.laddr, f.len),
            Range::new(f.wr.remote_addr, f.len),
            f.wr.order_before,
            f.wr.order_after,
            self.inline_max,
        );
        match self.order.submit(desc, id) {
            Ok(Admit::Issue(t, _)) => {
                if let Some(o) = self.ops.get_mut(id) {
                    o.ticket = Some(t);
                }
                // Its NIC WRs are out: conflicting ops may pipeline behind
                // it (nothing is parked: the table was idle).
                let mut none = Vec::new();
                let _ = self.order.on_nic(t, &mut none);
            }
            Ok(Admit::Parked(_)) | Err(_) => {
                tracing::error!("lean-path op not admitted at promotion");
            }
        }
    }

    /// Operations outstanding on the lean path (0 or 1).
    pub(super) fn fast_outstanding(&self) -> usize {
        usize::from(self.fast.is_some())
    }
}
