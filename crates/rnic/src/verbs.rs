//! Verbs value types: statuses, opcodes, flags, work requests, work completions and
//! QP attributes. Numeric values equal libibverbs' enums so a C shim maps 1:1.

use bitflags::bitflags;

/// Completion status, numerically equal to `enum ibv_wc_status`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcStatus {
    #[default]
    /// Success.
    Success = 0,
    /// Local length error.
    LocLenErr = 1,
    /// Local QP operation error.
    LocQpOpErr = 2,
    /// Local EE context operation error.
    LocEecOpErr = 3,
    /// Local protection error.
    LocProtErr = 4,
    /// WR flushed (QP in ERR).
    WrFlushErr = 5,
    /// Memory-window bind error.
    MwBindErr = 6,
    /// Bad response.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// Remote invalid request.
    RemInvReqErr = 9,
    /// Remote access error.
    RemAccessErr = 10,
    /// Remote operation error.
    RemOpErr = 11,
    /// Transport retries exceeded.
    RetryExcErr = 12,
    /// RNR retries exceeded.
    RnrRetryExcErr = 13,
    /// Local RDD violation.
    LocRddViolErr = 14,
    /// Remote invalid RD request.
    RemInvRdReqErr = 15,
    /// Remote aborted.
    RemAbortErr = 16,
    /// Invalid EE context number.
    InvEecnErr = 17,
    /// Invalid EE context state.
    InvEecStateErr = 18,
    /// Fatal error.
    FatalErr = 19,
    /// Response timeout.
    RespTimeoutErr = 20,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// The status of an `ibv_wc_status` number (unknown → `GeneralErr`).
    pub fn from_u32(v: u32) -> WcStatus {
        use WcStatus::*;
        const ALL: [WcStatus; 22] = [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
        ];
        ALL.get(v as usize).copied().unwrap_or(GeneralErr)
    }
    /// Whether this is `Success`.
    pub fn is_ok(self) -> bool {
        self == WcStatus::Success
    }
    /// Whether the status reports what the responder did or did not answer (a NAK,
    /// a missing answer): the requester of an unreliable connection never learns it.
    pub fn is_remote(self) -> bool {
        use WcStatus::*;
        matches!(
            self,
            RemInvReqErr | RemAccessErr | RemOpErr | RetryExcErr | RnrRetryExcErr | RemInvRdReqErr | RemAbortErr
        )
    }
}

/// Transport service of a QP (`enum ibv_qp_type`'s connected types).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QpType {
    /// Reliable connected: acknowledged, retried, every operation.
    #[default]
    Rc,
    /// Unreliable connected: SEND, SEND_WITH_IMM, RDMA WRITE (with immediate) only;
    /// nothing is acknowledged, so the requester completes a WR once it has left —
    /// a message the responder refuses (no receive posted, a bad rkey, a receive
    /// too small) is dropped there and never reported back.
    Uc,
    /// Unreliable datagram: SEND / SEND_WITH_IMM of up to [`PORT_MTU`] bytes, each to
    /// the destination its WR names ([`UdDest`]); nothing is acknowledged, a receive
    /// gets the [`grh`] first.
    Ud,
}

/// Completion opcode, numerically equal to `enum ibv_wc_opcode`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcOpcode {
    #[default]
    /// SEND completed.
    Send = 0,
    /// RDMA WRITE completed.
    RdmaWrite = 1,
    /// RDMA READ completed.
    RdmaRead = 2,
    /// Compare-and-swap completed.
    CompSwap = 3,
    /// Fetch-and-add completed.
    FetchAdd = 4,
    /// A RECV consumed by a SEND.
    Recv = 128,
    /// A RECV consumed by a WRITE with immediate.
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// The opcode of an `ibv_wc_opcode` number (unknown → `Send`).
    pub fn from_u32(v: u32) -> WcOpcode {
        match v {
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            3 => WcOpcode::CompSwap,
            4 => WcOpcode::FetchAdd,
            128 => WcOpcode::Recv,
            129 => WcOpcode::RecvRdmaWithImm,
            _ => WcOpcode::Send,
        }
    }
}

/// Work-request opcode (`enum ibv_wr_opcode` numbering via [`WrOpcode::ibv`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOpcode {
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate data (consumes a RECV at the target).
    WriteImm(u32),
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendImm(u32),
    /// RDMA READ.
    Read,
    /// Compare-and-swap on a remote u64.
    CmpSwap {
        /// The value expected at the remote address.
        compare: u64,
        /// The value stored there if it matched.
        swap: u64,
    },
    /// Fetch-and-add on a remote u64.
    FetchAdd {
        /// The addend.
        add: u64,
    },
}

