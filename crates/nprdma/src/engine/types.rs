//! The engine's vocabulary at the bottom of its tower: configuration,
//! errors, the application's work requests, counters and endpoints.

use std::time::Duration;

use crate::ctrl::CtrlConfig;
use crate::nic::Sge;
use crate::ordering::OrderConfig;
use crate::plan::AppOp as Opcode;
use crate::plan::PlanConfig;

/// Bytes per page (the pager's and the NIC's).
pub(super) const PS: u64 = vmem::PAGE_SIZE as u64;

/// Engine errors (post-time and setup); execution errors are completions.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The NIC refused a setup step (resources, connection). The payload is
    /// the software RNIC's error (the default backend, and what the verbs
    /// shim reports); another backend's errors become [`Error::Other`].
    #[error("NIC: {0}")]
    Nic(#[from] rnic::Error),
    /// The pager refused (registration of the MR's range).
    #[error("pager: {0}")]
    Pager(#[from] vmem::Error),
    /// An argument out of range (what is wrong is said).
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The send or receive queue holds its depth already.
    #[error("queue full")]
    QueueFull,
    /// The QP is not connected, was destroyed, or its peer is gone.
    #[error("QP is not connected or in error")]
    QpState,
    /// Anything else (a lower layer's message).
    #[error("{0}")]
    Other(String),
}

/// Engine configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The polling thread blocks at once when idle (no spinning).
    pub interrupt_mode: bool,
    /// How long the polling thread spins after its last piece of work.
    pub spin: Duration,
    /// Planner thresholds (small-WRITE read-back limit, versioned READ, inline limit).
    ///
    /// The default `plan.write_version_threshold` is **4096**: WRITEs up to
    /// one page use WRITE + read-back, longer ones page versions. Measured
    /// on the software NIC (in-process, 2 B–16 KiB signaled WRITE medians,
    /// best of 3, `NPRDMA_WRITE_VERSION_THRESHOLD` in the `bench` example):
    /// read-back 0.72 / 0.90 / 1.15 / 2.98 µs at 512 B / 4 / 8 / 16 KiB,
    /// versions 0.98 / 1.04 / 1.37 µs at 4 / 8 / 16 KiB — the crossover lies
    /// between 4 and 8 KiB, and a read-back also moves the payload twice
    /// through the NIC (halving WRITE throughput) while versions add 8 B
    /// per page. `PlanConfig::default()` itself (16 KiB) is the planner's
    /// generic value; the QP's read-back scratch is `max(threshold, 4 KiB)`
    /// per WR of depth.
    pub plan: PlanConfig,
    /// Ordering configuration of every QP.
    pub order: OrderConfig,
    /// Control-channel configuration (inline limit).
    pub ctrl: CtrlConfig,
    /// Retry mode: fault requests ask the target for Receiver-Ready and
    /// retry one-sided.
    pub retry_mode: bool,
    /// Entries of the NIC CQ shared by all QPs of the context.
    pub nic_cq_depth: u32,
    /// A two-sided request unanswered this long completes with
    /// RETRY_EXC_ERR (the peer destroyed its QP or died).
    pub two_sided_timeout: Duration,
    /// Longest piece of a two-sided READ/WRITE: a longer one goes as a
    /// sequence of fault requests of this length, two at the target at a
    /// time, so the target serves its other requests in between and pins
    /// no more than two pieces of it at once (values below 4096 count as
    /// 4096).
    pub two_sided_piece: u32,
    /// Ring takeover: the polling thread, once blocked, is woken when the
    /// software NIC's thread starts serving peers' requests in its place
    /// (`Nic::add_ring_waker`) and takes the request rings back, spinning.
    /// Off by default: a long stream of READs at a passive target then costs
    /// no NIC-thread sleep and wake-up per request (`ib_read_lat -n 10⁶`
    /// 5.96 → 0.83 µs), but on this 2-core VM a short one (`ib_read_lat`'s
    /// default 1 000 iterations) ran at 48–60 µs instead of 1–15 µs: the
    /// spinning target and the spinning initiator shared a core (BENCHMARKS.md,
    /// session 16).
    pub ring_takeover: bool,
    /// User-space mode's registration cache: bytes of temporary MRs kept
    /// registered after their operation (LRU; 0: off, every two-sided
    /// operation registers and deregisters). Kernel-module mode does not
    /// cache. The trade-off: while cached, an MR (and its rkey, which the
    /// peer has seen) stays open over those resident pages — whole pages,
    /// rounded out from the operation's range — until evicted from the
    /// cache, swapped out, unmapped or deregistered.
    pub reg_cache_bytes: u64,
    /// User-space mode's leases (beyond the paper; see the engine's `lease`
    /// module): a target lends a peer its registration of a range the peer
    /// came back to two-sided, so that the peer's next READs or WRITEs of it
    /// go one-sided (0: never). The peer uses a lease for `lease_ms / 2` after
    /// its request (each two-sided operation on the range renews it), then
    /// gives it back; the pages stay pinned until then (10 × `lease_ms`, at
    /// least 1 s, for a peer that never gives it back).
    pub lease_ms: u32,
    /// Bytes a target lends at most at a time (0: no leases).
    pub lease_bytes: u64,
    /// Carry each QP's control channel on its data QP (whose receive queue
    /// the engine does not otherwise use) instead of a second NIC QP: the
    /// command-ring RECVs are posted on the data QP and the control SENDs
    /// share its send queue. The peer then needs only the data QP's number
    /// — what an unmodified verbs program exchanges — and must run the same
    /// way ([`Endpoint::ctrl_qpn`] equal to [`Endpoint::qpn`] says so).
    /// Used by the verbs shim over a device that numbers its QPs itself.
    pub ctrl_on_data_qp: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interrupt_mode: false,
            spin: Duration::from_micros(50),
            plan: PlanConfig {
                write_version_threshold: 4096,
                ..PlanConfig::default()
            },
            order: OrderConfig::default(),
            ctrl: CtrlConfig::default(),
            retry_mode: false,
            nic_cq_depth: 32768,
            two_sided_timeout: Duration::from_secs(5),
            two_sided_piece: 1 << 20,
            ring_takeover: false,
            reg_cache_bytes: 64 << 20,
            lease_ms: 100,
            lease_bytes: 64 << 20,
            ctrl_on_data_qp: false,
        }
    }
}

