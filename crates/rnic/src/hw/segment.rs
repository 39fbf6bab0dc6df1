//! The host segment: every piece of NIC state a peer needs (MR table, QP table with
//! RQ rings and request rings, CQ rings, IOMMU page table, frame-residency map,
//! flush epochs, NIC doorbell, stats) in one fixed-layout `#[repr(C)]` shared
//! mapping addressed by offsets. In-process peers use it directly; other processes
//! map the same memfd through `/proc/<pid>/fd/<fd>`.

use crate::config::HostConfig;
use crate::error::{Error, Result};
use crate::sys::{self, Mapping};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

pub use crate::sys::{PAGE, PAGE_SHIFT};
const SEG_MAGIC: u64 = 0x6e70_7264_6d61_0006; // "nprdma" v6 (v5 + trusted flag, multi-part ring requests)

/// A cache-line-aligned wrapper to keep hot shared counters apart.
#[repr(C, align(64))]
#[derive(Default)]
pub struct Line<T>(pub T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Sizing parameters, written once at creation; peers recompute the layout from them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Largest DMA atom (the PCIe max TLP size) in bytes.
    pub max_tlp: u32,
    /// The signature word a non-resident page reads as.
    pub magic: u32,
    /// QP table size.
    pub max_qp: u32,
    /// MR table size.
    pub max_mr: u32,
    /// CQ table size.
    pub max_cq: u32,
    /// Entries per CQ ring.
    pub max_cqe: u32,
    /// Receive WQEs per QP.
    pub max_wr: u32,
    /// SGEs per receive WQE.
    pub max_sge: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Slots per QP request ring.
    pub ring_slots: u32,
    /// Data bytes per request-ring slot.
    pub ring_max: u32,
    /// Residency-map range records.
    pub max_tracked_ranges: u32,
    /// IOMMU page-table entries (IOVA pages).
    pub iova_pages: u64,
    /// Pages the residency map can track.
    pub max_tracked_pages: u64,
    /// Largest READ/WRITE the initiators send through the ring (<= ring_max).
    pub ring_rw_max: u32,
    /// 1 if the owner trusts peers with direct access to its memory
    /// (`HostConfig::trusted_peers`); 0 = every request goes through its rings.
    pub trusted: u32,
}

impl Params {
    /// Whether the owner trusts its peers with direct access (`HostConfig::trusted_peers`).
    pub fn trusted_by_owner(&self) -> bool {
        self.trusted != 0
    }

    /// The parameters of a host built from `c`.
    pub fn from_config(c: &HostConfig) -> Params {
        Params {
            max_tlp: c.max_tlp as u32,
            magic: c.magic,
            max_qp: c.max_qp,
            max_mr: c.max_mr,
            max_cq: c.max_cq,
            max_cqe: c.max_cqe,
            max_wr: c.max_wr,
            max_sge: c.max_sge,
            max_inline: c.max_inline,
            ring_slots: c.ring_slots,
            ring_max: c.ring_max,
            max_tracked_ranges: c.max_tracked_ranges,
            iova_pages: c.iova_pages,
            max_tracked_pages: c.max_tracked_pages,
            ring_rw_max: c.ring_rw_max.unwrap_or(c.ring_max).min(c.ring_max),
            trusted: c.trusted_peers as u32,
        }
    }
}

/// Per-host counters (all hosts' DMA engines update them through the segment).
#[repr(C)]
#[derive(Default)]
pub struct StatsRec {
    /// Send WRs executed.
    pub wrs: AtomicU64,
    /// Payload bytes moved by DMA.
    pub bytes: AtomicU64,
    /// DMA atoms (max-TLP pieces) moved.
    pub atoms: AtomicU64,
    /// DMA atoms refused because their frame was not resident (0 in a correct run).
    pub nonresident_dma: AtomicU64,
    /// IOMMU flushes.
    pub flushes: AtomicU64,
    /// Requests served through request rings.
    pub ring_requests: AtomicU64,
    /// SENDs that found no posted RECV.
    pub rnr_naks: AtomicU64,
    /// WRs completed with an error status.
    pub errors: AtomicU64,
    /// ODP model: page faults on the initiator's own MRs.
    pub odp_faults_local: AtomicU64,
    /// ODP model: page faults raised at a target.
    pub odp_faults_remote: AtomicU64,
    /// ODP model: retransmissions after a fault NAK.
    pub retransmissions: AtomicU64,
    /// Transfers copied through the NIC-shared DMA pool.
    pub pool_copies: AtomicU64,
    /// WRs executed directly against another process's memory (trusting hosts only).
    pub direct_remote: AtomicU64,
    /// IOMMU flushes that waited longer than a second for DMA sections.
    pub flush_stalls: AtomicU64,
    /// IOMMU flushes that gave up at their timeout (the caller keeps the old
    /// frames in use: `Iommu::flush` returned an error).
    pub flush_timeouts: AtomicU64,
}

#[repr(C)]
/// The segment header: identity, parameters, epochs, NIC-thread signalling, stats.
pub struct Header {
    /// Layout version magic (`SEG_MAGIC`), written last at creation.
    pub magic: AtomicU64,
    /// Random nonce naming this host incarnation (part of `HostAddr`).
    pub nonce: AtomicU64,
    /// Length of the whole mapping.
    pub total_len: AtomicU64,
    /// PID of the owning process.
    pub pid: AtomicU32,
    /// The segment's memfd number in the owner.
    pub memfd: AtomicU32,
    /// Sizing parameters (peers recompute the layout from them).
    pub params: Params,
    /// IOMMU flush epoch (see `iommu::flush_epoch`).
    pub epoch: Line<AtomicU64>,
    /// DMA-section counters per epoch parity, in `EPOCH_SLOTS` cache lines chosen
    /// per thread (see `iommu::enter`): initiators of different processes entering
    /// this host's sections do not bounce one line between cores.
    pub inflight: [[Line<AtomicU64>; 2]; EPOCH_SLOTS],
    /// Owner of each claimable slot (`iommu::FOREIGN_SLOTS`): the process token
    /// (`sys::process_token`) of the other process whose threads count their
    /// sections there, 0 = free. A flush that finds a section of a dead owner
    /// still counted clears it (`iommu::flush_epoch`).
    pub slot_owner: [Line<AtomicU64>; EPOCH_SLOTS],
    /// Per-host counters.
    pub stats: Line<StatsRec>,
    /// Range records in use in the residency map.
    pub nranges: Line<AtomicU32>,
    /// ODP model: page faults raised by peers in other processes (see `odp`).
    pub odp_mail: Line<OdpMail>,
    /// NIC-shared DMA pool (see [`crate::pool`]): memfd number in the owner, the
    /// owner's mapping address, and its length (0 = no pool).
    pub pool_fd: AtomicU32,
    /// The pool's mapping address in the owner.
    pub pool_base: AtomicU64,
    /// The pool's length (0 = no pool).
    pub pool_len: AtomicU64,
    /// The mailbox's memfd number in the owner (see [`MboxHeader`]).
    pub mbox_fd: AtomicU32,
    /// The mailbox's length.
    pub mbox_len: AtomicU64,
}

