//! The narrow interfaces NP-RDMA needs from below: a NIC offering standard
//! verbs plus an optional IOMMU-control capability ([`Nic`], [`NicQp`],
//! [`NicCq`], [`NicMr`], [`IommuControl`]), and a memory manager offering
//! residency queries, temporary pins and swap-out notifications
//! ([`MemoryManager`], [`SwapListener`], the RAII guard [`Pinned`]).
//!
//! They are deliberately small so the same NP-RDMA logic can sit on the
//! project's software RNIC with its host IOMMU (kernel-module mode of the
//! paper) or on a real libibverbs device without IOMMU control (pure
//! user-space mode: every fault goes two-sided and NIC MRs are registered on
//! the fly). Adapters live next to the concrete crates (`rnic`, `vmem`);
//! value types here mirror libibverbs (status numbers are `ibv_wc_status`).
//!
//! A [`Nic`] value stands for *one protection domain* of an opened device:
//! NP-RDMA creates one per application PD, and all MRs and QPs made through
//! it belong to that PD.

use std::os::fd::RawFd;
use std::sync::Arc;

/// Memory access rights of an MR (numerically `ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    /// `IBV_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: Access = Access(1);
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: Access = Access(2);
    /// `IBV_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: Access = Access(4);
    /// `IBV_ACCESS_REMOTE_ATOMIC`.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Not an ibverbs flag (bit 30, outside their range): the MR is reachable
    /// by a peer's requests whatever the receiving QP's access flags (the
    /// protocol's own MRs: version tables, reverse-operation buffers). Only
    /// a backend whose QPs filter remote requests by their flags *before*
    /// the MR's rights needs it; others ignore the bit.
    pub const ANY_QP: Access = Access(1 << 30);
    /// Whether all bits of `other` are set.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// Device capabilities NP-RDMA depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Max TLP size: the NIC's DMA atom (see [`crate::check`]).
    pub max_tlp: usize,
    /// Magic word of the signature page.
    pub magic: u32,
    /// Page size of IOMMU mappings.
    pub page_size: usize,
    /// Max outstanding WRs per QP (NP-RDMA needs 3× the application depth).
    pub max_qp_wr: u32,
    /// Max SGEs per WR.
    pub max_sge: u32,
    /// Max inline data per WR.
    pub max_inline: u32,
    /// Whether [`Nic::iommu`] returns a capability (else: user-space mode).
    pub iommu: bool,
    /// Max entries of one CQ.
    pub max_cqe: u32,
}

/// Scatter/gather element (`struct ibv_sge`, its C layout: a backend whose
/// own SGE type is `struct ibv_sge` too may post an array of these as is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    /// Address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// Work-request operation (the one verbs vocabulary: NIC WRs and the
/// application's, `plan::AppOp`, alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WrOp {
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate data.
    WriteImm(u32),
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendImm(u32),
    /// RDMA READ.
    Read,
    /// Compare-and-swap.
    CmpSwap {
        /// The value expected at the remote address.
        compare: u64,
        /// The value stored there if it matched.
        swap: u64,
    },
    /// Fetch-and-add.
    FetchAdd {
        /// The addend.
        add: u64,
    },
}

impl WrOp {
    /// What the operation does to its local buffer: READ and the atomics
    /// write their result into it; WRITE and SEND only read it.
    pub fn local_pin(self) -> PinFor {
        match self {
            WrOp::Read | WrOp::CmpSwap { .. } | WrOp::FetchAdd { .. } => PinFor::Write,
            WrOp::Write | WrOp::WriteImm(_) | WrOp::Send | WrOp::SendImm(_) => PinFor::Read,
        }
    }
}

/// A send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct WorkRequest<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: WrOp,
    /// Local buffers.
    pub sg_list: &'a [Sge],
    /// Remote address (RDMA and atomics).
    pub remote_addr: u64,
    /// Remote key (RDMA and atomics).
    pub rkey: u32,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Wait for earlier READs/atomics before starting (IBV_SEND_FENCE).
    pub fence: bool,
    /// Copy the data at post time (no lkey needed).
    pub inline: bool,
}