impl WrOpcode {
    /// The `ibv_wr_opcode` value.
    pub fn ibv(&self) -> u32 {
        match self {
            WrOpcode::Write => 0,
            WrOpcode::WriteImm(_) => 1,
            WrOpcode::Send => 2,
            WrOpcode::SendImm(_) => 3,
            WrOpcode::Read => 4,
            WrOpcode::CmpSwap { .. } => 5,
            WrOpcode::FetchAdd { .. } => 6,
        }
    }
    /// The completion opcode this WR produces.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            WrOpcode::Write | WrOpcode::WriteImm(_) => WcOpcode::RdmaWrite,
            WrOpcode::Send | WrOpcode::SendImm(_) => WcOpcode::Send,
            WrOpcode::Read => WcOpcode::RdmaRead,
            WrOpcode::CmpSwap { .. } => WcOpcode::CompSwap,
            WrOpcode::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
    /// Whether this is an atomic (CAS / FADD).
    pub fn is_atomic(&self) -> bool {
        matches!(self, WrOpcode::CmpSwap { .. } | WrOpcode::FetchAdd { .. })
    }
    /// The immediate data, for the `*Imm` opcodes.
    pub fn imm(&self) -> Option<u32> {
        match self {
            WrOpcode::WriteImm(i) | WrOpcode::SendImm(i) => Some(*i),
            _ => None,
        }
    }
}

bitflags! {
    /// MR / QP access flags (`enum ibv_access_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// The local CPU/NIC may write (required with any remote write right).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA WRITE.
        const REMOTE_WRITE = 2;
        /// Peers may RDMA READ.
        const REMOTE_READ = 4;
        /// Peers may run atomics.
        const REMOTE_ATOMIC = 8;
        /// On-demand paging MR (`IBV_ACCESS_ON_DEMAND`): see [`crate::odp`].
        const ON_DEMAND = 1 << 6;
        /// rnic extension, outside the ibv flags: an MR with this bit is reachable
        /// through any QP of its PD whatever that QP's access flags (the MR's own
        /// rights still apply). For the protocol buffers of a layer above the verbs
        /// (NP-RDMA's page-version tables and the temporary MRs of its reverse
        /// operations), which must work on QPs whose application flags grant less.
        const ANY_QP = 1 << 30;
    }
}

bitflags! {
    /// Send flags (`enum ibv_send_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier READs/atomics before starting.
        const FENCE = 1;
        /// Generate a completion on success.
        const SIGNALED = 2;
        /// Ask for a solicited event at the receiver.
        const SOLICITED = 4;
        /// The payload is copied at post time.
        const INLINE = 8;
    }
}

bitflags! {
    /// Work-completion flags (`enum ibv_wc_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        /// A GRH is present (never, here).
        const GRH = 1;
        /// `imm_data` is valid.
        const WITH_IMM = 2;
    }
}

/// Scatter/gather element (`struct ibv_sge`, its C layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    /// Buffer address.
    pub addr: u64,
    /// Buffer length in bytes.
    pub length: u32,
    /// Local key of the MR covering the buffer.
    pub lkey: u32,
}

/// A send work request. With `SendFlags::INLINE` the payload is `inline_data`
/// (copied at post time, no lkey needed) and `sg_list` is ignored.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Local buffers (gather list).
    pub sg_list: &'a [Sge],
    /// The operation.
    pub opcode: WrOpcode,
    /// `SendFlags`.
    pub flags: SendFlags,
    /// Remote address (RDMA and atomic ops).
    pub remote_addr: u64,
    /// Remote key (RDMA and atomic ops).
    pub rkey: u32,
    /// Inline payload (with `SendFlags::INLINE`).
    pub inline_data: &'a [u8],
    /// A UD QP's destination (an address handle's host, its QPN and Q_Key); unused
    /// on connected QPs.
    pub ud: Option<UdDest>,
}

impl<'a> SendWr<'a> {
    /// A signaled WR with the given opcode and no remote address.
    pub fn new(wr_id: u64, opcode: WrOpcode, sg_list: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            sg_list,
            opcode,
            flags: SendFlags::SIGNALED,
            remote_addr: 0,
            rkey: 0,
            inline_data: &[],
            ud: None,
        }
    }
    /// Address a UD send (`ibv_send_wr.wr.ud`).
    pub fn to(mut self, dest: UdDest) -> Self {
        self.ud = Some(dest);
        self
    }
    /// Set the remote address and rkey.
    pub fn remote(mut self, remote_addr: u64, rkey: u32) -> Self {
        self.remote_addr = remote_addr;
        self.rkey = rkey;
        self
    }
    /// Replace the flags.
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.flags = flags;
        self
    }
    /// Make this an inline WR carrying `data`.
    pub fn inline(mut self, data: &'a [u8]) -> Self {
        self.flags |= SendFlags::INLINE;
        self.inline_data = data;
        self
    }
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Buffers the message is scattered into.
    pub sg_list: &'a [Sge],
}