/// The head of a host's **mailbox**: the only memory of a host that peers in other
/// processes may write (a memfd of its own, mapped writable by peers). It holds this
/// header (the NIC thread's doorbell futex and liveness token), the doorbell bitmap and
/// the request rings. Everything else of the segment — MR, QP and CQ tables, receive
/// queues, IOMMU, residency map — is sealed against writes by others
/// (`F_SEAL_FUTURE_WRITE`: peers can only map it read-only) unless the owner trusts its
/// peers (`HostConfig::trusted_peers`), so a process that bypasses this crate cannot
/// rewrite another host's tables; whatever it writes in the mailbox is a request that
/// the owner checks.
#[repr(C)]
pub struct MboxHeader {
    /// NIC thread futex word (bumped to wake it).
    pub nic_seq: Line<AtomicU32>,
    /// Non-zero while the NIC thread is (about to be) blocked on `nic_seq`:
    /// [`NIC_ASLEEP`], or [`NIC_ASLEEP_ATTENDING`] while it collects answers for an
    /// application that blocked (targets then wake it when they answer).
    pub nic_sleeping: Line<AtomicU32>,
    /// 1 while another thread of the owner polls the doorbells in the NIC
    /// thread's place (see `Host::set_ring_polling`): requesters then do not wake
    /// the NIC thread for a doorbell.
    pub ext_polling: Line<AtomicU32>,
    /// Set when the owner's NIC thread stopped (orderly) or a peer found it dead.
    pub dead: AtomicU32,
    /// Liveness token (a process-shared robust `pthread_mutex_t`, see `sys::life`)
    /// held by the owner's NIC thread.
    pub life: Line<[AtomicU64; 8]>,
}

const _: () = assert!(std::mem::size_of::<libc::pthread_mutex_t>() <= 64);

/// `MboxHeader::nic_sleeping`: the NIC thread is blocked (or about to be).
pub const NIC_ASLEEP: u32 = 1;
/// `MboxHeader::nic_sleeping`: blocked while attending (see `Segment::kick_answer`).
pub const NIC_ASLEEP_ATTENDING: u32 = 2;

/// The NIC's mapping of a host's DMA pool memfd (own or a peer's).
struct PoolMap {
    map: Mapping,
    /// The owner's address of the pool's first byte.
    base: u64,
    len: u64,
    fd: OwnedFd,
}

/// Epoch counter slots per host (SRCU-style per-thread counters; a flush sums them).
pub const EPOCH_SLOTS: usize = 16;
/// Epoch slots `0..OWN_SLOTS` count the sections of the owner process's own
/// threads (spread per thread); `FOREIGN_SLOTS` are claimed one per other process
/// (an owner token in the header names it, so a flush can clear the sections of a
/// process that died inside one); the last slot is shared by other processes that
/// found no free slot (never cleared: a death there still costs the flush timeout).
pub const OWN_SLOTS: usize = EPOCH_SLOTS / 2;
/// Epoch slots claimable by threads of other processes.
pub const FOREIGN_SLOTS: std::ops::Range<usize> = OWN_SLOTS..EPOCH_SLOTS - 1;

/// Slots of the ODP fault mailbox.
pub const ODP_MAIL_SLOTS: usize = 16;

/// ODP model: a small mailbox of remote page faults (raised by initiators of other
/// processes, served by the owning host's NIC thread). Slot states: 0 free, 1 being
/// written, 2 full.
#[repr(C)]
pub struct OdpMail {
    /// Full slots not yet served.
    pub pending: AtomicU32,
    /// Slot states (0 free, 1 being written, 2 full).
    pub state: [AtomicU32; ODP_MAIL_SLOTS],
    /// Faulting address per slot.
    pub addr: [AtomicU64; ODP_MAIL_SLOTS],
    /// Faulting length per slot.
    pub len: [AtomicU64; ODP_MAIL_SLOTS],
}

#[repr(C)]
/// An MR table entry (the MTT of one MR).
pub struct MrRec {
    /// 0 = invalid; otherwise the current lkey/rkey.
    pub key: AtomicU32,
    /// Protection domain number.
    pub pd: AtomicU32,
    /// `Access` bits.
    pub access: AtomicU32,
    /// 0 = passthrough (identity MTT, no IOMMU), 1 = IOVA range.
    pub kind: AtomicU32,
    /// Registered virtual address.
    pub va: AtomicU64,
    /// Registered length in bytes.
    pub len: AtomicU64,
    /// First IOVA of the range (for `kind` 1).
    pub iova_base: AtomicU64,
    /// Slot of the IOVA range's record ([`IovaRec`]) for `kind` 1.
    pub iova_slot: AtomicU32,
    /// Protection sub-domain within the PD: 0 = any QP of the PD may reach
    /// the MR; otherwise only a QP of the same domain
    /// ([`QpRec::domain`]) may, as remote keys go (a layer above the NIC
    /// that keeps one NIC PD for several of its own PDs uses it).
    pub domain: AtomicU32,
    _pad: [u64; 2],
}

/// One IOMMU page-table entry (see [`crate::iommu`] for the encoding): 4 bytes
/// per IOVA page, the size of a real IOMMU's PTE.
pub type IommuEntry = AtomicU32;

/// Frame windows per IOVA range (see [`IovaRec`]).
pub const FRAME_WINDOWS: usize = 4;

/// The record of one allocated IOVA range: the aligned windows of frame
/// addresses its RAM entries point into (entries hold a window index and the
/// page offset inside it). Slot `i` holds `window number + 1`, 0 = unused;
/// a slot is set once (before any entry naming it is stored) and cleared only
/// when the range is freed.
#[repr(C)]
pub struct IovaRec {
    /// Window number + 1 per slot, 0 = unused.
    pub windows: [AtomicU64; FRAME_WINDOWS],
}

