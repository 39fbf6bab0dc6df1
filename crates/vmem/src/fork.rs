//! fork() with managed memory: the child of a process whose pager swapped
//! pages out gets the parent's contents of every managed page, as it would
//! without a pager (a child's copy of a private anonymous mapping is not
//! registered with the parent's userfaultfd, so a page the pager had moved
//! out would read as zeroes there).
//!
//! How: `pthread_atfork` handlers, registered with the first pager. Before
//! the fork (`prepare`) every live pager's evictor is held between batches
//! (its lock) and its address space read-locked, so no swap slot is
//! rewritten and no registration changes. Right after the fork, the child
//! (`child`) reads the slot of every swapped-out page its copy lacks into
//! that copy (plain `pread`; the child has none of the parent's threads),
//! then lets the parent go on (`parent` waits for that on a pipe the child
//! closes, or for the child's death). The parent's peers keep working
//! meanwhile: only its eviction pauses, for about one swap read per
//! swapped-out page. Never-touched pages read as zeroes in the child, which
//! is what they hold. Not covered: a page whose write the pager announced
//! but had not filled yet at the fork (`Pager::write_absent_then`) shows its
//! old contents in the child.

use crate::core::Inner;
use crate::mm::{self, PageBuf, PAGE, PAGE_SHIFT};
use crate::state::{self, SWAPPED};
use std::cell::RefCell;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Once, Weak};

/// The live pagers of the process.
static PAGERS: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

/// What `prepare` holds for `parent` / `child` (same thread: the one forking).
struct Held {
    pagers: Vec<Arc<Inner>>,
    /// The child closes its copy of `tx` once its pages are in.
    rx: OwnedFd,
    tx: Option<OwnedFd>,
}

thread_local! {
    static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// Follow `inner` across forks (installs the handlers once per process).
pub(crate) fn register(inner: &Arc<Inner>) {
    static HANDLERS: Once = Once::new();
    HANDLERS.call_once(|| {
        // SAFETY: the three handlers are plain `extern "C"` functions that live
        // as long as the process (pthread_atfork keeps the pointers).
        let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if r != 0 {
            tracing::error!(
                r,
                "pthread_atfork failed: a forked child may read swapped-out pages as zeroes"
            );
        }
    });
    let mut l = PAGERS.lock().unwrap_or_else(|p| p.into_inner());
    l.retain(|w| w.strong_count() > 0);
    l.push(Arc::downgrade(inner));
}

extern "C" fn prepare() {
    let pagers: Vec<Arc<Inner>> = PAGERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let Ok((rx, tx)) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) else {
        tracing::error!("fork: no pipe; a child may read swapped-out pages as zeroes");
        return;
    };
    for i in &pagers {
        // Held across the fork, released by `parent` and `child` (force_unlock).
        std::mem::forget(i.evict.lock());
        std::mem::forget(i.space.read());
    }
    HELD.with(|h| {
        *h.borrow_mut() = Some(Held {
            pagers,
            rx,
            tx: Some(tx),
        })
    });
}

/// Releases what `prepare` took.
fn release(pagers: &[Arc<Inner>]) {
    for i in pagers {
        // SAFETY: `prepare`, on this thread, took one read lock of `space`
        // and the `evict` lock and forgot the guards; each is released once.
        unsafe {
            i.space.force_unlock_read();
            i.evict.force_unlock();
        }
    }
}

extern "C" fn parent() {
    let Some(mut h) = HELD.with(|h| h.borrow_mut().take()) else {
        return;
    };
    // Our copy of the write end goes; the read returns once the child closed
    // its copy (its pages are in) or died — at once if fork failed.
    drop(h.tx.take());
    let mut b = [0u8; 1];
    while let Err(rustix::io::Errno::INTR) = rustix::io::read(&h.rx, &mut b) {}
    release(&h.pagers);
}

extern "C" fn child() {
    let Some(h) = HELD.with(|h| h.borrow_mut().take()) else {
        return;
    };
    for i in &h.pagers {
        i.fill_child_copy();
    }
    release(&h.pagers);
    drop(h);
}

impl Inner {
    /// In a forked child (only this thread runs): reads every swapped-out
    /// managed page the child's copy lacks from its swap slot into it.
    fn fill_child_copy(&self) {
        // SAFETY: `prepare` holds a read lock of `space` (forgotten guard), so
        // no writer was inside when the process forked, and no other thread
        // exists in the child: the data is stable while we read it.
        let space = unsafe { &*self.space.data_ptr() };
        const CHUNK: usize = 1 << 16;
        let mut buf = PageBuf::new(1);
        let mut vec = vec![0u8; CHUNK];
        for s in space.all().filter(|s| !s.arr.external) {
            let mut p0 = s.start;
            while p0 < s.end {
                let n = (s.end - p0).min(CHUNK);
                // A range missing in the child (not inherited) is skipped.
                if mm::mincore(p0 << PAGE_SHIFT, n * PAGE, &mut vec[..n]).is_ok() {
                    for p in p0..p0 + n {
                        let v = s.arr.word(p).load(std::sync::atomic::Ordering::Acquire);
                        let Some(slot) = state::slot(v).filter(|_| state::kind(v) == SWAPPED)
                        else {
                            continue;
                        };
                        if vec[p - p0] & 1 != 0
                            || self.swap.read_plain(slot, buf.as_mut_slice()).is_err()
                        {
                            continue;
                        }
                        // SAFETY: page `p` lies in a private anonymous mapping the
                        // child inherited (mincore succeeded over it) and holds no
                        // page yet; `buf` is one page of our own.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr(),
                                (p << PAGE_SHIFT) as *mut u8,
                                PAGE,
                            )
                        };
                    }
                }
                p0 += n;
            }
        }
    }
}
