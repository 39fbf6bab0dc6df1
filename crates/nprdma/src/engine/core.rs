//! The engine's state machine: per-QP state (NIC data + control QP, command
//! ring, ordering table, reorder buffer, outstanding operations and target
//! requests), posting, the optimistic one-sided attempts and their checks,
//! the two-sided path in both roles, and NIC completion dispatch. Everything
//! runs under the context's one lock, in whichever thread progresses (the
//! polling thread, or an application thread polling its CQ).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rnic::{QpAttr, QpAttrMask, QpInitAttr, QpState as NicQpState, WcStatus, WrOpcode};
use smallvec::SmallVec;

use super::ctrlbuf::CtrlBuf;
use super::idhash::IdMap;
use super::mr::MrEntry;
use super::ucq::UCq;
use super::{Config, Error, RecvWr, SendWr, Stats};
use crate::adapt::{RnicIommu, VmemMm};
use crate::check::{check_read, check_readback, page_span, precheck_local, CheckConfig};
use crate::cmdq::{self, Reassembler};
use crate::ctrl::{
    AtomicKind, AtomicRequest, FaultKind, FaultRequest, KeyMapping, Repr, Status, SLOT,
};
use crate::keymap::{KeyMapError, KeyTable, PeerKeys, SyncState, Translation};
use crate::mem;
use crate::nic::{Access, CompOp, Completion, Pinned};
use crate::ordering::{Admit, OrderTable, Range, Ticket};
use crate::pending::Pending;
use crate::plan::{choose, nic_steps_small, order_desc, probes_first, AppOp, LocalBuf, Strategy};
use crate::rob::CompletionOrder;
use crate::shadow::MrShadow;
use crate::target::{apply_atomic, validate, wc_status, LocalRegion};
use crate::trace::{mark, Step};

const PS: u64 = vmem::PAGE_SIZE as u64;
/// The control QP's number: the data QP's with this bit set.
pub const CTRL_QPN_BIT: u32 = 1 << 23;

const K_OP: u64 = 0;
const K_REV: u64 = 1;
const K_CSEND: u64 = 2;
const K_CRECV: u64 = 3;
const K_RB: u64 = 4;
/// A WR of the QP's lean-path operation ([`fast`]).
const K_FAST: u64 = 5;

mod fast;
mod replay;

const ST_LOC_LEN: u32 = 1;
const ST_LOC_PROT: u32 = 4;
const ST_FLUSH: u32 = 5;
const ST_REM_ACCESS: u32 = 10;
const ST_RETRY_EXC: u32 = 12;

fn enc(qi: usize, gen: u8, kind: u64, step: u64, id: u32) -> u64 {
    (qi as u64) << 48 | (gen as u64) << 40 | kind << 36 | step << 32 | id as u64
}

fn dec(w: u64) -> (usize, u8, u64, u64, u32) {
    (
        (w >> 48) as usize,
        (w >> 40) as u8,
        (w >> 36) & 0xf,
        (w >> 32) & 0xf,
        w as u32,
    )
}

/// Where a peer QP lives (exchange it out of band, like a GID + QPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: [u8; 16],
    pub qpn: u32,
}

impl Endpoint {
    /// 20 bytes: host address + QPN (little endian).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..16].copy_from_slice(&self.addr);
        b[16..].copy_from_slice(&self.qpn.to_le_bytes());
        b
    }
    pub fn from_bytes(b: &[u8; 20]) -> Endpoint {
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&b[..16]);
        Endpoint {
            addr,
            qpn: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
        }
    }
}

pub(crate) struct Shared {
    pub st: Mutex<State>,
    pub host: rnic::Host,
    pub iommu: Arc<RnicIommu>,
    pub pd: rnic::Pd,
    pub mm: VmemMm,
    pub chan: rnic::CompChannel,
    /// Send completions of the data QPs (one-sided operations, reverse
    /// operations, read-backs).
    pub ncq: rnic::Cq,
    /// Completions of the control QPs: their sends and their receives
    /// (pushed by the peers).
    pub rcq: rnic::Cq,
    pub check: CheckConfig,
    pub cfg: Config,
    pub stop: AtomicBool,
    /// Bumped by every application CQ poll (the polling thread steps aside
    /// while it moves).
    pub app_polls: AtomicU64,
    pub _ctx: rnic::Context,
}

impl Shared {
    /// An application thread is polling: the polling thread stays asleep
    /// for a while (the application progresses inline).
    pub fn mark_app_active(&self) {
        // A plain load + store, not a locked read-modify-write: the polling
        // thread only watches for a change; an increment lost between two
        // racing pollers is harmless (each stores a value it did not read).
        let n = self.app_polls.load(Ordering::Relaxed);
        self.app_polls.store(n.wrapping_add(1), Ordering::Relaxed);
    }
}

pub(crate) struct State {
    qps: Vec<Option<QpState>>,
    gens: Vec<u8>,
    pub mrs: IdMap<Arc<MrEntry>>,
    pub keys: KeyTable,
    ready: VecDeque<(usize, u32)>,
    pub next_pd: u32,
    pub stats: Stats,
    next_req: u32,
    last_sweep: Instant,
    progress_calls: u32,
    /// The NIC completion buffer of [`progress`] (allocated once).
    wcs: Vec<rnic::Wc>,
    flush_qps: Vec<usize>,
    cq_failed: bool,
    /// Ops the ordering table releases on a completion (reused buffer).
    released: Vec<(Ticket, u32)>,
    /// Lean-path completions for the user CQ an application thread is
    /// polling right now ([`progress_app_into`]), handed straight to its
    /// array instead of through the CQ's queue.
    direct: fast::Direct,
    /// Pins + map-ins owed after an answer-first inline READ (target side):
    /// done when a progress pass finds no new NIC completion, so a request
    /// that is already waiting is served first.
    post_answer: VecDeque<(Arc<MrEntry>, u64, u64)>,
    /// `ZERO_BUF` zero bytes registered for the NIC: the source of reverse
    /// WRITEs answering READs of never-populated memory (made on first use).
    zero: Option<rnic::OwnedMr>,
}

/// Bytes of the zero source buffer, and SGEs of one reverse WRITE from it:
/// one WR answers up to `ZERO_BUF * ZERO_SGES` (8 MiB).
const ZERO_BUF: usize = 512 * 1024;
const ZERO_SGES: usize = 16;

/// SGEs per zero-answer WR: `ZERO_SGES`, or fewer if the NIC has fewer.
fn zero_sges(sh: &Shared) -> usize {
    ZERO_SGES.min(sh.host.config().max_sge as usize).max(1)
}
/// Largest READ answered from the zero source (a few WRs; more goes the
/// ordinary way).
const ZERO_READ_MAX: u64 = 64 << 20;

impl State {
    pub fn new() -> State {
        State {
            qps: Vec::new(),
            gens: Vec::new(),
            mrs: IdMap::default(),
            keys: KeyTable::new(PS as usize).expect("page size is a power of two"),
            ready: VecDeque::new(),
            next_pd: 0,
            stats: Stats::default(),
            next_req: 1,
            last_sweep: Instant::now(),
            progress_calls: 0,
            wcs: vec![rnic::Wc::default(); 64],
            flush_qps: Vec::new(),
            cq_failed: false,
            released: Vec::new(),
            direct: fast::Direct::default(),
            post_answer: VecDeque::new(),
            zero: None,
        }
    }

    pub fn insert_qp(&mut self, q: QpState) -> (usize, u8) {
        let i = match self.qps.iter().position(|q| q.is_none()) {
            Some(i) => i,
            None => {
                self.qps.push(None);
                self.gens.push(0);
                self.qps.len() - 1
            }
        };
        let gen = self.gens[i];
        let mut q = q;
        q.idx = i;
        q.gen = gen;
        self.qps[i] = Some(q);
        (i, gen)
    }

    pub fn qp_mut(&mut self, i: usize, gen: u8) -> Option<&mut QpState> {
        if self.gens.get(i) != Some(&gen) {
            return None;
        }
        self.qps.get_mut(i).and_then(|q| q.as_mut())
    }
}

/// Temporary NIC MR + pin of a two-sided operation (dropped in this
/// order: the MR waits for DMA, then the pages are unpinned).
#[derive(Default)]
struct Hold {
    mr: Option<rnic::Mr>,
    pin: Option<EnginePin>,
}

/// A pager pin recorded in the MR's shadow: released by noting the unpin
/// in the shadow first, then unpinning.
struct EnginePin {
    shadow: Arc<MrShadow<RnicIommu>>,
    addr: u64,
    len: u64,
    pin: Option<Pinned<VmemMm>>,
}

impl Drop for EnginePin {
    fn drop(&mut self) {
        self.shadow.unpinned(self.addr, self.len);
        drop(self.pin.take());
    }
}

/// Pin `[addr, addr+len)` of `mr` (faulting it in on this thread) and map
/// it into the NIC views.
fn engine_pin(sh: &Shared, mr: &MrEntry, addr: u64, len: u64) -> Result<EnginePin, ()> {
    let p = Pinned::new(sh.mm.clone(), addr, len).map_err(|e| {
        tracing::warn!(addr, len, error = %e, "pin failed");
    })?;
    mark(Step::TPinned);
    let g = EnginePin {
        shadow: mr.shadow.clone(),
        addr,
        len,
        pin: Some(p),
    };
    if let Err(e) = mr.shadow.pinned_map_in(addr, len) {
        tracing::error!(error = %e, "map-in failed");
        return Err(());
    }
    mark(Step::TMapped);
    Ok(g)
}

enum Scratch {
    Slot(u32),
    Own(rnic::OwnedMr),
}

enum Stage {
    Queued,
    Failed(u32),
    KeyWait,
    OneSided {
        strat: Strategy,
        /// NIC WRs posted (only the last one is signaled).
        steps: u8,
        /// NIC completions still expected.
        left: u8,
        err: u32,
        vlen: u64,
    },
    TwoSided,
    ImmNotify,
    /// Unsignaled small WRITE done on the NIC, read-back deferred.
    Deferred,
    /// Its read-back is in flight (batch).
    Checking,
    /// Passed its check, waiting for earlier conflicting ops ([`replay`]).
    HeldOk(u32),
    /// Needs the two-sided path once earlier conflicting ops are done.
    HeldTwoSided,
}

struct Op {
    /// Pins and temporary MR: dropped before `lmr` (the registration).
    hold: Hold,
    /// When the current two-sided request was sent (for the timeout).
    sent: Option<Instant>,
    wr: SendWr,
    laddr: u64,
    len: u64,
    seq: u64,
    ticket: Option<Ticket>,
    lmr: Option<Arc<MrEntry>>,
    stage: Stage,
    /// The KeyQuery this op waits for (0: none sent yet).
    key_req: u32,
    /// That query has been answered (an unknown key is then an error).
    key_answered: bool,
    scratch: Option<Scratch>,
    lver: Versions,
    /// Retry mode: 0 = not tried, 1 = waiting for Receiver-Ready, 2 = the
    /// one-sided retry is in flight, 3 = retried (use the reverse path).
    retry: u8,
    /// Replayed while its NIC WRs (or read-back) were still out: the
    /// result is discarded when they complete ([`replay`]).
    stale: bool,
    /// Re-issued by the ordering table while stale: start again then.
    restart: bool,
}

#[derive(Clone, Copy)]
enum TKind {
    Fault {
        len: u32,
    },
    /// Retry mode: pages pinned until the initiator's Release.
    Retry,
    Rendezvous {
        recv_wr_id: u64,
        len: u32,
        imm: Option<u32>,
    },
}

/// One read-back READ covering consecutive deferred WRITEs.
struct RbBatch {
    remote_addr: u64,
    members: Vec<u32>,
    scratch: Option<Scratch>,
}