/// A QP's shared record. The first cache line is read-mostly (identity, state,
/// connection); the receive-queue indices, written on every post_recv and every
/// delivered message, have their own line, so a peer delivering into the RQ does not
/// invalidate the line the owner reads on every post (QP state).
#[repr(C)]
pub struct QpRec {
    /// QP number.
    pub qpn: AtomicU32,
    /// 1 while the table slot holds a QP.
    pub in_use: AtomicU32,
    /// `QpState` value.
    pub state: AtomicU32,
    /// Protection domain number.
    pub pd: AtomicU32,
    /// `qp_access_flags` (`Access` bits).
    pub access: AtomicU32,
    /// Send CQ table index.
    pub send_cq: AtomicU32,
    /// Receive CQ table index.
    pub recv_cq: AtomicU32,
    /// `min_rnr_timer` from the last modify.
    pub min_rnr_timer: AtomicU32,
    /// Nonce of the connected peer host.
    pub peer_nonce: AtomicU64,
    /// QP number of the connected peer QP.
    pub peer_qpn: AtomicU32,
    /// SGEs per receive WQE.
    pub max_recv_sge: AtomicU32,
    /// Receive-queue depth.
    pub rq_depth: AtomicU32,
    /// Bumped on every RESET so stale peers notice a recycled QP.
    pub incarnation: AtomicU32,
    /// [`QP_UC`] for an unreliable-connected QP, [`QP_UD`] for a datagram QP (their
    /// responders drop what they refuse instead
    /// of failing the QP), 0 for RC.
    pub unreliable: AtomicU32,
    /// Protection sub-domain of the QP (see [`MrRec::domain`]); 0 = none: the
    /// QP reaches only MRs without one.
    pub domain: AtomicU32,
    /// `shm_lock` word serialising receive-queue consumers.
    pub rq_lock: AtomicU32,
    /// 1 + the table index of the shared receive queue this QP takes its receives
    /// from (0 = its own RQ). An SRQ is a table entry of its own whose RQ fields
    /// (lock, head, tail, WQEs, `pd`) are the shared queue; its `in_use` is
    /// [`SRQ_IN_USE`], so it is never a QP.
    pub srq: AtomicU32,
    /// Next receive WQE to consume.
    pub rq_head: AtomicU64,
    /// Next receive WQE slot to post.
    pub rq_tail: AtomicU64,
    /// A UD QP's Q_Key (a datagram presenting another is dropped).
    pub qkey: AtomicU32,
    _pad_q: u32,
    _pad_rq2: [u64; 4],
    /// Request-ring consumer index.
    pub ring_cons: Line<AtomicU64>,
    _pad1: [u64; 16],
}

/// `QpRec::unreliable` of an unreliable-connected QP.
pub const QP_UC: u32 = 1;
/// `QpRec::unreliable` of an unreliable-datagram QP: its request ring takes
/// [`RING_UD`] requests from any peer (slots claimed [`SLOT_FREE`] -> [`SLOT_FILL`]
/// -> [`SLOT_REQ`], freed by the consumer; nothing is answered).
pub const QP_UD: u32 = 2;

/// `QpRec::in_use` of a table entry that holds a shared receive queue.
pub const SRQ_IN_USE: u32 = 2;

#[repr(C)]
/// One SGE of a receive WQE.
pub struct SgeRec {
    /// Buffer address.
    pub addr: AtomicU64,
    /// Buffer length.
    pub len: AtomicU32,
    /// Local key of the buffer's MR.
    pub lkey: AtomicU32,
}

#[repr(C)]
/// Header of a receive WQE (its SGEs follow).
pub struct WqeHdr {
    /// The RECV's `wr_id`.
    pub wr_id: AtomicU64,
    /// Number of SGEs that follow.
    pub nsge: AtomicU32,
    _pad: u32,
}

/// Ring slot states.
pub const SLOT_FREE: u32 = 0;
/// Slot holds a request.
pub const SLOT_REQ: u32 = 1;
/// Slot holds the answer.
pub const SLOT_DONE: u32 = 2;
/// A shared-copy job taken by the target's NIC thread.
pub const SLOT_BUSY: u32 = 3;
/// A UD QP's slot a producer claimed and is filling.
pub const SLOT_FILL: u32 = 4;

/// Ring op codes.
pub const RING_READ: u32 = 1;
/// Ring op: WRITE.
pub const RING_WRITE: u32 = 2;
/// Ring op: compare-and-swap.
pub const RING_CAS: u32 = 3;
/// Ring op: fetch-and-add.
pub const RING_FADD: u32 = 4;
/// Help a large cross-process READ: copy target -> initiator (process_vm_writev).
pub const RING_HELP_READ: u32 = 5;
/// Help a large cross-process WRITE: copy initiator -> target (process_vm_readv).
pub const RING_HELP_WRITE: u32 = 6;
/// One part of a SEND / SEND_WITH_IMM (`raddr` = offset in the message, `swp` = the
/// message length, `cmp` = immediate data; payload in the slot's data area).
pub const RING_SEND: u32 = 7;
/// The last part of a WRITE_WITH_IMM (earlier parts are RING_WRITEs): writes its
/// payload, then consumes a receive (`swp` = the whole WRITE's length, `cmp` = imm).
pub const RING_WRITE_IMM: u32 = 8;
/// A datagram for a UD QP, in one slot, never answered: `len` payload bytes in the
/// data area, `rkey` = the Q_Key presented, `cmp` = immediate data (low half) and
/// the destination QPN (high half), `raddr` = the sender's PID (high half) and
/// segment fd (low half), `src_nonce` its nonce (with them: the sender's GID),
/// `swp` = when it was claimed (the monotonic clock, in ns: the serving order).
pub const RING_UD: u32 = 9;
/// Op-code mask; the bits above it are flags.
pub const RING_OP_MASK: u32 = 0xff;
/// Flag: first part of a WR (READ/WRITE: `swp` = the WR's whole length, checked
/// against the rkey before anything moves; SEND: claims a receive).
pub const RING_F_FIRST: u32 = 1 << 8;
/// Flag: last part of a SEND (completes the receive).
pub const RING_F_LAST: u32 = 1 << 9;
/// Flag: the message carries immediate data (`cmp`).
pub const RING_F_IMM: u32 = 1 << 10;
/// Flag: solicited event.
pub const RING_F_SOLICITED: u32 = 1 << 11;
/// A SEND part whose message length is not known at its first part (it arrived over
/// the network, where only the last packet tells): `swp` is 0, the receive's buffers
/// bound the message, and its length is what the parts brought.
pub const RING_F_OPEN: u32 = 1 << 12;

