//! The C library's `munmap`, interposed: in NP-RDMA mode an munmap of registered
//! memory returns to the application only once the pager (and through it the NIC's
//! views) has let go of the pages. userfaultfd reports an munmap after the fact — the
//! kernel releases the unmapping thread as soon as the pager *reads* the event, before
//! it acts — so without this an application could map new memory at the old address
//! while the NIC still reached it there, and a peer's WRITE would land in it. (Copies
//! that meet the address while it is unmapped end with an error: `rnic::fault_guard`.)
//! `mremap` likewise (moving registered memory away leaves the old address free for
//! new memory). Registered memory whose munmap userfaultfd does not report at all
//! (file mappings, hugetlbfs: NP-RDMA's pager takes them as always resident, a pinned
//! MR over them is not watched) is let go of before the system call. Other calls
//! cost two atomic loads (no NP-RDMA device open, no such MR) or a short lock. Not
//! covered: munmaps the C library makes internally (`free` of a large block), which
//! do not go through these symbols; there the pager's own handling leaves a window
//! of microseconds (vmem's documented residual window).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A process-wide list of entries under ids, whose length every munmap reads
/// without the lock. The lock is held only to look or edit (no syscall, no drop
/// of an entry under it: a pager's threads call munmap as they exit).
struct Registry<T> {
    list: parking_lot::Mutex<Vec<(u64, T)>>,
    len: AtomicUsize,
    next: AtomicU64,
}

impl<T> Registry<T> {
    const fn new() -> Self {
        Registry {
            list: parking_lot::Mutex::new(Vec::new()),
            len: AtomicUsize::new(0),
            next: AtomicU64::new(1),
        }
    }

    fn add(&self, t: T) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut l = self.list.lock();
        l.push((id, t));
        self.len.store(l.len(), Ordering::Release);
        id
    }

    /// The entries `take` picks, removed (each `take` sees an entry once).
    fn take(&self, mut take: impl FnMut(u64, &T) -> bool) -> Vec<T> {
        let mut l = self.list.lock();
        let mut out = Vec::new();
        let mut i = 0;
        while i < l.len() {
            if take(l[i].0, &l[i].1) {
                out.push(l.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        self.len.store(l.len(), Ordering::Release);
        out
    }

    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }
}

/// Pagers of the open NP-RDMA devices (normally one).
static PAGERS: Registry<vmem::Pager> = Registry::new();

/// Follows munmaps of `pager`'s memory until the returned guard drops.
pub fn follow(pager: &vmem::Pager) -> Following {
    Following(PAGERS.add(pager.clone()))
}

/// Registration of a pager with the munmap wrapper (see [`follow`]).
pub struct Following(u64);

impl Drop for Following {
    fn drop(&mut self) {
        // Dropped outside the lock (it may be the pager's last handle).
        drop(PAGERS.take(|id, _| id == self.0));
    }
}

/// Pinned MRs over memory userfaultfd cannot watch (file mappings): range and
/// what to run, once, when the application unmaps or moves any of it.
static FOREIGN: Registry<(usize, usize, vmem::OnGone)> = Registry::new();

/// Runs `on_gone` (before the system call) when the application unmaps or moves
/// away any of `[addr, addr+len)`, unless the returned guard drops first.
pub fn follow_foreign(addr: usize, len: usize, on_gone: vmem::OnGone) -> ForeignFollow {
    ForeignFollow(FOREIGN.add((addr, addr.saturating_add(len), on_gone)))
}

/// A range followed by [`follow_foreign`]; dropping it stops following.
pub struct ForeignFollow(u64);

impl Drop for ForeignFollow {
    fn drop(&mut self) {
        // Dropped unrun, outside the lock.
        drop(FOREIGN.take(|id, _| id == self.0));
    }
}

/// Before `[addr, addr+len)` goes: runs (outside the lock) the callbacks of
/// the followed ranges that overlap it, each once; and the pagers'
/// registrations there of memory they do not page (hugetlbfs, file mappings),
/// whose munmap userfaultfd does not report, are forgotten now
/// (`vmem::Pager::forget_foreign`: the NIC's views stop reaching them), so no
/// peer reaches memory mapped anew at the address. Returns handles on the fault
/// threads of the pagers managing part of the range, to wait on after the
/// system call.
fn before_unmap(addr: *mut c_void, len: usize) -> Vec<vmem::EventsHandled> {
    let (start, end) = (addr as usize, (addr as usize).saturating_add(len));
    if !FOREIGN.is_empty() {
        for g in FOREIGN.take(|_, (s, e, _)| *s < end && start < *e) {
            g.2();
        }
    }
    if PAGERS.is_empty() {
        return Vec::new();
    }
    // Cloned under the lock, called outside it (their listeners remap NIC views).
    let pagers: Vec<vmem::Pager> = PAGERS
        .list
        .lock()
        .iter()
        .filter(|(_, p)| p.manages(start, len))
        .map(|(_, p)| p.clone())
        .collect();
    pagers
        .iter()
        .map(|p| {
            p.forget_foreign(start, len);
            p.events_handled()
        })
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
    let managing = before_unmap(old, old_size);
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
    let managing = before_unmap(addr, len);
    // SAFETY: the raw system call with the caller's arguments (the caller's
    // contract); `syscall` sets errno on failure as munmap would.
    let r = unsafe { libc::syscall(libc::SYS_munmap, addr, len) } as c_int;
    for h in managing {
        h.wait();
    }
    r
}
