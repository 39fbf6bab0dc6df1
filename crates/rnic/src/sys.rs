//! Thin, documented wrappers over the Linux syscalls the NIC needs: memfd,
//! shared mappings, futexes, eventfds, pidfd_getfd and process_vm_readv/writev.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A MAP_SHARED mapping of a file; unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access to it goes through atomics
// or through the DMA copy routines, which document their own invariants.
unsafe impl Send for Mapping {}
// SAFETY: see above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, read-only (a peer's sealed tables).
    pub fn map_shared_ro(fd: RawFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: requesting a fresh mapping chosen by the kernel; fd validity is checked
        // by the kernel.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p as *mut u8, len })
    }
    pub fn map_shared(fd: RawFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: requesting a fresh mapping chosen by the kernel; fd validity is checked
        // by the kernel.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p as *mut u8, len })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping we created and nobody uses after drop.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// FUTEX_WAIT (shared, not private: the word may live in a cross-process mapping).
/// Returns when woken, on timeout, on a spurious wakeup or if `*word != expected`.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map(|t| t as *const libc::timespec)
        .unwrap_or(std::ptr::null());
    // SAFETY: word is a valid aligned u32 for the duration of the call; tsp is null or
    // points to a live timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            tsp,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// FUTEX_WAKE all waiters on `word` (shared futex).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: word is a valid aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// A non-blocking eventfd (completion channel).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Add 1 to an eventfd counter.
pub fn eventfd_signal(fd: RawFd) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64.
    let r = unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
    if r == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Read (and reset) an eventfd counter; Ok(0) if it was zero.
pub fn eventfd_drain(fd: RawFd) -> io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64.
    let r = unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
    if r == 8 {
        Ok(v)
    } else {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        }
    }
}

/// poll(2) one fd for readability; true if readable before the timeout.
pub fn poll_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout
        .map(|d| d.as_millis().min(i32::MAX as u128) as i32)
        .unwrap_or(-1);
    loop {
        // SAFETY: one live pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r >= 0 {
            return Ok(r > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Duplicate file descriptor `fd` of process `pid` into this process (pidfd_getfd).
pub fn pidfd_getfd(pid: u32, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls with integer arguments.
    let pfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pfd is a fresh fd owned by us.
    let pfd = unsafe { OwnedFd::from_raw_fd(pfd as RawFd) };
    // SAFETY: plain syscall.
    let nfd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pfd.as_raw_fd(), fd, 0) };
    if nfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(nfd as RawFd) })
}

/// Allow any process to ptrace-attach / process_vm_* us (Yama).
pub fn allow_ptrace_any() {
    // SAFETY: prctl with integer arguments; failure is harmless (no Yama).
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
}

/// Direction of a cross-process copy.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum VmDir {
    /// remote -> local
    Read,
    /// local -> remote
    Write,
}