struct TReq {
    reply: u32,
    kind: TKind,
    _tmr: Option<rnic::Mr>,
    _pin: Option<EnginePin>,
    _mr: Arc<MrEntry>,
}

pub(crate) struct QpState {
    data: rnic::Qp,
    ctrl: rnic::Qp,
    /// Command-slot receive ring (from the NIC-shared DMA pool if possible).
    ring: CtrlBuf,
    scratch: rnic::OwnedMr,
    idx: usize,
    gen: u8,
    qpn: u32,
    pd: u32,
    /// The application's remote access flags of this QP (`qp_access_flags`):
    /// the data QP's NIC access flags (one-sided requests) and checked by the
    /// target CPU for two-sided ones (see [`grant`]).
    remote_access: Access,
    depth: u32,
    nslots: u32,
    slot_size: usize,
    scratch_free: Vec<u32>,
    send_cq: Arc<UCq>,
    recv_cq: Arc<UCq>,
    connected: bool,
    dead: bool,
    /// Moved to ERR by the application ([`set_error`]): later posts are
    /// accepted and complete with WR_FLUSH_ERR, as on verbs hardware.
    errored: bool,
    peer: PeerKeys,
    /// The peer has queried our key table (its initial sync happened): from
    /// then on new MRs and revocations are pushed to it. Before that its QP
    /// may not even be connected, and its first use syncs everything.
    keys_served: bool,
    key_wait: Vec<u32>,
    /// Sequence number the next posted WR gets.
    next_seq: u64,
    /// WRs posted before the pending initial KeyQuery was sent (`seq` below
    /// this) may wait for its answer; later ones need their own query.
    sync_cover: u64,
    reasm: Reassembler,
    /// Emit buffer of [`QpState::send_ctrl`] (reused: no allocation per message).
    emit_buf: Vec<u8>,
    backlog: VecDeque<[u8; SLOT]>,
    ctrl_out: u32,
    order: OrderTable<u32>,
    rob: CompletionOrder<Completion>,
    ops: Pending<Op>,
    recvs: VecDeque<RecvWr>,
    inbound: VecDeque<Repr<'static>>,
    rdv_busy: bool,
    treqs: Pending<TReq>,
    /// Unsignaled WRITEs waiting for their read-back, in post order.
    deferred: Vec<u32>,
    /// Read-backs of deferred WRITEs are due for ops posted before this
    /// sequence number (the last signaled WR's).
    flush_seq: u64,
    batches: Pending<RbBatch>,
    /// The operation on the lean path, if any ([`fast`]).
    fast: Option<fast::FastOp>,
    /// Pending id of the last lean-path operation promoted to the general
    /// path (its NIC completions are routed there).
    fast_promoted: Option<u32>,
    /// Largest READ/WRITE the two-sided path carries inline.
    inline_max: u64,
    /// The last large READ (≥ `PlanConfig::probe_min`) of this QP found a
    /// target page out: the next ones probe versions first. A probe that
    /// finds every page in clears it, so a QP without faults never probes.
    probe_hint: bool,
}

