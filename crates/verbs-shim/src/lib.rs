//! # libnprdma.so — the libibverbs C ABI for `LD_PRELOAD`
//!
//! Unmodified libibverbs applications (perftest, ibverbs-utils) run on the project's
//! software RNIC when started with `LD_PRELOAD=…/libnprdma.so`: the library exports the
//! `ibv_*` functions those binaries import (unversioned exports satisfy their versioned
//! references) and hands out a `verbs_context` whose data-path ops
//! (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`, `post_srq_recv`) and extended
//! ops (`query_port`, `query_device_ex`) point into it (`abi_compat = UINTPTR_MAX`).
//!
//! * One device `nprdma0`, one port, active, Ethernet link layer (RoCE-like). GID 0 is
//!   the process NIC's 16-byte rnic `HostAddr`, so the applications' own GID exchange
//!   carries it; `ibv_modify_qp(RTR)` connects to (GID, dest_qp_num).
//! * One NIC per process, created at the first `ibv_open_device` with the shared-memory
//!   transport, so two processes talk; remote READ/WRITE progress without any verbs
//!   call by the passive side (rnic's NIC thread / initiator-side DMA).
//! * `NPRDMA_MODE` selects the [`backend`]: `pinned` (default) = standard RDMA on
//!   the software RNIC. Unknown or unavailable modes fail `ibv_open_device` clearly.
//! * Unsupported verbs/options (SRQ, UD/AH, multicast, ECE, rereg/resize, extended QPs,
//!   MR iova != addr, unknown access/send flags or opcodes) print `libnprdma: …` on
//!   stderr and return the errno libibverbs would (`EOPNOTSUPP`/`EINVAL`).
//!
//! Modules: [`ffi`] (bindgen types), [`backend`] (internal verbs interface + pinned),
//! `objects` (C-visible objects, entry guard), `device` (device/port/GID verbs),
//! `resources` (PD/MR/CQ/channel/QP verbs), `datapath` (ops), `convert` (C <-> backend).

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
