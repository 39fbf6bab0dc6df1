//! Raw userfaultfd: the file descriptor, its ioctls and its messages (the only
//! place that talks to the kernel's userfaultfd interface). The descriptor comes
//! from rustix; the ioctls (API, REGISTER, UNREGISTER, WAKE, COPY, ZEROPAGE, MOVE)
//! and the read of the message array stay raw `libc` calls, because no typed crate
//! offers them: each states its contract in its SAFETY comment.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

const UFFD_API: u64 = 0xAA;
const UFFDIO: u64 = 0xAA;

const fn iowr(nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (UFFDIO << 8) | nr
}
const fn ior(nr: u64, size: u64) -> u64 {
    (2 << 30) | (size << 16) | (UFFDIO << 8) | nr
}

const UFFDIO_API: u64 = iowr(0x3F, 24);
const UFFDIO_REGISTER: u64 = iowr(0x00, 32);
const UFFDIO_UNREGISTER: u64 = ior(0x01, 16);
const UFFDIO_WAKE: u64 = ior(0x02, 16);
const UFFDIO_COPY: u64 = iowr(0x03, 40);
const UFFDIO_ZEROPAGE: u64 = iowr(0x04, 32);
const UFFDIO_MOVE: u64 = iowr(0x05, 40);
/// `UFFDIO_MOVE` among a registration's range operations (`1 << _UFFDIO_MOVE`):
/// not offered on hugetlbfs (offered on shmem, where the move itself then fails
/// and the page stays resident, see `evict.rs`).
pub const RANGE_MOVE: u64 = 1 << 0x05;

/// Kernel feature bits (linux/userfaultfd.h).
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
pub const FEATURE_MOVE: u64 = 1 << 16;

const REGISTER_MODE_MISSING: u64 = 1;
const REGISTER_MODE_WP: u64 = 2;
const MODE_DONTWAKE: u64 = 1;

pub const EVENT_PAGEFAULT: u8 = 0x12;
pub const EVENT_REMAP: u8 = 0x14;
pub const EVENT_REMOVE: u8 = 0x15;
pub const EVENT_UNMAP: u8 = 0x16;
pub const PAGEFAULT_FLAG_WRITE: u64 = 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}
#[repr(C)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

/// One `struct uffd_msg` (32 bytes), decoded lazily.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Msg {
    pub event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    pub a0: u64,
    pub a1: u64,
    pub a2: u64,
}

impl Msg {
    /// Page-fault flags (for `EVENT_PAGEFAULT`).
    pub fn pf_flags(&self) -> u64 {
        self.a0
    }
    /// Faulting address (for `EVENT_PAGEFAULT`).
    pub fn pf_address(&self) -> u64 {
        self.a1
    }
    /// Faulting thread id (with `FEATURE_THREAD_ID`).
    pub fn pf_tid(&self) -> u32 {
        self.a2 as u32
    }
}

/// Outcome of a partial-capable ioctl (COPY / ZEROPAGE / MOVE).
#[derive(Debug)]
pub struct Partial {
    /// Bytes done before the error (0 if the first page failed).
    pub done: u64,
    pub err: io::Error,
}

/// An owned userfaultfd.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    pub features: u64,
}