/// One application send WR (one SGE at most: NP-RDMA's WRs carry a single
/// local range).
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    /// The application's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: Opcode,
    /// The local range (an NP-RDMA MR's key), if any.
    pub sge: Option<Sge>,
    /// Remote address (READ/WRITE/atomics).
    pub remote_addr: u64,
    /// The remote MR's key (the peer's NP-RDMA `Mr::rkey`).
    pub rkey: u32,
    /// Complete it on success too (errors always complete).
    pub signaled: bool,
    /// Wait until nothing of this QP is in flight before issuing.
    pub order_before: bool,
    /// Issue nothing behind this WR until it completes.
    pub order_after: bool,
    /// SEND / SEND_WITH_IMM / WRITE_WITH_IMM with the solicited-event bit
    /// (`IBV_SEND_SOLICITED`): the receive completion it causes wakes a peer
    /// CQ armed with [`crate::Cq::req_notify_solicited`].
    pub solicited: bool,
}

impl SendWr {
    /// A signaled WR.
    pub fn new(wr_id: u64, op: Opcode, sge: Option<Sge>, remote_addr: u64, rkey: u32) -> Self {
        SendWr {
            wr_id,
            op,
            sge,
            remote_addr,
            rkey,
            signaled: true,
            order_before: false,
            order_after: false,
            solicited: false,
        }
    }
}

/// One application receive WR.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr {
    /// The application's id, returned in the completion.
    pub wr_id: u64,
    /// Where the SEND's data lands (none: zero-length SENDs only).
    pub sge: Option<Sge>,
}

/// Engine counters (per context).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Optimistic one-sided attempts that passed their check.
    pub optimistic_ok: u64,
    /// Versioned operations posted without their "before" READ: the QP had
    /// seen every page's version ([`crate::seen_versions`]).
    pub versions_seen: u64,
    /// Operations that went (or fell back) to the two-sided path.
    pub two_sided: u64,
    /// Local pre-check fix-ups (pin + map-in before issuing).
    pub local_fixups: u64,
    /// Two-sided requests served as target.
    pub served: u64,
    /// Pages swapped in together for a batch of READs of swapped-out pages
    /// served in one progress pass (their swap reads issued concurrently).
    pub batched_swap_ins: u64,
    /// Key queries sent.
    pub key_queries: u64,
    /// Retry-mode one-sided retries after Receiver-Ready.
    pub retries: u64,
    /// Unsignaled WRITEs whose read-back was deferred.
    pub deferred_writes: u64,
    /// Read-back READs posted for deferred WRITEs (contiguous ones merged).
    pub readback_batches: u64,
    /// Ops pipelined behind an op whose optimistic check then failed: their
    /// one-sided result was discarded and they ran again after it.
    pub replayed: u64,
    /// Large READs whose version probe found a page out: they went
    /// two-sided without copying signature frames first.
    pub probed_out: u64,
    /// Temporary MRs found in the registration cache (user-space mode).
    pub reg_cache_hits: u64,
    /// Temporary MRs registered (each a registration call).
    pub reg_cache_misses: u64,
    /// Cached MRs dropped because their pages were evicted, unmapped or
    /// deregistered.
    pub reg_cache_invalidations: u64,
    /// Leases granted to peers (target side; each a registration).
    pub leases_granted: u64,
    /// Leases renewed by a peer's two-sided operation on the range.
    pub leases_renewed: u64,
    /// Leases the peers gave back (target side).
    pub leases_released: u64,
    /// Leases dropped at their time, nobody having given them back (a peer
    /// gone or stopped; target side).
    pub leases_expired: u64,
    /// READs/WRITEs sent one-sided on a lease (initiator side).
    pub leased_ops: u64,
}

/// Where a peer QP lives (exchange it out of band, like a GID + QPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// The peer host's address (the NIC's [`crate::nic::PeerAddr`] bytes).
    pub addr: [u8; 16],
    /// The peer's application QP number ([`crate::Qp::qpn`]).
    pub qpn: u32,
    /// The peer's control QP number; 0: derived from `qpn` (the software
    /// NIC's pairing, what the 20-byte form carries). A device that numbers
    /// its QPs itself (user-space mode over libibverbs) needs it said.
    /// Equal to `qpn`: the peer carries its control channel on its data QP
    /// ([`Config::ctrl_on_data_qp`]).
    pub ctrl_qpn: u32,
}

impl Endpoint {
    /// 20 bytes: host address + QPN (little endian); `ctrl_qpn` is not
    /// carried (it must be 0: derived).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..16].copy_from_slice(&self.addr);
        b[16..].copy_from_slice(&self.qpn.to_le_bytes());
        b
    }
    /// The endpoint of [`Endpoint::to_bytes`]'s 20 bytes.
    pub fn from_bytes(b: &[u8; 20]) -> Endpoint {
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&b[..16]);
        Endpoint {
            addr,
            qpn: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
            ctrl_qpn: 0,
        }
    }
}
