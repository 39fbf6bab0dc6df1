//! The CQ ring (rxe's rxe_cq): a completion queue's MPSC ring in the host segment
//! (the local requester and completer and remote initiators all produce), the push
//! that fills it and signals an armed CQ's completion channel, and the ring's owner,
//! which keeps its index and its channel's eventfd for as long as a QP may push.

use crate::error::{Error, Result};
use crate::hw::peer::Peer;
use crate::hw::segment::Segment;
use crate::nic::state::Nic;
use crate::verbs::Wc;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub(crate) const NO_FD: u32 = u32::MAX;

thread_local! {
    /// Completions this thread holds back (see [`Held`]): (CQ index, completion,
    /// solicited).
    static HELD: std::cell::RefCell<Option<Vec<(u32, Wc, bool)>>> = const { std::cell::RefCell::new(None) };
}

/// While alive, this thread's completions to its own host's CQs are held back; when
/// dropped (also on unwinding) they are pushed, in order, into `via`'s (this host's)
/// CQs. A responder answers the ring slots it serves before the receive completions
/// they produce become visible (or signal a channel), so the application it
/// completes a receive for can never reply ahead of the answer — a real responder's
/// ACK leaves before the reply. One that no longer fits leaves its CQ in the
/// overflow error state, as a direct push would have.
pub(crate) struct Held<'a>(&'a Peer);

impl<'a> Held<'a> {
    pub(crate) fn new(via: &'a Peer) -> Held<'a> {
        HELD.with(|h| {
            h.borrow_mut().get_or_insert_with(Vec::new);
        });
        Held(via)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let Some(held) = HELD.with(|h| h.borrow_mut().take()) else {
            return;
        };
        for (idx, wc, solicited) in held {
            if push(&self.0.seg, self.0, idx, &wc, solicited).is_err() {
                tracing::warn!(cq = idx, "a held completion overflowed its CQ");
            }
        }
    }
}

/// Push a completion into CQ `idx` of `seg`; signals the completion channel through
/// `via` if the CQ was armed. Err(()) on overflow (the CQ enters the error state).
pub(crate) fn push(seg: &Segment, via: &Peer, idx: u32, wc: &Wc, solicited: bool) -> std::result::Result<(), ()> {
    if std::ptr::eq(seg, &*via.seg)
        && HELD.with(|h| h.borrow_mut().as_mut().map(|v| v.push((idx, *wc, solicited))).is_some())
    {
        return Ok(());
    }
    let Some(c) = seg.cq(idx) else { return Err(()) };
    if c.in_use.load(Ordering::Acquire) == 0 {
        return Err(());
    }
    let depth = c.depth.load(Ordering::Relaxed).max(1);
    let limit = c.limit.load(Ordering::Relaxed).clamp(1, depth);
    let cached = via.cq_head(idx);
    let t = loop {
        let t = c.tail.load(Ordering::Acquire);
        if c.overflow.load(Ordering::Relaxed) != 0 {
            return Err(());
        }
        // Heads only grow, and a head seen earlier is <= every later tail: a cached
        // head that leaves room proves there is room, without touching the line the
        // consumer writes on every poll.
        if let Some(ch) = cached {
            let h = ch.load(Ordering::Relaxed);
            if h <= t && t - h < limit as u64 {
                if c.tail
                    .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    break t;
                }
                continue;
            }
        }
        let h = c.head.load(Ordering::Acquire);
        if let Some(ch) = cached {
            ch.fetch_max(h, Ordering::Relaxed);
        }
        if c.overflow.load(Ordering::Relaxed) != 0 {
            return Err(());
        }
        // `t` may be stale: other producers can claim slots and the consumer retire
        // them (even past `t`) between the two loads, so `h > t` or an apparently full
        // ring only count once `tail` is confirmed unchanged. (Without this, a stale
        // `t` below `h` wrapped to a huge occupancy: a spurious overflow that put the
        // CQ into the error state under MPSC load.)
        if h > t {
            continue;
        }
        if t - h >= limit as u64 {
            if c.tail.load(Ordering::Acquire) != t {
                continue;
            }
            // `h` was read while `tail == t`: the ring really held `t - h` entries.
            c.overflow.store(1, Ordering::Release);
            return Err(());
        }
        if c.tail
            .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            break t;
        }
    };
    let e = seg.wc(idx, t, depth);
    e.wr_id.store(wc.wr_id, Ordering::Relaxed);
    e.status.store(wc.status as u32, Ordering::Relaxed);
    e.opcode.store(wc.opcode as u32, Ordering::Relaxed);
    e.byte_len.store(wc.byte_len, Ordering::Relaxed);
    e.imm.store(wc.imm_data, Ordering::Relaxed);
    e.qp_num.store(wc.qp_num, Ordering::Relaxed);
    e.src_qp.store(wc.src_qp, Ordering::Relaxed);
    e.wc_flags.store(wc.wc_flags.bits(), Ordering::Relaxed);
    e.vendor_err.store(wc.vendor_err, Ordering::Relaxed);
    e.seq.store(t + 1, Ordering::Release);
    // Store-load ordering against `req_notify` (store notify; load seq in the next
    // poll): either the poller sees this entry or we see the armed CQ, never neither.
    std::sync::atomic::fence(Ordering::SeqCst);
    let n = c.notify.load(Ordering::Acquire);
    if (n == 1 || (n == 2 && (solicited || !wc.status.is_ok())))
        && c.notify
            .compare_exchange(n, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        c.event_pending.store(1, Ordering::Release);
        let fd = c.chan_fd.load(Ordering::Acquire);
        if fd != NO_FD {
            via.signal(fd);
        }
    }
    Ok(())
}