fn cvt(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Uffd {
    /// Opens a non-blocking, close-on-exec userfaultfd and negotiates `want`
    /// features (all of which must be offered by the kernel).
    pub fn open(want: u64) -> io::Result<Uffd> {
        // SAFETY: rustix marks userfaultfd unsafe because the fd's ioctls manipulate
        // the address space; this fd is only used through the ioctls below, each of
        // which states its own contract.
        let fd = unsafe {
            rustix::mm::userfaultfd(
                rustix::mm::UserfaultfdFlags::CLOEXEC | rustix::mm::UserfaultfdFlags::NONBLOCK,
            )
        }?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads/writes exactly one `struct uffdio_api`, which `api` is.
        cvt(unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) })?;
        Ok(Uffd {
            fd,
            features: api.features,
        })
    }

    /// The userfaultfd itself.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Registers `[start, start+len)` in missing mode; returns the range
    /// operations the kernel offers on it (`1 << _UFFDIO_*` bits, see
    /// [`RANGE_MOVE`]).
    pub fn register(&self, start: usize, len: usize) -> io::Result<u64> {
        self.register_mode(start, len, REGISTER_MODE_MISSING)
    }

    /// Registers `[start, start+len)` in write-protect mode only. No page is
    /// write-protected unless `UFFDIO_WRITEPROTECT` asks for it (never done here), so
    /// such a range never faults to us: the registration only attaches the range to
    /// this userfaultfd, whose UNMAP / REMAP / REMOVE events then report it.
    pub fn register_events_only(&self, start: usize, len: usize) -> io::Result<()> {
        self.register_mode(start, len, REGISTER_MODE_WP).map(drop)
    }

    fn register_mode(&self, start: usize, len: usize, mode: u64) -> io::Result<u64> {
        let mut r = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: the ioctl reads/writes exactly one `struct uffdio_register`; it only
        // changes VMA flags of our own address space.
        cvt(unsafe { libc::ioctl(self.raw(), UFFDIO_REGISTER as _, &mut r) })?;
        Ok(r.ioctls)
    }

    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: the ioctl reads exactly one `struct uffdio_range`.
        cvt(unsafe { libc::ioctl(self.raw(), UFFDIO_UNREGISTER as _, &mut r) })
    }

    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: the ioctl reads exactly one `struct uffdio_range`.
        cvt(unsafe { libc::ioctl(self.raw(), UFFDIO_WAKE as _, &mut r) })
    }

    /// Atomically fills missing page(s) at `dst` with `len` bytes read from `src`.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes.
    pub unsafe fn copy(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
        wake: bool,
    ) -> Result<(), Partial> {
        let mut c = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: if wake { 0 } else { MODE_DONTWAKE },
            copy: 0,
        };
        // SAFETY: the ioctl reads/writes one `struct uffdio_copy`; the caller
        // guarantees `src` is readable; `dst` is only filled if it is missing.
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_COPY as _, &mut c) };
        partial(r, c.copy)
    }

    /// Maps the zero page at missing page(s) `[dst, dst+len)`.
    pub fn zeropage(&self, dst: usize, len: usize, wake: bool) -> Result<(), Partial> {
        let mut z = UffdioZeropage {
            range: UffdioRange {
                start: dst as u64,
                len: len as u64,
            },
            mode: if wake { 0 } else { MODE_DONTWAKE },
            zeropage: 0,
        };
        // SAFETY: the ioctl reads/writes one `struct uffdio_zeropage`; it only maps
        // pages where none are present.
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_ZEROPAGE as _, &mut z) };
        partial(r, z.zeropage)
    }

    /// Atomically moves the pages `[src, src+len)` to `[dst, dst+len)` (both
    /// anonymous, `dst` registered with this uffd and empty). After a move, an
    /// access to `src` is a missing fault.
    pub fn mv(&self, dst: usize, src: usize, len: usize, wake: bool) -> Result<(), Partial> {
        let mut m = UffdioMove {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: if wake { 0 } else { MODE_DONTWAKE },
            moved: 0,
        };
        // SAFETY: the ioctl reads/writes one `struct uffdio_move`; the kernel
        // validates both ranges against our own VMAs.
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_MOVE as _, &mut m) };
        partial(r, m.moved)
    }

    /// Reads up to `buf.len()` messages without blocking; returns how many.
    pub fn read_msgs(&self, buf: &mut [Msg]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(buf);
        // SAFETY: `buf` is valid for `bytes` bytes and `Msg` is plain old data of
        // the kernel's 32-byte layout.
        let n = unsafe { libc::read(self.raw(), buf.as_mut_ptr().cast(), bytes) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize / std::mem::size_of::<Msg>())
    }
}

fn partial(r: libc::c_int, done: i64) -> Result<(), Partial> {
    if r == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    Err(Partial {
        done: if done > 0 { done as u64 } else { 0 },
        err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_kernel() {
        assert_eq!(std::mem::size_of::<Msg>(), 32);
        assert_eq!(std::mem::size_of::<UffdioMove>(), 40);
        assert_eq!(std::mem::size_of::<UffdioCopy>(), 40);
        assert_eq!(std::mem::size_of::<UffdioZeropage>(), 32);
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
    }

    #[test]
    fn open_with_move() {
        let u = Uffd::open(FEATURE_MOVE | FEATURE_EVENT_UNMAP).expect("userfaultfd");
        assert_ne!(u.features & FEATURE_MOVE, 0);
    }
}
