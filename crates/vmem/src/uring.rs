//! Swap reads waited for by polling: a thread that spins anyway (NP-RDMA's
//! polling thread, while it has its core to itself) opts in with
//! [`poll_swap_reads`]; its reads are then submitted to a per-thread
//! io_uring and their completions polled for, instead of sleeping in
//! `pread(2)`. A sleeping reader leaves its core idle: on a VM the wake-up
//! around the read then costs a halted vCPU's wake (the device's interrupt
//! lands on one core; 20–30 µs of a ~60 µs 4 KiB read on this machine,
//! BENCHMARKS "Session 17"); a polling thread's core stays busy. The ring
//! runs completions cooperatively (`IORING_SETUP_COOP_TASKRUN` with its
//! flag, where the kernel has them): the completion's task work does not
//! interrupt the thread with an IPI either; the thread sees the flag and
//! enters the kernel to run it. Polling is bounded: after [`SPIN`] the
//! thread blocks in `io_uring_enter` like any other read. Threads that did
//! not opt in (the I/O pool's, the application's) always read with `pread`;
//! so does every thread where io_uring is unavailable (disabled by
//! `kernel.io_uring_disabled`, seccomp, an old kernel).

use io_uring::{opcode, types, IoUring};
use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a read is polled before the thread blocks for it.
const SPIN: Duration = Duration::from_micros(500);

/// Set once a ring could not be created: no thread tries again.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);
/// Reads done polled, process-wide.
static POLLED: AtomicU64 = AtomicU64::new(0);

/// How many swap reads of this process were polled for (see
/// [`poll_swap_reads`]).
pub fn polled_swap_reads() -> u64 {
    POLLED.load(Ordering::Relaxed)
}

/// Whether this process can create an io_uring (so threads that opt in poll
/// for their swap reads); asks the kernel the first time.
pub fn swap_reads_can_poll() -> bool {
    static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAN.get_or_init(|| !UNAVAILABLE.load(Ordering::Relaxed) && IoUring::new(1).is_ok())
}

thread_local! {
    static POLL: Cell<bool> = const { Cell::new(false) };
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// Whether the calling thread waits for its own swap reads by polling
/// (`true`: a thread that spins anyway, with a core to itself) or by
/// sleeping in `pread` (`false`, every thread's default).
pub fn poll_swap_reads(on: bool) {
    POLL.with(|p| p.set(on));
}

/// Reads `buf.len()` bytes at `off` of `file`: polled if this thread opted in
/// and io_uring is available, else with `pread`.
pub(crate) fn read_at(file: &File, buf: &mut [u8], off: u64) -> io::Result<()> {
    if POLL.with(Cell::get) {
        if let Some(r) = read_polled(file, buf, off) {
            return r;
        }
    }
    file.read_exact_at(buf, off)
}

/// A polled read on this thread's ring; `None`: io_uring is not available
/// here — nothing was read.
pub(crate) fn read_polled(file: &File, buf: &mut [u8], off: u64) -> Option<io::Result<()>> {
    if UNAVAILABLE.load(Ordering::Relaxed) {
        return None;
    }
    RING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_none() {
            // Cooperative task running: a completion's task work does not
            // interrupt this (spinning) thread with an IPI; the ring's flag
            // says it is pending and the next `io_uring_enter` runs it.
            let built = IoUring::builder()
                .setup_coop_taskrun()
                .setup_taskrun_flag()
                .build(4)
                .or_else(|_| IoUring::new(4));
            match built {
                Ok(ring) => *r = Some(ring),
                Err(e) => {
                    tracing::info!(%e, "io_uring unavailable; swap reads block in pread");
                    UNAVAILABLE.store(true, Ordering::Relaxed);
                    return None;
                }
            }
        }
        let ring = r.as_mut()?;
        match read_on(ring, file.as_raw_fd(), buf, off) {
            Done::Read(res) => {
                POLLED.fetch_add(1, Ordering::Relaxed);
                Some(res)
            }
            // The entry never reached the kernel: drop the ring with it (it
            // must never be submitted later, its buffer is the caller's) and
            // read with pread.
            Done::NotSubmitted(e) => {
                tracing::debug!(%e, "io_uring submission failed; pread instead");
                *r = None;
                None
            }
        }
    })
}

enum Done {
    Read(io::Result<()>),
    NotSubmitted(io::Error),
}

fn read_on(ring: &mut IoUring, fd: i32, buf: &mut [u8], off: u64) -> Done {
    let Ok(len) = u32::try_from(buf.len()) else {
        return Done::Read(Err(io::Error::from(io::ErrorKind::InvalidInput)));
    };
    let sqe = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), len)
        .offset(off)
        .build();
    // SAFETY: the buffer is valid for `len` bytes and stays borrowed until the
    // read's completion has been taken below: once submitted, this function
    // returns only with the completion (it polls, then blocks, until the
    // completion queue holds it); unsubmitted, the caller drops the ring with
    // the entry. The ring is this thread's and has nothing else in flight.
    if unsafe { ring.submission().push(&sqe) }.is_err() {
        return Done::NotSubmitted(io::Error::other("io_uring submission queue full"));
    }
    loop {
        match ring.submit() {
            Ok(1) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Ok(n) => return Done::NotSubmitted(io::Error::other(format!("{n} entries submitted"))),
            Err(e) => return Done::NotSubmitted(e),
        }
    }
    let t0 = Instant::now();
    let res = loop {
        if let Some(c) = ring.completion().next() {
            break c.result();
        }
        if ring.submission().taskrun() {
            // The completion's task work is pending: entering runs it.
            let _ = ring.submit();
        } else if t0.elapsed() < SPIN {
            std::hint::spin_loop();
        } else if let Err(e) = ring.submit_and_wait(1) {
            // The read is in flight: wait on whatever the error was.
            if e.raw_os_error() != Some(libc::EINTR) {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    };
    Done::Read(match res {
        r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
        r if r as u32 == len => Ok(()),
        r => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short swap read: {r} of {len} bytes"),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mm::{PageBuf, PAGE};
    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn polled_reads_return_the_bytes_written() {
        let path = std::env::temp_dir().join(format!("vmem-uring-{}", std::process::id()));
        let f = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                eprintln!("skipped: {} refuses O_DIRECT", path.display());
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let _ = std::fs::remove_file(&path);
        let mut w = PageBuf::new(3);
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        f.write_all_at(w.as_mut_slice(), 0).unwrap();
        poll_swap_reads(true);
        for (pages, at) in [(1, 1), (2, 1), (1, 0)] {
            let mut r = PageBuf::new(pages);
            read_at(&f, r.as_mut_slice(), (at * PAGE) as u64).unwrap();
            assert_eq!(
                r.as_mut_slice(),
                &w.as_mut_slice()[at * PAGE..(at + pages) * PAGE]
            );
        }
        // They went through this thread's ring (unless io_uring is unavailable).
        assert!(RING.with(|r| r.borrow().is_some()) || UNAVAILABLE.load(Ordering::Relaxed));
        // Past the end of the file: a short read is an error, polled or not.
        let mut r = PageBuf::new(1);
        assert!(read_at(&f, r.as_mut_slice(), 4 * PAGE as u64).is_err());
        poll_swap_reads(false);
        assert!(read_at(&f, r.as_mut_slice(), 4 * PAGE as u64).is_err());
        read_at(&f, r.as_mut_slice(), 2 * PAGE as u64).unwrap();
        assert_eq!(r.as_mut_slice(), &w.as_mut_slice()[2 * PAGE..]);
    }
}