/// A CQ's ring as the engines hold it: QPs keep it (and with it the CQ's index and the
/// completion channel's eventfd) while they may push completions into it.
pub(crate) struct CqRing {
    pub nic: Arc<Nic>,
    pub idx: u32,
    pub depth: u32,
    /// How many QPs completing here have send-queue work (queued, issued or waiting
    /// WRs, zombie ring slots): maintained by each QP under its SQ lock
    /// (`QpCtx::note_busy`). Zero lets an idle `Cq::poll` skip its QP list entirely.
    pub busy_qps: AtomicU32,
    /// Completions of QPs moved to RESET, which polls drop (as mlx5 cleans a reset
    /// QP's entries out of its CQs): (QPN, ring index below which its entries go).
    pub discard: parking_lot::Mutex<Vec<(u32, u64)>>,
    /// Whether `discard` is non-empty (an idle poll does not take its lock).
    pub discarding: std::sync::atomic::AtomicBool,
    /// The completion channel's eventfd, open while completions may signal it.
    _chan: Option<Arc<OwnedFd>>,
}

impl Drop for CqRing {
    fn drop(&mut self) {
        let hi = &self.nic;
        if let Some(c) = hi.seg.cq(self.idx) {
            c.in_use.store(0, Ordering::Release);
        }
        hi.cqs.lock().release(self.idx);
    }
}

impl CqRing {
    /// Whether an application armed this CQ and its event has not fired yet: it
    /// (or a thread on its behalf) may be blocked waiting for the next completion,
    /// which then only the NIC thread can produce.
    pub fn armed(&self) -> bool {
        self.nic
            .seg
            .cq(self.idx)
            .is_some_and(|c| c.notify.load(Ordering::Acquire) != 0)
    }

    /// QP `qpn` went to RESET: its completions now in the ring are dropped by polls.
    pub fn discard_qp(&self, qpn: u32) {
        let Some(c) = self.nic.seg.cq(self.idx) else { return };
        let below = c.tail.load(Ordering::Acquire);
        if below == c.head.load(Ordering::Acquire) {
            return;
        }
        let mut d = self.discard.lock();
        d.retain(|&(q, _)| q != qpn);
        d.push((qpn, below));
        self.discarding.store(true, Ordering::Release);
    }

    /// Whether the entry at ring index `i` of QP `qpn` is dropped (see `discard_qp`).
    pub fn discarded(&self, qpn: u32, i: u64) -> bool {
        self.discarding.load(Ordering::Acquire) && self.discard.lock().iter().any(|&(q, below)| q == qpn && i < below)
    }

    /// Forget what polls have passed (head at `head`).
    pub fn prune_discard(&self, head: u64) {
        if self.discarding.load(Ordering::Acquire) {
            let mut d = self.discard.lock();
            d.retain(|&(_, below)| below > head);
            self.discarding.store(!d.is_empty(), Ordering::Release);
        }
    }

    /// Claim a CQ of `depth` entries of host `hi`, signalling `chan` (an eventfd) when
    /// armed.
    pub fn create(hi: Arc<Nic>, depth: u32, chan: Option<Arc<OwnedFd>>) -> Result<Arc<CqRing>> {
        if depth == 0 || depth > hi.cfg.max_cqe {
            return Err(Error::InvalidArgument("CQ depth"));
        }
        let idx = hi.cqs.lock().alloc().ok_or(Error::NoResources("CQs"))?;
        let c = hi.seg.cq(idx).expect("allocated index");
        // Room to grow (`Cq::resize`) without moving entries: the slot has
        // `max_cqe` entries of storage; a small ring keeps its entries close (64
        // entries, a few KiB, stay in the L1 cache of the cores it bounces between).
        let cap = depth.saturating_mul(2).max(64).min(hi.cfg.max_cqe);
        c.depth.store(cap, Ordering::Relaxed);
        c.limit.store(depth, Ordering::Relaxed);
        c.overflow.store(0, Ordering::Relaxed);
        c.notify.store(0, Ordering::Relaxed);
        c.event_pending.store(0, Ordering::Relaxed);
        let t = c.tail.load(Ordering::Relaxed);
        c.head.store(t, Ordering::Relaxed);
        c.chan_fd.store(
            chan.as_ref().map(|f| f.as_raw_fd() as u32).unwrap_or(NO_FD),
            Ordering::Relaxed,
        );
        c.incarnation.fetch_add(1, Ordering::Relaxed);
        // Old entries of a previous incarnation must not be mistaken for new ones:
        // head == tail and sequence numbers continue from there.
        c.in_use.store(1, Ordering::Release);
        Ok(Arc::new(CqRing {
            nic: hi,
            idx,
            depth: cap,
            busy_qps: AtomicU32::new(0),
            discard: parking_lot::Mutex::new(Vec::new()),
            discarding: std::sync::atomic::AtomicBool::new(false),
            _chan: chan,
        }))
    }
}
