//! The C library's `munmap`, interposed: in NP-RDMA mode an munmap of registered
//! memory returns to the application only once the pager (and through it the NIC's
//! views) has let go of the pages. userfaultfd reports an munmap after the fact — the
//! kernel releases the unmapping thread as soon as the pager *reads* the event, before
//! it acts — so without this an application could map new memory at the old address
//! while the NIC still reached it there, and a peer's WRITE would land in it. (Copies
//! that meet the address while it is unmapped end with an error: `rnic::fault_guard`.)
//! `mremap` likewise (moving registered memory away leaves the old address free for
//! new memory). Registered memory the pager does not page (file mappings, taken
//! as always resident), which userfaultfd does not report at all, is let go of
//! before the system call. Other calls cost one atomic load (no NP-RDMA device
//! open) or two short locks. Not covered: munmaps the C library makes internally (`free` of a large
//! block), which do not go through these symbols; there the pager's own handling
//! leaves a window of microseconds (vmem's documented residual window).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Pagers of the open NP-RDMA devices (normally one). The lock is held only to
/// look (no syscall, no drop of a pager under it: a pager's threads call munmap
/// as they exit).
static PAGERS: parking_lot::Mutex<Vec<(u64, vmem::Pager)>> = parking_lot::Mutex::new(Vec::new());
/// `PAGERS.len()`, read without the lock on every munmap.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Follows munmaps of `pager`'s memory until the returned guard drops.
pub fn follow(pager: &vmem::Pager) -> Following {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut p = PAGERS.lock();
    p.push((id, pager.clone()));
    OPEN.store(p.len(), Ordering::Release);
    Following(id)
}

/// Registration of a pager with the munmap wrapper (see [`follow`]).
pub struct Following(u64);

impl Drop for Following {
    fn drop(&mut self) {
        let gone = {
            let mut p = PAGERS.lock();
            let at = p.iter().position(|(id, _)| *id == self.0);
            let gone = at.map(|i| p.swap_remove(i));
            OPEN.store(p.len(), Ordering::Release);
            gone
        };
        // Dropped outside the lock (it may be the pager's last handle).
        drop(gone);
    }
}

/// Pinned MRs over memory userfaultfd cannot watch (file mappings): id, range and
/// what to run, once, when the application unmaps or moves any of it.
static FOREIGN: parking_lot::Mutex<Vec<(u64, usize, usize, vmem::OnGone)>> =
    parking_lot::Mutex::new(Vec::new());
/// `FOREIGN.len()`, read without the lock on every munmap.
static FOREIGN_N: AtomicUsize = AtomicUsize::new(0);

/// Runs `on_gone` (before the system call) when the application unmaps or moves
/// away any of `[addr, addr+len)`, unless the returned guard drops first.
pub fn follow_foreign(addr: usize, len: usize, on_gone: vmem::OnGone) -> ForeignFollow {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut f = FOREIGN.lock();
    f.push((id, addr, addr.saturating_add(len), on_gone));
    FOREIGN_N.store(f.len(), Ordering::Release);
    ForeignFollow(id)
}

/// A range followed by [`follow_foreign`]; dropping it stops following.
pub struct ForeignFollow(u64);

impl Drop for ForeignFollow {
    fn drop(&mut self) {
        let gone = {
            let mut f = FOREIGN.lock();
            let at = f.iter().position(|e| e.0 == self.0);
            let gone = at.map(|i| f.swap_remove(i));
            FOREIGN_N.store(f.len(), Ordering::Release);
            gone
        };
        // Dropped unrun, outside the lock.
        drop(gone);
    }
}

/// Runs (outside the lock) the callbacks of the followed ranges that overlap
/// `[addr, addr+len)`, each once.
fn run_foreign(addr: *mut c_void, len: usize) {
    if FOREIGN_N.load(Ordering::Acquire) == 0 {
        return;
    }
    let (start, end) = (addr as usize, (addr as usize).saturating_add(len));
    let due: Vec<vmem::OnGone> = {
        let mut f = FOREIGN.lock();
        let mut due = Vec::new();
        let mut i = 0;
        while i < f.len() {
            if f[i].1 < end && start < f[i].2 {
                due.push(f.swap_remove(i).3);
            } else {
                i += 1;
            }
        }
        FOREIGN_N.store(f.len(), Ordering::Release);
        due
    };
    for g in due {
        g();
    }
}

/// Before the range goes: the pagers' registrations there of memory they do not
/// page (file mappings), whose munmap userfaultfd does not report, are forgotten
/// now (`vmem::Pager::forget_foreign`: the NIC's views stop reaching them), so no
/// peer reaches memory mapped anew at the address. The pagers are cloned under
/// the lock and called outside it (their listeners remap NIC views).
fn forget_foreign(addr: *mut c_void, len: usize) {
    if OPEN.load(Ordering::Acquire) == 0 {
        return;
    }
    let pagers: Vec<vmem::Pager> = PAGERS
        .lock()
        .iter()
        .filter(|(_, p)| p.manages(addr as usize, len))
        .map(|(_, p)| p.clone())
        .collect();
    for p in pagers {
        p.forget_foreign(addr as usize, len);
    }
}

/// Handles on the fault threads of the pagers managing part of `[addr, addr+len)`.
fn managing(addr: *mut c_void, len: usize) -> Vec<vmem::EventsHandled> {
    if OPEN.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    PAGERS
        .lock()
        .iter()
        .filter(|(_, p)| p.manages(addr as usize, len))
        .map(|(_, p)| p.events_handled())
        .collect()
}

/// `mremap(2)`, for every caller in the process (see the module documentation).
/// The C prototype is variadic (`new_address` is read only with `MREMAP_FIXED`, as
/// glibc does); on x86-64 a variadic call passes it exactly where this non-variadic
/// definition reads it (the fifth integer argument register), so the definition is
/// limited to that architecture.
///
/// # Safety
/// As `mremap(2)`.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_size: usize,
    new_size: usize,
    flags: c_int,
    new_address: *mut c_void,
) -> *mut c_void {
    let new_address = if flags & libc::MREMAP_FIXED != 0 {
        new_address
    } else {
        std::ptr::null_mut()
    };
    let managing = managing(old, old_size);
    forget_foreign(old, old_size);
    run_foreign(old, old_size);
    // SAFETY: the raw system call with the caller's arguments (the caller's
    // contract); on failure it returns -1 (MAP_FAILED) with errno set.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            old,
            old_size,
            new_size,
            flags,
            new_address,
        )
    };
    for h in managing {
        h.wait();
    }
    r as *mut c_void
}

/// `munmap(2)`, for every caller in the process (see the module documentation).
///
/// # Safety
/// As `munmap(2)`: the caller gives up `[addr, addr+len)`.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    let managing = managing(addr, len);
    forget_foreign(addr, len);
    run_foreign(addr, len);
    // SAFETY: the raw system call with the caller's arguments (the caller's
    // contract); `syscall` sets errno on failure as munmap would.
    let r = unsafe { libc::syscall(libc::SYS_munmap, addr, len) } as c_int;
    for h in managing {
        h.wait();
    }
    r
}