impl QpState {
    pub fn create(
        sh: &Shared,
        pd: u32,
        send_cq: Arc<UCq>,
        recv_cq: Arc<UCq>,
        depth: u32,
    ) -> Result<QpState, Error> {
        if depth == 0 || depth > 1000 {
            return Err(Error::Invalid("QP depth must be 1..=1000"));
        }
        let data = sh.pd.create_qp(
            &sh.ncq,
            &sh.ncq,
            &QpInitAttr {
                qpn: None,
                max_send_wr: 4 * depth + 16,
                max_recv_wr: 4,
                max_send_sge: zero_sges(sh) as u32,
                max_recv_sge: 1,
                max_inline_data: 64,
                sq_sig_all: false,
            },
        )?;
        let qpn = data.qpn();
        let nslots = (16 * depth).clamp(256, 4000);
        // The control QP completes sends and receives on `rcq`: `ncq` then
        // holds data-QP completions only, and an application thread waiting
        // for a one-sided operation polls (and progresses) just that.
        let ctrl = sh.pd.create_qp(
            &sh.rcq,
            &sh.rcq,
            &QpInitAttr {
                qpn: Some(qpn | CTRL_QPN_BIT),
                max_send_wr: nslots,
                max_recv_wr: nslots,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: SLOT as u32,
                sq_sig_all: false,
            },
        )?;
        let ring = CtrlBuf::new(
            &sh.host,
            &sh.pd,
            nslots as usize * SLOT,
            rnic::Access::LOCAL_WRITE,
        )?;
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
            .pd
            .reg_mr_owned(vec![0; scratch_len as usize], rnic::Access::LOCAL_WRITE)?;
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
            depth,
            nslots,
            slot_size,
            scratch_free: (0..depth).rev().collect(),
            send_cq,
            recv_cq,
            connected: false,
            dead: false,
            errored: false,
            peer: PeerKeys::new(PS as usize).expect("page size"),
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
            inbound: VecDeque::new(),
            rdv_busy: false,
            treqs: Pending::new(4096).map_err(|e| Error::Other(e.to_string()))?,
            deferred: Vec::new(),
            flush_seq: 0,
            batches: Pending::new(depth as usize).map_err(|e| Error::Other(e.to_string()))?,
            fast: None,
            fast_promoted: None,
            inline_max: inline_max(sh),
            probe_hint: false,
        })
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
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
    fn flush_ops(&mut self) {
        self.flush_ops_after(ST_FLUSH);
    }

    /// [`QpState::flush_ops`], the oldest outstanding operation completing
    /// with `first` instead (RETRY_EXC_ERR when the peer vanished, as an RC
    /// transport reports it).
    fn flush_ops_after(&mut self, first: u32) {
        self.promote_fast();
        let mut ops: Vec<(u32, Op)> = self.ops.drain();
        ops.sort_by_key(|(_, o)| o.seq);
        for (k, (_, mut op)) in ops.into_iter().enumerate() {
            let c = Completion {
                wr_id: op.wr.wr_id,
                status: if k == 0 { first } else { ST_FLUSH },
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
    fn flush_recvs(&mut self) {
        for r in self.recvs.drain(..) {
            self.recv_cq.push(Completion {
                wr_id: r.wr_id,
                status: ST_FLUSH,
                op: CompOp::Recv,
                byte_len: 0,
                imm: None,
                qp_num: self.qpn,
            });
        }
    }

    /// Deliver the completions the reorder buffer has in post order, with
    /// RC's error rule: the first one that failed (other than a flush) moves
    /// the QP to ERR, and every completion behind it is WR_FLUSH_ERR — its
    /// operation may have run on another channel (two-sided) and succeeded,
    /// but on RC a WR behind a failed one never completes successfully.
    /// Later posts, and the posted RECVs, are flushed as for
    /// [`set_error`].
    fn deliver(&mut self) {
        let was = self.errored;
        let cq = &self.send_cq;
        let errored = &mut self.errored;
        self.rob.drain_ready_with(|mut c| {
            if *errored {
                c.status = ST_FLUSH;
                c.byte_len = 0;
            } else if c.status != 0 && c.status != ST_FLUSH {
                *errored = true;
            }
            cq.push(c)
        });
        if self.errored && !was {
            self.flush_recvs();
        }
    }

    /// A WR posted to a QP in ERR: accepted, completed with WR_FLUSH_ERR.
    fn flush_posted_send(&mut self, wr: &SendWr) {
        let seq = self.rob.post(wr.signaled);
        self.next_seq = seq + 1;
        let c = Completion {
            wr_id: wr.wr_id,
            status: ST_FLUSH,
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
        let dest = rnic::HostAddr::from_bytes(&peer.addr);
        let acc = rnic::Access::LOCAL_WRITE
            | rnic::Access::REMOTE_READ
            | rnic::Access::REMOTE_WRITE
            | rnic::Access::REMOTE_ATOMIC;
        // The peer's one-sided requests reach the application's MR views
        // through the data QP: its NIC enforces the application's flags (the
        // protocol's own MRs are `ANY_QP`). The control QP only receives SENDs.
        self.data.connect(self.data_access(), dest, peer.qpn, 7)?;
        self.ctrl.connect(acc, dest, peer.qpn | CTRL_QPN_BIT, 7)?;
        for s in 0..self.nslots {
            self.post_slot(s)?;
        }
        self.connected = true;
        Ok(())
    }

    fn data_access(&self) -> rnic::Access {
        rnic::Access::LOCAL_WRITE | crate::adapt::rnic_access(self.remote_access)
    }

    /// Set the application's remote access flags (`ibv_modify_qp` with
    /// `IBV_QP_ACCESS_FLAGS`): enforced from now on, by the data QP's NIC for
    /// one-sided requests and by [`grant`] for two-sided ones.
    pub fn set_remote_access(&mut self, access: Access) -> Result<(), Error> {
        let rights = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        self.remote_access = Access(access.0 & rights.0);
        if self.connected && !self.dead && !self.errored {
            let a = rnic::QpAttr {
                qp_access_flags: self.data_access(),
                ..Default::default()
            };
            self.data.modify(&a, rnic::QpAttrMask::ACCESS_FLAGS)?;
        }
        Ok(())
    }

    fn post_slot(&self, s: u32) -> Result<(), Error> {
        let sge = self.ring.sge(s as usize * SLOT, SLOT as u32);
        self.ctrl
            .post_recv(&[rnic::RecvWr {
                wr_id: enc(self.idx, self.gen, K_CRECV, 0, s),
                sg_list: &[sge],
            }])
            .map_err(|e| Error::Nic(e.err))
    }

    /// Send one control message. With nothing queued ahead and enough send
    /// credits (the common case) its slots are posted straight from the
    /// reused emit buffer as one chain of inline SENDs: no allocation, no
    /// copy through the backlog.
    fn send_ctrl(&mut self, ctrl: &crate::ctrl::CtrlConfig, msg: &Repr<'_>) {
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
            let wr_id = enc(self.idx, self.gen, K_CSEND, 0, 0);
            let wrs: SmallVec<[rnic::SendWr; 8]> = cmdq::slots(&buf)
                .map(|s| rnic::SendWr::new(wr_id, WrOpcode::Send, &[]).inline(s))
                .collect();
            match self.ctrl.post_send(&wrs) {
                Ok(()) => self.ctrl_out += n as u32,
                Err(e) => {
                    // The first `bad_wr_index` slots went out; queue the
                    // rest in order and let `flush_ctrl` decide.
                    self.ctrl_out += e.bad_wr_index as u32;
                    for sl in cmdq::slots(&buf).skip(e.bad_wr_index) {
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

    fn flush_ctrl(&mut self) {
        while !self.backlog.is_empty() && self.ctrl_out < self.nslots {
            let n = self
                .backlog
                .len()
                .min((self.nslots - self.ctrl_out) as usize)
                .min(64);
            let slots: Vec<[u8; SLOT]> = self.backlog.drain(..n).collect();
            let wr_id = enc(self.idx, self.gen, K_CSEND, 0, 0);
            let wrs: Vec<rnic::SendWr> = slots
                .iter()
                .map(|s| rnic::SendWr::new(wr_id, WrOpcode::Send, &[]).inline(s))
                .collect();
            match self.ctrl.post_send(&wrs) {
                Ok(()) => self.ctrl_out += n as u32,
                Err(e) => {
                    self.ctrl_out += e.bad_wr_index as u32;
                    for s in slots[e.bad_wr_index..].iter().rev() {
                        self.backlog.push_front(*s);
                    }
                    if e.bad_wr_index == 0 && self.ctrl_out == 0 {
                        tracing::error!(error = %e.err, "control QP refuses sends");
                        self.dead = true;
                        self.backlog.clear();
                    }
                    break;
                }
            }
        }
    }

    fn scratch_addr(&self, s: &Scratch) -> (u64, u32) {
        match s {
            Scratch::Slot(i) => {
                let base = (self.scratch.addr() as u64).next_multiple_of(PS);
                let stride = (self.slot_size as u64).div_ceil(PS) * PS + PS;
                (base + *i as u64 * stride, self.scratch.lkey())
            }
            Scratch::Own(m) => (m.addr() as u64, m.lkey()),
        }
    }

    /// Where the read-back of remote `raddr` lands in scratch `s`: at the
    /// same page offset as `raddr` (slots and own buffers have a page of
    /// slack for it). Source and destination then share their alignment
    /// modulo the page, which keeps the NIC's copy on this CPU's fast path
    /// (`rep movsb` here is ~30× slower for some relative misalignments,
    /// e.g. a page-aligned source and a destination 16 bytes into a page,
    /// which is exactly what a heap scratch buffer gave).
    fn readback_addr(&self, s: &Scratch, raddr: u64) -> u64 {
        self.scratch_addr(s).0 + (raddr & (PS - 1))
    }

    fn release_scratch(&mut self, s: Option<Scratch>) {
        if let Some(Scratch::Slot(i)) = s {
            self.scratch_free.push(i);
        }
    }
}

fn comp_op(op: AppOp) -> CompOp {
    match op {
        AppOp::Read => CompOp::Read,
        AppOp::Write | AppOp::WriteImm(_) => CompOp::Write,
        AppOp::Send | AppOp::SendImm(_) => CompOp::Send,
        AppOp::CmpSwap { .. } => CompOp::CmpSwap,
        AppOp::FetchAdd { .. } => CompOp::FetchAdd,
    }
}

fn is_atomic(op: AppOp) -> bool {
    matches!(op, AppOp::CmpSwap { .. } | AppOp::FetchAdd { .. })
}

/// Post application send WRs (see `Qp::post_send`).
pub(crate) fn post_send(
    _sh: &Shared,
    st: &mut State,
    qi: usize,
    gen: u8,
    wrs: &[SendWr],
) -> Result<(), (usize, Error)> {
    for (i, wr) in wrs.iter().enumerate() {
        if fast::try_post(_sh, st, qi, gen, wr) {
            continue;
        }
        let State {
            qps,
            gens,
            mrs,
            ready,
            ..
        } = &mut *st;
        if gens.get(qi) != Some(&gen) {
            return Err((i, Error::QpState));
        }
        let Some(qp) = qps.get_mut(qi).and_then(|q| q.as_mut()) else {
            return Err((i, Error::QpState));
        };
        // Anything posted behind a lean-path operation is ordered after it.
        qp.promote_fast();
        if qp.errored {
            qp.flush_posted_send(wr);
            continue;
        }
        if !qp.connected || qp.dead {
            return Err((i, Error::QpState));
        }
        if qp.ops.len() >= qp.depth as usize {
            return Err((i, Error::QueueFull));
        }
        let (laddr, len, lkey) = wr
            .sge
            .map(|s| (s.addr, s.length as u64, s.lkey))
            .unwrap_or((0, 0, 0));
        let lmr = wr.sge.and_then(|_| mrs.get(&lkey).cloned());
        let mut status = 0;
        let local_write = matches!(wr.op, AppOp::Read) || is_atomic(wr.op);
        if wr.sge.is_some() {
            match &lmr {
                None => status = ST_LOC_PROT,
                Some(m) => {
                    if m.pd != qp.pd
                        || !m.contains(laddr, len)
                        || (local_write && !m.access.contains(Access::LOCAL_WRITE))
                    {
                        status = ST_LOC_PROT;
                    }
                }
            }
        }
        if is_atomic(wr.op) && len != 8 {
            status = ST_LOC_LEN;
        }
        if len > i32::MAX as u64 {
            status = ST_LOC_LEN;
        }
        let seq = qp.rob.post(wr.signaled);
        qp.next_seq = seq + 1;
        let rlen = if is_atomic(wr.op) { 8 } else { len };
        let op = Op {
            sent: None,
            wr: *wr,
            laddr,
            len,
            seq,
            ticket: None,
            lmr,
            stage: Stage::Queued,
            key_req: 0,
            key_answered: false,
            retry: 0,
            stale: false,
            restart: false,
            scratch: None,
            lver: Versions::new(),
            hold: Hold::default(),
        };
        let id = match qp.ops.insert(op) {
            Ok(id) => id,
            Err(_) => return Err((i, Error::QueueFull)),
        };
        let mut issue = false;
        if status == 0 {
            let desc = order_desc(
                wr.op,
                Range::new(laddr, len),
                Range::new(wr.remote_addr, rlen),
                wr.order_before,
                wr.order_after,
                qp.inline_max,
            );
            let (ticket, now) = match qp.order.submit(desc, id) {
                Ok(Admit::Issue(t, _)) => (Some(t), true),
                Ok(Admit::Parked(t)) => (Some(t), false),
                Err(_) => {
                    status = ST_LOC_PROT;
                    (None, false)
                }
            };
            issue = now;
            if let Some(o) = qp.ops.get_mut(id) {
                o.ticket = ticket;
            }
        }
        if status != 0 {
            if let Some(o) = qp.ops.get_mut(id) {
                o.stage = Stage::Failed(status);
            }
            issue = true;
        }
        if issue {
            ready.push_back((qi, id));
        }
        if wr.signaled {
            qp.flush_seq = seq;
            if !qp.deferred.is_empty() {
                flush_deferred(_sh, st, qi);
            }
        }
    }
    Ok(())
}

/// Post the read-backs of the deferred WRITEs of QP `qi` (contiguous ones
/// share a READ, [`crate::plan::batch_readbacks`]).
fn flush_deferred(sh: &Shared, st: &mut State, qi: usize) {
    let Some(qp) = qp_at(st, qi) else { return };
    let ids: Vec<u32> = std::mem::take(&mut qp.deferred);
    let mut list = Vec::new();
    let mut members = Vec::new();
    for id in ids {
        if let Some(op) = qp.ops.get_mut(id) {
            if matches!(op.stage, Stage::Deferred) {
                op.stage = Stage::Checking;
                list.push(crate::plan::DeferredWrite {
                    id: id as u64,
                    remote_addr: op.wr.remote_addr,
                    len: op.len,
                    rkey: op.wr.rkey,
                });
                members.push(id);
            }
        }
    }
    let mut failed = Vec::new();
    let mut batches = 0;
    let mut chain = Vec::new();
    for b in crate::plan::batch_readbacks(&list, qp.slot_size as u64) {
        let ids: Vec<u32> = members[b.members.clone()].to_vec();
        let scratch = if b.len as usize <= qp.slot_size && !qp.scratch_free.is_empty() {
            qp.scratch_free.pop().map(Scratch::Slot)
        } else {
            sh.pd
                .reg_mr_owned(
                    vec![0; b.len as usize + PS as usize],
                    rnic::Access::LOCAL_WRITE,
                )
                .ok()
                .map(Scratch::Own)
        };
        let Some(scratch) = scratch else {
            failed.extend(ids);
            continue;
        };
        let (_, skey) = qp.scratch_addr(&scratch);
        let saddr = qp.readback_addr(&scratch, b.remote_addr);
        let Ok(bid) = qp.batches.insert(RbBatch {
            remote_addr: b.remote_addr,
            members: ids.clone(),
            scratch: None,
        }) else {
            qp.release_scratch(Some(scratch));
            failed.extend(ids);
            continue;
        };
        if let Some(bt) = qp.batches.get_mut(bid) {
            bt.scratch = Some(scratch);
        }
        let sge = [rnic::Sge {
            addr: saddr,
            length: b.len as u32,
            lkey: skey,
        }];
        chain.push((bid, sge, b.remote_addr, b.rkey));
    }
    // All read-backs go to the NIC as one chain (one post, one NIC
    // progress pass); a refused tail is redone two-sided.
    let gen = qp.gen;
    let wrs: Vec<rnic::SendWr> = chain
        .iter()
        .map(|(bid, sge, raddr, rkey)| {
            rnic::SendWr::new(enc(qi, gen, K_RB, 0, *bid), WrOpcode::Read, sge)
                .remote(*raddr, *rkey)
        })
        .collect();
    let posted = match qp.data.post_send(&wrs) {
        Ok(()) => wrs.len(),
        Err(e) => e.bad_wr_index,
    };
    drop(wrs);
    for (bid, ..) in &chain[posted..] {
        if let Some(mut bt) = qp.batches.take(*bid) {
            let s = bt.scratch.take();
            qp.release_scratch(s);
            failed.extend(bt.members);
        }
    }
    batches += posted as u64;
    st.stats.readback_batches += batches;
    // A read-back that could not be posted: redo those WRITEs two-sided.
    for id in failed {
        replay::two_sided(sh, st, qi, id);
    }
}

/// A deferred read-back completed: check each WRITE it covers.
fn check_batch(sh: &Shared, st: &mut State, qi: usize, bid: u32, status: WcStatus) {
    let Some(qp) = qp_at(st, qi) else { return };
    let Some(mut b) = qp.batches.take(bid) else {
        return;
    };
    let scratch = b.scratch.take();
    let saddr = scratch
        .as_ref()
        .map(|s| qp.readback_addr(s, b.remote_addr))
        .unwrap_or(0);
    let mut results = Vec::new();
    let mut stale = Vec::new();
    for &id in &b.members {
        let Some(op) = qp.ops.get_mut(id) else {
            continue;
        };
        if op.stale {
            stale.push(id);
            continue;
        }
        if status != WcStatus::Success {
            results.push((id, Err(status as u32)));
            continue;
        }
        let lmr = op.lmr.clone().expect("WRITE with data");
        let off = op.wr.remote_addr - b.remote_addr;
        let (laddr, len, raddr) = (op.laddr, op.len, op.wr.remote_addr);
        let now = local_versions(&lmr.shadow, laddr, len);
        let ok = now == op.lver
            && now.iter().all(|v| v % 2 == 1)
            && mem::with_slice(saddr + off, len as usize, |rb| {
                mem::with_slice(laddr, len as usize, |src| {
                    check_readback(src, rb, raddr, &sh.check).is_ok()
                })
            });
        results.push((id, Ok((ok, len))));
    }
    qp.release_scratch(scratch);
    for id in stale {
        replay::stale_done(st, qi, id);
    }
    for (id, r) in results {
        match r {
            Err(e) => finish(st, qi, id, e, 0),
            Ok((true, len)) => {
                st.stats.optimistic_ok += 1;
                replay::finish_ok(st, qi, id, len as u32);
            }
            Ok((false, _)) => replay::two_sided(sh, st, qi, id),
        }
    }
}

/// Post application receive WRs.
pub(crate) fn post_recv(
    sh: &Shared,
    st: &mut State,
    qi: usize,
    gen: u8,
    wrs: &[RecvWr],
) -> Result<(), (usize, Error)> {
    for (i, wr) in wrs.iter().enumerate() {
        let Some(qp) = st.qp_mut(qi, gen) else {
            return Err((i, Error::QpState));
        };
        if qp.errored {
            qp.recvs.push_back(*wr);
            qp.flush_recvs();
            continue;
        }
        if qp.dead {
            return Err((i, Error::QpState));
        }
        if qp.recvs.len() >= qp.depth as usize {
            return Err((i, Error::QueueFull));
        }
        qp.recvs.push_back(*wr);
    }
    deliver_inbound(sh, st, qi);
    Ok(())
}

/// Start the operations admitted so far.
pub(crate) fn run_ready(sh: &Shared, st: &mut State) {
    while let Some((qi, id)) = st.ready.pop_front() {
        start_op(sh, st, qi, id);
    }
}

fn qp_at(st: &mut State, qi: usize) -> Option<&mut QpState> {
    st.qps.get_mut(qi).and_then(|q| q.as_mut())
}

fn start_op(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    let State {
        qps,
        stats,
        next_req,
        ..
    } = &mut *st;
    let Some(qp) = qps.get_mut(qi).and_then(|q| q.as_mut()) else {
        return;
    };
    let Some(op) = qp.ops.get_mut(id) else {
        return;
    };
    if op.stale {
        // Replayed while its old NIC WRs are out: start when they are done.
        op.restart = true;
        return;
    }
    match op.stage {
        Stage::Failed(s) => {
            finish(st, qi, id, s, 0);
            return;
        }
        Stage::HeldOk(len) => {
            finish(st, qi, id, 0, len);
            return;
        }
        Stage::HeldTwoSided => {
            replay::two_sided(sh, st, qi, id);
            return;
        }
        _ => {}
    }
    match op.wr.op {
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) => {}
        _ => {
            replay::two_sided(sh, st, qi, id);
            return;
        }
    }
    let t = match qp.peer.lookup(op.wr.rkey, op.wr.remote_addr, op.len) {
        Ok(t) => t,
        Err(KeyMapError::UnknownKey(rkey)) if !op.key_answered => {
            op.stage = Stage::KeyWait;
            // Timed like a two-sided request: a peer that dies before it
            // answers the key query must not leave the op waiting forever.
            op.sent.get_or_insert_with(Instant::now);
            qp.key_wait.push(id);
            if op.key_req != 0 {
                // Our query is still out; a push of other keys woke us.
                return;
            }
            match qp.peer.state() {
                // The pending query's answer proves a key unknown only if
                // the query left after this WR was posted (the peer had
                // registered the key by then); an answer to an older query
                // may be a snapshot from before the registration.
                SyncState::Pending { req_id } if op.seq < qp.sync_cover => op.key_req = req_id,
                s => {
                    let req_id = *next_req;
                    *next_req = next_req.wrapping_add(1).max(1);
                    let rkey = if s == SyncState::Unsynced {
                        qp.peer.begin_sync(req_id);
                        qp.sync_cover = qp.next_seq;
                        None
                    } else {
                        Some(rkey)
                    };
                    op.key_req = req_id;
                    stats.key_queries += 1;
                    qp.send_ctrl(&sh.cfg.ctrl, &Repr::KeyQuery { req_id, rkey });
                }
            }
            return;
        }
        Err(_) => {
            finish(st, qi, id, ST_REM_ACCESS, 0);
            return;
        }
    };
    if op.len == 0 {
        if let AppOp::WriteImm(_) = op.wr.op {
            start_notify(sh, st, qi, id);
        } else {
            finish(st, qi, id, 0, 0);
        }
        return;
    }
    let lmr = op.lmr.clone().expect("len > 0 has a local MR");
    if local_fenced(sh, op) {
        finish(st, qi, id, ST_LOC_PROT, 0);
        return;
    }
    let (laddr, len) = (op.laddr, op.len);
    if precheck_local(laddr, len, PS as usize, |p| lmr.shadow.is_mapped(p)).is_err() {
        stats.local_fixups += 1;
        match engine_pin(sh, &lmr, laddr, len) {
            Ok(p) => drop(p),
            Err(()) => {
                finish(st, qi, id, ST_LOC_PROT, 0);
                return;
            }
        }
    }
    let large = probes_first(op.wr.op, len, &sh.cfg.plan);
    let strat = if op.retry == 0 && large && qp.probe_hint {
        Strategy::VersionProbe
    } else {
        choose(op.wr.op, len, op.wr.signaled, &sh.cfg.plan)
    };
    if let Strategy::TwoSided(_) = strat {
        replay::two_sided(sh, st, qi, id);
        return;
    }
    post_steps(sh, st, qi, id, strat, &t, &lmr);
}

/// Page versions of a local range (inline up to 8 pages: no allocation).
type Versions = SmallVec<[u32; 8]>;

#[inline]
fn local_versions(shadow: &MrShadow<RnicIommu>, addr: u64, len: u64) -> Versions {
    let Some((first, n)) = page_span(addr, len, PS as usize) else {
        return Versions::new();
    };
    let mut v: Versions = smallvec::smallvec![0u32; n as usize];
    if let Some(i) = shadow.page_index(first) {
        shadow.versions().snapshot(i, &mut v);
    }
    v
}

/// The optimistic check's version condition, read in place: a fresh
/// `local_versions(shadow, addr, len)` equals `before` and every version is
/// odd (each page's word is read once; a range outside the table reads as
/// even versions, i.e. fails, as in `local_versions`).
fn versions_unchanged(shadow: &MrShadow<RnicIommu>, addr: u64, len: u64, before: &[u32]) -> bool {
    let Some((first, n)) = page_span(addr, len, PS as usize) else {
        return before.is_empty();
    };
    if n as usize != before.len() {
        return false;
    }
    if n == 0 {
        return true;
    }
    let Some(i) = shadow.page_index(first) else {
        return false;
    };
    let vt = shadow.versions();
    before.iter().enumerate().all(|(k, &b)| {
        i.checked_add(k)
            .and_then(|j| vt.get(j))
            .is_some_and(|v| v == b && v % 2 == 1)
    })
}

fn post_steps(
    sh: &Shared,
    st: &mut State,
    qi: usize,
    id: u32,
    strat: Strategy,
    t: &Translation,
    lmr: &Arc<MrEntry>,
) {
    let Some(qp) = qp_at(st, qi) else { return };
    let Some(op) = qp.ops.get(id) else { return };
    let (laddr, len, raddr) = (op.laddr, op.len, op.wr.remote_addr);
    let steps = nic_steps_small(strat, raddr, len, t);
    let vlen = t.version_len;
    let need = match strat {
        Strategy::WriteReadback { deferred: false } => len,
        Strategy::ReadVersioned | Strategy::WriteVersioned => 2 * vlen,
        Strategy::VersionProbe => vlen,
        _ => 0,
    };
    let scratch = if need == 0 {
        None
    } else if need as usize <= qp.slot_size && !qp.scratch_free.is_empty() {
        qp.scratch_free.pop().map(Scratch::Slot)
    } else {
        match sh.pd.reg_mr_owned(
            vec![0; need as usize + PS as usize],
            rnic::Access::LOCAL_WRITE,
        ) {
            Ok(m) => Some(Scratch::Own(m)),
            Err(e) => {
                tracing::warn!(error = %e, "scratch MR failed");
                finish(st, qi, id, ST_LOC_PROT, 0);
                return;
            }
        }
    };
    let (saddr, skey) = scratch
        .as_ref()
        .map(|s| qp.scratch_addr(s))
        .unwrap_or((0, 0));
    let sges: SmallVec<[[rnic::Sge; 1]; 3]> = steps
        .iter()
        .map(|s| {
            let (addr, length, lkey) = match s.local {
                LocalBuf::AppRead => (laddr, len, lmr.read_lkey()),
                LocalBuf::AppWrite => (laddr, len, lmr.write_lkey()),
                LocalBuf::Temp => (saddr + (raddr & (PS - 1)), len, skey),
                LocalBuf::VersionsBefore => (saddr, vlen, skey),
                LocalBuf::VersionsAfter => (saddr + vlen, vlen, skey),
            };
            [rnic::Sge {
                addr,
                length: length as u32,
                lkey,
            }]
        })
        .collect();
    let gen = qp.gen;
    let last = steps.len().saturating_sub(1);
    let wrs: SmallVec<[rnic::SendWr; 3]> = steps
        .iter()
        .zip(&sges)
        .enumerate()
        .map(|(k, (s, sge))| {
            let opc = match s.op {
                crate::nic::WrOp::Read => WrOpcode::Read,
                _ => WrOpcode::Write,
            };
            let mut w = rnic::SendWr::new(enc(qi, gen, K_OP, k as u64, id), opc, sge)
                .remote(s.remote_addr, s.rkey);
            // One NIC completion per operation: on the RC QP the last WR
            // completes after the others; a failing WR and the flushed
            // ones behind it still complete (errors are always reported).
            if k != last {
                w.flags.remove(rnic::SendFlags::SIGNALED);
            }
            w
        })
        .collect();
    let lver = local_versions(&lmr.shadow, laddr, len);
    let (posted, err) = match qp.data.post_send(&wrs) {
        Ok(()) => (wrs.len(), 0),
        Err(e) => {
            tracing::debug!(error = %e.err, "data QP post failed");
            (e.bad_wr_index, ST_LOC_PROT)
        }
    };
    if posted == 0 {
        qp.release_scratch(scratch);
        finish(st, qi, id, err, 0);
        return;
    }
    if posted < wrs.len() {
        // A prefix of unsignaled WRs went out without its signaled last
        // WR: no completion may ever come for them. Unreachable with the
        // SQ sized for 4 WRs per operation; if it happens, the QP fails
        // like on a NIC error (every operation completes, flushed).
        tracing::error!(posted, "partial post of an operation's NIC WRs");
        qp.release_scratch(scratch);
        fail_qp(st, qi, ST_FLUSH);
        return;
    }
    let Some(op) = qp.ops.get_mut(id) else { return };
    op.lver = lver;
    op.scratch = scratch;
    op.sent = None;
    op.stage = Stage::OneSided {
        strat,
        steps: posted as u8,
        left: posted as u8,
        err,
        vlen,
    };
    // A probe moves no data: nothing may pipeline behind it until the
    // operation's data WRs are out (then `on_nic`).
    if op.retry == 0 && strat != Strategy::VersionProbe {
        replay::on_nic(st, qi, id);
    }
}

fn eval_one_sided(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    let Some(qp) = qp_at(st, qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    let Stage::OneSided {
        strat, err, vlen, ..
    } = op.stage
    else {
        return;
    };
    if op.stale {
        replay::stale_done(st, qi, id);
        return;
    }
    if strat == (Strategy::WriteReadback { deferred: true }) && err == 0 {
        // The read-back waits for the next signaled WR (or an idle QP).
        op.stage = Stage::Deferred;
        let due = op.seq < qp.flush_seq;
        st.stats.deferred_writes += 1;
        let Some(qp) = qp_at(st, qi) else { return };
        qp.deferred.push(id);
        if due && !st.flush_qps.contains(&qi) {
            // After this poll batch, so that neighbours share a READ.
            st.flush_qps.push(qi);
        }
        return;
    }
    let scratch = op.scratch.take();
    let lver = std::mem::take(&mut op.lver);
    let (laddr, len, raddr, wop) = (op.laddr, op.len, op.wr.remote_addr, op.wr.op);
    let lmr = op.lmr.clone().expect("one-sided ops have a local MR");
    if err != 0 {
        qp.release_scratch(scratch);
        finish(st, qi, id, err, 0);
        return;
    }
    let mut ok = versions_unchanged(&lmr.shadow, laddr, len, &lver);
    if ok {
        ok = match strat {
            Strategy::ReadMagic => mem::with_slice(laddr, len as usize, |d| {
                check_read(d, laddr, raddr, &sh.check).is_ok()
            }),
            Strategy::WriteReadback { .. } => {
                let s = scratch.as_ref().expect("read-back buffer");
                let sa = qp.readback_addr(s, raddr);
                mem::with_slice(sa, len as usize, |rb| {
                    mem::with_slice(laddr, len as usize, |src| {
                        check_readback(src, rb, raddr, &sh.check).is_ok()
                    })
                })
            }
            Strategy::ReadVersioned | Strategy::WriteVersioned => {
                let s = scratch.as_ref().expect("version buffer");
                let (sa, _) = qp.scratch_addr(s);
                mem::with_slice(sa, 2 * vlen as usize, |b| {
                    let (x, y) = b.split_at(vlen as usize);
                    x.chunks_exact(4).zip(y.chunks_exact(4)).all(|(p, q)| {
                        p == q && u32::from_le_bytes([p[0], p[1], p[2], p[3]]) % 2 == 1
                    })
                })
            }
            Strategy::VersionProbe => {
                let s = scratch.as_ref().expect("version buffer");
                let (sa, _) = qp.scratch_addr(s);
                mem::with_slice(sa, vlen as usize, |b| {
                    b.chunks_exact(4)
                        .all(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]) % 2 == 1)
                })
            }
            Strategy::TwoSided(_) => false,
        };
    }
    qp.release_scratch(scratch);
    if strat == Strategy::VersionProbe {
        // Every page in: the real one-sided attempt (checked as usual);
        // else two-sided at once.
        qp.probe_hint = !ok;
        if ok {
            if let Some(op) = qp.ops.get(id) {
                let real = choose(op.wr.op, len, op.wr.signaled, &sh.cfg.plan);
                match qp.peer.lookup(op.wr.rkey, raddr, len) {
                    Ok(t) => return post_steps(sh, st, qi, id, real, &t, &lmr),
                    Err(_) => return finish(st, qi, id, ST_REM_ACCESS, 0),
                }
            }
            return;
        }
        st.stats.probed_out += 1;
        replay::two_sided(sh, st, qi, id);
        return;
    }
    if let Some(op) = qp.ops.get_mut(id) {
        if op.retry == 2 {
            op.retry = 3;
            qp.send_ctrl(&sh.cfg.ctrl, &Repr::Release { req_id: id });
        }
    }
    if !ok {
        if probes_first(wop, len, &sh.cfg.plan) {
            qp.probe_hint = true;
        }
        replay::two_sided(sh, st, qi, id);
        return;
    }
    st.stats.optimistic_ok += 1;
    if let AppOp::WriteImm(_) = wop {
        start_notify(sh, st, qi, id);
    } else {
        replay::finish_ok(st, qi, id, len as u32);
    }
}

fn start_notify(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    let Some(qp) = qp_at(st, qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    let AppOp::WriteImm(imm) = op.wr.op else {
        return;
    };
    op.stage = Stage::ImmNotify;
    op.sent = Some(Instant::now());
    op.hold = Hold::default();
    let msg = Repr::WriteImmNotify {
        req_id: id,
        addr: op.wr.remote_addr,
        len: op.len as u32,
        rkey: op.wr.rkey,
        imm,
        solicited: false,
    };
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
}

/// Pin the local buffer and map it into the NIC views.
fn pin_local(sh: &Shared, op: &Op) -> Result<Option<EnginePin>, ()> {
    match &op.lmr {
        Some(m) if op.len > 0 => engine_pin(sh, m, op.laddr, op.len).map(Some),
        _ => Ok(None),
    }
}

fn temp_mr(sh: &Shared, addr: u64, len: u64, acc: rnic::Access) -> Result<rnic::Mr, ()> {
    // `ANY_QP`: the peer's reverse operation reaches it whatever the
    // application's flags on the QP (the MR's own rights still apply).
    let acc = acc | rnic::Access::ANY_QP;
    #[allow(unsafe_code)]
    // SAFETY: the range is inside a registered application MR (mapped while
    // registered) and pinned by the caller for the MR's whole lifetime (the
    // `Hold` drops the MR before the pin).
    unsafe { sh.pd.reg_mr(addr as usize, len as usize, acc) }.map_err(|e| {
        tracing::warn!(error = %e, "temporary MR failed");
    })
}

/// Largest READ/WRITE the two-sided path carries inline.
fn inline_max(sh: &Shared) -> u64 {
    (sh.cfg.ctrl.max_inline as u64).min(sh.cfg.plan.inline_max)
}

fn go_two_sided(sh: &Shared, st: &mut State, qi: usize, id: u32) {
    mark(Step::ICheckFail);
    st.stats.two_sided += 1;
    let Some(qp) = qp_at(st, qi) else { return };
    let Some(op) = qp.ops.get_mut(id) else { return };
    if local_fenced(sh, op) {
        // Deregistered (or unmapped) since it was posted: no temporary MR
        // may open that memory to the peer again.
        finish(st, qi, id, ST_LOC_PROT, 0);
        return;
    }
    let inline_max = inline_max(sh);
    let (laddr, len, raddr, rkey) = (op.laddr, op.len, op.wr.remote_addr, op.wr.rkey);
    let mut hold = Hold::default();
    let mut stack = [0u8; mem::STACK_COPY];
    let msg = match op.wr.op {
        AppOp::Read | AppOp::Write | AppOp::WriteImm(_) => {
            let read = op.wr.op == AppOp::Read;
            // Inline forms need no local pin: the NIC never touches the
            // local buffer, the CPU copies it (now for a WRITE, at the answer
            // for a READ), as for atomics and inline SENDs. A page swapped
            // out meanwhile faults on that copy and the pager's fault thread
            // brings it back (it never needs the engine lock).
            if len > inline_max {
                let Ok(pin) = pin_local(sh, op) else {
                    finish(st, qi, id, ST_LOC_PROT, 0);
                    return;
                };
                hold.pin = pin;
            }
            mark(Step::ILocalPinned);
            if len <= inline_max {
                if read {
                    Repr::ReadInline {
                        req_id: id,
                        remote_addr: raddr,
                        rkey,
                        len: len as u32,
                    }
                } else {
                    Repr::WriteInline {
                        req_id: id,
                        remote_addr: raddr,
                        rkey,
                        data: mem::copy_out(laddr, len as usize, &mut stack),
                    }
                }
            } else {
                let acc = if read {
                    rnic::Access::LOCAL_WRITE | rnic::Access::REMOTE_WRITE
                } else {
                    rnic::Access::REMOTE_READ
                };
                let Ok(mr) = temp_mr(sh, laddr, len, acc) else {
                    drop(hold);
                    finish(st, qi, id, ST_LOC_PROT, 0);
                    return;
                };
                let key = mr.rkey();
                hold.mr = Some(mr);
                let retry_mode = sh.cfg.retry_mode && op.retry == 0;
                if retry_mode {
                    op.retry = 1;
                }
                Repr::Fault(FaultRequest {
                    req_id: id,
                    kind: if read {
                        FaultKind::Read
                    } else {
                        FaultKind::Write
                    },
                    local_addr: laddr,
                    local_key: key,
                    remote_addr: raddr,
                    rkey,
                    len: len as u32,
                    inline_ok: false,
                    retry_mode,
                })
            }
        }
        AppOp::CmpSwap { compare, swap } => Repr::Atomic(AtomicRequest {
            req_id: id,
            kind: AtomicKind::CmpSwap,
            remote_addr: raddr,
            rkey,
            compare_add: compare,
            swap,
        }),
        AppOp::FetchAdd { add } => Repr::Atomic(AtomicRequest {
            req_id: id,
            kind: AtomicKind::FetchAdd,
            remote_addr: raddr,
            rkey,
            compare_add: add,
            swap: 0,
        }),
        AppOp::Send | AppOp::SendImm(_) => {
            let imm = match op.wr.op {
                AppOp::SendImm(i) => Some(i),
                _ => None,
            };
            if len <= inline_max {
                Repr::SendInline {
                    req_id: id,
                    imm,
                    solicited: false,
                    data: mem::copy_out(laddr, len as usize, &mut stack),
                }
            } else {
                let Ok(pin) = pin_local(sh, op) else {
                    finish(st, qi, id, ST_LOC_PROT, 0);
                    return;
                };
                hold.pin = pin;
                let Ok(mr) = temp_mr(sh, laddr, len, rnic::Access::REMOTE_READ) else {
                    drop(hold);
                    finish(st, qi, id, ST_LOC_PROT, 0);
                    return;
                };
                let key = mr.rkey();
                hold.mr = Some(mr);
                Repr::SendRendezvous {
                    req_id: id,
                    addr: laddr,
                    len: len as u32,
                    key,
                    imm,
                    solicited: false,
                }
            }
        }
    };
    op.hold = hold;
    op.stage = Stage::TwoSided;
    op.sent = Some(Instant::now());
    qp.send_ctrl(&sh.cfg.ctrl, &msg);
    mark(Step::ISent);
}

/// Complete application operation `id` of QP `qi` and release what waits
/// behind it.
fn finish(st: &mut State, qi: usize, id: u32, status: u32, byte_len: u32) {
    let State {
        qps,
        ready,
        released,
        ..
    } = &mut *st;
    let Some(qp) = qps.get_mut(qi).and_then(|q| q.as_mut()) else {
        return;
    };
    let Some(mut op) = qp.ops.take(id) else {
        return;
    };
    let s = op.scratch.take();
    qp.release_scratch(s);
    qp.key_wait.retain(|x| *x != id);
    let c = Completion {
        wr_id: op.wr.wr_id,
        status,
        op: comp_op(op.wr.op),
        byte_len: if status == 0 { byte_len } else { 0 },
        imm: None,
        qp_num: qp.qpn,
    };
    if let Err(e) = qp.rob.finish(op.seq, status == 0, c) {
        tracing::error!(error = %e, "reorder buffer");
    }
    qp.deliver();
    mark(Step::IDone);
    if let Some(t) = op.ticket {
        released.clear();
        if qp.order.complete_into(t, released).is_ok() {
            ready.extend(released.drain(..).map(|(_, nid)| (qi, nid)));
        }
    }
}

/// Drive the engine: poll the NIC CQ and handle everything. Returns the
/// number of NIC completions handled.
pub(crate) fn progress(sh: &Shared, st: &mut State) -> usize {
    // No application array to fill here (even if an earlier
    // `progress_app_into` unwound without clearing it).
    st.direct.stop();
    progress_inner(sh, st, false)
}

/// [`progress`] from an application thread spinning on user CQ `cq` with
/// room for `out.len()` completions: an idle poll reads the clock (for the
/// timeout sweep) only every 32nd time, and lean-path completions for `cq`
/// go straight into `out` while its queue is empty (so post order holds).
/// Returns how many were put into `out`.
pub(crate) fn progress_app_into(
    sh: &Shared,
    st: &mut State,
    cq: &Arc<UCq>,
    out: &mut [Completion],
) -> usize {
    st.direct.begin(cq, out.len());
    progress_inner(sh, st, true);
    st.direct.end(out)
}

fn progress_inner(sh: &Shared, st: &mut State, app: bool) -> usize {
    let mut wcs = std::mem::take(&mut st.wcs);
    if wcs.is_empty() {
        wcs = vec![rnic::Wc::default(); 64];
    }
    let mut total = 0;
    for (k, cq) in [&sh.ncq, &sh.rcq].into_iter().enumerate() {
        // An application thread that just got data-QP completions leaves
        // the control CQ for the next idle poll (at the latest every 16th
        // call): a one-sided op's completion never arrives there.
        if k == 1 && app && total > 0 && st.progress_calls % 16 != 0 {
            break;
        }
        loop {
            let n = match cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    if !st.cq_failed {
                        st.cq_failed = true;
                        tracing::error!(error = %e, "NIC CQ failed");
                    }
                    0
                }
            };
            for wc in &wcs[..n] {
                handle_wc(sh, st, wc);
                run_ready(sh, st);
            }
            total += n;
            if n < wcs.len() {
                break;
            }
        }
    }
    st.wcs = wcs;
    if !st.flush_qps.is_empty() {
        for qi in std::mem::take(&mut st.flush_qps) {
            flush_deferred(sh, st, qi);
        }
    }
    run_ready(sh, st);
    st.progress_calls = st.progress_calls.wrapping_add(1);
    let idle_check = total == 0 && (!app || st.progress_calls % 32 == 0);
    if (idle_check || st.progress_calls % 256 == 0)
        && st.last_sweep.elapsed() >= std::time::Duration::from_millis(10)
    {
        st.last_sweep = Instant::now();
        sweep_timeouts(sh, st);
    }
    if total == 0 && !st.post_answer.is_empty() {
        // Nothing new arrived: the owed pins + map-ins (counts as work).
        return map_in_owed(sh, st);
    }
    total
}

/// The pins + map-ins owed by answer-first inline READs, all in one pass:
/// page-adjacent ranges of one MR merge into a run that is faulted in
/// with one range pin (one zero-fill / swap-in per run of pages, see
/// `vmem`'s range pin) and mapped with one shadow pass. Returns the
/// number of runs.
fn map_in_owed(sh: &Shared, st: &mut State) -> usize {
    let mut owed: Vec<_> = st.post_answer.drain(..).collect();
    owed.sort_unstable_by_key(|(m, addr, _)| (Arc::as_ptr(m) as usize, *addr));
    let mut runs = 0;
    let mut i = 0;
    while i < owed.len() {
        let (m, start, len) = &owed[i];
        let mut end = start + len;
        let mut j = i + 1;
        while j < owed.len() && Arc::ptr_eq(&owed[j].0, m) && owed[j].1 <= end.next_multiple_of(PS)
        {
            end = end.max(owed[j].1 + owed[j].2);
            j += 1;
        }
        drop(engine_pin(sh, m, *start, end - start));
        runs += 1;
        i = j;
    }
    runs
}

/// Two-sided requests the peer never answered (it destroyed its QP or
/// died) complete with RETRY_EXC_ERR, like an RC transport timeout.
fn sweep_timeouts(sh: &Shared, st: &mut State) {
    let limit = sh.cfg.two_sided_timeout;
    let mut late = Vec::new();
    for (qi, q) in st.qps.iter_mut().enumerate() {
        let Some(qp) = q else { continue };
        for (id, op) in qp.ops.iter() {
            if op.sent.is_some_and(|t| t.elapsed() > limit) {
                late.push((qi, id));
            }
        }
    }
    for (qi, id) in late {
        tracing::warn!(qi, id, "two-sided request timed out");
        finish(st, qi, id, ST_RETRY_EXC, 0);
    }
    // Deferred read-backs are not left waiting for a signaled WR forever.
    let idle: Vec<usize> = st
        .qps
        .iter()
        .enumerate()
        .filter_map(|(qi, q)| q.as_ref().filter(|q| !q.deferred.is_empty()).map(|_| qi))
        .collect();
    for qi in idle {
        flush_deferred(sh, st, qi);
    }
    run_ready(sh, st);
}

fn handle_wc(sh: &Shared, st: &mut State, wc: &rnic::Wc) {
    let (qi, gen, mut kind, step, mut id) = dec(wc.wr_id);
    if st.gens.get(qi) != Some(&gen) {
        return;
    }
    if kind == K_FAST {
        match fast::on_wc(sh, st, qi, step, wc) {
            Some(pid) => (kind, id) = (K_OP, pid),
            None => return,
        }
    }
    let Some(qp) = qp_at(st, qi) else { return };
    let ok = wc.status == WcStatus::Success;
    match kind {
        K_OP => {
            let Some(op) = qp.ops.get_mut(id) else { return };
            if let Stage::OneSided {
                steps, left, err, ..
            } = &mut op.stage
            {
                // Completions still due after step `step`: none on success
                // (only the last WR is signaled), the flushed WRs behind a
                // failed one otherwise.
                let behind = (*steps as u64).saturating_sub(step + 1) as u8;
                *left = (*left).min(behind);
                if !ok && *err == 0 {
                    *err = wc.status as u32;
                }
                if *left == 0 {
                    mark(Step::IOptDone);
                    eval_one_sided(sh, st, qi, id);
                }
            }
        }
        K_REV => {
            let Some(t) = qp.treqs.take(id) else { return };
            let status = if ok { Status::Ok } else { Status::RemoteOp };
            let (reply, kind) = (t.reply, t.kind);
            // Temporary MR first (waits for DMA), then the pin.
            drop(t);
            match kind {
                TKind::Retry => {}
                TKind::Fault { len } => {
                    qp.send_ctrl(
                        &sh.cfg.ctrl,
                        &Repr::Completion {
                            req_id: reply,
                            status,
                            byte_len: if ok { len } else { 0 },
                        },
                    );
                }
                TKind::Rendezvous {
                    recv_wr_id,
                    len,
                    imm,
                } => {
                    qp.rdv_busy = false;
                    qp.recv_cq.push(Completion {
                        wr_id: recv_wr_id,
                        status: if ok { 0 } else { ST_LOC_PROT },
                        op: if imm.is_some() {
                            CompOp::RecvWithImm
                        } else {
                            CompOp::Recv
                        },
                        byte_len: if ok { len } else { 0 },
                        imm,
                        qp_num: qp.qpn,
                    });
                    qp.send_ctrl(
                        &sh.cfg.ctrl,
                        &Repr::Completion {
                            req_id: reply,
                            status,
                            byte_len: if ok { len } else { 0 },
                        },
                    );
                    deliver_inbound(sh, st, qi);
                }
            }
        }
        K_CSEND => {
            qp.ctrl_out = qp.ctrl_out.saturating_sub(1);
            if !ok && wc.status != WcStatus::WrFlushErr {
                tracing::warn!(status = ?wc.status, qpn = qp.qpn, "control send failed: peer gone");
                fail_qp(st, qi, ST_RETRY_EXC);
                return;
            }
            qp.flush_ctrl();
        }
        K_RB => check_batch(sh, st, qi, id, wc.status),
        K_CRECV => {
            if !ok {
                return;
            }
            mark(Step::CtrlRecv);
            let mut slot = [0u8; SLOT];
            qp.ring.read(id as usize * SLOT, &mut slot);
            // The message is copied out of the reassembler (it lives in the
            // engine state the handler mutates) onto the stack: parsing
            // borrows from it, so no allocation for any message up to the
            // default inline limit.
            let mut bytes: SmallVec<[u8; 2048]> = SmallVec::new();
            match qp.reasm.push(&slot) {
                Ok(Some(b)) => bytes.extend_from_slice(b),
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "broken control stream"),
            }
            if !bytes.is_empty() {
                match Repr::parse_bytes(&bytes, &sh.cfg.ctrl) {
                    Ok(msg) => handle_msg(sh, st, qi, msg),
                    Err(e) => tracing::warn!(error = %e, "malformed control message"),
                }
            }
            // The slot was copied out above; it is re-posted only after the
            // message was handled, so an answer leaves without waiting for
            // the NIC's receive post (the ring has slots to spare, and the
            // control QP retries on RNR forever).
            if let Some(qp) = qp_at(st, qi).filter(|q| !q.dead) {
                if let Err(e) = qp.post_slot(id) {
                    tracing::warn!(error = %e, "re-posting a command slot failed");
                }
            }
        }
        _ => {}
    }
}

/// Deregistration of `mr` (its entry already left the table): the
/// temporary MRs over its memory — a two-sided op's local one, a served
/// request's target one — and its own NIC MRs are dropped now, each
/// waiting for the DMA in flight through it. Operations still in flight on
/// it complete with an error: their NIC work fails at the NIC, and their
/// answers are no longer copied in ([`MrEntry::is_fenced`]).
pub(crate) fn fence_mr(st: &mut State, mr: &Arc<MrEntry>) {
    for qp in st.qps.iter_mut().flatten() {
        for (_, t) in qp.treqs.iter_mut() {
            if Arc::ptr_eq(&t._mr, mr) {
                t._tmr = None;
            }
        }
        for (_, op) in qp.ops.iter_mut() {
            if op.lmr.as_ref().is_some_and(|l| Arc::ptr_eq(l, mr)) {
                op.hold.mr = None;
            }
        }
    }
    st.post_answer.retain(|(m, _, _)| !Arc::ptr_eq(m, mr));
    mr.fence();
}

/// Whether op `op`'s local memory is no longer its to write: its MR was
/// deregistered, or the application unmapped the buffer (the address may
/// hold other memory now).
fn local_fenced(sh: &Shared, op: &Op) -> bool {
    op.lmr.as_ref().is_some_and(|m| {
        m.is_fenced()
            || (op.len > 0
                && m.shadow.some_unmapped()
                && (sh.mm.0.is_gone(op.laddr as usize)
                    || sh.mm.0.is_gone((op.laddr + op.len - 1) as usize)))
    })
}

/// The QP fails (its peer is gone, or its NIC work broke): every
/// outstanding operation completes with an error — the oldest with `first`
/// (RETRY_EXC_ERR for a vanished peer), the rest WR_FLUSH_ERR.
fn fail_qp(st: &mut State, qi: usize, first: u32) {
    let Some(qp) = qp_at(st, qi) else { return };
    qp.dead = true;
    qp.flush_ops_after(first);
    for (_, t) in qp.treqs.drain() {
        drop(t);
    }
}

/// Target side of a two-sided READ/WRITE ([`Repr::Fault`]): validate, pin
/// and map in, then the reverse operation through a temporary MR (or, in
/// retry mode, Receiver-Ready).
fn serve_fault(
    sh: &Shared,
    qp: &mut QpState,
    qi: usize,
    f: &FaultRequest,
    need: Access,
    r: Option<(Arc<MrEntry>, LocalRegion<'_, RnicIommu>)>,
) {
    let res = grant(
        sh,
        qp.remote_access,
        r.as_ref(),
        f.remote_addr,
        f.len as u64,
        need,
        false,
    );
    let reply = |qp: &mut QpState, status| {
        qp.send_ctrl(
            &sh.cfg.ctrl,
            &Repr::Completion {
                req_id: f.req_id,
                status,
                byte_len: 0,
            },
        )
    };
    let pin = match res {
        Ok(g) => g,
        Err(s) => return reply(qp, s),
    };
    let (m, _) = r.expect("admitted");
    if f.len == 0 {
        return reply(qp, Status::Ok);
    }
    if f.retry_mode {
        // Pages pinned and mapped: the initiator retries one-sided
        // and releases them.
        let ok = qp
            .treqs
            .insert(TReq {
                reply: f.req_id,
                kind: TKind::Retry,
                _tmr: None,
                _pin: pin,
                _mr: m,
            })
            .is_ok();
        let status = if ok { Status::Ok } else { Status::NoResources };
        qp.send_ctrl(
            &sh.cfg.ctrl,
            &Repr::ReceiverReady {
                req_id: f.req_id,
                status,
            },
        );
        return;
    }
    let opc = if f.kind == FaultKind::Read {
        WrOpcode::Write
    } else {
        WrOpcode::Read
    };
    let Ok(tmr) = temp_mr(sh, f.remote_addr, f.len as u64, rnic::Access::LOCAL_WRITE) else {
        return reply(qp, Status::NoResources);
    };
    let lkey = tmr.lkey();
    let Ok(tid) = qp.treqs.insert(TReq {
        reply: f.req_id,
        kind: TKind::Fault { len: f.len },
        _tmr: Some(tmr),
        _pin: pin,
        _mr: m,
    }) else {
        return reply(qp, Status::NoResources);
    };
    let sge = [rnic::Sge {
        addr: f.remote_addr,
        length: f.len,
        lkey,
    }];
    let wr = rnic::SendWr::new(enc(qi, qp.gen, K_REV, 0, tid), opc, &sge)
        .remote(f.local_addr, f.local_key);
    if let Err(e) = qp.data.post_send(&[wr]) {
        tracing::warn!(error = %e.err, "reverse operation not posted");
        drop(qp.treqs.take(tid));
        reply(qp, Status::RemoteOp);
    }
}

/// Answer READ `f` of never-populated memory of `m` with zeroes: a reverse
/// WRITE from the zero source (made on first use), nothing pinned or faulted
/// in. `false` if it could not be posted (the caller serves it the ordinary
/// way).
fn answer_zero_read(
    sh: &Shared,
    qp: &mut QpState,
    zero: &mut Option<rnic::OwnedMr>,
    qi: usize,
    f: &FaultRequest,
    m: Arc<MrEntry>,
) -> bool {
    if zero.is_none() {
        match sh
            .pd
            .reg_mr_owned(vec![0; ZERO_BUF], rnic::Access::LOCAL_WRITE)
        {
            Ok(z) => *zero = Some(z),
            Err(e) => {
                tracing::warn!(error = %e, "zero source not registered");
                return false;
            }
        }
    }
    let Some(z) = zero.as_ref() else { return false };
    let Ok(tid) = qp.treqs.insert(TReq {
        reply: f.req_id,
        kind: TKind::Fault { len: f.len },
        _tmr: None,
        _pin: None,
        _mr: m,
    }) else {
        return false;
    };
    let per_wr = (ZERO_BUF * zero_sges(sh)) as u64;
    let total = f.len as u64;
    let nwr = total.div_ceil(per_wr);
    if nwr > 8 {
        return false;
    }
    let mut sges: Vec<[rnic::Sge; ZERO_SGES]> = Vec::with_capacity(nwr as usize);
    let mut lens = Vec::with_capacity(nwr as usize);
    for w in 0..nwr {
        let len = (total - w * per_wr).min(per_wr);
        let mut a = [rnic::Sge {
            addr: z.addr() as u64,
            length: 0,
            lkey: z.lkey(),
        }; ZERO_SGES];
        let n = len.div_ceil(ZERO_BUF as u64) as usize; // ≤ zero_sges
        for (k, sg) in a.iter_mut().enumerate().take(n) {
            sg.length = (len - k as u64 * ZERO_BUF as u64).min(ZERO_BUF as u64) as u32;
        }
        sges.push(a);
        lens.push(n);
    }
    let wrs: Vec<rnic::SendWr> = sges
        .iter()
        .zip(&lens)
        .enumerate()
        .map(|(w, (sg, &n))| {
            let last = w as u64 == nwr - 1;
            let mut wr =
                rnic::SendWr::new(enc(qi, qp.gen, K_REV, 0, tid), WrOpcode::Write, &sg[..n])
                    .remote(f.local_addr + w as u64 * per_wr, f.local_key);
            if !last {
                wr.flags.remove(rnic::SendFlags::SIGNALED);
            }
            wr
        })
        .collect();
    match qp.data.post_send(&wrs) {
        Ok(()) => true,
        Err(e) if e.bad_wr_index == 0 => {
            tracing::debug!(error = %e.err, "zero answer not posted");
            drop(qp.treqs.take(tid));
            false
        }
        Err(e) => {
            // Part of it is out without its signaled last WR: the QP fails
            // like on a NIC error.
            tracing::error!(error = %e.err, "zero answer partly posted");
            drop(qp.treqs.take(tid));
            qp.send_ctrl(
                &sh.cfg.ctrl,
                &Repr::Completion {
                    req_id: f.req_id,
                    status: Status::RemoteOp,
                    byte_len: 0,
                },
            );
            true
        }
    }
}

/// Target side: validate like the NIC would — the QP's access flags first
/// (`qp_access`: REM_INV_REQ, as rxe/mlx5 and the pinned NIC), then key,
/// bounds and the MR's rights — then pin and map in.
fn grant(
    sh: &Shared,
    qp_access: Access,
    r: Option<&(Arc<MrEntry>, LocalRegion<'_, RnicIommu>)>,
    addr: u64,
    len: u64,
    need: Access,
    atomic: bool,
) -> Result<Option<EnginePin>, Status> {
    if !qp_access.contains(need) {
        return Err(Status::RemoteInvalid);
    }
    validate(r.map(|x| &x.1), addr, len, need, atomic)?;
    mark(Step::TValidated);
    let (m, _) = r.ok_or(Status::RemoteAccess)?;
    if len == 0 {
        return Ok(None);
    }
    engine_pin(sh, m, addr, len)
        .map(Some)
        .map_err(|()| Status::NoResources)
}

fn region<'a>(
    mrs: &'a IdMap<Arc<MrEntry>>,
    pd: u32,
    rkey: u32,
) -> Option<(Arc<MrEntry>, LocalRegion<'a, RnicIommu>)> {
    let m = mrs.get(&rkey).filter(|m| m.pd == pd)?;
    Some((
        m.clone(),
        LocalRegion {
            access: m.access,
            shadow: &m.shadow,
        },
    ))
}

fn handle_msg(sh: &Shared, st: &mut State, qi: usize, msg: Repr<'_>) {
    let ctrl = sh.cfg.ctrl;
    let State {
        qps,
        mrs,
        keys,
        stats,
        ready,
        post_answer,
        zero,
        ..
    } = &mut *st;
    let Some(qp) = qps.get_mut(qi).and_then(|q| q.as_mut()) else {
        return;
    };
    match msg {
        Repr::KeyQuery { req_id, .. } => {
            qp.keys_served = true;
            for m in keys.sync_messages(req_id, &ctrl) {
                qp.send_ctrl(&ctrl, &m);
            }
        }
        Repr::KeySync { .. } | Repr::KeyRevoke { .. } => {
            let answer = match msg {
                Repr::KeySync {
                    more: false,
                    req_id,
                    ..
                } => Some(req_id),
                _ => None,
            };
            if let Err(e) = qp.peer.apply(&msg) {
                tracing::warn!(error = %e, "bad key message from peer");
            }
            if let Some(r) = answer {
                // Retry every waiting op; those whose query this answers
                // fail if their key is still unknown.
                for id in qp.key_wait.drain(..) {
                    if let Some(op) = qp.ops.get_mut(id) {
                        if r != 0 && op.key_req == r {
                            op.key_answered = true;
                        }
                        op.stage = Stage::Queued;
                        ready.push_back((qi, id));
                    }
                }
            }
        }
        Repr::Fault(f) => {
            stats.served += 1;
            let need = if f.kind == FaultKind::Read {
                Access::REMOTE_READ
            } else {
                Access::REMOTE_WRITE
            };
            let r = region(mrs, qp.pd, f.rkey);
            // A READ of memory that was never populated reads zeroes: it is
            // answered from the zero source at once, nothing faulted in (as
            // Linux maps no page for a read of untouched anonymous memory);
            // the READ linearises at the proof, like the inline answer.
            if f.kind == FaultKind::Read
                && !f.retry_mode
                && qp.remote_access.contains(Access::REMOTE_READ)
                && f.len as u64 <= ZERO_READ_MAX
                && validate(
                    r.as_ref().map(|x| &x.1),
                    f.remote_addr,
                    f.len as u64,
                    Access::REMOTE_READ,
                    false,
                )
                .is_ok()
                && r.as_ref().is_some_and(|(m, _)| {
                    m.range_reads_as_zero(&sh.mm.0, f.remote_addr, f.len as u64)
                })
            {
                let (m, _) = r.expect("checked");
                if answer_zero_read(sh, qp, zero, qi, &f, m) {
                    return;
                }
                let r = region(mrs, qp.pd, f.rkey);
                return serve_fault(sh, qp, qi, &f, need, r);
            }
            serve_fault(sh, qp, qi, &f, need, r)
        }
        Repr::ReadInline {
            req_id,
            remote_addr,
            rkey,
            len,
        } => {
            mark(Step::TParsed);
            stats.served += 1;
            let r = region(mrs, qp.pd, rkey);
            // Pages whose content the target gets without pinning them —
            // never populated (a remote minor fault: zeroes, proven by
            // `MrEntry::reads_as_zero`), swapped out by the pager (a major
            // fault: the bytes are read from the swap slot) or resident (a
            // lazy swap-in: a CPU copy) — are answered first; the pin
            // (zero-fill / swap-in) and map-in follow, off the initiator's
            // critical path. Validation is the same as below, and
            // the READ linearises at the proof / slot read (a racing local
            // write may follow it).
            let early = r.as_ref().filter(|_| {
                len > 0
                    && qp.remote_access.contains(Access::REMOTE_READ)
                    && len as usize <= mem::STACK_COPY
                    && validate(
                        r.as_ref().map(|x| &x.1),
                        remote_addr,
                        len as u64,
                        Access::REMOTE_READ,
                        false,
                    )
                    .is_ok()
            });
            if let Some((m, _)) = early {
                let mut data = [0u8; mem::STACK_COPY];
                let n = len as usize;
                let known = m.reads_as_zero(&sh.mm.0, remote_addr, len as u64)
                    || matches!(
                        sh.mm.0.read_swapped(remote_addr as usize, &mut data[..n]),
                        Ok(true)
                    )
                    || (page_span(remote_addr, len as u64, PS as usize).is_some_and(|(p, k)| {
                        (0..k).all(|i| sh.mm.0.is_resident((p + i * PS) as usize))
                    }) && {
                        // Resident (a lazy swap-in: the NIC views are
                        // still unmapped): the CPU copies it now; were
                        // it evicted meanwhile, the copy faults it back
                        // in through the pager (slow, still exact).
                        mem::read_into(remote_addr, &mut data[..n]);
                        true
                    });
                if known {
                    mark(Step::TValidated);
                    mark(Step::TCopied);
                    let status = Status::Ok;
                    let data = Cow::Borrowed(&data[..n]);
                    qp.send_ctrl(
                        &ctrl,
                        &Repr::ReadInlineResp {
                            req_id,
                            status,
                            data,
                        },
                    );
                    mark(Step::TSent);
                    // Then fault them in and map them for the NIC, as the
                    // pinned path would have, so that later READs go
                    // one-sided: at the next idle progress pass (a bounded
                    // queue; beyond it, now).
                    if post_answer.len() < 256 {
                        post_answer.push_back((m.clone(), remote_addr, len as u64));
                    } else {
                        drop(engine_pin(sh, m, remote_addr, len as u64));
                    }
                    return;
                }
            }
            let res = grant(
                sh,
                qp.remote_access,
                r.as_ref(),
                remote_addr,
                len as u64,
                Access::REMOTE_READ,
                false,
            );
            let mut stack = [0u8; mem::STACK_COPY];
            let (status, data) = match res {
                Ok(g) => {
                    let d = mem::copy_out(remote_addr, len as usize, &mut stack);
                    drop(g);
                    (Status::Ok, d)
                }
                Err(s) => (s, Cow::Borrowed(&[][..])),
            };
            mark(Step::TCopied);
            qp.send_ctrl(
                &ctrl,
                &Repr::ReadInlineResp {
                    req_id,
                    status,
                    data,
                },
            );
            mark(Step::TSent);
        }
        Repr::WriteInline {
            req_id,
            remote_addr,
            rkey,
            data,
        } => {
            stats.served += 1;
            let r = region(mrs, qp.pd, rkey);
            let res = grant(
                sh,
                qp.remote_access,
                r.as_ref(),
                remote_addr,
                data.len() as u64,
                Access::REMOTE_WRITE,
                false,
            );
            let status = match res {
                Ok(g) => {
                    mem::write(remote_addr, &data);
                    drop(g);
                    Status::Ok
                }
                Err(s) => s,
            };
            qp.send_ctrl(
                &ctrl,
                &Repr::Completion {
                    req_id,
                    status,
                    byte_len: data.len() as u32,
                },
            );
        }
        Repr::Atomic(a) => {
            stats.served += 1;
            let r = region(mrs, qp.pd, a.rkey);
            let res = grant(
                sh,
                qp.remote_access,
                r.as_ref(),
                a.remote_addr,
                8,
                Access::REMOTE_ATOMIC,
                true,
            );
            let (status, original) = match res {
                Ok(g) => match mem::atomic_at(a.remote_addr) {
                    Some(w) => {
                        let v = apply_atomic(a.kind, a.compare_add, a.swap, w);
                        drop(g);
                        (Status::Ok, v)
                    }
                    None => (Status::RemoteInvalid, 0),
                },
                Err(s) => (s, 0),
            };
            qp.send_ctrl(
                &ctrl,
                &Repr::AtomicResp {
                    req_id: a.req_id,
                    status,
                    original,
                },
            );
        }
        Repr::SendInline { .. } | Repr::SendRendezvous { .. } | Repr::WriteImmNotify { .. } => {
            qp.inbound.push_back(msg.into_owned());
            deliver_inbound(sh, st, qi);
        }
        Repr::Completion {
            req_id,
            status,
            byte_len,
        } => {
            let Some(op) = qp.ops.get_mut(req_id) else {
                return;
            };
            match op.stage {
                Stage::TwoSided => {
                    if matches!(op.wr.op, AppOp::WriteImm(_)) && status == Status::Ok {
                        start_notify(sh, st, qi, req_id);
                    } else if matches!(
                        op.wr.op,
                        AppOp::Read | AppOp::Write | AppOp::Send | AppOp::SendImm(_)
                    ) {
                        let len = if status == Status::Ok { byte_len } else { 0 };
                        finish(st, qi, req_id, wc_status(status), len);
                    }
                }
                Stage::ImmNotify => {
                    let len = op.len as u32;
                    finish(st, qi, req_id, wc_status(status), len);
                }
                _ => {}
            }
        }
        Repr::ReadInlineResp {
            req_id,
            status,
            data,
        } => {
            let Some(op) = qp.ops.get_mut(req_id) else {
                return;
            };
            if !matches!(op.stage, Stage::TwoSided) || op.wr.op != AppOp::Read {
                return;
            }
            let mut s = wc_status(status);
            // A later READ of the same destination may already have landed
            // (it did not wait for this one): this answer is dead then.
            let dead = op.ticket.is_some_and(|t| qp.order.data_dead(t));
            if local_fenced(sh, op) {
                // Deregistered meanwhile: its memory is not ours to write.
                s = ST_LOC_PROT;
            } else if status == Status::Ok {
                if data.len() as u64 == op.len {
                    if !dead {
                        mem::write(op.laddr, &data);
                    }
                } else {
                    s = wc_status(Status::RemoteInvalid);
                }
            }
            let len = op.len as u32;
            finish(st, qi, req_id, s, len);
        }
        Repr::AtomicResp {
            req_id,
            status,
            original,
        } => {
            let Some(op) = qp.ops.get_mut(req_id) else {
                return;
            };
            if !matches!(op.stage, Stage::TwoSided) || !is_atomic(op.wr.op) {
                return;
            }
            let mut s = wc_status(status);
            if local_fenced(sh, op) {
                s = ST_LOC_PROT;
            } else if status == Status::Ok {
                mem::write(op.laddr, &original.to_le_bytes());
            }
            finish(st, qi, req_id, s, 8);
        }
        Repr::Release { req_id } => {
            let hit = qp
                .treqs
                .iter()
                .find(|(_, t)| t.reply == req_id && matches!(t.kind, TKind::Retry))
                .map(|(tid, _)| tid);
            if let Some(tid) = hit {
                drop(qp.treqs.take(tid));
            }
        }
        Repr::ReceiverReady { req_id, status } => {
            let Some(op) = qp.ops.get_mut(req_id) else {
                return;
            };
            if !matches!(op.stage, Stage::TwoSided) || op.retry != 1 {
                return;
            }
            if status != Status::Ok {
                finish(st, qi, req_id, wc_status(status), 0);
                return;
            }
            op.retry = 2;
            stats.retries += 1;
            let t = match qp.peer.lookup(op.wr.rkey, op.wr.remote_addr, op.len) {
                Ok(t) => t,
                Err(_) => {
                    finish(st, qi, req_id, ST_REM_ACCESS, 0);
                    return;
                }
            };
            // Both sides are pinned and mapped; page versions prove it.
            let strat = if op.wr.op == AppOp::Read {
                Strategy::ReadVersioned
            } else {
                Strategy::WriteVersioned
            };
            let lmr = op.lmr.clone().expect("READ/WRITE with data has a local MR");
            post_steps(sh, st, qi, req_id, strat, &t, &lmr);
        }
        other => {
            tracing::debug!(op = ?other.opcode(), "control message ignored");
        }
    }
}

/// Match inbound messages (SEND, WRITE_WITH_IMM notices) with posted RECVs.
fn deliver_inbound(sh: &Shared, st: &mut State, qi: usize) {
    let ctrl = sh.cfg.ctrl;
    let State { qps, mrs, .. } = &mut *st;
    let Some(qp) = qps.get_mut(qi).and_then(|q| q.as_mut()) else {
        return;
    };
    while !qp.rdv_busy && !qp.inbound.is_empty() && !qp.recvs.is_empty() {
        let msg = qp.inbound.pop_front().expect("non-empty");
        let rwr = qp.recvs.pop_front().expect("non-empty");
        let (raddr, rlen, rkey) = rwr
            .sge
            .map(|s| (s.addr, s.length as u64, s.lkey))
            .unwrap_or((0, 0, 0));
        let rmr = rwr.sge.and_then(|_| mrs.get(&rkey).cloned()).filter(|m| {
            m.pd == qp.pd && m.contains(raddr, rlen) && m.access.contains(Access::LOCAL_WRITE)
        });
        let valid = rwr.sge.is_none() || rmr.is_some();
        let mut cqe = Completion {
            wr_id: rwr.wr_id,
            status: 0,
            op: CompOp::Recv,
            byte_len: 0,
            imm: None,
            qp_num: qp.qpn,
        };
        let reply = |qp: &mut QpState, req_id, status, byte_len| {
            qp.send_ctrl(
                &ctrl,
                &Repr::Completion {
                    req_id,
                    status,
                    byte_len,
                },
            )
        };
        match msg {
            Repr::SendInline {
                req_id, imm, data, ..
            } => {
                cqe.imm = imm;
                if imm.is_some() {
                    cqe.op = CompOp::RecvWithImm;
                }
                if !valid {
                    cqe.status = ST_LOC_PROT;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::RemoteOp, 0);
                } else if data.len() as u64 > rlen {
                    cqe.status = ST_LOC_LEN;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::RemoteInvalid, 0);
                } else {
                    mem::write(raddr, &data);
                    cqe.byte_len = data.len() as u32;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::Ok, data.len() as u32);
                }
            }
            Repr::WriteImmNotify {
                req_id, len, imm, ..
            } => {
                cqe.op = CompOp::RecvWithImm;
                cqe.imm = Some(imm);
                cqe.byte_len = len;
                qp.recv_cq.push(cqe);
                reply(qp, req_id, Status::Ok, len);
            }
            Repr::SendRendezvous {
                req_id,
                addr,
                len,
                key,
                imm,
                ..
            } => {
                let Some(m) = rmr.filter(|_| len as u64 <= rlen) else {
                    cqe.status = if valid { ST_LOC_LEN } else { ST_LOC_PROT };
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::RemoteInvalid, 0);
                    continue;
                };
                if len == 0 {
                    cqe.imm = imm;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::Ok, 0);
                    continue;
                }
                let pinned = engine_pin(sh, &m, raddr, len as u64).and_then(|p| {
                    temp_mr(sh, raddr, len as u64, rnic::Access::LOCAL_WRITE).map(|t| (p, t))
                });
                let Ok((pin, tmr)) = pinned else {
                    cqe.status = ST_LOC_PROT;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::NoResources, 0);
                    continue;
                };
                let lkey = tmr.lkey();
                let Ok(tid) = qp.treqs.insert(TReq {
                    reply: req_id,
                    kind: TKind::Rendezvous {
                        recv_wr_id: rwr.wr_id,
                        len,
                        imm,
                    },
                    _tmr: Some(tmr),
                    _pin: Some(pin),
                    _mr: m,
                }) else {
                    cqe.status = ST_LOC_PROT;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::NoResources, 0);
                    continue;
                };
                let sge = [rnic::Sge {
                    addr: raddr,
                    length: len,
                    lkey,
                }];
                let wr = rnic::SendWr::new(enc(qi, qp.gen, K_REV, 0, tid), WrOpcode::Read, &sge)
                    .remote(addr, key);
                if let Err(e) = qp.data.post_send(&[wr]) {
                    tracing::warn!(error = %e.err, "rendezvous READ not posted");
                    drop(qp.treqs.take(tid));
                    cqe.status = ST_LOC_PROT;
                    qp.recv_cq.push(cqe);
                    reply(qp, req_id, Status::RemoteOp, 0);
                    continue;
                }
                qp.rdv_busy = true;
            }
            _ => {}
        }
    }
}

