//! Thin, documented wrappers over the Linux syscalls the NIC needs: memfd,
//! shared mappings, futexes, eventfds, pidfd_getfd and process_vm_readv/writev.

use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::thread::futex;

/// Size of a page (IOVA page, frame and pager page alike).
pub const PAGE: usize = 4096;
/// `log2(PAGE)`.
pub const PAGE_SHIFT: u32 = 12;

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
    pub fn map_shared_ro(fd: impl AsFd, len: usize) -> io::Result<Mapping> {
        Self::map(fd, len, ProtFlags::READ)
    }
    pub fn map_shared(fd: impl AsFd, len: usize) -> io::Result<Mapping> {
        Self::map(fd, len, ProtFlags::READ | ProtFlags::WRITE)
    }
    fn map(fd: impl AsFd, len: usize, prot: ProtFlags) -> io::Result<Mapping> {
        // SAFETY: requesting a fresh mapping at an address the kernel chooses (no
        // existing memory is replaced); fd validity is checked by the kernel.
        let p = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0)? };
        Ok(Mapping { ptr: p.cast(), len })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping we created and nobody uses after drop.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// FUTEX_WAIT (shared, not private: the word may live in a cross-process mapping).
/// Returns when woken, on timeout, on a spurious wakeup or if `*word != expected`.
#[inline]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| futex::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: d.subsec_nanos() as _,
    });
    // Every outcome (woken, EAGAIN, ETIMEDOUT, EINTR) means "look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, ts.as_ref());
}

/// FUTEX_WAKE all waiters on `word` (shared futex).
#[inline]
pub fn futex_wake(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// A non-blocking eventfd (completion channel).
pub fn eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
    )?)
}

/// Add 1 to an eventfd counter.
pub fn eventfd_signal(fd: impl AsFd) -> io::Result<()> {
    match rustix::io::write(fd, &1u64.to_ne_bytes())? {
        8 => Ok(()),
        _ => Err(io::ErrorKind::WriteZero.into()),
    }
}

/// Read (and reset) an eventfd counter; Ok(0) if it was zero.
pub fn eventfd_drain(fd: impl AsFd) -> io::Result<u64> {
    let mut v = [0u8; 8];
    match rustix::io::read(fd, &mut v) {
        Ok(8) => Ok(u64::from_ne_bytes(v)),
        Ok(_) => Err(io::ErrorKind::UnexpectedEof.into()),
        Err(rustix::io::Errno::AGAIN) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// poll(2) one fd for readability; true if readable before the timeout. The
/// timeout keeps its nanoseconds (ppoll): rounded down to milliseconds, the last
/// fraction of a millisecond of a caller's deadline became zero timeouts, and a
/// waiting loop (`CompChannel::get_event`) spun through it — up to a millisecond
/// of a core taken from the threads it waited for, at every timeout.
pub fn poll_readable(fd: impl AsFd, timeout: Option<Duration>) -> io::Result<bool> {
    let ts = timeout.map(|d| rustix::event::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: d.subsec_nanos() as _,
    });
    let mut p = [PollFd::new(&fd, PollFlags::IN)];
    loop {
        match rustix::event::poll(&mut p, ts.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Duplicate file descriptor `fd` of process `pid` into this process (pidfd_getfd).
pub fn pidfd_getfd(pid: u32, fd: RawFd) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid as i32).ok_or(io::ErrorKind::InvalidInput)?;
    let pfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    Ok(rustix::process::pidfd_getfd(
        pfd,
        fd,
        rustix::process::PidfdGetfdFlags::empty(),
    )?)
}

/// Allow any process to ptrace-attach / process_vm_* us (Yama).
pub fn allow_ptrace_any() {
    // Failure is harmless (no Yama).
    let _ = rustix::process::set_ptracer(rustix::process::PTracer::Any);
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
/// Raw libc on purpose: rustix (1.x) has no process_vm_readv/writev wrapper.
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
#[inline]
pub fn now_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A sealed anonymous memory file of `len` bytes: its size can never change, so a
/// peer's mapping of it can never SIGBUS (used for the NIC-shared DMA pool).
pub fn memfd_fixed(name: &str, len: usize) -> io::Result<OwnedFd> {
    let fd = memfd_sealable(name, len)?;
    seal_size(&fd, false)?;
    Ok(fd)
}

/// A memfd of `len` bytes that can be sealed later ([`seal_size`]), once its owner
/// mapped it.
pub fn memfd_sealable(name: &str, len: usize) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    Ok(fd)
}

/// Seal a [`memfd_sealable`] file's size for good and, with `no_more_writers`, every
/// write but through the mappings that exist now (`F_SEAL_FUTURE_WRITE`: a later
/// `mmap(PROT_WRITE, MAP_SHARED)` or `write` by anyone, through any fd, fails).
pub fn seal_size(fd: impl AsFd, no_more_writers: bool) -> io::Result<()> {
    let mut seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    if no_more_writers {
        seals |= SealFlags::FUTURE_WRITE;
    }
    Ok(rustix::fs::fcntl_add_seals(fd, seals)?)
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
            off += PAGE;
        }
        Ok(rustix::mm::mlock(ptr.cast(), len)?)
    }
}

/// Undo [`populate_and_lock`]: munlock the range and free its pages in the file
/// (`fd` at offset `off`); the mapping stays valid (it reads zeros again).
///
/// # Safety
/// `[ptr, ptr+len)` must be the mapping of `fd`'s `[off, off+len)`, no longer in use.
pub unsafe fn unlock_and_free(fd: impl AsFd, off: usize, ptr: *mut u8, len: usize) {
    // SAFETY: the caller guarantees the range is `fd`'s mapping, no longer in use (this function's contract).
    let _ = unsafe { rustix::mm::munlock(ptr.cast(), len) };
    if let Err(e) = rustix::fs::fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        off as u64,
        len as u64,
    ) {
        tracing::warn!("DMA pool: punching a freed range failed: {}", io::Error::from(e));
    }
}

/// A process-shared robust mutex used as a liveness token: the owning host's NIC
/// thread holds it for its whole life; the kernel marks it OWNER_DIED when that
/// thread (or the whole process) dies, so a peer learns about it with a trylock
/// (a CAS, no syscall) instead of a syscall per check.
///
/// Raw libc on purpose: this is glibc's userspace pthread robust mutex (its robust
/// list and OWNER_DIED protocol), which rustix does not offer.
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
