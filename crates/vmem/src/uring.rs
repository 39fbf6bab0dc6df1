//! Polled reads: one O_DIRECT read submitted to a per-thread io_uring whose
//! completion the thread waits for by polling the completion queue instead
//! of sleeping in `pread(2)`. A blocking read is woken by the I/O completion
//! (on a 2-core VM that wake-up costs ~10–15 µs of a ~45 µs 4 KiB read, more
//! when the core is busy); a polling thread is merely interrupted to post the
//! completion. Polling is bounded: after [`SPIN`] the thread blocks in
//! `io_uring_enter` like any other read. Where io_uring is unavailable
//! (disabled by `kernel.io_uring_disabled`, seccomp, an old kernel) every call
//! says so and the caller reads with `pread(2)`.

use io_uring::{opcode, types, IoUring};
use std::cell::RefCell;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a read is polled before the thread blocks for it.
const SPIN: Duration = Duration::from_micros(500);

/// Set once a ring could not be created: no thread tries again.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);

thread_local! {
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// Reads `buf.len()` bytes at `off` of `file` (opened with O_DIRECT; `buf`
/// aligned as O_DIRECT requires) by polling a per-thread io_uring. `None`:
/// io_uring is not available here — nothing was read, use `pread(2)`.
pub fn read_polled(file: &impl AsRawFd, buf: &mut [u8], off: u64) -> Option<io::Result<()>> {
    if UNAVAILABLE.load(Ordering::Relaxed) {
        return None;
    }
    RING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_none() {
            match IoUring::new(4) {
                Ok(ring) => *r = Some(ring),
                Err(e) => {
                    tracing::info!(%e, "io_uring unavailable; swap reads block in pread");
                    UNAVAILABLE.store(true, Ordering::Relaxed);
                    return None;
                }
            }
        }
        let ring = r.as_mut()?;
        Some(read_on(ring, file.as_raw_fd(), buf, off))
    })
}

fn read_on(ring: &mut IoUring, fd: i32, buf: &mut [u8], off: u64) -> io::Result<()> {
    let len = u32::try_from(buf.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let sqe = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), len)
        .offset(off)
        .build();
    // SAFETY: the buffer is valid for `len` bytes and stays borrowed until the
    // read's completion has been taken below (this function returns only
    // then: the loop polls, then blocks, until the completion queue holds it;
    // the ring is this thread's and has nothing else in flight).
    unsafe { ring.submission().push(&sqe) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))?;
    ring.submit()?;
    let t0 = Instant::now();
    let res = loop {
        if let Some(c) = ring.completion().next() {
            break c.result();
        }
        if t0.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            ring.submit_and_wait(1)?;
        }
    };
    match res {
        r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
        r if r as u32 == len => Ok(()),
        r => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short swap read: {r} of {len} bytes"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mm::{PageBuf, PAGE};
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    #[test]
    fn polled_read_returns_the_bytes_written_or_says_unavailable() {
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
        let mut w = PageBuf::new(2);
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        f.write_all_at(w.as_mut_slice(), 0).unwrap();
        let mut r = PageBuf::new(1);
        match read_polled(&f, r.as_mut_slice(), PAGE as u64) {
            None => assert!(UNAVAILABLE.load(Ordering::Relaxed)),
            Some(res) => {
                res.unwrap();
                assert_eq!(r.as_mut_slice(), &w.as_mut_slice()[PAGE..]);
                // Past the end of the file: a short read is an error.
                assert!(read_polled(&f, r.as_mut_slice(), 4 * PAGE as u64)
                    .unwrap()
                    .is_err());
            }
        }
    }
}