/// Slot statuses beyond `WcStatus` values: receiver not ready (low 16 bits: the
/// responder's min_rnr_timer); nothing was consumed, retry the whole WR.
pub const RING_ST_RNR: u32 = 0x1_0000;
/// ODP model: the responder raised a page fault and NAKed (retransmit later).
pub const RING_ST_ODP_NAK: u32 = 0x2_0000;
/// A part of a message that is not being received (an earlier part was refused):
/// dropped without effect.
pub const RING_ST_DROPPED: u32 = 0x3_0000;
/// Not executed: an earlier request of the same rewind generation met a receiver
/// not ready, and everything behind it is refused until the requester resends from
/// there (RC's go-back-N: nothing after an RNR-NAKed request executes before it).
pub const RING_ST_SEQ: u32 = 0x4_0000;
/// The transport gave the request up (across the network: no answer within the QP's
/// timeout and retry count): the WR completes RETRY_EXC_ERR now.
pub const RING_ST_RETRY_EXC: u32 = 0x5_0000;
/// Bits of a request's `op` above the flags: the requester's rewind generation (it
/// moves on each time the requester goes back to resend after an RNR).
pub const RING_GEN_SHIFT: u32 = 16;
/// The flag bits of a request's `op` (below the generation).
pub const RING_FLAGS_MASK: u32 = 0xff00;

#[repr(C)]
/// Header of a request-ring slot (its data follows).
pub struct SlotHdr {
    /// `SLOT_*` state.
    pub state: AtomicU32,
    /// `RING_*` op code.
    pub op: AtomicU32,
    /// Answer status (`WcStatus` value).
    pub status: AtomicU32,
    /// Payload length.
    pub len: AtomicU32,
    /// Remote (target) address.
    pub raddr: AtomicU64,
    /// Remote key.
    pub rkey: AtomicU32,
    /// Requesting QP number.
    pub src_qpn: AtomicU32,
    /// Compare operand (CAS).
    pub cmp: AtomicU64,
    /// Swap / add operand.
    pub swp: AtomicU64,
    /// Nonce of the requesting host.
    pub src_nonce: AtomicU64,
    /// Atomic result (the original value).
    pub result: AtomicU64,
}

#[repr(C)]
/// A CQ table entry: ring indices and notification state.
pub struct CqRec {
    /// 1 while the table slot holds a CQ.
    pub in_use: AtomicU32,
    /// Ring size: the modulus of the entry slots, fixed for the CQ's life.
    pub depth: AtomicU32,
    /// Entries the ring may hold (at most `depth`): the CQ's size as the
    /// application sees it (`Cq::resize` changes it).
    pub limit: AtomicU32,
    /// Set when a completion found the ring full.
    pub overflow: AtomicU32,
    /// 0 = disarmed, 1 = next completion, 2 = solicited only.
    pub notify: AtomicU32,
    /// Completion-channel eventfd number in the owner process, or -1.
    pub chan_fd: AtomicU32,
    /// 1 while a channel event is signalled and not yet taken.
    pub event_pending: AtomicU32,
    /// Bumped when the slot is reused.
    pub incarnation: AtomicU32,
    _pad0: [u32; 8],
    /// Consumer index.
    pub head: Line<AtomicU64>,
    /// Producer index.
    pub tail: Line<AtomicU64>,
}

#[repr(C)]
/// A completion in a CQ ring (the fields of `Wc`).
pub struct WcRec {
    /// Sequence number publishing the entry.
    pub seq: AtomicU64,
    /// See `Wc::wr_id`.
    pub wr_id: AtomicU64,
    /// See `Wc::status`.
    pub status: AtomicU32,
    /// See `Wc::opcode`.
    pub opcode: AtomicU32,
    /// See `Wc::byte_len`.
    pub byte_len: AtomicU32,
    /// See `Wc::imm_data`.
    pub imm: AtomicU32,
    /// See `Wc::qp_num`.
    pub qp_num: AtomicU32,
    /// See `Wc::src_qp`.
    pub src_qp: AtomicU32,
    /// See `Wc::wc_flags`.
    pub wc_flags: AtomicU32,
    /// See `Wc::vendor_err`.
    pub vendor_err: AtomicU32,
    _pad: [u64; 2],
}

#[repr(C)]
/// A tracked address range of the residency map.
pub struct RangeRec {
    /// First page number.
    pub start_page: AtomicU64,
    /// Pages in the range.
    pub npages: AtomicU64,
    /// First bit of the range in the residency bitmap.
    pub bit_off: AtomicU64,
    /// 1 while the record is in use.
    pub used: AtomicU64,
}

/// Offsets of every region, derived deterministically from [`Params`].
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// Offset of the MR table.
    pub mr: usize,
    /// Offset of the QP table.
    pub qp: usize,
    /// Offset of the receive queues.
    pub rq: usize,
    /// Bytes per QP's receive queue.
    pub rq_stride: usize,
    /// Bytes per receive WQE.
    pub wqe_stride: usize,
    /// Offset of the request rings (in the mailbox).
    pub ring: usize,
    /// Bytes per QP's request ring.
    pub ring_stride: usize,
    /// Bytes per request-ring slot.
    pub slot_stride: usize,
    /// Offset of the CQ table.
    pub cq: usize,
    /// Offset of the CQ rings.
    pub wc: usize,
    /// Bytes per CQ ring.
    pub wc_stride: usize,
    /// Offset of the IOMMU page table.
    pub iommu: usize,
    /// Offset of the IOVA range records.
    pub iova_ranges: usize,
    /// Offset of the residency range records.
    pub ranges: usize,
    /// Offset of the residency bitmap.
    pub bitmap: usize,
    /// Offset of the doorbell bitmap (in the mailbox).
    pub doorbell: usize,
    /// Length of the whole segment (without the mailbox).
    pub total: usize,
    /// Length of the mailbox.
    pub mbox_total: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Layout {
    /// The layout for `p`; `None` if a size overflows.
    pub fn compute(p: &Params) -> Option<Layout> {
        let mut off = align(std::mem::size_of::<Header>(), PAGE);
        let mut region = |sz: usize| -> Option<usize> {
            let at = off;
            off = align(off.checked_add(sz)?, PAGE);
            Some(at)
        };
        let mr = region((p.max_mr as usize).checked_mul(std::mem::size_of::<MrRec>())?)?;
        let qp = region((p.max_qp as usize).checked_mul(std::mem::size_of::<QpRec>())?)?;
        let wqe_stride = std::mem::size_of::<WqeHdr>() + p.max_sge as usize * std::mem::size_of::<SgeRec>();
        let rq_stride = align(wqe_stride.checked_mul(p.max_wr as usize)?, PAGE);
        let rq = region(rq_stride.checked_mul(p.max_qp as usize)?)?;
        let cq = region((p.max_cq as usize).checked_mul(std::mem::size_of::<CqRec>())?)?;
        let wc_stride = align(std::mem::size_of::<WcRec>().checked_mul(p.max_cqe as usize)?, PAGE);
        let wc = region(wc_stride.checked_mul(p.max_cq as usize)?)?;
        let iommu = region((p.iova_pages as usize).checked_mul(std::mem::size_of::<IommuEntry>())?)?;
        // At most one IOVA range per MR (a range exists to be registered).
        let iova_ranges = region((p.max_mr as usize).checked_mul(std::mem::size_of::<IovaRec>())?)?;
        let ranges = region((p.max_tracked_ranges as usize).checked_mul(std::mem::size_of::<RangeRec>())?)?;
        let bitmap = region((p.max_tracked_pages as usize).div_ceil(64).checked_mul(8)?)?;
        let total = off;
        // The mailbox: its header, the doorbells, the request rings.
        let doorbell = align(std::mem::size_of::<MboxHeader>(), PAGE);
        let slot_stride = align(std::mem::size_of::<SlotHdr>() + p.ring_max as usize, 64);
        let ring_stride = align(slot_stride.checked_mul(p.ring_slots as usize)?, PAGE);
        let ring = align(doorbell + (p.max_qp as usize).div_ceil(64) * 8, PAGE);
        let mbox_total = align(ring.checked_add(ring_stride.checked_mul(p.max_qp as usize)?)?, PAGE);
        Some(Layout {
            mr,
            qp,
            rq,
            rq_stride,
            wqe_stride,
            ring,
            ring_stride,
            slot_stride,
            cq,
            wc,
            wc_stride,
            iommu,
            iova_ranges,
            ranges,
            bitmap,
            doorbell,
            total,
            mbox_total,
        })
    }
}

