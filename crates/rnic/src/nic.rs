//! The host's NIC thread: serves the request rings of its QPs (small READ/WRITE and
//! atomics from peers in other processes), progresses deferred local work (RNR retry
//! timers; outstanding requests while the application is not polling), spins only
//! while it has recent work and otherwise blocks on a futex in the segment.

use crate::host::HostInner;
use crate::qp::QpInner;
use crate::responder;
use crate::sys;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// After this long without an application progressing a QP, the NIC thread does.
const UNATTENDED_NS: u64 = 1_000_000;
/// The NIC thread never sleeps longer than this (it then re-checks deferred work).
pub(crate) const MAX_SLEEP_NS: u64 = 10_000_000;

pub(crate) fn run(h: Arc<HostInner>) {
    let seg = h.seg.clone();
    let hdr = seg.hdr();
    let base_spin = h.cfg.nic_spin.as_nanos() as u64;
    // Adaptive spin window: if a doorbell wakes us soon after we went to sleep, the
    // spin window was too short for the request rate (each wakeup costs ~50-100 us,
    // which would itself stretch the gaps past the window): double it, up to 32x.
    let mut spin_ns = base_spin;
    let mut slept_at = 0u64;
    let section = h.cfg.dma_section;
    let mut last_work = 0u64;
    while !h.shutdown.load(Ordering::Acquire) {
        let seq = hdr.nic_seq.load(Ordering::SeqCst);
        let mut work = false;
        for w in 0..seg.doorbell_words() {
            let mut bits = seg.doorbell_word(w).swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                while responder::serve_one(&seg, &h.self_peer, w * 64 + b, section) {
                    work = true;
                }
            }
        }
        let now = sys::now_ns();
        let attend = now < h.attend_until.load(Ordering::Acquire);
        let act: Vec<Arc<QpInner>> = h.active.lock().iter().filter_map(|w| w.upgrade()).collect();
        let mut next_deadline: Option<u64> = None;
        let mut outstanding = false;
        let mut idle: Vec<*const QpInner> = Vec::new();
        for q in &act {
            let dl = q.deadline.load(Ordering::Relaxed);
            let out = q.outstanding.load(Ordering::Relaxed);
            let stale = now.saturating_sub(q.last_progress.load(Ordering::Relaxed)) > UNATTENDED_NS;
            if (dl != 0 && dl <= now) || (out > 0 && (attend || stale)) {
                q.progress();
                work |= dl != 0 || attend;
            }
            let dl = q.deadline.load(Ordering::Relaxed);
            let out = q.outstanding.load(Ordering::Relaxed);
            if dl != 0 {
                next_deadline = Some(next_deadline.map_or(dl, |d: u64| d.min(dl)));
            }
            if out > 0 {
                outstanding = true;
            }
            if dl == 0 && out == 0 {
                idle.push(Arc::as_ptr(q));
            }
        }
        if !idle.is_empty() || act.len() != h.active.lock().len() {
            let mut a = h.active.lock();
            a.retain(|w| match w.upgrade() {
                Some(q) => {
                    if idle.contains(&Arc::as_ptr(&q))
                        && q.deadline.load(Ordering::Relaxed) == 0
                        && q.outstanding.load(Ordering::Relaxed) == 0
                    {
                        q.in_active.store(false, Ordering::Release);
                        // Re-check after clearing the flag: new work re-activates itself.
                        q.deadline.load(Ordering::Acquire) != 0 || q.outstanding.load(Ordering::Acquire) != 0
                    } else {
                        true
                    }
                }
                None => false,
            });
        }
        drop(act);
        if work {
            if slept_at != 0 {
                let gap = now.saturating_sub(slept_at);
                spin_ns = if gap < 4 * spin_ns {
                    (spin_ns * 2).min(base_spin * 32)
                } else {
                    base_spin
                };
                slept_at = 0;
            }
            last_work = now;
            continue;
        }
        if now.saturating_sub(last_work) < spin_ns {
            std::hint::spin_loop();
            continue;
        }
        if slept_at == 0 {
            slept_at = now;
        }
        hdr.nic_sleeping.store(1, Ordering::SeqCst);
        let pending = (0..seg.doorbell_words()).any(|w| seg.doorbell_word(w).load(Ordering::SeqCst) != 0);
        if !pending && !h.shutdown.load(Ordering::SeqCst) {
            let mut timeout = next_deadline.map(|d| d.saturating_sub(now));
            if outstanding {
                let t = if attend { 20_000 } else { UNATTENDED_NS };
                timeout = Some(timeout.map_or(t, |x| x.min(t)));
            }
            let timeout = timeout.map_or(MAX_SLEEP_NS, |t| t.min(MAX_SLEEP_NS));
            sys::futex_wait(&hdr.nic_seq, seq, Some(Duration::from_nanos(timeout)));
        }
        hdr.nic_sleeping.store(0, Ordering::SeqCst);
    }
}
