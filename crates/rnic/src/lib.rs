//! # rnic — a software commodity RNIC (ConnectX class, no page-fault support)
//!
//! Every DMA goes MR -> MTT -> host IOMMU -> frame and the NIC never takes a page
//! fault: frames the host declared non-resident are refused (the WR fails) and
//! counted (`NicStats::nonresident_dma`, which tests assert stays 0 in normal runs).
//! The one exception is the ODP *model* (`Access::ON_DEMAND` MRs, module [`odp`]).
//!
//! ## API in one screen
//! ```text
//! Host::new(HostConfig) -> Host            // a machine: NIC + IOMMU + frame map (+ NIC thread)
//!   .addr() -> HostAddr (16 B: pid, memfd, nonce; to_bytes/to_hex for out-of-band exchange)
//!   .iommu() -> &Iommu   alloc_range(n) / unsafe map(page, Frame) / map_at(range, i, Frame) / map_range / unmap / lookup / flush / free_range
//!   .frames() -> &FrameMap   track(addr, len, resident) / set_resident / untrack / is_resident
//!   .stats() -> NicStats      .query_device() -> DeviceAttr     .open_context() -> Context
//! Context: alloc_pd, create_cq(depth, Option<&CompChannel>), create_comp_channel
//! Pd: unsafe reg_mr(addr, len, Access), unsafe reg_mr_iova(addr, len, Access, &IovaRange),
//!     reg_mr_owned(Vec<u8>, Access) -> OwnedMr, create_qp(&send_cq, &recv_cq, &QpInitAttr),
//!     create_qp_of(QpType, ..), create_ah(HostAddr) -> Ah (UD: SendWr::to(ah.to(qpn, qkey)))
//! Mr/OwnedMr: lkey, rkey, addr, len, sge(off, len); Drop deregisters (and waits for DMA)
//! Cq: poll(&mut [Wc]) (non-blocking; also progresses its QPs), poll_wait, req_notify(solicited_only)
//! CompChannel: fd() (eventfd, poll/epoll it), get_event(timeout) -> Cq, ack
//! Qp: qpn, state, modify(&QpAttr, QpAttrMask), query, connect(..) helper,
//!     post_send(&[SendWr]) / post_recv(&[RecvWr]) -> Result<(), PostError { bad_wr_index, err }>
//! ODP model: Access::ON_DEMAND MRs; Host::set_odp_fault_handler(Arc<dyn Fn(addr, len)>),
//!   odp_invalidate(addr, len), odp_invalidate_then(addr, len, swap_out); HostConfig::odp_timeout
//! DMA pool: Host::alloc_dma_buffer(len) -> DmaBuffer { addr, len, as_ptr, as_mut_ptr,
//!   write_at, read_at } (pinned); Pd::reg_dma_buffer(buf, Access) -> DmaMr (owns the buffer,
//!   derefs to Mr; .buffer()), or unsafe Pd::reg_mr(buf.addr(), buf.len(), ..) / reg_mr_iova
//! ```
//! `WcStatus`, `WcOpcode`, `QpState`, `QpAttrMask`, `Access`, `SendFlags`, `WcFlags` and
//! `WrOpcode::ibv()` are numerically equal to libibverbs' enums.
//!
//! ## Architecture (final design)
//!
//! * **Host segment** ([`segment`]): all NIC state a peer needs — MR table, QP table
//!   with RQ rings and request rings, CQ rings (MPSC), IOMMU page table (4-byte entries
//!   plus a small record per IOVA range), residency map,
//!   flush epochs, NIC-thread futex, stats — lives in one fixed-layout memfd mapping
//!   addressed by offsets. In-process peers share it; another process maps it through
//!   `/proc/<pid>/fd/<fd>` from the 16-byte [`HostAddr`], lazily at RTR.
//! * **Target-enforced protection across processes (the default).** A host never
//!   touches another process's memory: every request to a peer in another process —
//!   READ/WRITE of any size in parts of one ring slot (`ring_max` bytes, at least
//!   4 KiB), atomics, SEND/SEND_WITH_IMM in parts, WRITE_WITH_IMM as WRITE parts plus a
//!   last part that consumes the receive — goes through the target QP's request ring.
//!   The target's NIC thread (or the thread serving its rings) reads each slot once and
//!   checks QP, connection, rkey, PD, bounds and rights itself (the whole range at a
//!   WR's first part, each part's own range again inside the epoch section of its copy,
//!   so a deregistration that returned is never overtaken); a SEND in parts claims its
//!   receive at the first part and lands each part through the receive's lkeys,
//!   re-validated per part, from state the server keeps in its own memory
//!   (`nic/inbound.rs`). No `PR_SET_PTRACER_ANY`, no `process_vm_*`, no `pidfd_getfd`: a
//!   dead or stopped peer holds none of this host's flushes, a resumed one meets the
//!   checks of the moment, a reused PID reaches nothing. A request no QP is ready to
//!   take (absent, not yet RTR, not connected to us) is what a fabric drops: it is
//!   resent every transport timeout of the QP (4.096 µs × 2^`timeout`) and fails with
//!   RETRY_EXC_ERR when `retry_cnt` resends went unanswered; a target process that died
//!   (its liveness token) fails its WRs once that budget passed, a stopped one at the
//!   host's transport timeout. `Cq::poll` serves the host's rings too, so two polling
//!   applications exchange messages without waking a NIC thread; a target QP moved to
//!   RESET keeps the answers its initiator has not taken.
//! * **Trusting hosts** (`HostConfig::trusted_peers` on both sides, the labelled
//!   opt-in; `NicStats::direct_remote` counts its WRs): the older, faster path below,
//!   where the initiator performs the target NIC's work itself. Within one process both
//!   hosts always share the address space and use it (`inproc_ring` sends every op
//!   through the target-enforced protocol in-process, for tests).
//! * **No passive application thread** (trusting hosts). The requester runs in the posting/polling
//!   thread of the initiator: `post_send` validates, queues and starts WRs in QP order.
//!   WRITE, READ, SEND, WRITE_WITH_IMM are performed by the initiator itself against
//!   the target's shared tables (the exact responder checks, per-atom translation
//!   through the target's IOMMU, memmove in-process or `process_vm_readv/writev`
//!   across processes, the receive CQE pushed into the target's CQ and its completion
//!   channel signalled through `pidfd_getfd`). In-process atomics are real CPU atomics
//!   on the target frame.
//! * **The target's NIC thread** (one per host) serves, across processes, small READ
//!   and WRITE (≤ `ring_rw_max`, default 4 KiB; `Some(0)` = all direct)
//!   and all atomics (whatever the limits) through the target QP's
//!   request ring (process_vm costs ~1.1 µs per call; a ring round trip ~0.3 µs), so
//!   atomics execute on one thread of the target (`IBV_ATOMIC_HCA`). It spins only for
//!   an adaptive window after its last request (`nic_spin`, doubled up to 32x while
//!   requests keep coming right after it fell asleep), and only once no application
//!   thread of its process polled a CQ for 1 ms (`Cq::poll` serves the rings too; it
//!   looks every 20 µs), and otherwise blocks on a futex
//!   (requesters wake it: once per issuing pass, so the ring requests of one post —
//!   NP-RDMA's WRITE is three — are all in its rings when it wakes, and only the
//!   requester that clears its sleep flag makes the `FUTEX_WAKE`). A latency run
//!   therefore has one spinning thread per process: the initiator's poller and the
//!   target's NIC thread; the initiator's own NIC thread sleeps. It costs the active
//!   side no latency: a 2 B READ takes ~0.75 µs (see BENCHMARKS.md). Spinners
//!   yield their core (`sched_yield`) once they have spun a
//!   while without work — the NIC thread after 20 µs, a CQ poller every 256th empty
//!   poll in a row — because a thread they woke (a peer's NIC thread, its requester)
//!   may sit queued behind them on the same core: the scheduler places a woken
//!   thread on the waker's core and leaves it there for milliseconds while the other
//!   core idles. A process with a polling thread of its own (NP-RDMA's) lets that
//!   thread serve the rings while it spins (`Host::set_ring_polling` +
//!   `Host::serve_rings`): the NIC thread then neither spins nor is woken for a
//!   doorbell, and turning the external polling off serves what rang meanwhile
//!   (the requester reads the flag after ringing, SeqCst, so no request waits for a
//!   wake-up that nobody sends). One request ring keeps one consumer (a lock).
//! * **Large cross-process READ/WRITE** (≥ 256 KiB per section) are shared with the
//!   target's NIC thread: the initiator posts the validated, translated copy units
//!   (128 KiB) in a free ring slot and both claim units from a shared counter, so the
//!   two cores copy in parallel; a sleeping or busy helper never delays the initiator
//!   beyond the unit it is copying (an untaken job is cancelled). If the helper kept
//!   the initiator waiting (> 100 µs: preempted on a loaded machine), sharing pauses
//!   for 50 ms. `HostConfig::dma_help = false` disables it.
//! * **RC ordering** (stronger than IB, no FENCE needed): a per-QP software SQ; ring
//!   requests pipeline, but a direct op waits for earlier ring requests and a ring
//!   WRITE waits for earlier READs/atomics (whose data lands at completion), so WRs
//!   take effect in posting order; completions retire strictly in order; an error
//!   completion moves the QP to ERR and flushes every WR behind it (WR_FLUSH_ERR).
//! * **Deferred work** (RNR retry timers; responses nobody polls for) is progressed by
//!   the NIC thread: RNR timers wake it; otherwise it looks at least every 10 ms, and
//!   within 1 ms for QPs nobody progressed, eagerly while a CQ is armed.
//! * **Translation**: once per page on each side and epoch section, for IOVA MRs
//!   (MTT -> IOMMU entry; every atom of a page shares its frame, so a remap tears a
//!   transfer only at a page boundary, which is an atom boundary) and passthrough MRs
//!   (identity MTT, no IOMMU entry) alike, with the frame-residency check per page;
//!   pages whose frames are contiguous coalesce into one memmove / iovec.
//!   Special frames: signature reads return the magic word (writes dropped),
//!   black-hole reads return zeros (writes absorbed), unmapped fails the WR.
//! * **Flush**: SRCU-style epochs in the segment; every DMA section (translate + copy,
//!   at most `dma_section` bytes) holds the epochs of both hosts; `Iommu::flush` flips
//!   the epoch and waits for the old parity to drain (from any process). MR
//!   deregistration also flushes.
//!
//! * **NIC-shared DMA pool** ([`pool`]): `Host::alloc_dma_buffer` hands out pinned
//!   (populated, mlocked) pages of a sealed memfd that peers map next to the segment.
//!   MRs over it are ordinary MRs (same keys, bounds, residency checks, epoch
//!   sections); a cross-process initiator whose translated target lies in the peer's
//!   pool copies with memcpy through its own mapping instead of process_vm_*, so a
//!   small SEND into a pool RECV buffer costs ~0.7 µs instead of ~3 µs (see
//!   BENCHMARKS.md / notes). Liveness: the owner's NIC thread holds a process-shared
//!   robust mutex in the segment; a peer's trylock sees it dead (OWNER_DIED, or
//!   released at shutdown), so a WR into a dead peer's pool fails like one into a dead
//!   peer's ordinary memory. The pool only changes *how the software NIC reaches* the
//!   memory (a real NIC DMAs every buffer at the same cost); use it only for buffers
//!   that are pinned anyway (control rings, message slots), never to get application
//!   memory around the pager.
//! * **ODP model** ([`odp`], a *model* of ConnectX-5 on-demand paging, the baseline
//!   NP-RDMA is compared with): ON_DEMAND MRs pin nothing; a DMA atom on a non-present
//!   page (the residency map is the NIC's page table) raises a page fault to the owning
//!   host's handler on its NIC thread. Local faults stall the WR for that round trip;
//!   remote faults NAK, the initiator retransmits after `odp_timeout` (2 ms) together
//!   with the later WRs it had executed meanwhile (go-back-N). Counters:
//!   `odp_faults_local`, `odp_faults_remote`, `retransmissions`.
//!
//! ## Across the network (RoCEv2, `wire/`)
//! A QP connected to a host across the network ([`Host::wire_peer`]: a peer GID no device
//! of this host has) keeps the requester above unchanged: its ring requests go into a
//! local *shadow* of the peer's tables (a segment of our own standing for the peer), and
//! the host's RoCEv2 engine sends each part as RoCEv2 packets (`wire::tx`: segmentation
//! at the path MTU, PSNs, a 1 MiB window, go-back-N on NAKs, response gaps and the QP's
//! timeout, `retry_cnt` then RETRY_EXC_ERR) and answers the shadow's slots from the
//! responses, where the completer takes them as a peer's answers over shared memory. On
//! the target, the engine's receive thread (one per host, blocked on the UDP socket of
//! port 4791, `recvmmsg` batches) puts each in-order request into the receiving QP's own
//! ring and serves it there (`wire::rx`), so every check of the shared-memory path holds,
//! and sends ACKs (one per connection and batch), READ responses (replayed for
//! duplicates), atomic ACKs (from a replay cache for duplicates), NAKs and RNR NAKs.
//! `NPRDMA_WIRE_FAULTS` turns on a seeded fault injector (`wire::inject`).
//!
//! ## Source layout
//! Three layers over a few plain files; a file names only files beneath it, in its
//! own layer or lower (`tests/layers.rs` checks this on every `cargo test`):
//! * bottom: `sys` (system calls, `PAGE`), `verbs` (value types), `error`, `config`;
//! * device, `hw/`: `scratch`, `segment`, `iommu`, `frames`, `dma` (the DMA engine:
//!   key checks, translation, copies), `peer` (a resolved peer), `device` (a host's
//!   device state), `dma_pool` (the pool's pages);
//! * engines, `nic/` (cut like Linux rxe's): `small`, `inbound` (the ring server's own
//!   state), `odp`, `state` (what a host's engines share: the device, the ODP queue,
//!   the ring server), `cq_ring`, `qp_ctx` (the QP context), `responder`, `requester`,
//!   `completer` (ring answers, NAKs, in-order completion and flush), `sq` (the send
//!   queue's driver), `thread` (the NIC thread);
//! * the RoCEv2 transport, `wire/`: `socket` (UDP sockets, batched I/O), `inject` (the
//!   fault injector), `conn` (PSNs, paths, packet building), `tx` (requester side), `rx`
//!   (responder side), `engine` (the host's engine and receive thread);
//! * handles, `objects/`: `context` ([`Host`], [`Context`]), `dma_buffer`, `pd`, `mr`,
//!   `cq`, `srq`, `qp`, `ah`. The public modules ([`host`], [`cq`], [`mr`], [`qp`], [`pool`],
//!   [`odp`], [`dma`], [`segment`], ...) re-export them.
//!
//! Engines hold `Arc<nic::state::Nic>` and each other's contexts (a QP its CQ rings),
//! never a handle; each handle holds its parent (a PD its host, an MR its PD, a QP its
//! PD and CQs), and the host's last handle stops its NIC thread.
//!
//! ## Statuses
//! Post-time errors (wrong QP state, too many SGEs, inline too large, SQ/RQ full)
//! return [`PostError`]. Execution errors complete with the verbs status: `LocProtErr`
//! (bad lkey/PD/bounds/access, non-resident or unmapped local frame), `LocLenErr`
//! (atomic length != 8, message > 2 GiB), `RemAccessErr` (bad rkey/PD/bounds/access,
//! unmapped or non-resident remote frame), `RemInvReqErr` (QP access flags, misaligned
//! atomic, receive buffer too small), `RemOpErr` (bad receive lkey), `RnrRetryExcErr`,
//! `RetryExcErr` (target QP gone / not connected to us / no response within
//! `transport_timeout`), `WrFlushErr` behind an error. A responder-side error also moves
//! the target QP to ERR and flushes its receives, as on hardware. CQ overflow is an
//! error state of the CQ (`poll` returns `Error::CqOverflow`) and moves the QP to ERR.
//!
//! ## QP types
//! RC, UC (`Pd::create_qp_of(QpType::Uc, ..)`) and UD (below): SEND / SEND_WITH_IMM / WRITE /
//! WRITE_WITH_IMM only (READ and atomics are refused at post), UC's own transition
//! attributes (no responder resources, timeouts or retries), and nothing acknowledged:
//! a message or WRITE the responder refuses (no receive posted, a bad rkey, a receive
//! too small) is dropped there — the receive stays posted, the QP stays up — and the
//! requester completes the WR successfully.
//!
//! UD (`QpType::Ud`): IB's UD transitions (RESET→INIT needs PKEY_INDEX | PORT | QKEY,
//! INIT→RTR the state only, RTR→RTS SQ_PSN; QKEY optional after), SEND /
//! SEND_WITH_IMM only, each to the destination its WR names
//! (`SendWr::to(ah.to(qpn, qkey))`; a Q_Key with the high bit set means the QP's own).
//! [`Pd::create_ah`] resolves the destination host (maps its segment) when the handle is
//! made. Nothing is acknowledged: a WR completes once its datagram left; one longer than
//! [`PORT_MTU`] is never sent yet succeeds (IBA C10-93.1.1, as rxe). The responder
//! drops a datagram for an absent, non-UD or not-RTR/RTS QP, with another Q_Key,
//! finding no receive, or one too small (on an SRQ that receive completes
//! REM_INV_REQ_ERR, rxe's class E); a receive gets the 40-byte [`grh`] (sgid = the
//! sender's GID, dgid = ours) then the payload, its completion src_qp, `WcFlags::GRH`
//! and the immediate. In-process (and between trusting hosts) the sender delivers
//! directly; otherwise the datagram takes one slot of the destination QP's request
//! ring, which any peer may claim (FREE → FILL → REQ, stamped with the monotonic
//! clock, served oldest first, freed unanswered); the target checks everything. A full
//! ring holds the sender, as a lossless fabric would, until the transport timeout or
//! the destination's death drops the datagram: a dead peer never wedges a sender (a
//! producer that dies mid-fill leaves its slot claimed until the QP is reset).
//!
//! ## Shared receive queues
//! `Pd::create_srq` makes a table entry whose receive queue QPs created on it
//! (`Pd::create_qp_of(.., Some(&srq), ..)`) share: a message takes the oldest WQE
//! whichever QP it arrives on (one arriving in parts takes its WQE at the first part,
//! so parts of messages on several QPs interleave safely), the completion goes to the
//! QP's receive CQ, and a QP that fails leaves the SRQ's WQEs to the others. No SRQ
//! limit events (the crate has no asynchronous events).
//!
//! ## Known limits
//! SQD/SQE states, memory windows, multicast, asynchronous events are not modelled; on
//! the same-host transports PSNs are accepted and ignored (they are lossless); across the
//! network (below) they are the transport's. UD and UC do not cross the network yet.
//! Between trusting hosts
//! (`HostConfig::trusted_peers`), a peer performs the target NIC's checks itself.

pub mod config;
pub mod error;
pub mod fault_guard;
mod hw;
mod nic;
mod objects;
pub mod subnet;
mod sys;
pub mod verbs;
mod wire;

pub use hw::{dma, frames, iommu, segment};
pub use nic::odp;
pub use objects::{ah, context as host, cq, dma_buffer as pool, qp, srq};

/// Protection domains and memory regions.
pub mod mr {
    pub use crate::objects::mr::{DmaMr, Mr, OwnedMr};
    pub use crate::objects::pd::Pd;
}

pub use ah::Ah;
pub use config::HostConfig;
pub use cq::{CompChannel, Cq};
pub use error::{Error, PostError, Result};
pub use frames::FrameMap;
pub use host::{Context, Host, HostAddr, NicStats, WireStats};
pub use iommu::{Frame, Iommu, IovaRange};
pub use mr::{DmaMr, Mr, OwnedMr, Pd};
pub use odp::OdpFaultHandler;
pub use pool::DmaBuffer;
pub use qp::Qp;
pub use srq::Srq;
pub use verbs::*;