/// process_vm_readv/writev over matching iovec lists (total lengths must be equal).
/// Returns the number of bytes moved (short on a fault in the remote process).
///
/// # Safety
/// Every local iovec must describe memory of this process that is valid for the
/// access (writable for `VmDir::Read`).
pub unsafe fn process_vm(pid: u32, dir: VmDir, local: &[libc::iovec], remote: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: the caller guarantees the local iovecs (this function's contract); the remote side is checked by the kernel.
    unsafe {
        let r = match dir {
            VmDir::Read => libc::process_vm_readv(
                pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            ),
            VmDir::Write => libc::process_vm_writev(
                pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            ),
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

/// Monotonic nanoseconds (CLOCK_MONOTONIC), comparable across processes.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes into a live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A sealed anonymous memory file of `len` bytes: its size can never change, so a
/// peer's mapping of it can never SIGBUS (used for the NIC-shared DMA pool).
pub fn memfd_fixed(name: &str, len: usize) -> io::Result<OwnedFd> {
    let fd = memfd_sealable(name, len)?;
    seal_size(fd.as_raw_fd(), false)?;
    Ok(fd)
}

/// A memfd of `len` bytes that can be sealed later ([`seal_size`]), once its owner
/// mapped it.
pub fn memfd_sealable(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: cname is a valid NUL-terminated string; flags are valid.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: valid fd, plain integer length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Seal a [`memfd_sealable`] file's size for good and, with `no_more_writers`, every
/// write but through the mappings that exist now (`F_SEAL_FUTURE_WRITE`: a later
/// `mmap(PROT_WRITE, MAP_SHARED)` or `write` by anyone, through any fd, fails).
pub fn seal_size(fd: RawFd, no_more_writers: bool) -> io::Result<()> {
    let mut seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    if no_more_writers {
        seals |= libc::F_SEAL_FUTURE_WRITE;
    }
    // SAFETY: valid fd, plain integer arguments.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Make `[ptr, ptr+len)` of a shared file mapping present and unswappable: write-fault
/// every page in (allocating it in the file), then mlock it.
///
/// # Safety
/// The range must be a page-aligned part of a writable mapping nobody else uses yet.
pub unsafe fn populate_and_lock(ptr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range is a writable mapping nobody else uses (this function's contract).
    unsafe {
        let mut off = 0;
        while off < len {
            ptr.add(off).write_volatile(0);
            off += crate::segment::PAGE;
        }
        if libc::mlock(ptr as *const libc::c_void, len) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Undo [`populate_and_lock`]: munlock the range and free its pages in the file
/// (`fd` at offset `off`); the mapping stays valid (it reads zeros again).
///
/// # Safety
/// `[ptr, ptr+len)` must be the mapping of `fd`'s `[off, off+len)`, no longer in use.
pub unsafe fn unlock_and_free(fd: RawFd, off: usize, ptr: *mut u8, len: usize) {
    // SAFETY: the caller guarantees the range is `fd`'s mapping, no longer in use (this function's contract).
    unsafe {
        libc::munlock(ptr as *const libc::c_void, len);
        if libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        ) != 0
        {
            tracing::warn!(
                "DMA pool: punching a freed range failed: {}",
                io::Error::last_os_error()
            );
        }
    }
}

/// A process-shared robust mutex used as a liveness token: the owning host's NIC
/// thread holds it for its whole life; the kernel marks it OWNER_DIED when that
/// thread (or the whole process) dies, so a peer learns about it with a trylock
/// (a CAS, no syscall) instead of a syscall per check.
pub mod life {
    use std::io;

    /// Initialise the mutex at `m` (fresh shared memory).
    ///
    /// # Safety
    /// `m` must point to writable, suitably aligned memory for a `pthread_mutex_t`
    /// that nobody uses yet.
    pub unsafe fn init(m: *mut libc::pthread_mutex_t) -> io::Result<()> {
        // SAFETY: `m` is writable, aligned, unused (this function's contract); `a` is a live local attribute object.
        unsafe {
            let mut a: libc::pthread_mutexattr_t = std::mem::zeroed();
            let mut r = libc::pthread_mutexattr_init(&mut a);
            if r == 0 {
                r = libc::pthread_mutexattr_setpshared(&mut a, libc::PTHREAD_PROCESS_SHARED);
            }
            if r == 0 {
                r = libc::pthread_mutexattr_setrobust(&mut a, libc::PTHREAD_MUTEX_ROBUST);
            }
            if r == 0 {
                r = libc::pthread_mutex_init(m, &a);
            }
            libc::pthread_mutexattr_destroy(&mut a);
            if r == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(r))
            }
        }
    }

    /// Take the token (the owner, once, on the thread that lives as long as the host).
    ///
    /// # Safety
    /// `m` must be an initialised mutex (see [`init`]) that stays mapped until
    /// [`release`] on the same thread.
    pub unsafe fn hold(m: *mut libc::pthread_mutex_t) -> bool {
        // SAFETY: `m` is an initialised, mapped mutex (this function's contract).
        unsafe { libc::pthread_mutex_lock(m) == 0 }
    }

    /// Give the token back (orderly shutdown; peers then see the owner gone).
    ///
    /// # Safety
    /// Called on the thread that [`hold`] it.
    pub unsafe fn release(m: *mut libc::pthread_mutex_t) {
        // SAFETY: called on the holding thread (this function's contract).
        unsafe {
            libc::pthread_mutex_unlock(m);
        }
    }

    /// Whether the holder is alive. A dead (or orderly released) token is left
    /// unlocked-unrecoverable, so the probing thread never keeps it on its robust list.
    ///
    /// # Safety
    /// `m` must be an initialised mutex in a mapping that outlives the call.
    pub unsafe fn probe(m: *mut libc::pthread_mutex_t) -> bool {
        // SAFETY: `m` is an initialised, mapped mutex (this function's contract).
        unsafe {
            match libc::pthread_mutex_trylock(m) {
                libc::EBUSY => true,
                0 | libc::EOWNERDEAD => {
                    // We own it now: release it without marking it consistent.
                    libc::pthread_mutex_unlock(m);
                    false
                }
                _ => false,
            }
        }
    }
}

/// A token naming a live process and surviving PID reuse: its PID (≤ 2^22, the
/// kernel's `pid_max` limit) and its start time in clock ticks since boot (42
/// bits), from `/proc/<pid>/stat`. `None` if there is no such process or it has
/// exited (a zombie waiting to be reaped is gone too: it runs no code).
pub fn process_token(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name's closing ')': state (3), ..., starttime (22).
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    if matches!(rest.next()?, "Z" | "X" | "x") {
        return None;
    }
    let start: u64 = rest.nth(18)?.parse().ok()?;
    Some(((pid as u64) << 42) | (start & START_MASK))
}

const START_MASK: u64 = (1 << 42) - 1;

/// This process's [`process_token`] (computed once).
pub fn my_process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| {
        let pid = std::process::id();
        // Without /proc the token names the PID alone (reuse is then not seen).
        process_token(pid).unwrap_or((pid as u64) << 42)
    })
}

/// Whether the process named by `token` (see [`process_token`]) is gone.
pub fn process_gone(token: u64) -> bool {
    match process_token((token >> 42) as u32) {
        None => true,
        Some(t) => token & START_MASK != 0 && t != token,
    }
}

#[cfg(test)]
mod process_token_tests {
    use super::*;

    #[test]
    fn a_live_process_is_not_gone_and_an_exited_one_is() {
        let me = my_process_token();
        assert_eq!(me >> 42, std::process::id() as u64);
        assert_ne!(me & START_MASK, 0);
        assert!(!process_gone(me));
        // Same PID, another start time: PID reuse is seen.
        assert!(process_gone(me ^ 1));
        let mut c = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let t = process_token(c.id()).expect("a sleeping child has a token");
        assert!(!process_gone(t));
        c.kill().unwrap();
        // Killed but not reaped yet (a zombie): gone already.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(process_gone(t));
        c.wait().unwrap();
        assert!(process_gone(t));
    }
}
