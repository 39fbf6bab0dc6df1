//! The CPU's access to application memory on the two-sided path: copies in
//! and out of registered ranges and the target-CPU atomics. The only place
//! the engine dereferences application addresses.
//!
//! Every caller has validated the range against a registered application MR
//! (key, bounds, rights); registration requires the memory to stay mapped
//! while registered (`Pd::reg_mr`'s contract). A copy may take a page fault,
//! which the pager's fault thread resolves. Memory the application unmaps
//! anyway makes the access fail ([`Vanished`], from `rnic::fault_guard`), not
//! the process.
#![allow(unsafe_code)]

use crate::ctrl::AtomicKind;
use rnic::fault_guard::Vanished;

/// Copy `len` bytes at `addr` out.
pub fn read(addr: u64, len: usize) -> Result<Vec<u8>, Vanished> {
    let mut v = vec![0u8; len];
    read_into(addr, &mut v)?;
    Ok(v)
}

/// Copy `out.len()` bytes at `addr` into `out` (no allocation).
pub fn read_into(addr: u64, out: &mut [u8]) -> Result<(), Vanished> {
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: [addr, addr+out.len()) lies inside a registered MR (validated by
    // the caller), which stays mapped while registered — and if the application
    // unmaps it anyway, the fault guard ends the copy with an error; `out` is
    // engine-owned memory that cannot overlap it.
    unsafe { rnic::fault_guard::copy(out.as_mut_ptr(), addr as *const u8, out.len()) }
}

/// Up to this many bytes, [`copy_out`] copies onto the caller's stack.
pub const STACK_COPY: usize = 1024;

/// The `len` bytes at `addr` as a copy: borrowed from `stack` when they fit
/// (inline messages up to the default 1 KB limit allocate nothing), else owned.
pub fn copy_out(
    addr: u64,
    len: usize,
    stack: &mut [u8; STACK_COPY],
) -> Result<std::borrow::Cow<'_, [u8]>, Vanished> {
    if len <= STACK_COPY {
        read_into(addr, &mut stack[..len])?;
        Ok(std::borrow::Cow::Borrowed(&stack[..len]))
    } else {
        Ok(std::borrow::Cow::Owned(read(addr, len)?))
    }
}

/// Copy `data` to `addr`.
pub fn write(addr: u64, data: &[u8]) -> Result<(), Vanished> {
    if data.is_empty() {
        return Ok(());
    }
    // SAFETY: [addr, addr+len) lies inside a registered MR with LOCAL_WRITE (or a
    // granted remote right), validated by the caller — and if the application
    // unmaps it anyway, the fault guard ends the copy with an error; `data` is
    // engine-owned memory, not overlapping it.
    unsafe { rnic::fault_guard::copy(addr as *mut u8, data.as_ptr(), data.len()) }
}

/// Execute a target-CPU atomic on the 8-byte word at `addr`: the original value;
/// `None` if `addr` is not 8-aligned, `Some(Err)` if the application unmapped the
/// memory under it (a remote access error for the peer, not a crash here).
pub fn atomic(
    addr: u64,
    kind: AtomicKind,
    compare_add: u64,
    swap: u64,
) -> Option<Result<u64, Vanished>> {
    if addr % 8 != 0 || addr == 0 {
        return None;
    }
    let p = addr as *mut u64;
    // SAFETY: `addr` is 8-aligned, inside a registered MR granted for
    // REMOTE_ATOMIC and pinned by the caller for the duration of the use; the
    // fault guard covers the memory vanishing under it anyway, and
    // every NP-RDMA atomic of this host goes through here (so they are atomic with
    // respect to each other).
    Some(unsafe {
        match kind {
            AtomicKind::CmpSwap => rnic::fault_guard::compare_swap(p, compare_add, swap),
            AtomicKind::FetchAdd => rnic::fault_guard::fetch_add(p, compare_add),
        }
    })
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