/// A mapped host segment (own or a peer's).
pub struct Segment {
    map: Mapping,
    /// The mailbox (see [`MboxHeader`]).
    mbox: Mapping,
    _mbox_fd: OwnedFd,
    /// Region offsets.
    pub lay: Layout,
    /// Sizing parameters.
    pub p: Params,
    _fd: OwnedFd,
    pool: Option<PoolMap>,
    /// The epoch slot this process claimed in a peer's segment (see
    /// `iommu::enter`); released when the mapping goes.
    pub(crate) foreign_slot: std::sync::OnceLock<usize>,
    /// The segment belongs to a host of this process (decided once, at
    /// create/open: `enter` runs on every DMA section and must not ask the
    /// kernel for the PID each time).
    pub(crate) own: bool,
}

impl Drop for Segment {
    /// Give back the epoch slot this process claimed in the peer's segment (if
    /// no section of ours is counted there: a thread still inside one keeps the
    /// mapping alive through its `Arc`, so this is the normal case).
    fn drop(&mut self) {
        release_foreign_slot(self);
    }
}

/// Give back this process's foreign slot of `seg` (its mapping is going away).
fn release_foreign_slot(seg: &Segment) {
    let Some(&i) = seg.foreign_slot.get() else {
        return;
    };
    if !FOREIGN_SLOTS.contains(&i) {
        return;
    }
    let h = seg.hdr();
    if h.inflight[i].iter().all(|c| c.0.load(Ordering::SeqCst) == 0) {
        let me = sys::my_process_token();
        let _ = h.slot_owner[i]
            .0
            .compare_exchange(me, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

impl Segment {
    /// Create this host's segment.
    pub fn create(cfg: &HostConfig, nonce: u64) -> Result<Segment> {
        let pool = if cfg.dma_pool_size > 0 {
            let len = cfg.dma_pool_size.div_ceil(PAGE) * PAGE;
            let fd = sys::memfd_fixed("rnic-dma-pool", len)?;
            let map = Mapping::map_shared(&fd, len)?;
            Some(PoolMap {
                base: map.ptr() as u64,
                map,
                len: len as u64,
                fd,
            })
        } else {
            None
        };
        let p = Params::from_config(cfg);
        let lay = Layout::compute(&p).ok_or(Error::InvalidArgument("config too large"))?;
        let fd = sys::memfd_sealable("rnic-host", lay.total)?;
        let map = Mapping::map_shared(&fd, lay.total)?;
        // Our writable mapping exists: from now on nobody else gets one, unless we
        // trust our peers (they then perform our NIC's work in our tables).
        sys::seal_size(&fd, !cfg.trusted_peers)?;
        let mbox_fd = sys::memfd_fixed("rnic-mailbox", lay.mbox_total)?;
        let mbox = Mapping::map_shared(&mbox_fd, lay.mbox_total)?;
        let base = map.ptr();
        // SAFETY: the mapping is fresh, page aligned, zero-filled and at least
        // size_of::<Header>() long; nobody else can see it yet.
        unsafe {
            std::ptr::addr_of_mut!((*(base as *mut Header)).params).write(p);
        }
        let seg = Segment {
            map,
            mbox,
            _mbox_fd: mbox_fd,
            lay,
            p,
            _fd: fd,
            pool,
            foreign_slot: std::sync::OnceLock::new(),
            own: true,
        };
        let h = seg.hdr();
        if let Some(pm) = &seg.pool {
            h.pool_fd.store(pm.fd.as_raw_fd() as u32, Ordering::Relaxed);
            h.pool_base.store(pm.base, Ordering::Relaxed);
            h.pool_len.store(pm.len, Ordering::Relaxed);
        }
        // SAFETY: the header's `life` line is fresh, 64-byte aligned shared memory
        // large enough for a pthread_mutex_t (asserted above); nobody else sees it yet.
        unsafe { sys::life::init(seg.life_ptr())? };
        h.nonce.store(nonce, Ordering::Relaxed);
        h.total_len.store(lay.total as u64, Ordering::Relaxed);
        h.pid.store(std::process::id(), Ordering::Relaxed);
        h.memfd.store(seg._fd.as_raw_fd() as u32, Ordering::Relaxed);
        h.mbox_fd.store(seg._mbox_fd.as_raw_fd() as u32, Ordering::Relaxed);
        h.mbox_len.store(lay.mbox_total as u64, Ordering::Relaxed);
        h.magic.store(SEG_MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Map a peer's segment (another process) given its pid, memfd number and nonce.
    pub fn open(pid: u32, fd: u32, nonce: u64) -> Result<Segment> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .open(&path)
            .map_err(|e| Error::Unreachable(format!("{path}: {e}")))?;
        let flen = file.metadata()?.len() as usize;
        if flen < PAGE {
            return Err(Error::Unreachable("segment too small".into()));
        }
        let fd: OwnedFd = file.into();
        // Read-only: the owner's tables are its own (sealed against writable
        // mappings unless it trusts its peers, see `MboxHeader`).
        let mut map = Mapping::map_shared_ro(&fd, flen)?;
        // SAFETY: the mapping is at least one page, larger than Header, page aligned;
        // Header consists of atomics and plain integers valid for any bit pattern.
        let h = unsafe { &*(map.ptr() as *const Header) };
        if h.magic.load(Ordering::Acquire) != SEG_MAGIC || h.nonce.load(Ordering::Relaxed) != nonce {
            return Err(Error::Unreachable("segment identity mismatch".into()));
        }
        let p = h.params;
        let lay = Layout::compute(&p).ok_or(Error::Unreachable("bad peer params".into()))?;
        if lay.total > flen || h.total_len.load(Ordering::Relaxed) as usize != lay.total {
            return Err(Error::Unreachable("peer segment layout mismatch".into()));
        }
        let mpath = format!("/proc/{pid}/fd/{}", h.mbox_fd.load(Ordering::Relaxed));
        let mfile = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&mpath)
            .map_err(|e| Error::Unreachable(format!("{mpath}: {e}")))?;
        // The mailbox memfd is sealed against size changes: once its length checks
        // out, our mapping can never SIGBUS.
        if mfile.metadata()?.len() as usize != lay.mbox_total
            || h.mbox_len.load(Ordering::Relaxed) as usize != lay.mbox_total
        {
            return Err(Error::Unreachable("peer mailbox size mismatch".into()));
        }
        let mbox_fd: OwnedFd = mfile.into();
        let mbox = Mapping::map_shared(&mbox_fd, lay.mbox_total)?;

        let pool = match h.pool_len.load(Ordering::Relaxed) {
            0 => None,
            len => {
                let ppath = format!("/proc/{pid}/fd/{}", h.pool_fd.load(Ordering::Relaxed));
                let pf = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&ppath)
                    .map_err(|e| Error::Unreachable(format!("{ppath}: {e}")))?;
                // The pool memfd is sealed against size changes: once its length
                // checks out, our mapping can never SIGBUS.
                if pf.metadata()?.len() != len {
                    return Err(Error::Unreachable("peer DMA pool size mismatch".into()));
                }
                let pfd: OwnedFd = pf.into();
                let pmap = Mapping::map_shared(&pfd, len as usize)?;
                Some(PoolMap {
                    map: pmap,
                    base: h.pool_base.load(Ordering::Relaxed),
                    len,
                    fd: pfd,
                })
            }
        };
        if p.trusted_by_owner() {
            // A trusting owner lets us perform its NIC's work in its tables (`h`
            // points into the read-only mapping: not used past this point).
            let rw = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| Error::Unreachable(format!("{path}: {e}")))?;
            map = Mapping::map_shared(&rw, flen)?;
        }
        Ok(Segment {
            map,
            mbox,
            _mbox_fd: mbox_fd,
            lay,
            p,
            _fd: fd,
            pool,
            foreign_slot: std::sync::OnceLock::new(),
            own: pid == std::process::id(),
        })
    }

    fn life_ptr(&self) -> *mut libc::pthread_mutex_t {
        self.mbox().life.0.as_ptr() as *mut libc::pthread_mutex_t
    }

    /// Take this host's liveness token (its NIC thread, for the host's whole life).
    pub(crate) fn hold_life(&self) -> bool {
        // SAFETY: initialised in `create`; the NIC thread holds an Arc of this segment
        // until it calls `release_life`.
        unsafe { sys::life::hold(self.life_ptr()) }
    }

    /// Orderly shutdown: mark the host dead and give the token back.
    pub(crate) fn release_life(&self) {
        self.mbox().dead.store(1, Ordering::SeqCst);
        // SAFETY: called on the thread that holds it (see `hold_life`).
        unsafe { sys::life::release(self.life_ptr()) }
    }

    /// Whether the owning host's NIC is still alive (a CAS on the token's line; no
    /// syscall). A dead host stays dead.
    pub fn alive(&self) -> bool {
        let h = self.mbox();
        if h.dead.load(Ordering::Acquire) != 0 {
            return false;
        }
        // SAFETY: the token was initialised by the owner before the header magic
        // was published; our mapping outlives the call.
        if unsafe { sys::life::probe(self.life_ptr()) } {
            return true;
        }
        h.dead.store(1, Ordering::Release);
        false
    }

    /// Our mapping of `[addr, addr+len)` if it lies inside the owner's DMA pool
    /// (`addr` is the owner's address).
    pub fn pool_local(&self, addr: u64, len: u64) -> Option<*mut u8> {
        let p = self.pool.as_ref()?;
        let off = addr.checked_sub(p.base)?;
        if off.checked_add(len)? > p.len {
            return None;
        }
        // SAFETY: off + len <= the mapping's length.
        Some(unsafe { p.map.ptr().add(off as usize) })
    }

    /// The DMA pool's memfd (own segment), its first address and length.
    pub(crate) fn pool_file(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64, u64)> {
        self.pool.as_ref().map(|p| (p.fd.as_fd(), p.base, p.len))
    }

    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.lay.total);
        debug_assert!(off % std::mem::align_of::<T>() == 0);
        // SAFETY: every caller computes `off` from the layout with an index checked
        // against the params, so the object lies inside the mapping and is aligned;
        // all record types consist of atomics / plain integers valid for any bit pattern
        // (the mapping starts zeroed) and are only mutated through atomics.
        unsafe { &*(self.map.ptr().add(off) as *const T) }
    }

    /// Start of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.map.ptr()
    }
    /// The header.
    pub fn hdr(&self) -> &Header {
        self.at(0)
    }
    /// The mailbox header (the part of the host peers write, see [`MboxHeader`]).
    pub fn mbox(&self) -> &MboxHeader {
        self.at_mbox(0)
    }
    fn at_mbox<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.lay.mbox_total);
        debug_assert!(off % std::mem::align_of::<T>() == 0);
        // SAFETY: as `at`, inside the mailbox mapping (`lay.mbox_total` bytes): offsets
        // come from the layout with checked indices; the records are atomics.
        unsafe { &*(self.mbox.ptr().add(off) as *const T) }
    }
    /// The host's nonce.
    pub fn nonce(&self) -> u64 {
        self.hdr().nonce.load(Ordering::Relaxed)
    }
    /// The owner's PID.
    pub fn pid(&self) -> u32 {
        self.hdr().pid.load(Ordering::Relaxed)
    }
    /// The host's counters.
    pub fn stats(&self) -> &StatsRec {
        &self.hdr().stats
    }
    /// MR table entry `idx`.
    pub fn mr(&self, idx: u32) -> Option<&MrRec> {
        (idx < self.p.max_mr).then(|| self.at(self.lay.mr + idx as usize * std::mem::size_of::<MrRec>()))
    }
    /// QP table entry `idx`.
    pub fn qp(&self, idx: u32) -> Option<&QpRec> {
        (idx < self.p.max_qp).then(|| self.at(self.lay.qp + idx as usize * std::mem::size_of::<QpRec>()))
    }
    /// Find the QP table index of a QP number.
    pub fn find_qp(&self, qpn: u32) -> Option<u32> {
        (0..self.p.max_qp).find(|&i| {
            let q = self.qp(i).expect("in range");
            q.in_use.load(Ordering::Acquire) == 1 && q.qpn.load(Ordering::Acquire) == qpn
        })
    }
    /// Receive WQE `slot` (taken modulo max_wr) of QP `qp`: header and SGE array.
    pub fn wqe(&self, qp: u32, slot: u64) -> (&WqeHdr, &[SgeRec]) {
        let s = (slot % self.p.max_wr as u64) as usize;
        let off = self.lay.rq + qp as usize * self.lay.rq_stride + s * self.lay.wqe_stride;
        let hdr: &WqeHdr = self.at(off);
        let off2 = off + std::mem::size_of::<WqeHdr>();
        // SAFETY: the SGE array of max_sge entries follows the header inside the
        // WQE stride (see Layout::compute); SgeRec is all atomics.
        let sges =
            unsafe { std::slice::from_raw_parts(self.map.ptr().add(off2) as *const SgeRec, self.p.max_sge as usize) };
        (hdr, sges)
    }
    /// Request-ring slot `slot` (modulo ring_slots) of QP `qp`: header and data pointer.
    pub fn slot(&self, qp: u32, slot: u64) -> (&SlotHdr, *mut u8) {
        let s = (slot % self.p.ring_slots as u64) as usize;
        let off = self.lay.ring + qp as usize * self.lay.ring_stride + s * self.lay.slot_stride;
        let hdr: &SlotHdr = self.at_mbox(off);
        // SAFETY: the data area (ring_max bytes) follows the header within the stride,
        // inside the mailbox mapping.
        let data = unsafe { self.mbox.ptr().add(off + std::mem::size_of::<SlotHdr>()) };
        (hdr, data)
    }
    /// CQ table entry `idx`.
    pub fn cq(&self, idx: u32) -> Option<&CqRec> {
        (idx < self.p.max_cq).then(|| self.at(self.lay.cq + idx as usize * std::mem::size_of::<CqRec>()))
    }
    /// Entry `slot` (modulo `depth`) of CQ `cq`'s ring.
    pub fn wc(&self, cq: u32, slot: u64, depth: u32) -> &WcRec {
        let s = (slot % depth.max(1) as u64) as usize % self.p.max_cqe as usize;
        self.at(self.lay.wc + cq as usize * self.lay.wc_stride + s * std::mem::size_of::<WcRec>())
    }
    /// IOMMU entry of IOVA page `page`.
    pub fn iommu_entry(&self, page: u64) -> Option<&IommuEntry> {
        (page < self.p.iova_pages).then(|| self.at(self.lay.iommu + page as usize * std::mem::size_of::<IommuEntry>()))
    }
    /// The record of the IOVA range in slot `slot`.
    pub fn iova_rec(&self, slot: u32) -> Option<&IovaRec> {
        (slot < self.p.max_mr).then(|| self.at(self.lay.iova_ranges + slot as usize * std::mem::size_of::<IovaRec>()))
    }
    /// Residency range record `i`.
    pub fn range(&self, i: u32) -> Option<&RangeRec> {
        (i < self.p.max_tracked_ranges).then(|| self.at(self.lay.ranges + i as usize * std::mem::size_of::<RangeRec>()))
    }
    /// The residency-bitmap word holding bit `bit`.
    pub fn bitmap_word(&self, bit: u64) -> Option<&AtomicU64> {
        (bit < self.p.max_tracked_pages).then(|| self.at(self.lay.bitmap + (bit / 64) as usize * 8))
    }
    /// Doorbell word `w` (modulo the word count).
    pub fn doorbell_word(&self, w: u32) -> &AtomicU64 {
        self.at_mbox(self.lay.doorbell + (w as usize % (self.p.max_qp as usize).div_ceil(64)) * 8)
    }
    /// Number of doorbell words.
    pub fn doorbell_words(&self) -> u32 {
        self.p.max_qp.div_ceil(64)
    }
    /// Ring the NIC thread's doorbell for QP index `qp`, waking it if asleep and
    /// no other thread of the owner polls the doorbells.
    pub fn ring_doorbell(&self, qp: u32) {
        self.set_doorbell(qp);
        self.wake_for_doorbells();
    }
    /// Set QP index `qp`'s doorbell bit without waking anybody: the caller calls
    /// [`Segment::wake_for_doorbells`] once it has rung every doorbell of its batch
    /// (as a NIC is told of a whole posted list by one doorbell write).
    pub fn set_doorbell(&self, qp: u32) {
        self.doorbell_word(qp / 64).fetch_or(1 << (qp % 64), Ordering::SeqCst);
    }
    /// Wake the NIC thread for the doorbells set before, if it sleeps and no other
    /// thread of the owner polls the doorbells.
    pub fn wake_for_doorbells(&self) {
        // SeqCst pairs with `set_ring_polling(false)`: either the poller's final
        // pass sees our bits, or we see the flag cleared and wake the NIC thread.
        if self.mbox().ext_polling.load(Ordering::SeqCst) == 0 {
            self.kick();
        }
    }
    /// Wake the NIC thread if it sleeps attending an application that blocked on a
    /// completion channel: a target has just answered one of its ring requests (as a
    /// real NIC's arriving response raises an interrupt). The caller has made the
    /// answer visible and issued a SeqCst fence.
    pub fn kick_answer(&self) {
        let h = self.mbox();
        if h.nic_sleeping.load(Ordering::SeqCst) == NIC_ASLEEP_ATTENDING
            && h.nic_sleeping
                .compare_exchange(NIC_ASLEEP_ATTENDING, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            h.nic_seq.fetch_add(1, Ordering::SeqCst);
            sys::futex_wake(&h.nic_seq);
        }
    }
    /// Wake the NIC thread if it sleeps.
    ///
    /// One waker per sleep: the thread that clears `nic_sleeping` bumps the futex
    /// word and wakes it; later kickers see it awake (it is, or its futex word moved
    /// past what it waits on), so a burst of requests costs one `FUTEX_WAKE`, not
    /// one per request while the woken thread is still on its way to a core.
    pub fn kick(&self) {
        let h = self.mbox();
        if h.nic_sleeping.load(Ordering::SeqCst) != 0 && h.nic_sleeping.swap(0, Ordering::SeqCst) != 0 {
            h.nic_seq.fetch_add(1, Ordering::SeqCst);
            sys::futex_wake(&h.nic_seq);
        }
    }
}

