//! Verbs value types: statuses, opcodes, flags, work requests, work completions and
//! QP attributes. Numeric values equal libibverbs' enums so a C shim maps 1:1.

use bitflags::bitflags;

/// Completion status, numerically equal to `enum ibv_wc_status`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcStatus {
    #[default]
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

impl WcStatus {
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
    pub fn is_ok(self) -> bool {
        self == WcStatus::Success
    }
}

/// Completion opcode, numerically equal to `enum ibv_wc_opcode`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcOpcode {
    #[default]
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
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
    Write,
    WriteImm(u32),
    Send,
    SendImm(u32),
    Read,
    CmpSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
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
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            WrOpcode::Write | WrOpcode::WriteImm(_) => WcOpcode::RdmaWrite,
            WrOpcode::Send | WrOpcode::SendImm(_) => WcOpcode::Send,
            WrOpcode::Read => WcOpcode::RdmaRead,
            WrOpcode::CmpSwap { .. } => WcOpcode::CompSwap,
            WrOpcode::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
    pub fn is_atomic(&self) -> bool {
        matches!(self, WrOpcode::CmpSwap { .. } | WrOpcode::FetchAdd { .. })
    }
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
        const LOCAL_WRITE = 1;
        const REMOTE_WRITE = 2;
        const REMOTE_READ = 4;
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
        const FENCE = 1;
        const SIGNALED = 2;
        const SOLICITED = 4;
        const INLINE = 8;
    }
}

bitflags! {
    /// Work-completion flags (`enum ibv_wc_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        const GRH = 1;
        const WITH_IMM = 2;
    }
}

/// Scatter/gather element (`struct ibv_sge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A send work request. With `SendFlags::INLINE` the payload is `inline_data`
/// (copied at post time, no lkey needed) and `sg_list` is ignored.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
    pub opcode: WrOpcode,
    pub flags: SendFlags,
    pub remote_addr: u64,
    pub rkey: u32,
    pub inline_data: &'a [u8],
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
        }
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
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

/// A work completion (`struct ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: WcFlags,
}

/// QP states (`enum ibv_qp_state`). SQD/SQE exist for numbering but are not reachable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum QpState {
    #[default]
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Sqd = 4,
    Sqe = 5,
    Err = 6,
}

impl QpState {
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
        const STATE = 1;
        const CUR_STATE = 1 << 1;
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        const ACCESS_FLAGS = 1 << 3;
        const PKEY_INDEX = 1 << 4;
        const PORT = 1 << 5;
        const QKEY = 1 << 6;
        const AV = 1 << 7;
        const PATH_MTU = 1 << 8;
        const TIMEOUT = 1 << 9;
        const RETRY_CNT = 1 << 10;
        const RNR_RETRY = 1 << 11;
        const RQ_PSN = 1 << 12;
        const MAX_QP_RD_ATOMIC = 1 << 13;
        const ALT_PATH = 1 << 14;
        const MIN_RNR_TIMER = 1 << 15;
        const SQ_PSN = 1 << 16;
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        const PATH_MIG_STATE = 1 << 18;
        const CAP = 1 << 19;
        const DEST_QPN = 1 << 20;
    }
}

/// QP attributes for `modify` / `query` (subset of `struct ibv_qp_attr` that the
/// NIC models; the rest is accepted for mask validation and ignored).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    pub qp_state: QpState,
    pub cur_qp_state: QpState,
    pub qp_access_flags: Access,
    pub pkey_index: u16,
    pub port_num: u8,
    /// The remote host (the address vector: what `ibv_ah_attr`'s GID carries).
    pub dest: Option<crate::HostAddr>,
    pub dest_qp_num: u32,
    pub path_mtu: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    /// 7 = retry forever.
    pub rnr_retry: u8,
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
    pub fn rtr(dest: crate::HostAddr, dest_qpn: u32) -> (QpAttr, QpAttrMask) {
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
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
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
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_inline_data: u32,
    pub max_qp_rd_atom: u32,
    pub max_mr_size: u64,
    /// `IBV_ATOMIC_HCA` (1): atomics are atomic w.r.t. other NIC atomics.
    pub atomic_cap: u32,
    pub max_tlp: u32,
    pub signature_magic: u32,
    pub page_size: u32,
    pub iova_pages: u64,
}
