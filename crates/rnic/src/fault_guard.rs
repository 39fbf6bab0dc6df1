//! Memory accesses of the NIC that survive the memory vanishing under them. An
//! application may unmap registered memory while the NIC copies into it: a real
//! NIC's DMA then meets the pages it pinned (or a translation invalidated first), ours
//! — a copy by a thread of the process — would meet SIGSEGV and take the whole
//! process down. These accesses (`fault_guard.c`) end with [`Vanished`] instead, and
//! the work request with an access error. Faults anywhere else reach the handler
//! installed before ours (Rust's stack-overflow report, the application's own) or the
//! default action, unchanged. An application that installs its own SIGSEGV handler
//! after the NIC started replaces ours and gets the crash back.

use std::ffi::c_int;

unsafe extern "C" {
    fn rnic_guard_install();
    fn rnic_guarded_copy(dst: *mut u8, src: *const u8, n: usize) -> c_int;
    fn rnic_guarded_set(dst: *mut u8, byte: c_int, n: usize) -> c_int;
    fn rnic_guarded_fetch_add(p: *mut u64, add: u64, old: *mut u64) -> c_int;
    fn rnic_guarded_cas(p: *mut u64, cmp: u64, swp: u64, old: *mut u64) -> c_int;
}

/// The memory of a guarded access vanished under it (part of a copy may have been done).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vanished;

/// Install the SIGSEGV / SIGBUS handler (once per process; later calls do nothing).
pub fn install() {
    // SAFETY: pthread_once around two sigaction calls; no arguments.
    unsafe { rnic_guard_install() }
}

fn done(r: c_int) -> Result<(), Vanished> {
    if r == 0 {
        Ok(())
    } else {
        Err(Vanished)
    }
}

/// `memmove(dst, src, n)`, ending early with [`Vanished`] if either range faults.
///
/// # Safety
/// The ranges must be memory the caller may read / write, as far as it knows (a
/// registered MR's, inside a DMA section): the guard only covers their vanishing.
pub unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), Vanished> {
    // SAFETY: forwarded contract; the C side only moves bytes within the ranges.
    done(unsafe { rnic_guarded_copy(dst, src, n) })
}

/// `memset(dst, byte, n)`, ending early with [`Vanished`] if the range faults.
///
/// # Safety
/// As for [`copy`].
pub unsafe fn set(dst: *mut u8, byte: u8, n: usize) -> Result<(), Vanished> {
    // SAFETY: forwarded contract.
    done(unsafe { rnic_guarded_set(dst, c_int::from(byte), n) })
}

/// Atomic fetch-and-add on the 8-aligned word at `p`; the old value.
///
/// # Safety
/// `p` is 8-aligned and, as far as the caller knows, valid (see [`copy`]).
pub unsafe fn fetch_add(p: *mut u64, add: u64) -> Result<u64, Vanished> {
    let mut old = 0;
    // SAFETY: forwarded contract; `old` is a local.
    done(unsafe { rnic_guarded_fetch_add(p, add, &mut old) }).map(|()| old)
}

/// Atomic compare-and-swap on the 8-aligned word at `p`; the old value.
///
/// # Safety
/// As for [`fetch_add`].
pub unsafe fn compare_swap(p: *mut u64, compare: u64, swap: u64) -> Result<u64, Vanished> {
    let mut old = 0;
    // SAFETY: forwarded contract; `old` is a local.
    done(unsafe { rnic_guarded_cas(p, compare, swap, &mut old) }).map(|()| old)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping of `pages` pages whose page `hole` is unmapped.
    fn with_hole(pages: usize, hole: usize) -> *mut u8 {
        // SAFETY: fresh anonymous mapping; then one of its own pages unmapped.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                pages * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u8;
            assert!(!p.is_null() && p as isize != -1);
            assert_eq!(libc::munmap(p.add(hole * 4096).cast(), 4096), 0);
            p
        }
    }

    #[test]
    fn accesses_to_vanished_memory_fail_instead_of_crashing() {
        install();
        install();
        let p = with_hole(3, 1);
        let src = vec![7u8; 3 * 4096];
        // SAFETY: page 0 and 2 are mapped; page 1 is the hole the guard must catch.
        unsafe {
            assert_eq!(copy(p, src.as_ptr(), 4096), Ok(()));
            assert_eq!(*p.add(4095), 7);
            assert_eq!(copy(p, src.as_ptr(), 3 * 4096), Err(Vanished), "write into the hole");
            assert_eq!(
                copy(src.as_ptr() as *mut u8, p.add(4096), 16),
                Err(Vanished),
                "read from it"
            );
            assert_eq!(set(p.add(2 * 4096), 1, 4096), Ok(()));
            assert_eq!(set(p.add(4096), 1, 4096), Err(Vanished));
            let w = p.add(2 * 4096) as *mut u64;
            *w = 5;
            assert_eq!(fetch_add(w, 2), Ok(5));
            assert_eq!(compare_swap(w, 7, 9), Ok(7));
            assert_eq!(*w, 9);
            assert_eq!(fetch_add(p.add(4096) as *mut u64, 1), Err(Vanished));
            assert_eq!(compare_swap(p.add(4096) as *mut u64, 0, 1), Err(Vanished));
            // Many in a row: the signal stays unblocked after each recovery.
            for _ in 0..1000 {
                assert_eq!(copy(p.add(4096), src.as_ptr(), 8), Err(Vanished));
            }
            libc::munmap(p.cast(), 4096);
            libc::munmap(p.add(2 * 4096).cast(), 4096);
        }
    }

    #[test]
    fn other_faults_still_end_the_process() {
        // In a child: a fault outside any guarded access keeps its default action.
        if std::env::var_os("RNIC_GUARD_CHILD").is_some() {
            install();
            let p = with_hole(1, 0);
            // SAFETY: deliberately faults (the point of the test), in a child process.
            unsafe { std::ptr::write_volatile(p, 1) };
            unreachable!("the write above faults");
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "fault_guard::tests::other_faults_still_end_the_process",
                "--exact",
                "--nocapture",
            ])
            .env("RNIC_GUARD_CHILD", "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{out:?}");
    }
}
