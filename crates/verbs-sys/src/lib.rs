//! The libibverbs C ABI types, generated once by bindgen from rdma-core 44's
//! `/usr/include/infiniband/verbs.h` (see `ffi_gen.rs`'s header for the command), with
//! bindgen's layout tests, plus the few declarations verbs.h does not carry.
//!
//! Types only, no functions and no link to libibverbs: the two users are
//! `verbs-shim` (libnprdma.so, which *implements* this ABI; it re-exports
//! this crate as its `ffi` module) and `ibverbs-nic` (the NP-RDMA NIC backend
//! that *calls* it through `dlopen`). A crate of its own because verbs-shim
//! is a cdylib only (no rlib to depend on) and the types must be one copy,
//! checked once (`cargo test -p verbs-sys` runs the layout tests).

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    clippy::all,
    clippy::pedantic,
    unnecessary_transmutes,
    unsafe_op_in_unsafe_fn,
    missing_docs,
    clippy::undocumented_unsafe_blocks
)]
mod gen {
    include!("ffi_gen.rs");
}
pub use gen::*;

/// librdmacm's C ABI types (`rdma/rdma_cma.h`: `rdma_cm_id`, `rdma_cm_event`,
/// `rdma_addrinfo`, the socket addresses they embed), generated the same way
/// (see `rdmacm_gen.rs`'s header), over this crate's libibverbs types.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    clippy::all,
    clippy::pedantic,
    unnecessary_transmutes,
    unsafe_op_in_unsafe_fn,
    missing_docs,
    clippy::undocumented_unsafe_blocks
)]
pub mod rdmacm {
    use super::gen::*;
    include!("rdmacm_gen.rs");
}

/// `enum ibv_gid_type_sysfs` (rdma-core's private driver.h): IB / RoCE v1.
pub const IBV_GID_TYPE_SYSFS_IB_ROCE_V1: u32 = 0;
/// `enum ibv_gid_type_sysfs` (rdma-core's private driver.h): RoCE v2.
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: u32 = 1;
