//! The swap device's I/O threads: a batch of page reads or writes at distinct
//! offsets is issued concurrently, so the device's queue depth is used. The
//! calling thread does one share of the batch itself (a batch of one never
//! leaves it); idle I/O threads block on a condition variable, never spin.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;

/// One page-aligned transfer of a batch: `len` bytes at `ptr` from/to file
/// offset `off`.
pub struct IoOp {
    pub ptr: *mut u8,
    pub len: usize,
    pub off: u64,
    pub res: io::Result<()>,
}

impl IoOp {
    /// A read of `buf` at `off`.
    pub fn read(buf: &mut [u8], off: u64) -> IoOp {
        IoOp {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            off,
            res: Ok(()),
        }
    }
    /// A write of `data` at `off` (the pointer is only read from).
    pub fn write(data: &[u8], off: u64) -> IoOp {
        IoOp {
            ptr: data.as_ptr() as *mut u8,
            len: data.len(),
            off,
            res: Ok(()),
        }
    }
}

/// A batch's completion count and per-op results.
struct Done {
    m: Mutex<(usize, Vec<Option<io::Error>>)>,
    cv: Condvar,
}

struct Job {
    write: bool,
    ptr: usize,
    len: usize,
    off: u64,
    idx: usize,
    done: Arc<Done>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
}

struct Shared {
    file: Arc<File>,
    q: Mutex<Queue>,
    cv: Condvar,
}

/// Up to `threads` I/O threads over one file, started on first need.
pub struct IoPool {
    sh: Arc<Shared>,
    max_threads: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Performs one transfer in the current thread.
fn transfer(file: &File, write: bool, ptr: usize, len: usize, off: u64) -> io::Result<()> {
    // SAFETY: the submitter of the batch keeps every buffer alive, and does
    // not touch it, until all of the batch's jobs reported completion
    // (`IoPool::run` waits, also when unwinding); the buffers of a batch are
    // disjoint, so this slice aliases nothing else while it lives.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    if write {
        file.write_all_at(buf, off)
    } else {
        crate::uring::read_at(file, buf, off)
    }
}

fn worker(sh: Arc<Shared>) {
    loop {
        let job = {
            let mut q = sh.q.lock();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                sh.cv.wait(&mut q);
            }
        };
        let r = transfer(&sh.file, job.write, job.ptr, job.len, job.off);
        finish(&job.done, job.idx, r);
    }
}

fn finish(done: &Done, idx: usize, r: io::Result<()>) {
    let mut d = done.m.lock();
    if let Err(e) = r {
        d.1[idx] = Some(e);
    }
    d.0 -= 1;
    if d.0 == 0 {
        done.cv.notify_all();
    }
}

impl IoPool {
    /// A pool over `file` with at most `max_threads` I/O threads (0 = every
    /// batch runs in the calling thread, one op after the other).
    pub fn new(file: Arc<File>, max_threads: usize) -> IoPool {
        IoPool {
            sh: Arc::new(Shared {
                file,
                q: Mutex::new(Queue::default()),
                cv: Condvar::new(),
            }),
            max_threads,
            threads: Mutex::new(Vec::new()),
        }
    }

    /// I/O threads started so far.
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        self.threads.lock().len()
    }

    /// Runs every op of `ops` (reads, or writes if `write`), concurrently
    /// when there are several; each op's outcome lands in its `res`. Returns
    /// when all are done.
    pub fn run(&self, ops: &mut [IoOp], write: bool) {
        let file = &self.sh.file;
        if ops.len() <= 1 || self.max_threads == 0 {
            for op in ops.iter_mut() {
                op.res = transfer(file, write, op.ptr as usize, op.len, op.off);
            }
            return;
        }
        let n = ops.len();
        let done = Arc::new(Done {
            m: Mutex::new((n - 1, (0..n).map(|_| None).collect())),
            cv: Condvar::new(),
        });
        // Waits for the handed-out jobs even if this thread unwinds, so that
        // no I/O thread ever touches a buffer its owner has freed.
        struct WaitAll<'a>(&'a Done);
        impl Drop for WaitAll<'_> {
            fn drop(&mut self) {
                let mut d = self.0.m.lock();
                while d.0 > 0 {
                    self.0.cv.wait(&mut d);
                }
            }
        }
        {
            let mut q = self.sh.q.lock();
            for (idx, op) in ops.iter().enumerate().skip(1) {
                q.jobs.push_back(Job {
                    write,
                    ptr: op.ptr as usize,
                    len: op.len,
                    off: op.off,
                    idx,
                    done: done.clone(),
                });
            }
            // Threads grow to the largest batch seen (at most `max_threads`)
            // and then stay, blocked while idle.
            let want = (n - 1).min(self.max_threads);
            let mut threads = self.threads.lock();
            while threads.len() < want {
                let sh = self.sh.clone();
                match std::thread::Builder::new()
                    .name("vmem-swap-io".into())
                    .spawn(move || worker(sh))
                {
                    Ok(t) => threads.push(t),
                    Err(e) => {
                        // Fewer threads only means less overlap; the caller
                        // drains the queue itself below.
                        tracing::warn!(%e, "could not start a swap I/O thread");
                        break;
                    }
                }
            }
            // One wake-up per job, not a herd.
            for _ in 1..n.min(threads.len() + 1) {
                self.sh.cv.notify_one();
            }
        }
        let wait = WaitAll(&done);
        // Our own share: the first op, then any of our jobs no thread took yet.
        ops[0].res = transfer(file, write, ops[0].ptr as usize, ops[0].len, ops[0].off);
        loop {
            let job = {
                let mut q = self.sh.q.lock();
                let pos = q.jobs.iter().position(|j| Arc::ptr_eq(&j.done, &done));
                pos.and_then(|p| q.jobs.remove(p))
            };
            let Some(j) = job else { break };
            let r = transfer(file, j.write, j.ptr, j.len, j.off);
            finish(&done, j.idx, r);
        }
        drop(wait);
        let mut d = done.m.lock();
        for (op, e) in ops.iter_mut().zip(d.1.iter_mut()).skip(1) {
            op.res = match e.take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
        }
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.sh.q.lock().shutdown = true;
        self.sh.cv.notify_all();
        for t in self.threads.get_mut().drain(..) {
            let _ = t.join();
        }
    }
}
