//! The host's NIC thread: serves the request rings of its QPs (small READ/WRITE,
//! atomics and shared large copies from peers in other processes), progresses deferred
//! local work (RNR retry timers; outstanding requests while the application is not
//! polling), spins only while it has recent work and otherwise blocks on a futex in the
//! segment.

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
/// While spinning, deferred work is looked at this often (or when kicked).
const DEFERRED_EVERY_NS: u64 = 20_000;

/// Serve every doorbell that rang, unless another thread is serving them (it then
/// sees what rang). Returns whether any request was served.
pub(crate) fn serve_doorbells(h: &HostInner) -> bool {
    let seg = &h.seg;
    // Cheap idle test first: no lock traffic while nothing rang.
    if (0..seg.doorbell_words()).all(|w| seg.doorbell_word(w).load(Ordering::Acquire) == 0) {
        return false;
    }
    match h.ring_server.try_lock() {
        Some(mut srv) => serve_doorbells_locked(h, &mut srv),
        None => false,
    }
}

/// [`serve_doorbells`] with `h.ring_server` held by the caller.
pub(crate) fn serve_doorbells_locked(h: &HostInner, srv: &mut crate::inbound::RingServer) -> bool {
    let seg = &h.seg;
    let mut work = false;
    for w in 0..seg.doorbell_words() {
        let word = seg.doorbell_word(w);
        // Load first: swapping an idle word on every spin would keep stealing the
        // cache line from requesters.
        if word.load(Ordering::Acquire) == 0 {
            continue;
        }
        let mut bits = word.swap(0, Ordering::AcqRel);
        while bits != 0 {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            while responder::serve_one(seg, &h.self_peer, w * 64 + b, h.cfg.dma_section, srv) {
                work = true;
            }
        }
    }
    work
}

struct Deferred {
    work: bool,
    next_deadline: Option<u64>,
    outstanding: bool,
    attend: bool,
}

/// Progress local QPs with due RNR timers or unattended outstanding requests; prune
/// QPs with nothing pending from the active list.
fn deferred(h: &HostInner, now: u64) -> Deferred {
    let attend = now < h.attend_until.load(Ordering::Acquire);
    let act: Vec<Arc<QpInner>> = h.active.lock().iter().filter_map(|w| w.upgrade()).collect();
    let mut d = Deferred {
        work: false,
        next_deadline: None,
        outstanding: false,
        attend,
    };
    let mut idle: Vec<*const QpInner> = Vec::new();
    for q in &act {
        let dl = q.deadline.load(Ordering::Relaxed);
        let out = q.outstanding.load(Ordering::Relaxed);
        let stale = now.saturating_sub(q.last_progress.load(Ordering::Relaxed)) > UNATTENDED_NS;
        if (dl != 0 && dl <= now) || (out > 0 && (attend || stale)) {
            q.progress();
            d.work |= dl != 0 || attend;
        }
        let dl = q.deadline.load(Ordering::Relaxed);
        let out = q.outstanding.load(Ordering::Relaxed);
        if dl != 0 {
            d.next_deadline = Some(d.next_deadline.map_or(dl, |x: u64| x.min(dl)));
        }
        d.outstanding |= out > 0;
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
    d
}

pub(crate) fn run(h: Arc<HostInner>) {
    let seg = h.seg.clone();
    let hdr = seg.mbox();
    h.odp.set_nic_thread();
    let base_spin = h.cfg.nic_spin.as_nanos() as u64;
    // Adaptive spin window: if a doorbell wakes us soon after we went to sleep, the
    // spin window was too short for the request rate (each wakeup costs ~50-100 us,
    // which would itself stretch the gaps past the window): double it, up to 32x.
    let mut spin_ns = base_spin;
    let mut slept_at = 0u64;
    let mut last_work = 0u64;
    let mut last_seq = hdr.nic_seq.load(Ordering::SeqCst).wrapping_sub(1);
    let mut next_check = 0u64;
    let mut d = Deferred {
        work: false,
        next_deadline: None,
        outstanding: false,
        attend: false,
    };
    while !h.shutdown.load(Ordering::Acquire) {
        let seq = hdr.nic_seq.load(Ordering::SeqCst);
        let mut work = serve_doorbells(&h);
        // Another thread polls the rings: do not spin for them.
        let ext = hdr.ext_polling.load(Ordering::SeqCst) != 0;
        work |= crate::odp::serve(&h);
        let now = sys::now_ns();
        if seq != last_seq || now >= next_check || d.attend {
            last_seq = seq;
            next_check = now + DEFERRED_EVERY_NS;
            d = deferred(&h, now);
            work |= d.work;
        }
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
        if !ext && now.saturating_sub(last_work) < spin_ns {
            std::hint::spin_loop();
            continue;
        }
        if slept_at == 0 {
            slept_at = now;
        }
        // Deferred state must be current before deciding how long to sleep.
        if seq != hdr.nic_seq.load(Ordering::SeqCst) {
            continue;
        }
        d = deferred(&h, now);
        if d.work {
            continue;
        }
        hdr.nic_sleeping.store(1, Ordering::SeqCst);
        // Pending doorbells keep us awake unless the external poller serves them
        // (it serves what is pending when it stops, see `Host::set_ring_polling`).
        let ext = hdr.ext_polling.load(Ordering::SeqCst) != 0;
        let pending = (!ext && (0..seg.doorbell_words()).any(|w| seg.doorbell_word(w).load(Ordering::SeqCst) != 0))
            || crate::odp::mail_pending(&seg);
        if !pending && !h.shutdown.load(Ordering::SeqCst) {
            let mut timeout = d.next_deadline.map(|x| x.saturating_sub(now));
            if d.outstanding {
                let t = if d.attend { 20_000 } else { UNATTENDED_NS };
                timeout = Some(timeout.map_or(t, |x| x.min(t)));
            }
            let timeout = timeout.map_or(MAX_SLEEP_NS, |t| t.min(MAX_SLEEP_NS));
            sys::futex_wait(&hdr.nic_seq, seq, Some(Duration::from_nanos(timeout)));
        }
        hdr.nic_sleeping.store(0, Ordering::SeqCst);
        next_check = 0;
    }
}
