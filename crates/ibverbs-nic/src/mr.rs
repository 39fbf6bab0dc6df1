//! Registrations: [`VerbsMr`] (`ibv_reg_mr` of the caller's memory, the
//! user-space mode's on-the-fly and long-lived MRs alike) and [`VerbsBuf`]
//! (memory this backend maps and registers: control rings, scratch).

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use nprdma::nic::{Access, NicBuf, NicMr};
use verbs_sys::*;

use crate::device::Dev;
use crate::dl::{check, errno_err};
use crate::Error;

/// `access` as `ibv_access_flags`: the four verbs bits; REMOTE_WRITE and
/// REMOTE_ATOMIC imply LOCAL_WRITE (verbs refuses them without it).
/// [`Access::ANY_QP`] is dropped: a hardware QP checks its own access flags
/// before any MR's, so it cannot be honoured here (the engine's protocol
/// MRs are reached through QPs that grant all rights).
pub(crate) fn ibv_access(access: Access) -> c_int {
    let mut a = access.0 & 0xf;
    if a & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0 {
        a |= IBV_ACCESS_LOCAL_WRITE;
    }
    a as c_int
}

/// A registered memory region; dropping it deregisters.
pub struct VerbsMr {
    dev: Arc<Dev>,
    mr: *mut ibv_mr,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
}

// SAFETY: the MR pointer is only handed to ibv_dereg_mr (thread-safe) once,
// in Drop; the keys are plain copies.
unsafe impl Send for VerbsMr {}
// SAFETY: as above; no shared mutation through `&self`.
unsafe impl Sync for VerbsMr {}

impl std::fmt::Debug for VerbsMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsMr")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish()
    }
}

impl VerbsMr {
    /// `ibv_reg_mr` of `[addr, addr+len)`. A refusal (ENOMEM, RLIMIT_MEMLOCK,
    /// EFAULT) is an error and is counted; nothing stays registered.
    ///
    /// # Safety
    /// The memory must stay mapped while the MR exists.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn register(
        dev: &Arc<Dev>,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<VerbsMr, Error> {
        let len_usize = usize::try_from(len).map_err(|_| Error::Invalid("MR length"))?;
        // SAFETY: a live PD; the caller keeps the memory mapped.
        let mr =
            unsafe { (dev.lib.reg_mr)(dev.pd, addr as *mut c_void, len_usize, ibv_access(access)) };
        if mr.is_null() {
            dev.reg_failures.fetch_add(1, Ordering::Relaxed);
            return Err(errno_err("ibv_reg_mr"));
        }
        dev.regs.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the MR just returned.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(VerbsMr {
            dev: dev.clone(),
            mr,
            lkey,
            rkey,
            addr,
            len,
        })
    }
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        // SAFETY: our MR, deregistered once.
        let rc = unsafe { (self.dev.lib.dereg_mr)(self.mr) };
        match check("ibv_dereg_mr", rc) {
            Ok(()) => {
                self.dev.deregs.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(error = %e, addr = self.addr, "ibverbs-nic: leaking an MR"),
        }
    }
}

impl NicMr for VerbsMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> u64 {
        self.len
    }
}

/// Zeroed anonymous memory (whole pages) registered for its whole life.
pub struct VerbsBuf {
    mr: Option<VerbsMr>,
    base: *mut u8,
    map_len: usize,
    len: usize,
}

// SAFETY: the mapping is owned by the buffer and unmapped once in Drop;
// reads through `&self` copy out (the NIC may write concurrently, as into
// any registered buffer).
unsafe impl Send for VerbsBuf {}
// SAFETY: as above.
unsafe impl Sync for VerbsBuf {}

impl std::fmt::Debug for VerbsBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsBuf").field("mr", &self.mr).finish()
    }
}

impl VerbsBuf {
    pub(crate) fn alloc(dev: &Arc<Dev>, len: usize, access: Access) -> Result<VerbsBuf, Error> {
        if len == 0 {
            return Err(Error::Invalid("empty buffer"));
        }
        // SAFETY: sysconf has no memory effects.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let map_len = len.div_ceil(page) * page;
        // SAFETY: a fresh private anonymous mapping (zeroed by the kernel).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno_err("mmap"));
        }
        // SAFETY: the mapping stays until Drop, after the MR is gone.
        match unsafe { VerbsMr::register(dev, p as u64, len as u64, access) } {
            Ok(mr) => Ok(VerbsBuf {
                mr: Some(mr),
                base: p.cast(),
                map_len,
                len,
            }),
            Err(e) => {
                // SAFETY: the mapping made above, not registered.
                unsafe { libc::munmap(p, map_len) };
                Err(e)
            }
        }
    }

    fn mr(&self) -> &VerbsMr {
        self.mr.as_ref().expect("registered until drop")
    }
}

impl Drop for VerbsBuf {
    fn drop(&mut self) {
        // Deregister first (the NIC is done with it), then unmap.
        drop(self.mr.take());
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

impl NicMr for VerbsBuf {
    fn lkey(&self) -> u32 {
        self.mr().lkey
    }
    fn rkey(&self) -> u32 {
        self.mr().rkey
    }
    fn addr(&self) -> u64 {
        self.base as u64
    }
    fn len(&self) -> u64 {
        self.len as u64
    }
}

impl NicBuf for VerbsBuf {
    fn read(&self, off: usize, out: &mut [u8]) {
        assert!(
            off.checked_add(out.len()).is_some_and(|e| e <= self.len),
            "read {}+{} outside a {}-byte buffer",
            off,
            out.len(),
            self.len
        );
        // SAFETY: in bounds of our live mapping (checked above); `out` is
        // a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off), out.as_mut_ptr(), out.len()) };
    }
}