/// A tiny spin-then-yield lock living in shared memory (held only for short,
/// bounded critical sections).
pub struct ShmGuard<'a>(&'a AtomicU32);

/// Holders keep the lock for microseconds; one held this long belongs to a process
/// that died inside the critical section, and waiting forever would hang us.
const SHM_LOCK_STEAL_NS: u64 = 2_000_000_000;

/// Take the shared-memory lock `w` (stolen from a holder dead for 2 s).
pub fn shm_lock(w: &AtomicU32) -> ShmGuard<'_> {
    let mut spins = 0u32;
    let mut since = 0u64;
    while w
        .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        spins += 1;
        if spins < 100 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
            if spins % 64 == 0 {
                let now = sys::now_ns();
                if since == 0 {
                    since = now;
                } else if now - since > SHM_LOCK_STEAL_NS {
                    tracing::warn!("taking over a shared-memory lock held for over 2 s (dead peer?)");
                    w.store(1, Ordering::SeqCst);
                    break;
                }
            }
        }
    }
    ShmGuard(w)
}

impl Drop for ShmGuard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_page_aligned_and_ordered() {
        let p = Params::from_config(&HostConfig::default());
        let l = Layout::compute(&p).unwrap();
        let offs = [
            l.mr,
            l.qp,
            l.rq,
            l.cq,
            l.wc,
            l.iommu,
            l.iova_ranges,
            l.ranges,
            l.bitmap,
            l.total,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]));
        assert!(offs.iter().all(|o| o % PAGE == 0));
        // The mailbox: header, doorbells, rings.
        let mbox = [0, l.doorbell, l.ring, l.mbox_total];
        assert!(mbox.windows(2).all(|w| w[0] < w[1]), "{mbox:?}");
        assert!(mbox.iter().all(|o| o % PAGE == 0));
        assert!(l.ring + l.ring_stride * p.max_qp as usize <= l.mbox_total);
        assert_eq!(std::mem::size_of::<MrRec>(), 64);
        assert_eq!(std::mem::size_of::<WcRec>(), 64);
        assert_eq!(std::mem::size_of::<SlotHdr>(), 64);
        assert_eq!(std::mem::offset_of!(QpRec, rq_lock), 64, "RQ indices on their own line");
        assert_eq!(std::mem::offset_of!(QpRec, ring_cons), 128);
    }

    /// Wakes the NIC thread of `seg` was given (bumps of its futex word).
    fn wakes(seg: &Segment, before: u32) -> u32 {
        seg.mbox().nic_seq.load(Ordering::SeqCst).wrapping_sub(before)
    }

    #[test]
    fn a_sleeping_nic_thread_is_woken_once_per_sleep() {
        // A segment without a NIC thread: the sleep flag is ours to set.
        let seg = Segment::create(&HostConfig::default(), 7).unwrap();
        let peer = Segment::open(std::process::id(), seg.hdr().memfd.load(Ordering::Relaxed), 7).unwrap();
        let h = seg.mbox();
        let seq = h.nic_seq.load(Ordering::SeqCst);
        // Awake: doorbells wake nobody.
        peer.ring_doorbell(1);
        assert_eq!(wakes(&seg, seq), 0);
        // Asleep: a burst of doorbells (a peer's, then one of our own host) wakes it once.
        h.nic_sleeping.store(NIC_ASLEEP, Ordering::SeqCst);
        for qp in [1, 2, 65] {
            peer.ring_doorbell(qp);
        }
        seg.kick();
        assert_eq!(wakes(&seg, seq), 1);
        assert_eq!(h.nic_sleeping.load(Ordering::SeqCst), 0);
        assert_ne!(seg.doorbell_word(0).load(Ordering::SeqCst) & 0b110, 0);
        assert_ne!(seg.doorbell_word(1).load(Ordering::SeqCst) & 0b10, 0);
        // Its next sleep takes the next wake.
        h.nic_sleeping.store(NIC_ASLEEP, Ordering::SeqCst);
        peer.set_doorbell(3);
        assert_eq!(wakes(&seg, seq), 1, "setting a doorbell bit wakes nobody");
        peer.wake_for_doorbells();
        peer.wake_for_doorbells();
        assert_eq!(wakes(&seg, seq), 2);
        // Answers wake it only while it attends, once.
        h.nic_sleeping.store(NIC_ASLEEP, Ordering::SeqCst);
        peer.kick_answer();
        assert_eq!(wakes(&seg, seq), 2, "not attending: answers are for its poller");
        h.nic_sleeping.store(NIC_ASLEEP_ATTENDING, Ordering::SeqCst);
        peer.kick_answer();
        peer.kick_answer();
        peer.kick();
        assert_eq!(wakes(&seg, seq), 3);
        // Another thread polls the rings: doorbells leave the NIC thread asleep.
        h.nic_sleeping.store(NIC_ASLEEP, Ordering::SeqCst);
        h.ext_polling.store(1, Ordering::SeqCst);
        peer.ring_doorbell(4);
        assert_eq!(wakes(&seg, seq), 3);
    }

    #[test]
    fn create_and_reopen_same_process() {
        let seg = Segment::create(&HostConfig::default(), 42).unwrap();
        seg.mr(3).unwrap().key.store(77, Ordering::SeqCst);
        let peer = Segment::open(std::process::id(), seg.hdr().memfd.load(Ordering::Relaxed), 42).unwrap();
        assert_eq!(peer.mr(3).unwrap().key.load(Ordering::SeqCst), 77);
        assert!(Segment::open(std::process::id(), seg.hdr().memfd.load(Ordering::Relaxed), 43).is_err());
        assert!(peer.mr(p_max(&peer)).is_none());
    }

    fn p_max(s: &Segment) -> u32 {
        s.p.max_mr
    }
}
