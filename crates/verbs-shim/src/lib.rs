//! # libnprdma.so — the libibverbs C ABI for `LD_PRELOAD`
//!
//! Unmodified libibverbs applications (perftest, ibverbs-utils) run on the project's
//! software RNIC when started with `LD_PRELOAD=…/libnprdma.so`: the library exports the
//! `ibv_*` functions those binaries import (unversioned exports satisfy their versioned
//! references; `tests/exports.rs` checks the list against the installed binaries) and
//! hands out a `verbs_context` (`abi_compat = UINTPTR_MAX`, `sz` = the whole struct)
//! whose data-path ops (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`,
//! `post_srq_recv`) and extended ops (`query_port`, `query_device_ex`, `create_qp_ex`, `create_cq_ex`)
//! point into it.
//!
//! * One device `nprdma0` (vendor 0x4e50, part 1: perftest uses `ibv_post_send`), one
//!   port, active, Ethernet link layer (RoCE-like). GID 0 is the process NIC's 16-byte
//!   rnic `HostAddr`, so the applications' own GID exchange carries it; entries 1..
//!   of the 32-entry GID table are the host's IP addresses as RoCE v2 GIDs
//!   (IPv4-mapped, loopback last: `netif`). The port has a LID of the host's subnet
//!   (`rnic::subnet`: one per device of this user on the machine, its QP numbers from
//!   the LID's range), so an address vector reaches a port by LID (no GRH: qperf,
//!   `ibv_rc_pingpong` without `-g`), by GID 0, or by an IP GID with the destination
//!   QP number (`gid`); UD address handles by IP GID resolve per datagram;
//!   `wc.slid` is the sender's LID.
//! * QP limits: pinned mode grants rxe's 16384 WRs and 32 SGEs per queue, 1024 B
//!   inline; NP-RDMA mode 1024 WRs (`max_qp_wr`), 16 SGEs, 1024 B; the granted caps
//!   are written back; a request past a limit fails with EINVAL without a message
//!   (libfabric's verbs provider searches `max_inline_data` by asking).
//! * `ibv_get_cq_event` fails with EINTR when a signal handler without `SA_RESTART`
//!   interrupted its wait (as libibverbs' `read` of the channel fd would).
//! * The device node `/dev/infiniband/uverbs0` (`dev_name` `uverbs0`), which
//!   middleware checks before opening a device (UCX's uct_ib: a character device the
//!   caller may read and write), is answered for by the interposed `stat`, `stat64`,
//!   `__xstat`, `__xstat64` and `access` (a uverbs node, 231:192, mode 0666): no node
//!   exists, and an unprivileged process could create none (see `devnode`). So UCX
//!   lists the `ib` memory domain `nprdma0` with `rc_verbs` (both modes) and `ud_verbs`
//!   (pinned mode) on `nprdma0:1` (`tests/ucx.rs`).
//! * One NIC per process, created at the first `ibv_open_device`, shared-memory
//!   transport (two processes talk); remote READ/WRITE/atomics progress without any
//!   verbs call by the passive side (rnic's NIC thread / initiator-side DMA).
//! * Classic `ibv_post_send` path and the `ibv_qp_ex` builder (`ibv_create_qp_ex` with
//!   `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`, `ibv_wr_start` .. `ibv_wr_complete`).
//! * Completion channels (`ibv_get_cq_event`, blocking or O_NONBLOCK), `ibv_ack_cq_events`.
//! * librdmacm's API (`rdma_cm`: rping, perftest `-R`, rdmacm-utils, libfabric's verbs
//!   MSG endpoints; both modes; see `rdmacm`).
//! * Extended CQs (`ibv_create_cq_ex`, IBV_WC_STANDARD_FLAGS, `ibv_start_poll` ..
//!   `ibv_end_poll`, `ibv_wc_read_*`; see `cq_ex`).
//! * `cmd_fd` is a real (private memfd) fd; `ibv_fork_init` succeeds and
//!   `ibv_is_fork_initialized` says IBV_FORK_UNNEEDED (memory is reached by virtual
//!   address). Pinned mode charges MRs against `RLIMIT_MEMLOCK` like `ib_umem_get`.
//!   A child made by `fork()` cannot use its parent's contexts (as on any device);
//!   the first device, CM context or CM reactor it asks for is its own
//!   (`per_process`), so a forked child (Python's multiprocessing) opens devices and
//!   connects as a new process does.
//! * `ibv_import_device` on a dup of a context's `cmd_fd`, `ibv_import_pd` /
//!   `ibv_import_mr` by handle (any context of the process), `ibv_unimport_*`.
//! * RC and UC QPs (UC: SEND/WRITE only, nothing acknowledged — what the responder
//!   refuses is dropped there and the WR completes successfully), in both modes.
//! * UD QPs in both modes (`ibv_create_qp[_ex]` with `IBV_QPT_UD`, SEND /
//!   SEND_WITH_IMM, `wr.ud` and `ibv_wr_set_ud_addr`): address handles
//!   (`ibv_create_ah` needs `is_global`, port 1, sgid index 0 and the GID of a
//!   reachable device, else EINVAL; `ibv_init_ah_from_wc`, `ibv_create_ah_from_wc`,
//!   `ibv_destroy_ah`), the Q_Key in `ibv_modify_qp` / `ibv_query_qp`, receives with
//!   the 40-byte GRH first (`IBV_WC_GRH`, `src_qp`); rxe's rules (see rnic's "QP
//!   types"). In NP-RDMA mode a UD QP is the NIC's own, its WRs' pages pinned from
//!   post to completion (`backend/np_ud.rs`), up to 4096 WRs per queue (more than
//!   RC's `max_qp_wr`); its user-space mode (`NPRDMA_DEVICE=verbs`) refuses UD QPs
//!   and AHs (EOPNOTSUPP).
//! * Shared receive queues (`ibv_create_srq`, `ibv_post_srq_recv`, `ibv_query_srq`,
//!   `ibv_destroy_srq`; QPs created with `srq`), in both modes (one SGE per WQE in
//!   NP-RDMA mode). A QP on an SRQ moved to ERR posts `IBV_EVENT_QP_LAST_WQE_REACHED`
//!   (`ibv_get_async_event`; the async fd is readable while events are queued;
//!   `ibv_destroy_qp` drops the QP's events not yet taken and waits until those taken
//!   are acknowledged with `ibv_ack_async_event`, as libibverbs does). SRQ
//!   limit events are not generated, so an SRQ limit (`srq_limit`) is refused
//!   (EOPNOTSUPP), and so is resizing (`IBV_SRQ_MAX_WR`, EINVAL, as mlx5).
//! * `ibv_rereg_mr` (PD, range and access; keys kept, the NIC fenced off the old
//!   registration first) in pinned mode; in NP-RDMA mode a new PD or access in
//!   place (keys kept), a new range as a new registration (new keys). A QP moved to
//!   RESET takes its queued completions out of its CQs (as mlx5), in both modes.
//! * `ibv_resize_cq` (rxe's rules: not below the completions waiting; pinned mode
//!   up to twice the created size or 64 entries, ENOMEM beyond).
//! * Unsupported verbs/options (UD/AH in NP-RDMA's user-space mode, multicast, MW, ECE, DM,
//!   MR iova != addr, ODP in pinned mode / other access flags, unknown send flags/opcodes, rate limits,
//!   alternate paths, rdma_cm multicast and ECE) print `libnprdma: <verb>: …` on stderr and return the
//!   errno libibverbs would (`EOPNOTSUPP`/`EINVAL`/`EBUSY`).
//!
//! ## Environment
//! * `NPRDMA_MODE` — backend: `pinned` (default) = standard RDMA on the software RNIC;
//!   `nprdma` (also `np`, `np-rdma`) = NP-RDMA (see below); unknown values fail
//!   `ibv_open_device`.
//! * `NPRDMA_DEVICE` — NP-RDMA mode's device: `soft` (default, the software RNIC) or
//!   `verbs` (the next libibverbs; see "NP-RDMA over any RDMA device" below).
//! * `NPRDMA_TRUSTED_PEERS=1` — the labelled opt-in to the direct path between trusting
//!   processes (set it on both sides): initiators copy into this process with
//!   `process_vm_*`, which it allows to any process (`PR_SET_PTRACER_ANY`). Default:
//!   target-enforced protection — every request of a peer is checked and executed by
//!   this process's own NIC thread, and nothing else of it is reachable.
//! * `NPRDMA_RING_MAX` (bytes; default 64 KiB, with trusted peers 8), `NPRDMA_NIC_SPIN_US`
//!   (default 0; a window applies only once no application thread polled a CQ for 1 ms),
//!   `NPRDMA_DMA_HELP` (default 1): the NIC's request-ring slot size,
//!   NIC-thread spin window and large-transfer sharing (see
//!   [`backend::host_config_from_env`]).
//! * `NPRDMA_TRACE` — log the sysfs reads applications attempt.
//! * `NPRDMA_STATS=1` — at exit, one `nprdma-stats: key=value …` line on stderr (mode;
//!   in NP-RDMA mode also the pager's budget/swap-outs/swap-ins/major faults, the
//!   engine's optimistic/two-sided/served counts and the NIC's `nonresident_dma`).
//!
//! ## NP-RDMA mode (`NPRDMA_MODE=nprdma`)
//! Same device, port and GID as pinned mode (plus explicit ODP on RC QPs:
//! `IBV_ACCESS_ON_DEMAND`, `odp_caps`, `ibv_advise_mr` prefetch — its MRs are never
//! pinned anyway), over the `nprdma` layer and one
//! process-wide `vmem` pager: `ibv_reg_mr` registers the application's own buffer
//! (malloc'd or mmapped private anonymous memory) with the pager and the layer, never
//! pinning it (memory the pager cannot page — hugetlbfs, file mappings outside tmpfs —
//! is taken as a pinning NIC takes it: always resident, let go of before its munmap;
//! in both modes a registration that lets anyone write refuses memory not mapped
//! writable with EFAULT, as `ib_umem_get` does); QPs, CQs and completion channels (the
//! layer's eventfd) are the layer's;
//! `ibv_modify_qp(INIT->RTR)` connects to the address vector's port (see above).
//! Limits: SGE lists up to 16 (`max_sge`; the layer's WRs carry one SGE, so a list
//! goes through a bounce buffer: gathered at post, scattered when the completion is
//! polled — see `backend::np_sgl`), inline payloads up to 1024 bytes (staged in a
//! per-QP registered buffer; nothing posted after an inline WR issues before it
//! finishes), QP depth up to 1024 (`max_qp_wr`), 256 QPs and 4096 MRs per process
//! (what `ibv_query_device` advertises), the target QP's `qp_access_flags` enforced
//! as by a NIC (REM_INV_REQ_ERR), QP state
//! RESET→INIT→RTR→RTS, any state → ERR (`nprdma::Qp::set_error`: every outstanding
//! WR and posted RECV completes once with WR_FLUSH_ERR; later posts are accepted and
//! flushed, as with rdma-core providers; `ibv_query_qp` reports ERR) and any state →
//! RESET (`nprdma::Qp::reset`: the same QP number, connected again at the next RTR;
//! what was outstanding goes without a completion, as on hardware); not SQD.
//! Solicited-only notification (`IBV_SEND_SOLICITED`), and RC's receiver-not-ready
//! rule: a SEND or WRITE_WITH_IMM that finds no posted RECV waits at the receiver for
//! the sender's `rnr_retry` × the receiver's `min_rnr_timer` (7 = forever), then
//! completes with RNR_RETRY_EXC_ERR (checked by `tests/c/*.c` in every mode). A
//! receiver's error completion (LOC_LEN_ERR, LOC_PROT_ERR) moves the receiving QP to
//! ERR, as on rxe. Settings:
//! * `NPRDMA_BUDGET_PAGES` or `NPRDMA_BUDGET_MB` — the pager's resident budget for
//!   registered memory (default unlimited). Below the size of the MRs, pages are
//!   swapped out and back during the run.
//! * `NPRDMA_SWAP_PATH` (default: an unlinked file in the temp dir), `NPRDMA_SWAP_MB`
//!   (default 1024, sparse) — the swap file.
//! * `NPRDMA_LOG` — what the libraries log to stderr (an env-filter directive:
//!   `warn`, `nprdma=debug`, ...; default `error`).
//! * `NPRDMA_SWAP_BUFFERED=1` — swap through the page cache (default: O_DIRECT, so a
//!   major fault reads the device, as Linux swap does).
//! * With `NPRDMA_TRUSTED_PEERS=1`, `NPRDMA_RING_MAX` defaults to 0 in this mode (atomics
//!   run on the target CPU, so every READ/WRITE, version READs included, is copied by
//!   the initiator itself).
//! * `NPRDMA_PAGER_SPIN_US` (default 50) — fault-thread polling after a fault.
//! * `NPRDMA_EAGER_SWAP_IN` (default 1) — pages the pager brings in (CPU fault, pin,
//!   prefetch) are mapped into the NIC's views in the same pass; `0` maps them on first
//!   RDMA access (two-sided), as Linux/the paper do.
//! * `NPRDMA_FAULT_AROUND_PAGES` (default 16 = 64 KiB, at most budget / 8) —
//!   never-touched pages filled together on a first touch; `0` off.
//! * `NPRDMA_FAULT_AROUND_MAX_PAGES` (default 512 = 2 MiB, at most budget / 8) — the run
//!   doubles up to this while first touches come in order; `0` no growth.
//! * `NPRDMA_RING_TAKEOVER=1` — the engine's polling thread, once blocked, takes the
//!   request rings back when peers' requests come (`np::Config::ring_takeover`).
//! * `NPRDMA_POLL_SPIN_US` (default 50), `NPRDMA_INTERRUPT=1` — the engine's polling
//!   thread: spin window after work / never spin.
//! * `NPRDMA_WRITE_VERSION_THRESHOLD` (bytes, default 0) — WRITEs up to this size are
//!   checked by reading the written range back, which needs REMOTE_READ on the target
//!   MR; longer ones (all, by default) by the remote page versions, which works with
//!   the write-only MRs applications register (perftest's WRITE tests).
//!
//! ## NP-RDMA over any RDMA device (`NPRDMA_DEVICE=verbs`)
//! With `NPRDMA_MODE=nprdma NPRDMA_DEVICE=verbs`, the NP-RDMA engine runs over the
//! *next* libibverbs of the process (crate `ibverbs-nic`, `dlopen`ed) instead of the
//! software NIC: the paper's user-space mode (no IOMMU control: every READ/WRITE
//! two-sided, MRs registered on the fly at the device, a bounded registration cache),
//! so unmodified programs on an rxe or ConnectX device use non-pinned memory. GID 0
//! is the device's GID (`NPRDMA_VERBS_GID_INDEX`); each QP's control channel rides
//! on its data QP (the program exchanges only the data QPN; both sides must run this
//! way). The software NIC stays the default device (`NPRDMA_DEVICE` unset or
//! `soft`). Settings (see `backend::np_verbs`):
//! * `NPRDMA_VERBS_LIB` — the library (default `libibverbs.so.1`, loaded into a new
//!   link-map namespace, `dlmopen`, so that its internal calls to its own exports do
//!   not reach this library's).
//!   Another copy of libnprdma.so at another path serves as a device too (the tests'
//!   chain): it is told through its exported `nprdma_shim_as_device` to ignore
//!   `NPRDMA_MODE`/`NPRDMA_DEVICE` and run in `NPRDMA_VERBS_MODE` (default `pinned`).
//! * `NPRDMA_VERBS_DEVICE` (default the first), `NPRDMA_VERBS_PORT` (default 1),
//!   `NPRDMA_VERBS_GID_INDEX` (default 0).
//! * `NPRDMA_STATS=1` adds the registration cache's hits/misses and the device's
//!   registration counters (`verbs_regs`, `verbs_reg_failures`, ...).
//!
//! Modules: [`ffi`] (bindgen types + layout tests: the `verbs-sys` crate), [`backend`] (internal verbs
//! interface, `pinned`, `np` + `np_env` + `np_sgl`: NP-RDMA mode, `np_verbs`: its libibverbs device), [`error`], `objects` (C-visible objects, entry guard), `device`
//! (device/port/GID verbs), `devnode` (the device node's `stat`/`access`), `strs` (enum strings), `resources` (PD/MR/CQ/channel/QP verbs, refusals),
//! `netif` (the host's IPs as GIDs), `gid` (GID table, LIDs, what an address vector names), `ah` (address handles), `datapath` (context ops), `qp_ex` (`ibv_wr_*` builder), `cq_ex` (extended CQs), `convert` (C <-> backend),
//! `rdmacm` (librdmacm's API: event channels, ids, connect/accept/disconnect over a
//! CM of our own, one TCP stream per connection on the rdma_cm port; see its module doc).

#[cfg(test)]
mod abi_tests;
mod ah;
pub mod backend;
mod convert;
mod cq_ex;
mod datapath;
mod device;
mod devnode;
pub mod error;
#[cfg(test)]
mod fault_tests;
/// The libibverbs C ABI types (the `verbs-sys` crate).
pub use verbs_sys as ffi;
mod gid;
mod logging;
mod maps;
mod netif;
mod objects;
mod per_process;
mod qp_ex;
mod rdmacm;
mod resources;
mod strs;
mod unmap;
