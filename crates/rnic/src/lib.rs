//! # rnic — a software commodity RC RNIC (ConnectX class, no page-fault support)
//!
//! Every DMA goes MR -> MTT -> host IOMMU -> frame, one max-TLP atom at a time, and the
//! NIC never takes a page fault: frames the host declared non-resident are refused and
//! counted (`NicStats::nonresident_dma`).
//!
//! ## Architecture (final design)
//!
//! * **Host segment** ([`segment`]): all NIC state a peer needs — MR table, QP table
//!   with RQ rings and request rings, CQ rings (MPSC), IOMMU page table, residency map,
//!   flush epochs, NIC-thread futex, stats — lives in one fixed-layout memfd mapping
//!   addressed by offsets. In-process peers share it; another process maps it through
//!   `/proc/<pid>/fd/<fd>` from the 16-byte [`HostAddr`] (pid, memfd, nonce), lazily
//!   at RTR.
//! * **Data path without a passive application thread.** The requester runs in the
//!   posting/polling thread of the initiator: `post_send` validates, queues and starts
//!   WRs in QP order; WRITE, large READ, SEND, WRITE_WITH_IMM are performed by the
//!   initiator itself against the target's shared tables (exact responder checks, per
//!   atom translation through the target's IOMMU, memmove in-process or
//!   `process_vm_readv/writev` across processes, recv CQE pushed into the target's CQ,
//!   its completion channel signalled through `pidfd_getfd`).
//! * **Small READ/WRITE (≤ `ring_max`) and all atomics across processes** go through
//!   the target QP's request ring, served by the target host's single **NIC thread**,
//!   which spins only for `nic_spin` after its last request and otherwise sleeps on a
//!   futex (requesters wake it). Atomics thus execute on the target's NIC thread only
//!   (`IBV_ATOMIC_HCA` semantics) — in-process they are real CPU atomics on the target
//!   frame. The passive side's NIC thread serves the request in ~a cache-line round
//!   trip, so it costs the active side no latency; in a latency run each process has at
//!   most one spinning thread (the initiator's poller; the target's NIC thread).
//! * **RC ordering**: a per-QP software SQ; ring requests pipeline, a direct op waits
//!   for earlier ring requests; completions retire strictly in order; an error
//!   completion moves the QP to ERR and flushes every WR behind it (WR_FLUSH_ERR).
//! * **Deferred work** (RNR retry timers, responses nobody polls for) is progressed by
//!   the NIC thread (timed futex waits; eager while a CQ is armed).
//! * **Flush**: SRCU-style epochs in the segment; every DMA section (translate + copy,
//!   at most `dma_section` bytes) holds the epoch of both hosts; `Iommu::flush` flips
//!   the epoch and waits for the old parity to drain. MR deregistration also flushes.
//!
//! ## Statuses
//! Post-time errors return [`PostError`]; execution errors complete with the verbs
//! status (`LocProtErr`, `LocLenErr`, `RemAccessErr`, `RemInvReqErr`, `RemOpErr`,
//! `RnrRetryExcErr`, `RetryExcErr` when the target QP is gone / not connected to us,
//! `WrFlushErr` behind an error). A responder-side error also moves the target QP to
//! ERR (and flushes its receives), as on hardware.

pub mod config;
pub mod cq;
pub mod dma;
pub mod error;
pub mod frames;
pub mod host;
pub mod iommu;
pub mod mr;
mod nic;
mod peer;
pub mod qp;
mod requester;
mod responder;
pub mod segment;
mod sys;
pub mod verbs;

pub use config::HostConfig;
pub use cq::{CompChannel, Cq};
pub use error::{Error, PostError, Result};
pub use frames::FrameMap;
pub use host::{Context, Host, HostAddr, NicStats};
pub use iommu::{Frame, Iommu, IovaRange};
pub use mr::{Mr, OwnedMr, Pd};
pub use qp::Qp;
pub use verbs::*;
