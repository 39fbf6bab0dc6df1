//! # ibverbs-nic — NP-RDMA's NIC backend over any libibverbs provider
//!
//! [`VerbsNic`] implements the engine's NIC seam ([`nprdma::nic::Nic`],
//! [`nprdma::nic::NicQp`], [`nprdma::nic::NicCq`], [`nprdma::nic::NicMr`],
//! [`nprdma::nic::NicBuf`] and [`nprdma::engine::Backend`]) over a device
//! that rdma-core's libibverbs drives (a ConnectX NIC, Soft-RoCE `rxe`),
//! **without IOMMU control**: [`nprdma::nic::Nic::iommu`] is `None` (the
//! capability type [`NoIommu`] is uninhabited), the device's ODP is not
//! used. This is the substrate of the paper's user-space mode ("we always
//! use the two-sided approach, and register standard MRs on the fly").
//!
//! * **Loaded at run time.** `dlopen` of the library named by
//!   [`Config::lib`], else the environment's `NPRDMA_VERBS_LIB`, else
//!   `libibverbs.so.1` ([`dl`]); nothing links libibverbs at build time.
//!   Tests point it at this repository's own `libnprdma.so` in pinned mode
//!   (the software NIC exposed through the libibverbs C ABI) — there is no
//!   RDMA hardware on the build machine.
//! * **Data path as libibverbs' inlines.** `post_send`, `post_recv`,
//!   `poll_cq` and `req_notify_cq` jump through the context's `ops` table,
//!   as verbs.h's `static inline` functions do (they are not exported
//!   symbols of libibverbs); control verbs are `dlsym`'d.
//! * **Bad input.** A device lacking what the backend needs (RC QPs,
//!   [`Config::min_qp_wr`] WRs, [`Config::min_sge`] SGEs,
//!   [`Config::min_cqe`] CQ entries, an active RoCE port with a GID) is
//!   refused by [`VerbsNic::open`] with [`Error::Unsupported`] naming it,
//!   nothing left open. A failed registration (ENOMEM, RLIMIT_MEMLOCK) is
//!   an error, counted in [`VerbsStats::reg_failures`], nothing registered.
//! * **Limits.** Peers are addressed by GID only ([`nprdma::nic::PeerAddr`]
//!   is 16 bytes): RoCE (Ethernet link layer), not InfiniBand LIDs. The
//!   device numbers its QPs ([`nprdma::nic::QpSpec::qpn`] must be `None`).
//!   [`nprdma::nic::Access::ANY_QP`] cannot be honoured: a hardware QP
//!   checks its own access flags before any MR's.
//!
//! ## Binding decision: the project's own bindgen types, not a binding crate
//!
//! * **sideway** (RDMA-Rust/sideway, maintained, MPL-2.0) sits on
//!   `rdma-mummy-sys`, which builds a stub ("mummy") rdma-core with CMake
//!   and Clang at build time and resolves the real libibverbs when the
//!   program runs: the library it reaches is the system's, by its fixed
//!   name — not a path chosen per context, which the tests need to reach
//!   `libnprdma.so` while the test process itself must not be preloaded.
//!   Its focus is the `ibv_wr_*` / `ibv_start_poll` API (the classic
//!   `ibv_post_send` path "wrapped, with no performance guarantee"), and it
//!   adds a C toolchain (cmake, clang) to the build and a second copy of
//!   the verbs types beside the committed ones.
//! * **rust-ibverbs** (jonhoo/rust-ibverbs, `ibverbs-sys`) links libibverbs
//!   at build time (building a vendored rdma-core with CMake): no run-time
//!   choice of library at all, and every build of the workspace would need
//!   rdma-core's build dependencies.
//! * **The committed bindgen types** (`verbs-sys`, generated once from
//!   rdma-core 44's verbs.h, with bindgen's layout tests) are already what
//!   libnprdma.so implements and is tested against. With ~20 `dlsym`'d
//!   functions and the `ops` table they are the whole binding, need no C
//!   toolchain, and let the library be any path. So: `verbs-sys` (the
//!   types moved out of verbs-shim, a cdylib other crates cannot depend
//!   on) + `dlopen` here.
//!
//! ## With the engine: user-space mode
//! `nprdma::Context::with_nic(VerbsNic::open(&cfg)?, &pager, config)` runs
//! NP-RDMA in the paper's user-space mode (see `nprdma::engine`): every
//! READ/WRITE two-sided over MRs registered on the fly (and kept in the
//! engine's bounded registration cache, `Config::reg_cache_bytes`), the
//! control rings the long-lived registrations. Peers exchange
//! `nprdma::Endpoint`s with `ctrl_qpn` set (the device numbers QPs), or,
//! with `nprdma::Config::ctrl_on_data_qp` on both sides, only the data QPN
//! (the control channel rides on the data QP: what libnprdma.so does with
//! `NPRDMA_DEVICE=verbs`, loading the library isolated, [`Config::isolated`]).
//!
//! ## Tests (over libnprdma.so, built by the tests like verbs-shim's own)
//! `tests/contract.rs`: the `nic` verbs contract, owned buffers,
//! capability refusals at open, a registration failed by RLIMIT_MEMLOCK
//! without leaks. `tests/user_space.rs`: two engines in user-space mode —
//! READ/WRITE/WRITE_IMM/atomics/SEND over untouched and swapped-out
//! memory, the registration cache's hit rate against its budget and its
//! invalidation before swap-out, QP access flags, randomized operations
//! under memory pressure against a model (`NPRDMA_CHAOS_OPS`).
//! `tests/xproc.rs`: user-space mode across two processes (the target a
//! child with its own libnprdma.so device, the shared-memory transport). A test
//! skips when libnprdma.so cannot be built, and fails instead under
//! `NPRDMA_REQUIRE_ALL=1` (as in CI).
//!
//! ## Layout (one job per file)
//! [`dl`] (library loading, the verbs table) → [`mr`] (MRs, owned
//! buffers) → [`cq`] (CQs, completion conversion) → [`qp`] (QPs, WR
//! conversion, connection) → [`iommu`] (the absent capability) →
//! [`device`] (opening, capability checks, the `Nic` and `Backend` impls).

pub mod cq;
pub mod device;
pub mod dl;
pub mod iommu;
pub mod mr;
pub mod qp;

pub use cq::VerbsCq;
pub use device::{Config, VerbsNic, VerbsStats};
pub use iommu::{NoIommu, NoRange};
pub use mr::{VerbsBuf, VerbsMr};
pub use qp::VerbsQp;

/// The backend's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The library could not be loaded.
    #[error("cannot load {lib}: {msg}")]
    Load {
        /// The path or name tried.
        lib: String,
        /// `dlerror`'s message.
        msg: String,
    },
    /// The library lacks a verb the backend calls.
    #[error("{lib} does not export {sym}")]
    Symbol {
        /// The library.
        lib: String,
        /// The missing symbol.
        sym: &'static str,
    },
    /// No (such) device.
    #[error("{0}")]
    NoDevice(String),
    /// The device lacks a capability the backend needs.
    #[error("RDMA device {device} is not usable by NP-RDMA: {what}")]
    Unsupported {
        /// The device's name.
        device: String,
        /// What it lacks.
        what: String,
    },
    /// A verb failed.
    #[error("{verb}: {source}")]
    Verb {
        /// The verb.
        verb: &'static str,
        /// Its errno.
        #[source]
        source: std::io::Error,
    },
    /// An argument the backend cannot pass on.
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
}