impl<'a> WorkRequest<'a> {
    /// A signaled, unfenced, not inline WR of `op` over `sg_list` (no remote
    /// side yet: [`WorkRequest::remote`]).
    #[inline]
    pub fn new(wr_id: u64, op: WrOp, sg_list: &'a [Sge]) -> Self {
        WorkRequest {
            wr_id,
            op,
            sg_list,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
            fence: false,
            inline: false,
        }
    }
    /// With remote address `addr` under key `rkey`.
    #[inline]
    pub fn remote(mut self, addr: u64, rkey: u32) -> Self {
        self.remote_addr = addr;
        self.rkey = rkey;
        self
    }
    /// Signaled or not.
    #[inline]
    pub fn signaled(mut self, signaled: bool) -> Self {
        self.signaled = signaled;
        self
    }
    /// Its data copied at post time (`IBV_SEND_INLINE`).
    #[inline]
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }
}

/// A receive-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvRequest<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Local buffers.
    pub sg_list: &'a [Sge],
}

/// What a completion completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompOp {
    #[default]
    /// A SEND.
    Send,
    /// An RDMA WRITE.
    Write,
    /// An RDMA READ.
    Read,
    /// A compare-and-swap.
    CmpSwap,
    /// A fetch-and-add.
    FetchAdd,
    /// A RECV consumed by a SEND (with immediate data: `imm` is set).
    Recv,
    /// A RECV consumed by a WRITE with immediate.
    RecvWithImm,
}

/// Status of a work completion (`enum ibv_wc_status`, same numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum WcStatus {
    /// The WR completed.
    #[default]
    Success = 0,
    /// Local length error (a RECV too short, a bad length).
    LocLenErr = 1,
    /// Local QP operation error.
    LocQpOpErr = 2,
    /// Local EE context operation error (unused: no RD).
    LocEecOpErr = 3,
    /// Local protection error (a bad lkey or range).
    LocProtErr = 4,
    /// Flushed: the QP was in ERR.
    WrFlushErr = 5,
    /// Memory-window bind error (unused).
    MwBindErr = 6,
    /// Bad response from the responder.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// Remote invalid request (rights of the QP, misaligned atomic, ...).
    RemInvReqErr = 9,
    /// Remote access error (a bad rkey, range or MR right).
    RemAccessErr = 10,
    /// Remote operation error (the responder could not do it).
    RemOpErr = 11,
    /// Transport retries exceeded (the peer is gone).
    RetryExcErr = 12,
    /// RNR retries exceeded (no RECV posted at the peer).
    RnrRetryExcErr = 13,
    /// Local RDD violation (unused: no RD).
    LocRddViolErr = 14,
    /// Remote invalid RD request (unused).
    RemInvRdReqErr = 15,
    /// Remote aborted error.
    RemAbortErr = 16,
    /// Invalid EE context number (unused).
    InvEecnErr = 17,
    /// Invalid EE context state (unused).
    InvEecStateErr = 18,
    /// Fatal error.
    FatalErr = 19,
    /// Response timeout.
    RespTimeoutErr = 20,
    /// General error (also: a number outside this list).
    GeneralErr = 21,
}

impl WcStatus {
    const ALL: [WcStatus; 22] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocEecOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::MwBindErr,
        WcStatus::BadRespErr,
        WcStatus::LocAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::RemOpErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::LocRddViolErr,
        WcStatus::RemInvRdReqErr,
        WcStatus::RemAbortErr,
        WcStatus::InvEecnErr,
        WcStatus::InvEecStateErr,
        WcStatus::FatalErr,
        WcStatus::RespTimeoutErr,
        WcStatus::GeneralErr,
    ];
    /// The `ibv_wc_status` number ([`Completion::status`]).
    pub const fn code(self) -> u32 {
        self as u32
    }
    /// The status of number `code`; an unknown number is `GeneralErr`.
    pub fn from_code(code: u32) -> WcStatus {
        Self::ALL
            .get(code as usize)
            .copied()
            .unwrap_or(WcStatus::GeneralErr)
    }
    /// Whether the status reports what the responder did or did not answer (a
    /// NAK, a missing answer): an unreliable connection's requester never learns it.
    pub fn is_remote(self) -> bool {
        use WcStatus::*;
        matches!(
            self,
            RemInvReqErr
                | RemAccessErr
                | RemOpErr
                | RetryExcErr
                | RnrRetryExcErr
                | RemInvRdReqErr
                | RemAbortErr
        )
    }
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `ibv_wc_status` number: 0 = success, 5 = WR_FLUSH_ERR, ...
    pub status: u32,
    /// What completed.
    pub op: CompOp,
    /// Bytes transferred.
    pub byte_len: u32,
    /// Immediate data, if any.
    pub imm: Option<u32>,
    /// Local QP number.
    pub qp_num: u32,
}

