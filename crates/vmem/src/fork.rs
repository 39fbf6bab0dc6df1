//! fork() with managed memory: the child of a process whose pager swapped
//! pages out gets the parent's contents of every managed page, as it would
//! without a pager (a child's copy of a private anonymous mapping is not
//! registered with the parent's userfaultfd, so a page the pager had moved
//! out would read as zeroes there).
//!
//! How: `pthread_atfork` handlers, registered with the first pager. Before
//! the fork (`prepare`) every live pager's evictor is held between batches
//! (its lock) and its address space read-locked, so the child's copy of the
//! pager's state is consistent, and the swap device keeps every slot
//! allocated at that moment from reuse until the child is done
//! (`SwapDevice::hold_for_child`: slots freed meanwhile are released later).
//! Right after the fork the parent lets both go and goes on at once: its
//! evictor and peers keep working. The child (`child`) reads the slot of
//! every swapped-out page its copy lacks into that copy (plain `pread`; the
//! child has none of the parent's threads), then closes its end of a pipe,
//! which tells the parent's swap device that it is done (or its death does).
//! Never-touched pages read as zeroes in the child, which is what they hold.
//! Not covered: a page whose write the pager announced but had not filled
//! yet at the fork (`Pager::write_absent_then`) shows its old contents there.

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
    /// The child closes its copy once its pages are in (the read ends are
    /// with the pagers' swap devices).
    _tx: OwnedFd,
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
    let flags = rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK;
    let Ok((rx, tx)) = rustix::pipe::pipe_with(flags) else {
        tracing::error!("fork: no pipe; a child may read swapped-out pages as zeroes");
        return;
    };
    for i in &pagers {
        // Held across the fork, released by `parent` and `child` (force_unlock).
        std::mem::forget(i.evict.lock());
        std::mem::forget(i.space.read());
        match rx.try_clone() {
            Ok(r) => i.swap.hold_for_child(r),
            Err(e) => tracing::error!(%e, "fork: a child may read reused swap slots"),
        }
    }
    HELD.with(|h| *h.borrow_mut() = Some(Held { pagers, _tx: tx }));
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
    let Some(h) = HELD.with(|h| h.borrow_mut().take()) else {
        return;
    };
    // Our copy of the write end goes: the child's is the last (none if fork
    // failed, and the slots are free to go at the next look).
    release(&h.pagers);
    drop(h);
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