/// A work completion (`struct ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Wc {
    /// The WR's `wr_id`.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Vendor error detail (0 here).
    pub vendor_err: u32,
    /// Bytes received (RECV) or transferred.
    pub byte_len: u32,
    /// Immediate data (with `WcFlags::WITH_IMM`).
    pub imm_data: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Sending QP number (RECV completions).
    pub src_qp: u32,
    /// `WcFlags`.
    pub wc_flags: WcFlags,
}

/// QP states (`enum ibv_qp_state`). SQD/SQE exist for numbering but are not reachable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum QpState {
    #[default]
    /// Reset.
    Reset = 0,
    /// Initialised.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Send queue drained (not reachable).
    Sqd = 4,
    /// Send queue error (not reachable).
    Sqe = 5,
    /// Error: every WR is flushed.
    Err = 6,
}

impl QpState {
    /// The state of an `ibv_qp_state` number (unknown → `Reset`).
    pub fn from_u32(v: u32) -> QpState {
        match v {
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            _ => QpState::Reset,
        }
    }
}

bitflags! {
    /// `enum ibv_qp_attr_mask`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// Sets `qp_state`.
        const STATE = 1;
        /// Sets `cur_qp_state`.
        const CUR_STATE = 1 << 1;
        /// Sets `en_sqd_async_notify`.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// Sets `qp_access_flags`.
        const ACCESS_FLAGS = 1 << 3;
        /// Sets `pkey_index`.
        const PKEY_INDEX = 1 << 4;
        /// Sets `port_num`.
        const PORT = 1 << 5;
        /// Sets `qkey`.
        const QKEY = 1 << 6;
        /// Sets `ah_attr` (here `dest`).
        const AV = 1 << 7;
        /// Sets `path_mtu`.
        const PATH_MTU = 1 << 8;
        /// Sets `timeout`.
        const TIMEOUT = 1 << 9;
        /// Sets `retry_cnt`.
        const RETRY_CNT = 1 << 10;
        /// Sets `rnr_retry`.
        const RNR_RETRY = 1 << 11;
        /// Sets `rq_psn`.
        const RQ_PSN = 1 << 12;
        /// Sets `max_rd_atomic`.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// Sets the alternate path.
        const ALT_PATH = 1 << 14;
        /// Sets `min_rnr_timer`.
        const MIN_RNR_TIMER = 1 << 15;
        /// Sets `sq_psn`.
        const SQ_PSN = 1 << 16;
        /// Sets `max_dest_rd_atomic`.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// Sets `path_mig_state`.
        const PATH_MIG_STATE = 1 << 18;
        /// Sets `cap`.
        const CAP = 1 << 19;
        /// Sets `dest_qp_num`.
        const DEST_QPN = 1 << 20;
    }
}

/// QP attributes for `modify` / `query` (subset of `struct ibv_qp_attr` that the
/// NIC models; the rest is accepted for mask validation and ignored).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    /// Target state.
    pub qp_state: QpState,
    /// Expected current state.
    pub cur_qp_state: QpState,
    /// Remote rights the QP grants (`Access`).
    pub qp_access_flags: Access,
    /// P_Key index (accepted, ignored).
    pub pkey_index: u16,
    /// Port number (1).
    pub port_num: u8,
    /// The remote host (the address vector: what `ibv_ah_attr`'s GID carries).
    pub dest: Option<HostAddr>,
    /// Remote QP number.
    pub dest_qp_num: u32,
    /// Path MTU in bytes (accepted, ignored).
    pub path_mtu: u32,
    /// Receive PSN (accepted, ignored).
    pub rq_psn: u32,
    /// Send PSN (accepted, ignored).
    pub sq_psn: u32,
    /// Outstanding READ/atomic as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding READ/atomic as target.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Transport timeout code.
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// 7 = retry forever.
    pub rnr_retry: u8,
    /// A UD QP's Q_Key: a datagram is received only if it carries this key.
    pub qkey: u32,
}

