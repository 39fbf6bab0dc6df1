//! The CPU's access to application memory on the two-sided path: copies in
//! and out of registered ranges and the target-CPU atomics. The only place
//! the engine dereferences application addresses.
//!
//! Every caller has validated the range against a registered application MR
//! (key, bounds, rights); registration requires the memory to stay mapped
//! while registered (`Pd::reg_mr`'s contract). A copy may take a page fault,
//! which the pager's fault thread resolves.
#![allow(unsafe_code)]

use std::sync::atomic::AtomicU64;

/// Copy `len` bytes at `addr` out.
pub fn read(addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    if len > 0 {
        // SAFETY: [addr, addr+len) lies inside a registered MR (validated by
        // the caller), which stays mapped while registered; `v` is a fresh
        // buffer that cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) };
    }
    v
}

/// Copy `out.len()` bytes at `addr` into `out` (no allocation).
pub fn read_into(addr: u64, out: &mut [u8]) {
    if !out.is_empty() {
        // SAFETY: [addr, addr+out.len()) lies inside a registered MR
        // (validated by the caller), which stays mapped while registered;
        // `out` is engine-owned memory that cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    }
}

/// Up to this many bytes, [`copy_out`] copies onto the caller's stack.
pub const STACK_COPY: usize = 1024;

/// The `len` bytes at `addr` as a copy: borrowed from `stack` when they fit
/// (inline messages up to the default 1 KB limit allocate nothing), else owned.
pub fn copy_out(addr: u64, len: usize, stack: &mut [u8; STACK_COPY]) -> std::borrow::Cow<'_, [u8]> {
    if len <= STACK_COPY {
        read_into(addr, &mut stack[..len]);
        std::borrow::Cow::Borrowed(&stack[..len])
    } else {
        std::borrow::Cow::Owned(read(addr, len))
    }
}

/// Copy `data` to `addr`.
pub fn write(addr: u64, data: &[u8]) {
    if !data.is_empty() {
        // SAFETY: [addr, addr+len) lies inside a registered MR with
        // LOCAL_WRITE (or a granted remote right), validated by the caller;
        // `data` is engine-owned memory, not overlapping it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
    }
}

/// The 8-byte word at `addr` as an atomic.
pub fn atomic_at<'a>(addr: u64) -> Option<&'a AtomicU64> {
    if addr % 8 != 0 || addr == 0 {
        return None;
    }
    // SAFETY: `addr` is 8-aligned, inside a registered MR granted for
    // REMOTE_ATOMIC and pinned by the caller for the duration of the use;
    // AtomicU64 has the layout of u64. All NP-RDMA atomics of this host go
    // through this function on the same memory, so they are atomic with
    // respect to each other.
    Some(unsafe { &*(addr as *const AtomicU64) })
}

/// Run `f` over the bytes at `[addr, addr+len)` without copying them.
///
/// For the checks after a NIC operation completed: the range is quiescent
/// (the operation is done, the ordering table keeps conflicting operations
/// of the layer out, and the application must not touch the buffers of an
/// in-flight WR, the verbs contract).
pub fn with_slice<R>(addr: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    if len == 0 || addr == 0 {
        return f(&[]);
    }
    // SAFETY: [addr, addr+len) lies inside a registered MR or an engine-owned
    // buffer (validated by the caller) that stays mapped for the call; the
    // range is not written during the call (see above).
    let s = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    f(s)
}