impl Completion {
    /// `IBV_WC_SUCCESS`.
    pub const SUCCESS: u32 = WcStatus::Success.code();
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub const WR_FLUSH_ERR: u32 = WcStatus::WrFlushErr.code();
    /// Whether the WR succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == Self::SUCCESS
    }
}

/// Creation parameters of a data or control QP (RC only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSpec {
    /// Requested QP number (NP-RDMA pairs each data QP with a control QP at
    /// a derivable number); `None` = automatic.
    pub qpn: Option<u32>,
    /// Send-queue depth.
    pub max_send_wr: u32,
    /// Receive-queue depth.
    pub max_recv_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Protection sub-domain (see [`IommuControl::reg_mr_iova`]): the
    /// application PD of a data QP, 0 for none (a QP that reaches no MR
    /// registered in a domain).
    pub domain: u32,
}

/// An opaque peer address (GID-like, e.g. the rnic `HostAddr` bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddr(pub [u8; 16]);

/// Failure of a post: the index of the first WR not posted and why. WRs
/// before it were posted and will complete; none from it on were.
#[derive(Debug, thiserror::Error)]
#[error("post failed at WR {bad_index}: {source}")]
pub struct PostError<E: std::error::Error + 'static> {
    /// Index of the first WR not posted.
    pub bad_index: usize,
    #[source]
    /// Why.
    pub source: E,
}

/// IB's RNR NAK timer for the 5-bit `min_rnr_timer` code (IBA table 45:
/// 0 = 655.36 ms, 1 = 0.01 ms … 31 = 491.52 ms; the software RNIC's
/// `verbs::rnr_timer` is the same table).
pub fn rnr_timer(code: u8) -> std::time::Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    std::time::Duration::from_micros(u64::from(US[usize::from(code & 31)]))
}

/// A registered memory region. Dropping it deregisters; the NIC must make
/// that safe while WRs referencing it are in flight (they then fail).
pub trait NicMr: Send + Sync {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// Registered address.
    fn addr(&self) -> u64;
    /// Registered length.
    fn len(&self) -> u64;
    /// Whether the length is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A buffer the backend owns, registered for its whole life (zeroed at
/// allocation): read-back scratch, the zero source, control rings. Dropping
/// it deregisters (waiting for DMA through it), then frees the memory.
pub trait NicBuf: NicMr {
    /// Copy `out.len()` bytes at offset `off` of the buffer into `out`.
    ///
    /// # Panics
    /// If the range is outside the buffer (a caller bug).
    fn read(&self, off: usize, out: &mut [u8]);
    /// The SGE of `len` bytes at offset `off`.
    fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr() + off as u64,
            length: len,
            lkey: self.lkey(),
        }
    }
}

/// A completion queue.
pub trait NicCq: Send + Sync {
    /// The NIC's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Non-blocking: move up to `out.len()` completions into `out`, in
    /// completion order; returns how many.
    fn poll(&self, out: &mut [Completion]) -> Result<usize, Self::Error>;
    /// Arm the completion channel: the next completion signals
    /// [`NicCq::event_fd`] (once per arm).
    fn arm(&self, solicited_only: bool) -> Result<(), Self::Error>;
    /// A file descriptor that becomes readable after an armed completion
    /// (eventfd semantics: read it to reset), if the NIC has one.
    fn event_fd(&self) -> Option<RawFd>;
}

