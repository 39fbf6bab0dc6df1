//! # libnprdma.so — the libibverbs C ABI for `LD_PRELOAD`
//!
//! Unmodified libibverbs applications (perftest, ibverbs-utils) run on the project's
//! software RNIC when started with `LD_PRELOAD=…/libnprdma.so`: the library exports the
//! `ibv_*` functions those binaries import (unversioned exports satisfy their versioned
//! references; `tests/exports.rs` checks the list against the installed binaries) and
//! hands out a `verbs_context` (`abi_compat = UINTPTR_MAX`, `sz` = the whole struct)
//! whose data-path ops (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`,
//! `post_srq_recv`) and extended ops (`query_port`, `query_device_ex`, `create_qp_ex`)
//! point into it.
//!
//! * One device `nprdma0` (vendor 0x4e50, part 1: perftest uses `ibv_post_send`), one
//!   port, active, Ethernet link layer (RoCE-like). GID 0 is the process NIC's 16-byte
//!   rnic `HostAddr`, so the applications' own GID exchange carries it;
//!   `ibv_modify_qp(RTR)` connects to (GID, dest_qp_num). An address vector without GRH
//!   is refused (e.g. `ibv_rc_pingpong` needs `-g 0`).
//! * One NIC per process, created at the first `ibv_open_device`, shared-memory
//!   transport (two processes talk); remote READ/WRITE/atomics progress without any
//!   verbs call by the passive side (rnic's NIC thread / initiator-side DMA).
//! * Classic `ibv_post_send` path and the `ibv_qp_ex` builder (`ibv_create_qp_ex` with
//!   `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`, `ibv_wr_start` .. `ibv_wr_complete`).
//! * Completion channels (`ibv_get_cq_event`, blocking or O_NONBLOCK), `ibv_ack_cq_events`.
//! * Unsupported verbs/options (SRQ, UD/AH, multicast, MW, ECE, rereg/resize, imports,
//!   MR iova != addr, ODP/other access flags, unknown send flags/opcodes, rate limits,
//!   alternate paths, rdma_cm) print `libnprdma: <verb>: …` on stderr and return the
//!   errno libibverbs would (`EOPNOTSUPP`/`EINVAL`/`EBUSY`).
//!
//! ## Environment
//! * `NPRDMA_MODE` — backend: `pinned` (default) = standard RDMA on the software RNIC.
//!   `nprdma` (NP-RDMA) is not available yet; unknown values fail `ibv_open_device`.
//! * `NPRDMA_RING_MAX` (bytes, default 8), `NPRDMA_NIC_SPIN_US` (default 0),
//!   `NPRDMA_DMA_HELP` (default 1): the NIC's request-ring size, NIC-thread spin window
//!   and large-transfer sharing (see [`backend::host_config_from_env`]).
//! * `NPRDMA_TRACE` — log the sysfs reads applications attempt.
//!
//! Modules: [`ffi`] (bindgen types + layout tests), [`backend`] (internal verbs
//! interface, `pinned`), [`error`], `objects` (C-visible objects, entry guard), `device`
//! (device/port/GID verbs), `resources` (PD/MR/CQ/channel/QP verbs, refusals),
//! `datapath` (context ops), `qp_ex` (`ibv_wr_*` builder), `convert` (C <-> backend),
//! `rdmacm` (rdma_cm refusal).

#[cfg(test)]
mod abi_tests;
pub mod backend;
mod convert;
mod datapath;
mod device;
pub mod error;
pub mod ffi;
mod objects;
mod qp_ex;
mod rdmacm;
mod resources;
