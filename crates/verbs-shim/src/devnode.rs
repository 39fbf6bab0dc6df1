//! The device's node, `/dev/infiniband/<dev_name>`, as `stat` and `access` see it:
//! the C library's `stat` family and `access`, interposed for that one path.
//!
//! Middleware checks that a device is usable by its character device before opening
//! it: UCX 1.13's `uct_ib_device_is_accessible` (src/uct/ib/base/ib_md.c:1158) skips
//! every device whose `/dev/infiniband/<ibv_device.dev_name>` is not a character
//! device readable and writable by the caller (`stat`, `S_ISCHR`, `access(R_OK|W_OK)`;
//! the `/dev/infiniband/` prefix is compiled in). This device has no kernel node —
//! `ibv_open_device` needs none (its `cmd_fd` is a memfd) — and an unprivileged
//! process can neither create `/dev/infiniband` nor make a character device
//! (`mknod` needs CAP_MKNOD), so no file the library could create (under /dev/shm
//! or elsewhere) passes that check. Instead the path answers here as the kernel's
//! uverbs node answers: a character device, major 231 minor 192 (uverbs0), mode
//! 0666, owned by root. Every other path goes to the C library's `fstatat` /
//! `faccessat` unchanged. Only these calls see the node: opening it fails
//! (ENOENT), as nothing but libibverbs (this library) would open it. A process's
//! libibverbs is this library, so a real `uverbs0` of the host, if any, stands for
//! no device of the process: answering for our own is what the process should see.

use crate::device::DEV_NODE;
use std::ffi::{c_char, c_int, CStr};

/// The uverbs character devices' major number and first minor (Linux's
/// `IB_UVERBS_MAJOR`, `IB_UVERBS_BASE_MINOR`).
const UVERBS_MAJOR: u32 = 231;
const UVERBS_BASE_MINOR: u32 = 192;

/// Whether `path` (a C string or NULL) names the device node.
fn is_node(path: *const c_char) -> bool {
    if path.is_null() {
        return false;
    }
    // SAFETY: the caller passes a NUL-terminated path (stat/access contract).
    unsafe { CStr::from_ptr(path) }.to_bytes() == DEV_NODE.as_bytes()
}

/// Fills `buf` as the kernel's stat of the uverbs0 node would (apart from times).
///
/// # Safety
/// `buf` must be writable `struct stat` memory.
unsafe fn fill_node_stat(buf: *mut libc::stat) -> c_int {
    if buf.is_null() {
        crate::error::set_errno(libc::EFAULT);
        return -1;
    }
    // SAFETY: struct stat is plain C data (all-zero valid).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_mode = libc::S_IFCHR | 0o666;
    st.st_nlink = 1;
    st.st_rdev = libc::makedev(UVERBS_MAJOR, UVERBS_BASE_MINOR);
    st.st_blksize = 4096;
    // SAFETY: caller contract (writable struct stat).
    unsafe { buf.write(st) };
    0
}

/// `stat` of `path` for every caller: the device node here, else `fstatat`.
///
/// # Safety
/// `path` NUL-terminated, `buf` a writable `struct stat`.
unsafe fn stat_path(path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    if is_node(path) {
        // SAFETY: forwarded contract.
        return unsafe { fill_node_stat(buf) };
    }
    // SAFETY: the C library's fstatat with the caller's arguments (its contract).
    unsafe { libc::fstatat(libc::AT_FDCWD, path, buf, flags) }
}

/// `stat(2)`, for every caller in the process (see the module documentation).
///
/// # Safety
/// As `stat(2)`.
#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    // SAFETY: caller contract.
    unsafe { stat_path(path, buf, 0) }
}

/// `stat64` (the same struct on 64-bit Linux).
///
/// # Safety
/// As `stat(2)`.
#[cfg(target_pointer_width = "64")]
#[no_mangle]
pub unsafe extern "C" fn stat64(path: *const c_char, buf: *mut libc::stat) -> c_int {
    // SAFETY: caller contract.
    unsafe { stat_path(path, buf, 0) }
}

/// `__xstat`, which binaries built against glibc before 2.33 call for `stat`
/// (`ver` is glibc's `_STAT_VER`, whose struct is `struct stat` on 64-bit Linux).
///
/// # Safety
/// As `stat(2)`.
#[cfg(target_pointer_width = "64")]
#[no_mangle]
pub unsafe extern "C" fn __xstat(_ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    // SAFETY: caller contract.
    unsafe { stat_path(path, buf, 0) }
}

/// `__xstat64` (as [`__xstat`]).
///
/// # Safety
/// As `stat(2)`.
#[cfg(target_pointer_width = "64")]
#[no_mangle]
pub unsafe extern "C" fn __xstat64(
    _ver: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
) -> c_int {
    // SAFETY: caller contract.
    unsafe { stat_path(path, buf, 0) }
}

/// `access(2)`, for every caller in the process: the device node is readable and
/// writable by everyone (mode 0666), not executable; other paths go to `faccessat`.
///
/// # Safety
/// As `access(2)`.
#[no_mangle]
pub unsafe extern "C" fn access(path: *const c_char, mode: c_int) -> c_int {
    if is_node(path) {
        if mode & !(libc::R_OK | libc::W_OK | libc::X_OK) != 0 {
            crate::error::set_errno(libc::EINVAL);
            return -1;
        }
        if mode & libc::X_OK != 0 {
            crate::error::set_errno(libc::EACCES);
            return -1;
        }
        return 0;
    }
    // SAFETY: the C library's faccessat with the caller's arguments.
    unsafe { libc::faccessat(libc::AT_FDCWD, path, mode, 0) }
}