/// Tell every peer whose initial key sync happened about a new MR (the
/// others learn it with the whole table on their first use; pushing to a
/// peer QP not yet connected would kill our control QP).
pub(crate) fn broadcast_keysync(sh: &Shared, st: &mut State, m: KeyMapping) {
    for qp in st.qps.iter_mut().flatten() {
        if qp.connected && qp.keys_served && !qp.dead {
            qp.send_ctrl(
                &sh.cfg.ctrl,
                &Repr::KeySync {
                    req_id: 0,
                    more: false,
                    entries: Cow::Owned(vec![m]),
                },
            );
        }
    }
}

/// Tell every peer whose initial key sync happened to forget `rkey` (the
/// others never got it).
pub(crate) fn broadcast_revoke(sh: &Shared, st: &mut State, rkey: u32) {
    for qp in st.qps.iter_mut().flatten() {
        if qp.connected && qp.keys_served && !qp.dead {
            qp.send_ctrl(&sh.cfg.ctrl, &Repr::KeyRevoke { req_id: 0, rkey });
        }
    }
}

/// Destroy QP `qi`: NIC QPs to ERR, every outstanding WR and RECV completes
/// with WR_FLUSH_ERR, pins drop. Returns the state to drop outside the lock.
pub(crate) fn destroy_qp(_sh: &Shared, st: &mut State, qi: usize, gen: u8) -> Option<QpState> {
    if st.gens.get(qi) != Some(&gen) {
        return None;
    }
    let mut qp = st.qps.get_mut(qi)?.take()?;
    st.gens[qi] = st.gens[qi].wrapping_add(1);
    st.ready.retain(|(q, _)| *q != qi);
    let err = QpAttr {
        qp_state: NicQpState::Err,
        ..QpAttr::default()
    };
    let _ = qp.data.modify(&err, QpAttrMask::STATE);
    let _ = qp.ctrl.modify(&err, QpAttrMask::STATE);
    qp.flush_ops();
    qp.flush_recvs();
    drop(qp.treqs.drain());
    Some(qp)
}

