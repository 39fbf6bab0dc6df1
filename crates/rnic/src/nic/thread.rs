//! The host's NIC thread: serves the request rings of its QPs (small READ/WRITE,
//! atomics and shared large copies from peers in other processes), progresses deferred
//! local work (RNR retry timers; outstanding requests while the application is not
//! polling), spins only while it has recent work and otherwise blocks on a futex in the
//! segment.

use crate::hw::segment::{NIC_ASLEEP, NIC_ASLEEP_ATTENDING};
use crate::nic::cq_ring;
use crate::nic::qp_ctx::{HostQps, QpCtx};
use crate::nic::responder;
use crate::nic::state::Nic;
use crate::sys;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// After this long without an application progressing a QP, the NIC thread does.
const UNATTENDED_NS: u64 = 1_000_000;
/// The NIC thread never sleeps longer than this (it then re-checks deferred work).
pub(crate) const MAX_SLEEP_NS: u64 = 10_000_000;
/// Spinning without work longer than this yields the core at every turn.
const YIELD_AFTER_NS: u64 = 20_000;
/// While spinning, deferred work is looked at this often (or when kicked).
const DEFERRED_EVERY_NS: u64 = 20_000;
/// The NIC thread looks this often whether an application thread polls a CQ
/// of this host (`Nic::cq_polled`).
const CQ_POLLS_EVERY_NS: u64 = 20_000;
/// The NIC thread spins for the rings only once no CQ poll was seen for this
/// long: an application that polls now and then (ib_write_lat polls its CQ for
/// its own WRITE, then spins on memory for the peer's) serves the rings in its
/// polls, and a NIC thread spinning beside it is one spinner too many on 2
/// cores, worst when a loaded machine keeps the application off its core for
/// a while.
const CQ_QUIET_NS: u64 = 1_000_000;

/// The initiator of QP `idx`'s requests may sleep attending an application that
/// blocked: wake it now that answers are in its slots (see `Segment::kick_answer`).
fn wake_initiator(h: &Nic, idx: u32) {
    let Some(r) = h.seg.qp(idx) else { return };
    let nonce = r.peer_nonce.load(Ordering::Acquire);
    let Some(peer) = h.peers.lock().get(&nonce).cloned() else {
        return;
    };
    // Our answers' SLOT_DONE stores before its NIC thread's `nic_sleeping`: either
    // it sees them in its last check before sleeping, or we see it asleep.
    std::sync::atomic::fence(Ordering::SeqCst);
    peer.seg.kick_answer();
}

/// Retire the answered requests of local QP `idx`, if it has any outstanding;
/// false when another thread holds its send queue (its requests' answers may not
/// be retired yet, so the peer's new requests must wait). A QP starting requests
/// raises `outstanding` before the first one is visible (`QpCtx::progress_locked`).
pub(crate) fn retire_answered(qps: &HostQps, idx: u32) -> bool {
    let Some(q) = qps.get(idx) else { return true };
    if q.outstanding.load(Ordering::Acquire) == 0 {
        return true;
    }
    let Some(mut sq) = q.sq.try_lock() else {
        return false;
    };
    q.progress_locked(&mut sq);
    true
}

/// Serve every doorbell that rang, unless another thread is serving them (it then
/// sees what rang). Returns whether any request was served.
pub(crate) fn serve_doorbells(h: &Nic, qps: &HostQps) -> bool {
    let seg = &h.seg;
    // Cheap idle test first: no lock traffic while nothing rang.
    if (0..seg.doorbell_words()).all(|w| seg.doorbell_word(w).load(Ordering::Acquire) == 0) {
        return false;
    }
    match h.ring_server.try_lock() {
        Some(mut srv) => serve_doorbells_locked(h, qps, &mut srv),
        None => false,
    }
}