/// An RC queue pair.
pub trait NicQp: Send + Sync {
    /// The NIC's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// QP number.
    fn qpn(&self) -> u32;
    /// Bring the QP to RTS connected to `peer_qpn` at `peer`
    /// (RESET→INIT→RTR→RTS with the given access rights for remote ops).
    fn connect(&self, peer: PeerAddr, peer_qpn: u32, access: Access) -> Result<(), Self::Error>;
    /// Post send WRs in order. Errors detectable at post time reject the WR
    /// (and all after it) without a completion; every accepted WR yields
    /// exactly one completion if signaled or failed.
    fn post_send(&self, wrs: &[WorkRequest<'_>]) -> Result<(), PostError<Self::Error>>;
    /// Post receive WRs in order (same contract).
    fn post_recv(&self, wrs: &[RecvRequest<'_>]) -> Result<(), PostError<Self::Error>>;
    /// Move the QP to ERR: outstanding WRs complete with WR_FLUSH_ERR.
    fn set_error(&self) -> Result<(), Self::Error>;
    /// Move the QP to RESET (from ERR): its queues emptied, its connection
    /// forgotten; [`NicQp::connect`] connects it again, with its number.
    fn reset(&self) -> Result<(), Self::Error>;
    /// Change the rights the QP grants the peer's requests
    /// (`ibv_modify_qp` with `IBV_QP_ACCESS_FLAGS`; REMOTE_* bits count).
    fn set_access(&self, access: Access) -> Result<(), Self::Error>;
    /// Whether the connected peer is known to be gone (its process exited). A NIC
    /// notices a dead peer only on requests it has outstanding; the engine asks
    /// while it waits for the peer's answer to a control message. Default: never
    /// known (the transport timeout and the engine's own timeout then bound the wait).
    fn peer_gone(&self) -> bool {
        false
    }
}

/// Where an IOVA page points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Frame {
    /// No mapping: DMA through it fails the WR.
    Unmapped,
    /// The page of this process's memory at this page-aligned address.
    Ram(u64),
    /// The shared signature page (reads return the magic word).
    Signature,
    /// The shared black-hole page (absorbs writes).
    BlackHole,
}

/// The IOMMU-control capability (the paper's kernel-module role).
pub trait IommuControl: Send + Sync {
    /// The NIC's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// A contiguous IOVA range.
    type Range: Copy + Send + Sync + std::fmt::Debug;
    /// MRs made over IOVA ranges.
    type Mr: NicMr;
    /// Bytes of IOMMU page table one mapped IOVA page costs (its PTE).
    const ENTRY_BYTES: usize;
    /// Reserve `npages` IOVA pages, all [`Frame::Unmapped`].
    fn alloc_range(&self, npages: u64) -> Result<Self::Range, Self::Error>;
    /// Release a range (no MR may still use it).
    fn free_range(&self, range: Self::Range) -> Result<(), Self::Error>;
    /// Point page `index` of `range` at `frame`. Effective for DMA atoms that
    /// translate after the call; atoms already in flight may still use the
    /// old frame until [`IommuControl::flush`] returns.
    fn map(&self, range: &Self::Range, index: u64, frame: Frame) -> Result<(), Self::Error>;
    /// Return only when no DMA atom that used a replaced entry is in flight.
    fn flush(&self) -> Result<(), Self::Error>;
    /// Whether DMA reached page `index` of `range` since it was mapped or
    /// last asked, clearing that record: the IOMMU page table's accessed
    /// bit, which the pager's reclaim asks about through
    /// [`SwapListener::test_and_clear_young`]. Default: an IOMMU without
    /// accessed bits, never young.
    fn test_and_clear_young(&self, _range: &Self::Range, _index: u64) -> Result<bool, Self::Error> {
        Ok(false)
    }
    /// Register `[addr, addr+len)` with MTT page i → IOVA page `range`+i,
    /// in protection sub-domain `domain` (the application PD it belongs to;
    /// 0 = none): a peer reaches it with its rkey only through a QP of the
    /// same domain ([`QpSpec::domain`]), as if the NIC had a PD for each
    /// application PD.
    ///
    /// # Safety
    /// The memory must stay mapped in this process while the MR exists
    /// (the NIC reads/writes the frames the IOMMU names).
    #[allow(unsafe_code)] // declaration only: the caller upholds the contract
    unsafe fn reg_mr_iova(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        range: &Self::Range,
        domain: u32,
    ) -> Result<Self::Mr, Self::Error>;
    /// Change an MR made by [`IommuControl::reg_mr_iova`] in place — its
    /// rights and its protection sub-domain — keeping its keys and
    /// translation (`ibv_rereg_mr` of an application MR's views); the DMA
    /// already inside it finishes first.
    fn set_mr_rights(
        &self,
        mr: &mut Self::Mr,
        access: Access,
        domain: u32,
    ) -> Result<(), Self::Error>;
    /// Tell the NIC model which pages of this process are resident (the
    /// host-OS role; the software NIC counts and refuses DMA to
    /// non-resident frames). A real IOMMU driver ignores it.
    fn set_resident(&self, addr: u64, len: u64, resident: bool) -> Result<(), Self::Error>;
    /// Start tracking the residency of `[addr, addr+len)` (page-aligned),
    /// all pages non-resident until [`IommuControl::set_resident`] says
    /// otherwise: the host-OS role of a NIC model (default: nothing).
    fn track_frames(&self, _addr: u64, _len: u64) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Stop tracking the range [`IommuControl::track_frames`] started at
    /// `addr` (default: nothing).
    fn untrack_frames(&self, _addr: u64) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// One protection domain of a NIC.
pub trait Nic: Send + Sync {
    /// The NIC's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Its MRs.
    type Mr: NicMr;
    /// Its CQs.
    type Cq: NicCq<Error = Self::Error>;
    /// Its QPs.
    type Qp: NicQp<Error = Self::Error>;
    /// Its owned registered buffers.
    type Buf: NicBuf;
    /// Its IOMMU control.
    type Iommu: IommuControl<Error = Self::Error>;
    /// The NIC's own counters ([`Nic::stats`]; `()` if it has none).
    type Stats: Clone + std::fmt::Debug + Send;
    /// Device capabilities.
    fn caps(&self) -> DeviceCaps;
    /// Standard (pinned, identity-translated) registration: control rings,
    /// version tables, temporary buffers, and the user-space mode.
    ///
    /// # Safety
    /// The memory must stay mapped while the MR exists.
    #[allow(unsafe_code)] // declaration only: the caller upholds the contract
    unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<Self::Mr, Self::Error>;
    /// [`Nic::reg_mr`] in protection sub-domain `domain` (0 = none; see
    /// [`IommuControl::reg_mr_iova`]): the temporary MRs a peer's reverse
    /// operation reaches, through a QP of that domain only. A backend without
    /// sub-domains (the default) registers it as [`Nic::reg_mr`] does: its
    /// peers reach it from any QP of its PD.
    ///
    /// # Safety
    /// As [`Nic::reg_mr`].
    #[allow(unsafe_code)] // the caller upholds the contract
    unsafe fn reg_mr_in_domain(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        domain: u32,
    ) -> Result<Self::Mr, Self::Error> {
        let _ = domain;
        // SAFETY: forwarded contract.
        unsafe { self.reg_mr(addr, len, access) }
    }
    /// `len` zeroed bytes the backend allocates and registers with `access`
    /// ([`NicBuf`]).
    fn alloc_buf(&self, len: usize, access: Access) -> Result<Self::Buf, Self::Error>;
    /// [`Nic::alloc_buf`] for a buffer peers' SENDs land in (a control
    /// ring): a backend with a NIC-shared DMA pool serves it from there, so
    /// a peer's SEND into it is cheap (default: [`Nic::alloc_buf`]).
    fn alloc_ring_buf(&self, len: usize, access: Access) -> Result<Self::Buf, Self::Error> {
        self.alloc_buf(len, access)
    }
    /// A CQ of `depth` entries (overflow is an error, as on hardware).
    fn create_cq(&self, depth: u32) -> Result<Self::Cq, Self::Error>;
    /// An RC QP in RESET.
    fn create_qp(
        &self,
        spec: &QpSpec,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
    ) -> Result<Self::Qp, Self::Error>;
    /// This host's address for peers.
    fn addr(&self) -> PeerAddr;
    /// The IOMMU-control capability, if available.
    fn iommu(&self) -> Option<Arc<Self::Iommu>>;
    /// Block until an armed CQ of this NIC ([`NicCq::arm`]) signals its
    /// completion channel, a ring waker of this NIC fires
    /// ([`Nic::add_ring_waker`]), or `timeout` passes: `true` on an event or
    /// a wake-up, `false` on the timeout.
    fn wait_event(&self, timeout: std::time::Duration) -> Result<bool, Self::Error>;
    /// The NIC's counters.
    fn stats(&self) -> Self::Stats;
    /// Software-NIC hook: let the calling thread serve the NIC's request
    /// rings (`on`) or hand them back; whether handing back served pending
    /// requests. A hardware NIC needs no CPU to serve its peers (default:
    /// nothing, `false`).
    fn set_ring_polling(&self, _on: bool) -> bool {
        false
    }
    /// Software-NIC hook: serve pending ring requests now (while ring
    /// polling is on); whether any was served (default: `false`).
    fn serve_rings(&self) -> bool {
        false
    }
    /// Software-NIC hook: how many passes over the request rings served
    /// requests so far, by any thread (polls of this NIC's CQs serve them
    /// too); a thread spinning for peers compares it between turns
    /// (default: 0, never changing).
    fn ring_passes(&self) -> u64 {
        0
    }
    /// Software-NIC hook: the calling thread paces its own spinning, so this
    /// NIC's CQ polls need not yield its core for it (default: nothing).
    fn pace_own_polls(&self) {}
    /// Software-NIC hook: have [`Nic::wait_event`] return when the NIC thread
    /// starts serving peers' requests while nobody polls the rings, so a ring
    /// poller that blocked takes them back; an id for
    /// [`Nic::remove_ring_waker`] (default: nothing, 0).
    fn add_ring_waker(&self) -> u64 {
        0
    }
    /// Software-NIC hook: undo [`Nic::add_ring_waker`] (default: nothing).
    fn remove_ring_waker(&self, _id: u64) {}
}

/// `timeout` as poll(2)'s milliseconds, rounded up: a sub-millisecond wait is
/// not a zero one (a caller's wait loop would spin through its last
/// millisecond instead of blocking).
pub fn poll_timeout_ms(timeout: std::time::Duration) -> i32 {
    timeout.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32
}

/// Opaque handle of a registered swap listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u64);

/// The MMU-notifier role: called synchronously by the memory manager.
pub trait SwapListener: Send + Sync {
    /// Called on the evicting thread with page-aligned addresses, *before*
    /// their contents leave memory. NP-RDMA remaps the pages' IOMMU entries
    /// (Read MR → signature, Write MR → black hole), bumps their versions to
    /// even, and flushes; only then may the pager reclaim them. `false`: the
    /// flush could not confirm that no DMA through the old mapping is still
    /// in flight, so the pages must not leave now (the pager keeps them
    /// resident). Must not call back into pin/unpin of the same pager.
    fn before_swap_out(&self, pages: &[u64]) -> bool;
    /// Optional eager swap-in notice (beyond the paper; Linux has none, so
    /// the default relies on lazy swap-in through the two-sided path).
    fn after_swap_in(&self, _pages: &[u64]) {}
    /// Secondary-MMU accessed bits (Linux's `mmu_notifier` `clear_young`):
    /// set `young[i]` for each of `pages` (resident eviction candidates)
    /// the NIC reached since last asked, clearing that record; the pager
    /// spares young pages as referenced ones. Default: reports nothing.
    fn test_and_clear_young(&self, _pages: &[u64], _young: &mut [bool]) {}
    /// The application unmapped `[start, end)` (page-aligned): the memory
    /// registered there is gone and its address may be reused; NP-RDMA
    /// takes the pages out of both NIC views, as for a swap-out, so no DMA
    /// reaches what is mapped there later.
    fn after_unmap(&self, _start: u64, _end: u64) {}
}

/// What NP-RDMA needs from the pager.
pub trait MemoryManager: Send + Sync {
    /// The memory manager's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Page size.
    fn page_size(&self) -> usize;
    /// Cheap (no syscall) residency of the page containing `addr`.
    fn is_resident(&self, addr: u64) -> bool;
    /// Residency of every page of `[addr, addr+len)`, appended to `out`.
    fn residency(&self, addr: u64, len: u64, out: &mut Vec<bool>) -> Result<(), Self::Error>;
    /// Make every page of the range resident and unevictable (refcounted),
    /// resolving faults in the calling thread. On error nothing stays pinned.
    fn pin(&self, addr: u64, len: u64) -> Result<(), Self::Error>;
    /// [`Self::pin`] of memory the holder only reads (the NIC reads it, or
    /// the CPU copies out of it): a never-touched page may be backed by the
    /// shared zero page, as a CPU read fault backs it, instead of a page
    /// allocated and zeroed now. A write to it later is the kernel's
    /// copy-on-write at the same address. Default: [`Self::pin`].
    fn pin_read(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        self.pin(addr, len)
    }
    /// Drop one pin reference of every page of the range.
    fn unpin(&self, addr: u64, len: u64) -> Result<(), Self::Error>;
    /// Whether the calling thread, which spins anyway while it has a core to
    /// itself, waits for the device reads its pins make by polling rather than
    /// by sleeping (default: nothing; see `vmem::poll_swap_reads`).
    fn poll_own_reads(&self, _on: bool) {}
    /// Register a swap listener.
    fn add_swap_listener(&self, l: Arc<dyn SwapListener>) -> ListenerId;
    /// Unregister; returns once no call to it is running.
    fn remove_swap_listener(&self, id: ListenerId);
}

impl<M: MemoryManager + ?Sized> MemoryManager for Arc<M> {
    type Error = M::Error;
    fn page_size(&self) -> usize {
        (**self).page_size()
    }
    fn is_resident(&self, addr: u64) -> bool {
        (**self).is_resident(addr)
    }
    fn residency(&self, addr: u64, len: u64, out: &mut Vec<bool>) -> Result<(), Self::Error> {
        (**self).residency(addr, len, out)
    }
    fn pin(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        (**self).pin(addr, len)
    }
    fn pin_read(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        (**self).pin_read(addr, len)
    }
    fn unpin(&self, addr: u64, len: u64) -> Result<(), Self::Error> {
        (**self).unpin(addr, len)
    }
    fn add_swap_listener(&self, l: Arc<dyn SwapListener>) -> ListenerId {
        (**self).add_swap_listener(l)
    }
    fn remove_swap_listener(&self, id: ListenerId) {
        (**self).remove_swap_listener(id)
    }
}

/// What the holder of a pin does with the pinned memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PinFor {
    /// Only reads it ([`MemoryManager::pin_read`]).
    Read,
    /// Writes it (or may): [`MemoryManager::pin`].
    Write,
}

impl PinFor {
    /// The pin a peer's request needing `need` takes: a READ (`need` is
    /// exactly remote read, not an atomic) only reads; anything else writes.
    pub fn for_request(need: Access, atomic: bool) -> PinFor {
        if need == Access::REMOTE_READ && !atomic {
            PinFor::Read
        } else {
            PinFor::Write
        }
    }
}

/// A temporary pin that is released on drop, so a failed or abandoned
/// two-sided operation can never leak a pin. Holds the manager by value:
/// pass an `Arc` (or another cheap handle).
#[derive(Debug)]
pub struct Pinned<M: MemoryManager> {
    mm: M,
    addr: u64,
    len: u64,
    released: bool,
}

impl<M: MemoryManager> Pinned<M> {
    /// Pin `[addr, addr+len)` for writing.
    pub fn new(mm: M, addr: u64, len: u64) -> Result<Self, M::Error> {
        Self::new_for(mm, addr, len, PinFor::Write)
    }
    /// Pin `[addr, addr+len)` for what `for_` says the holder does with it.
    pub fn new_for(mm: M, addr: u64, len: u64, for_: PinFor) -> Result<Self, M::Error> {
        match for_ {
            PinFor::Read => mm.pin_read(addr, len)?,
            PinFor::Write => mm.pin(addr, len)?,
        }
        Ok(Pinned {
            mm,
            addr,
            len,
            released: false,
        })
    }
    /// The pinned range.
    pub fn range(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
    /// Unpin now and report the result.
    pub fn release(mut self) -> Result<(), M::Error> {
        self.released = true;
        self.mm.unpin(self.addr, self.len)
    }
}

impl<M: MemoryManager> Drop for Pinned<M> {
    fn drop(&mut self) {
        if !self.released {
            if let Err(e) = self.mm.unpin(self.addr, self.len) {
                tracing::error!(addr = self.addr, len = self.len, error = %e, "unpin failed");
            }
        }
    }
}

#[cfg(any(test, feature = "contract"))]
pub mod contract;
#[cfg(test)]
mod tests;