impl QpAttr {
    /// RESET -> INIT attributes (with the required mask).
    pub fn init(access: Access) -> (QpAttr, QpAttrMask) {
        (
            QpAttr {
                qp_state: QpState::Init,
                qp_access_flags: access,
                port_num: 1,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )
    }
    /// INIT -> RTR attributes connecting to `dest_qpn` on host `dest`.
    pub fn rtr(dest: HostAddr, dest_qpn: u32) -> (QpAttr, QpAttrMask) {
        (
            QpAttr {
                qp_state: QpState::Rtr,
                dest: Some(dest),
                dest_qp_num: dest_qpn,
                path_mtu: 4096,
                max_dest_rd_atomic: 16,
                min_rnr_timer: 1,
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )
    }
    /// RTR -> RTS attributes with the given RNR retry count (7 = infinite).
    pub fn rts(rnr_retry: u8) -> (QpAttr, QpAttrMask) {
        (
            QpAttr {
                qp_state: QpState::Rts,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry,
                max_rd_atomic: 16,
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::MAX_QP_RD_ATOMIC
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::TIMEOUT,
        )
    }
}

/// QP creation attributes.
#[derive(Clone, Copy, Debug)]
pub struct QpInitAttr {
    /// Requested QP number (must be < 2^24 and unused); `None` = automatic (< 2^23).
    pub qpn: Option<u32>,
    /// Send-queue depth.
    pub max_send_wr: u32,
    /// Receive-queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
    /// If false, every send WR generates a completion regardless of SIGNALED.
    pub sq_sig_all: bool,
}

impl Default for QpInitAttr {
    fn default() -> Self {
        QpInitAttr {
            qpn: None,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
            sq_sig_all: false,
        }
    }
}

/// Device attributes (`ibv_query_device` subset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// QPs per host.
    pub max_qp: u32,
    /// WRs per queue.
    pub max_qp_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// CQs per host.
    pub max_cq: u32,
    /// Entries per CQ.
    pub max_cqe: u32,
    /// MRs per host.
    pub max_mr: u32,
    /// PDs per host.
    pub max_pd: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
    /// Outstanding READ/atomic per QP.
    pub max_qp_rd_atom: u32,
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// `IBV_ATOMIC_HCA` (1): atomics are atomic w.r.t. other NIC atomics.
    pub atomic_cap: u32,
    /// DMA atom size (max TLP) in bytes.
    pub max_tlp: u32,
    /// The signature word non-resident pages read as.
    pub signature_magic: u32,
    /// Page size.
    pub page_size: u32,
    /// IOVA pages of the IOMMU.
    pub iova_pages: u64,
}

/// What a peer needs to reach a host: 16 bytes (usable as a GID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostAddr {
    /// The owner's PID.
    pub pid: u32,
    /// The segment's memfd in the owner.
    pub fd: u32,
    /// The host incarnation's nonce.
    pub nonce: u64,
}

impl HostAddr {
    /// The 16-byte wire form (the GID in the verbs shim).
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b
    }
    /// Parse the 16-byte wire form.
    pub fn from_bytes(b: &[u8; 16]) -> HostAddr {
        HostAddr {
            pid: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            fd: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            nonce: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }
    /// Hex form (32 chars), handy for out-of-band exchange.
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The port's MTU in bytes: a UD message longer than this is not sent (its WR still
/// completes successfully, IBA C10-93.1.1, as rxe does).
pub const PORT_MTU: u32 = 4096;

/// Bytes of the global route header a UD receive gets before the payload.
pub const GRH_LEN: usize = 40;

/// Where a UD send goes (`ibv_send_wr.wr.ud`): the host an address handle names,
/// the destination QP and the Q_Key to present (one with the high bit set means
/// the sending QP's own Q_Key, as IB specifies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDest {
    /// The destination host (the address handle's GID).
    pub dest: HostAddr,
    /// Destination QP number.
    pub remote_qpn: u32,
    /// Q_Key to present.
    pub remote_qkey: u32,
}

/// The 40-byte global route header a UD receive starts with, as rxe writes it for
/// RoCE with IPv6-form GIDs: an IPv6 header (version 6, traffic class and flow label
/// 0, payload length = the UDP datagram, next header UDP, hop limit 64), the sender's
/// GID (`sgid`) and the receiver's (`dgid`).
pub fn grh(sgid: &HostAddr, dgid: &HostAddr, payload: u32, imm: bool) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    g[0] = 0x60;
    // UDP header, BTH, DETH, the immediate, the payload and the ICRC.
    let udp = 8 + 12 + 8 + if imm { 4 } else { 0 } + payload + 4;
    g[4..6].copy_from_slice(&(udp.min(0xffff) as u16).to_be_bytes());
    g[6] = 17;
    g[7] = 64;
    g[8..24].copy_from_slice(&sgid.to_bytes());
    g[24..40].copy_from_slice(&dgid.to_bytes());
    g
}

/// IB's RNR NAK timer for the 5-bit `min_rnr_timer` code (IBA table 45, as
/// rxe's `rnrnak_usec`): 0 = 655.36 ms, 1 = 0.01 ms … 31 = 491.52 ms.
pub fn rnr_timer(code: u8) -> std::time::Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
        10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    std::time::Duration::from_micros(u64::from(US[usize::from(code & 31)]))
}