/// [`serve_doorbells`] with `h.ring_server` held by the caller.
pub(crate) fn serve_doorbells_locked(h: &Nic, qps: &HostQps, srv: &mut crate::nic::inbound::RingServer) -> bool {
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
            let idx = w * 64 + b;
            // Our own requests on this QP that the peer answered come before what
            // the peer sent after answering (an ACK precedes the next packet).
            if !retire_answered(qps, idx) {
                // Served on a later pass, once the holder let go of the queue.
                word.fetch_or(1 << b, Ordering::AcqRel);
                work = true;
                continue;
            }
            work |= serve_qp(h, srv, idx);
        }
    }
    if work {
        h.ring_passes.fetch_add(1, Ordering::Relaxed);
    }
    work
}

/// Serve the requests waiting in QP `idx`'s ring (the caller holds the ring server
/// and retired the QP's own answered requests). Returns whether any was served.
pub(crate) fn serve_qp(h: &Nic, srv: &mut crate::nic::inbound::RingServer, idx: u32) -> bool {
    let held = cq_ring::Held::new(&h.self_peer);
    let mut served = false;
    while responder::serve_one(&h.seg, &h.self_peer, &h.addr, idx, h.cfg.dma_section, srv) {
        served = true;
    }
    if served {
        wake_initiator(h, idx);
    }
    // Released after the initiator was woken for its answers (this order is
    // what the ib_send_lat -e test holds to; releasing first hung it).
    drop(held);
    served
}

struct Deferred {
    work: bool,
    next_deadline: Option<u64>,
    outstanding: bool,
    attend: bool,
}