/// Move QP `qi` to ERR (`ibv_modify_qp(IBV_QPS_ERR)`): the NIC data and
/// control QPs go to ERR (the peer's requests to this QP fail at its NIC
/// and its outstanding operations complete with an error), every
/// outstanding WR — issued, parked in the ordering table, waiting for keys,
/// two-sided or with a deferred read-back — and every posted RECV completes
/// once with WR_FLUSH_ERR in post order, and pins drop. Later posts are
/// accepted and flushed (rdma-core semantics). Idempotent.
pub(crate) fn set_error(st: &mut State, qi: usize, gen: u8) -> Result<(), Error> {
    if st.gens.get(qi) != Some(&gen) {
        return Err(Error::QpState);
    }
    st.ready.retain(|(q, _)| *q != qi);
    st.flush_qps.retain(|q| *q != qi);
    let qp = qp_at(st, qi).ok_or(Error::QpState)?;
    if qp.errored {
        return Ok(());
    }
    let err = QpAttr {
        qp_state: NicQpState::Err,
        ..QpAttr::default()
    };
    if let Err(e) = qp.data.modify(&err, QpAttrMask::STATE) {
        tracing::warn!(error = %e, "data QP to ERR");
    }
    if let Err(e) = qp.ctrl.modify(&err, QpAttrMask::STATE) {
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