/// Progress local QPs with due RNR timers or unattended outstanding requests; prune
/// QPs with nothing pending from the active list.
fn deferred(qps: &HostQps, now: u64) -> Deferred {
    let act: Vec<Arc<QpCtx>> = qps.active.lock().iter().filter_map(|w| w.upgrade()).collect();
    let mut d = Deferred {
        work: false,
        next_deadline: None,
        outstanding: false,
        attend: false,
    };
    let mut idle: Vec<*const QpCtx> = Vec::new();
    for q in &act {
        let dl = q.deadline.load(Ordering::Relaxed);
        let out = q.outstanding.load(Ordering::Relaxed);
        let stale = now.saturating_sub(q.last_progress.load(Ordering::Relaxed)) > UNATTENDED_NS;
        // Attended: somebody blocked on this QP's send CQ (armed, its event not
        // yet fired) waits for a completion only this thread can now retire. A CQ
        // that is polled, not armed, is progressed by its poller (inline): waking
        // this thread for each answer would only take the poller's core.
        let attend = out > 0 && q.send_cq.armed();
        d.attend |= attend;
        if (dl != 0 && dl <= now) || attend || (out > 0 && stale) {
            q.progress();
            // Attending is no reason to spin: answers wake us (`kick_answer`).
            d.work |= dl != 0 || q.outstanding.load(Ordering::Relaxed) != out;
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
    if !idle.is_empty() || act.len() != qps.active.lock().len() {
        let mut a = qps.active.lock();
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

/// Call the host's ring wakers (outside the lock: a waker may take its own).
fn wake_ring_pollers(h: &Nic) {
    let wakers: Vec<_> = h.ring_wakers.lock().iter().map(|(_, w)| w.clone()).collect();
    for w in wakers {
        w();
    }
}

/// The NIC thread's loop (until the host shuts down).
pub(crate) fn run(h: Arc<Nic>, qps: Arc<HostQps>) {
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
    // When a look (every `CQ_POLLS_EVERY_NS`, also across sleeps: a look right
    // after one would mostly find the flag just cleared) last found that an
    // application thread had polled a CQ of this host: its polls serve the
    // rings, so we do not spin until `CQ_QUIET_NS` passed without one.
    let mut last_cq_poll = 0u64;
    let mut next_polls_look = 0u64;
    let mut d = Deferred {
        work: false,
        next_deadline: None,
        outstanding: false,
        attend: false,
    };
    while !h.shutdown.load(Ordering::Acquire) {
        let seq = hdr.nic_seq.load(Ordering::SeqCst);
        let mut work = serve_doorbells(&h, &qps);
        // Another thread polls the rings: do not spin for them.
        let ext = hdr.ext_polling.load(Ordering::SeqCst) != 0;
        work |= crate::nic::odp::serve(&h, &h.odp);
        let now = sys::now_ns();
        if seq != last_seq || now >= next_check || d.attend {
            last_seq = seq;
            next_check = now + DEFERRED_EVERY_NS;
            d = deferred(&qps, now);
            work |= d.work;
        }
        if work {
            if slept_at != 0 {
                if !ext {
                    // Serving after a sleep, no poller on the rings: wake a blocked one
                    // to take them (it spins; we go back to sleep once it polls them).
                    wake_ring_pollers(&h);
                }
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
        if now >= next_polls_look {
            next_polls_look = now + CQ_POLLS_EVERY_NS;
            if h.cq_polled.swap(false, Ordering::Relaxed) {
                last_cq_poll = now;
            }
        }
        let idle = now.saturating_sub(last_work);
        let cq_quiet = last_cq_poll == 0 || now.saturating_sub(last_cq_poll) >= CQ_QUIET_NS;
        if !ext && cq_quiet && idle < spin_ns {
            if idle < YIELD_AFTER_NS {
                std::hint::spin_loop();
            } else {
                // Spin yielding: the requester whose next request we wait for may be
                // queued behind us on this core (woken here), and the scheduler does
                // not move it to the idle one for milliseconds.
                std::thread::yield_now();
            }
            continue;
        }
        if slept_at == 0 {
            slept_at = now;
        }
        // Deferred state must be current before deciding how long to sleep.
        if seq != hdr.nic_seq.load(Ordering::SeqCst) {
            continue;
        }
        // Announce the sleep before the last look at the answers: a target that
        // answers after that look sees us asleep and wakes us (`kick_answer`).
        hdr.nic_sleeping.store(
            if d.attend { NIC_ASLEEP_ATTENDING } else { NIC_ASLEEP },
            Ordering::SeqCst,
        );
        d = deferred(&qps, now);
        if d.attend && hdr.nic_sleeping.load(Ordering::SeqCst) == NIC_ASLEEP {
            // A CQ was armed since: sleep attending (look once more first).
            hdr.nic_sleeping.store(NIC_ASLEEP_ATTENDING, Ordering::SeqCst);
            d = deferred(&qps, now);
        }
        if d.work {
            hdr.nic_sleeping.store(0, Ordering::SeqCst);
            continue;
        }
        // Pending doorbells keep us awake unless the external poller serves them
        // (it serves what is pending when it stops, see `Host::set_ring_polling`).
        let ext = hdr.ext_polling.load(Ordering::SeqCst) != 0;
        let pending = (!ext && (0..seg.doorbell_words()).any(|w| seg.doorbell_word(w).load(Ordering::SeqCst) != 0))
            || crate::nic::odp::mail_pending(&seg);
        if !pending && !h.shutdown.load(Ordering::SeqCst) {
            let mut timeout = d.next_deadline.map(|x| x.saturating_sub(now));
            if d.outstanding {
                // Answers wake us while attending; the timeout only bounds a
                // target that cannot (a peer of an older build, one that died).
                let t = UNATTENDED_NS;
                timeout = Some(timeout.map_or(t, |x| x.min(t)));
            }
            let timeout = timeout.map_or(MAX_SLEEP_NS, |t| t.min(MAX_SLEEP_NS));
            h.nic_sleeps.fetch_add(1, Ordering::Relaxed);
            sys::futex_wait(&hdr.nic_seq, seq, Some(Duration::from_nanos(timeout)));
        }
        hdr.nic_sleeping.store(0, Ordering::SeqCst);
        next_check = 0;
    }
}
