//! Leases of user-space mode (beyond the paper): after serving a peer's
//! two-sided READ or WRITE, a target lends that peer its NIC registration of
//! the range for a bounded time, and the peer's next operations on it go
//! one-sided, as on pinned memory. [`Leases`] is the target's table (the
//! registrations and the pins that keep their pages resident while lent);
//! [`HeldLeases`] is an initiator QP's table of the leases it was given.
//!
//! A new lease goes only to a request that comes back to a page one of the
//! QP's last few requests reached ([`SeenPages`]): repeated operations are
//! lent their pages, scattered ones are not (each lease is a registration).
//!
//! The rules that keep a lease safe:
//! - The initiator uses a lease for `ms / 2` from the moment it *sent* the
//!   request the lease answers; each two-sided operation on the range renews
//!   it (a new grant number). Once that time is over and none of its
//!   operations on the lease is in flight, it gives the lease back
//!   ([`crate::ctrl::Repr::LeaseRelease`], naming the last grant it saw).
//! - The target keeps the registration and the pin until the initiator gives
//!   it back — unless it renewed the lease since (the release names an older
//!   grant) — or, for a peer that died or stopped, until [`HOLD_MIN`] or ten
//!   times `ms` after the last grant, whichever is longer. So an operation the
//!   initiator posted on a lease never meets a dropped registration, however
//!   long it waits in the NIC's queue, short of that bound.
//! - Leased pages are pinned: the pager skips them, so a registration never
//!   outlives residency. The bytes leased are bounded by a budget.
//! - A lease covers only bytes of its application MR, with exactly the right
//!   the request needed (REMOTE_READ or REMOTE_WRITE).
//! - Deregistering (or re-registering) the application MR, unmapping its
//!   memory or destroying the QP drops its leases at once, before the call
//!   returns: a peer's later one-sided operation meets a missing key at its
//!   NIC (REM_ACCESS_ERR, as for a deregistered MR on any RDMA device).
//! - The NIC key of a lease is valid on every QP of the device's PD. So a
//!   lease is granted only while every QP of the context belongs to the
//!   application PD of the MR and grants the lease's right; a QP that would
//!   break that (created in another PD, or given fewer rights) first waits
//!   out the leases it would expose ([`Leases::expose_wait`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::backend::Backend;
use super::mr::MrEntry;
use super::pin::EnginePin;
use super::regcache::TempMr;
use crate::nic::{Access, NicMr as _, SwapListener};

/// Leases a target keeps at most (a fault request scans its QP's).
const MAX_LEASES: usize = 256;

/// One lease at the target. Field order is drop order: the registration
/// (which waits for DMA) before the pin.
struct Lease<N: Backend> {
    mr: TempMr<N>,
    _pin: EnginePin<N>,
    app: Arc<MrEntry<N>>,
    qi: usize,
    pd: u32,
    start: u64,
    end: u64,
    write: bool,
    /// The grant number (bumped by every renewal).
    seq: u32,
    /// Dropped then if not given back before (a peer gone or stopped).
    until: Instant,
}

/// The least a target keeps a lease nobody gave back (ten times its time of
/// use, if that is longer).
pub(super) const HOLD_MIN: Duration = Duration::from_secs(1);

/// Counters of the lease tables ([`super::Stats`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LeaseCounts {
    pub granted: u64,
    pub renewed: u64,
    pub released: u64,
    pub expired: u64,
}

struct Inner<N: Backend> {
    leases: Vec<Lease<N>>,
    bytes: u64,
}

/// A granted lease: what the [`crate::ctrl::Repr::Lease`] message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grant {
    pub key: u32,
    pub seq: u32,
    pub start: u64,
    pub len: u64,
}

/// What a new lease is made of (registered and pinned by the caller).
pub(super) struct NewLease<N: Backend> {
    pub mr: TempMr<N>,
    pub pin: EnginePin<N>,
}

/// The target's leases of one context (off: budget 0).
pub(crate) struct Leases<N: Backend> {
    budget: u64,
    ms: u32,
    inner: Mutex<Inner<N>>,
    granted: AtomicU64,
    renewed: AtomicU64,
    released: AtomicU64,
    expired: AtomicU64,
}

impl<N: Backend> Leases<N> {
    pub(super) fn new(budget: u64, ms: u32) -> Self {
        Leases {
            budget: if ms == 0 { 0 } else { budget },
            ms,
            inner: Mutex::new(Inner {
                leases: Vec::new(),
                bytes: 0,
            }),
            granted: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            released: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    /// Whether leases are granted at all.
    pub(super) fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// How long a lease lasts.
    pub(super) fn ms(&self) -> u32 {
        self.ms
    }

    pub(super) fn counts(&self) -> LeaseCounts {
        LeaseCounts {
            granted: self.granted.load(Ordering::Relaxed),
            renewed: self.renewed.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
        }
    }

    /// How long a lease nobody gives back is kept after its last grant.
    fn hold(&self) -> Duration {
        (Duration::from_millis(u64::from(self.ms)) * 10).max(HOLD_MIN)
    }

    /// Renew QP `qi`'s lease over `[start, end)` of `app` with right `write`,
    /// if it has one.
    pub(super) fn renew(
        &self,
        qi: usize,
        app: &Arc<MrEntry<N>>,
        start: u64,
        end: u64,
        write: bool,
    ) -> Option<(TempMr<N>, Grant)> {
        let mut g = self.inner.lock();
        let l = g.leases.iter_mut().find(|l| {
            l.qi == qi
                && l.write == write
                && Arc::ptr_eq(&l.app, app)
                && l.start <= start
                && end <= l.end
        })?;
        l.until = Instant::now() + self.hold();
        l.seq = l.seq.wrapping_add(1);
        self.renewed.fetch_add(1, Ordering::Relaxed);
        let grant = Grant {
            key: l.mr.rkey(),
            seq: l.seq,
            start: l.start,
            len: l.end - l.start,
        };
        Some((l.mr.clone(), grant))
    }

    /// The bytes that may be lent at a time: the budget, and at most a
    /// quarter of the pager's resident budget `resident` (bytes), if it has
    /// one — leased pages cannot be evicted.
    pub(super) fn limit(&self, resident: Option<u64>) -> u64 {
        resident.map_or(self.budget, |r| self.budget.min(r / 4))
    }

    /// Whether a lease of `len` more bytes fits `limit` (and the count of
    /// leases [`MAX_LEASES`]) once expired leases are gone.
    pub(super) fn room(&self, len: u64, limit: u64) -> bool {
        if !self.enabled() || len > limit {
            return false;
        }
        let fits = |g: &Inner<N>| g.bytes + len <= limit && g.leases.len() < MAX_LEASES;
        let victims = {
            let mut g = self.inner.lock();
            if fits(&g) {
                return true;
            }
            take(&mut g, |l| l.until <= Instant::now())
        };
        self.expired
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        drop(victims);
        fits(&self.inner.lock())
    }

    /// Keep a new lease of QP `qi` (application PD `pd`) over `[start, end)`
    /// of `app`; `None` if `limit` is reached now.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert(
        &self,
        qi: usize,
        pd: u32,
        app: &Arc<MrEntry<N>>,
        (start, end): (u64, u64),
        write: bool,
        new: NewLease<N>,
        limit: u64,
    ) -> Option<Grant> {
        let mut g = self.inner.lock();
        if g.bytes + (end - start) > limit || g.leases.len() >= MAX_LEASES {
            return None;
        }
        let key = new.mr.rkey();
        g.bytes += end - start;
        g.leases.push(Lease {
            mr: new.mr,
            _pin: new.pin,
            app: app.clone(),
            qi,
            pd,
            start,
            end,
            write,
            seq: 1,
            until: Instant::now() + self.hold(),
        });
        self.granted.fetch_add(1, Ordering::Relaxed);
        Some(Grant {
            key,
            seq: 1,
            start,
            len: end - start,
        })
    }

    /// QP `qi`'s peer gives back lease `key` as of grant `seq`: drop it,
    /// unless it was renewed since (its next release names the later grant).
    pub(super) fn release(&self, qi: usize, key: u32, seq: u32) {
        if !self.enabled() {
            return;
        }
        let victims = take(&mut self.inner.lock(), |l| {
            l.qi == qi && l.seq == seq && l.mr.rkey() == key
        });
        self.released
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        drop(victims);
    }

    /// Drop the leases nobody gave back in time (a peer gone or stopped).
    pub(super) fn sweep(&self, now: Instant) {
        if !self.enabled() {
            return;
        }
        let victims = take(&mut self.inner.lock(), |l| l.until <= now);
        self.expired
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        drop(victims);
    }

    /// Drop every lease of application MR `app` (deregistered or
    /// re-registered).
    pub(super) fn drop_mr(&self, app: &MrEntry<N>) {
        if self.enabled() {
            let victims = take(&mut self.inner.lock(), |l| {
                std::ptr::eq(Arc::as_ptr(&l.app), app)
            });
            drop(victims);
        }
    }

    /// Drop every lease granted through QP `qi` (destroyed or reset).
    pub(super) fn drop_qp(&self, qi: usize) {
        if self.enabled() {
            let victims = take(&mut self.inner.lock(), |l| l.qi == qi);
            drop(victims);
        }
    }

    /// Drop everything (context teardown).
    pub(super) fn clear(&self) {
        let victims = take(&mut self.inner.lock(), |_| true);
        drop(victims);
    }

    /// A QP of application PD `pd` granting `access` is about to be reachable
    /// by a peer: wait until no lease it could reach beyond its rights is left
    /// (leases of another PD, or with a right it lacks): given back by their
    /// holders or dropped at their time. New ones are not granted meanwhile:
    /// the caller's QP exists, and [`may_grant`] counts it. Returns how long
    /// it waited.
    pub(super) fn expose_wait(&self, pd: u32, access: Access) -> Duration {
        let t0 = Instant::now();
        if !self.enabled() {
            return Duration::ZERO;
        }
        let foreign = |l: &Lease<N>| l.pd != pd || !access.contains(right(l.write));
        loop {
            let now = Instant::now();
            let (victims, last) = {
                let mut g = self.inner.lock();
                let victims = take(&mut g, |l| foreign(l) && l.until <= now);
                let last = g
                    .leases
                    .iter()
                    .filter(|l| foreign(l))
                    .map(|l| l.until)
                    .max();
                (victims, last)
            };
            self.expired
                .fetch_add(victims.len() as u64, Ordering::Relaxed);
            drop(victims);
            // Given back meanwhile by the polling thread, or at their time.
            match last {
                Some(t) => std::thread::sleep(
                    t.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(2)),
                ),
                None => return t0.elapsed(),
            }
        }
    }
}

/// The right a lease grants.
pub(super) fn right(write: bool) -> Access {
    if write {
        Access::REMOTE_WRITE
    } else {
        Access::REMOTE_READ
    }
}

/// Whether a lease of PD `pd` with right `need` may be granted, given the
/// PD and rights of every QP of the context (`qps`).
pub(super) fn may_grant(
    pd: u32,
    need: Access,
    mut qps: impl Iterator<Item = (u32, Access)>,
) -> bool {
    qps.all(|(p, a)| p == pd && a.contains(need))
}

/// Remove the leases matching `f`, returning them (to drop outside the lock).
fn take<N: Backend>(g: &mut Inner<N>, mut f: impl FnMut(&Lease<N>) -> bool) -> Vec<Lease<N>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < g.leases.len() {
        if f(&g.leases[i]) {
            let l = g.leases.swap_remove(i);
            g.bytes -= l.end - l.start;
            out.push(l);
        } else {
            i += 1;
        }
    }
    out
}

impl<N: Backend> SwapListener for Leases<N> {
    /// Leased pages are pinned and never offered for eviction.
    fn before_swap_out(&self, _pages: &[u64]) -> bool {
        true
    }
    fn after_unmap(&self, start: u64, end: u64) {
        if self.enabled() {
            let victims = take(&mut self.inner.lock(), |l| l.start < end && start < l.end);
            drop(victims);
        }
    }
}

/// First pages of a target QP's recent requests that asked for a lease: a
/// new lease is lent only to a request that comes back to one of them, so
/// that scattered operations cost no registration each (they keep the
/// registration cache's temporary MRs).
#[derive(Debug, Default)]
pub(crate) struct SeenPages {
    pages: [u64; SEEN],
    next: usize,
}

/// Pages [`SeenPages`] remembers.
const SEEN: usize = 8;

impl SeenPages {
    /// Whether page number `page` was seen lately; if not, remember it now.
    pub(super) fn again(&mut self, page: u64) -> bool {
        // Page numbers are stored + 1 (0: empty slot).
        if self.pages.contains(&(page + 1)) {
            return true;
        }
        self.pages[self.next] = page + 1;
        self.next = (self.next + 1) % SEEN;
        false
    }
}

/// One operation in flight on a held lease: counted while it lives (the
/// lease is given back only when none is left).
#[derive(Debug)]
pub(crate) struct InFlight(Arc<AtomicU32>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A lease an initiator QP holds.
#[derive(Debug, Clone)]
struct Held {
    rkey: u32,
    start: u64,
    end: u64,
    write: bool,
    key: u32,
    /// The last grant number seen.
    seq: u32,
    /// Used until then (half its time from the request's sending).
    use_until: Instant,
    /// Operations on it in flight.
    inflight: Arc<AtomicU32>,
}

/// Leases an initiator QP holds at most (more are given back at once).
const MAX_HELD: usize = 16;

/// An initiator QP's leases.
#[derive(Debug, Default)]
pub(crate) struct HeldLeases {
    held: Vec<Held>,
}

impl HeldLeases {
    /// Keep the lease of `[addr, addr+len)` of the peer's MR `rkey` with NIC
    /// key `key`, grant `seq`, usable for half of `ms` from `sent` (when its
    /// request was sent). A renewal (a key held already) updates it. Returns
    /// the `(key, seq)` to give back at once when the table is full.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn keep(
        &mut self,
        rkey: u32,
        (addr, len): (u64, u64),
        write: bool,
        key: u32,
        ms: u32,
        seq: u32,
        sent: Instant,
    ) -> Option<(u32, u32)> {
        let use_until = sent + Duration::from_millis(u64::from(ms)) / 2;
        let Some(end) = addr.checked_add(len) else {
            return Some((key, seq));
        };
        if let Some(h) = self.held.iter_mut().find(|h| h.key == key) {
            h.seq = seq;
            h.use_until = h.use_until.max(use_until);
            (h.rkey, h.start, h.end, h.write) = (rkey, addr, end, write);
            return None;
        }
        if self.held.len() >= MAX_HELD {
            return Some((key, seq));
        }
        self.held.push(Held {
            rkey,
            start: addr,
            end,
            write,
            key,
            seq,
            use_until,
            inflight: Arc::new(AtomicU32::new(0)),
        });
        None
    }

    /// The NIC key of a usable lease covering `[addr, addr+len)` of the
    /// peer's MR `rkey` for a WRITE (`write`) or a READ, with the operation
    /// counted in flight on it until the returned guard drops.
    pub(super) fn find(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        write: bool,
    ) -> Option<(u32, InFlight)> {
        if self.held.is_empty() {
            return None;
        }
        let now = Instant::now();
        let end = addr.checked_add(len)?;
        let h = self.held.iter().find(|h| {
            h.use_until > now
                && h.rkey == rkey
                && h.write == write
                && h.start <= addr
                && end <= h.end
        })?;
        h.inflight.fetch_add(1, Ordering::AcqRel);
        Some((h.key, InFlight(h.inflight.clone())))
    }

    /// The leases whose time of use is over and that no operation uses any
    /// more, removed: `(key, seq)` to give back.
    pub(super) fn retire(&mut self, now: Instant) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        self.held.retain(|h| {
            let done = h.use_until <= now && h.inflight.load(Ordering::Acquire) == 0;
            if done {
                out.push((h.key, h.seq));
            }
            !done
        });
        out
    }

    /// Forget the leases of the peer's MR `rkey` (deregistered: the peer
    /// dropped them).
    pub(super) fn forget(&mut self, rkey: u32) {
        self.held.retain(|h| h.rkey != rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key of a usable lease, its in-flight guard dropped at once.
    fn key(h: &mut HeldLeases, rkey: u32, addr: u64, len: u64, write: bool) -> Option<u32> {
        h.find(rkey, addr, len, write).map(|(k, _)| k)
    }

    #[test]
    fn a_held_lease_covers_only_its_range_right_and_key() {
        let mut h = HeldLeases::default();
        let t = Instant::now();
        assert_eq!(h.keep(7, (0x1000, 0x2000), false, 99, 1000, 1, t), None);
        assert_eq!(key(&mut h, 7, 0x1000, 0x2000, false), Some(99));
        assert_eq!(key(&mut h, 7, 0x1800, 0x100, false), Some(99));
        assert_eq!(key(&mut h, 7, 0x1000, 0x2001, false), None, "past its end");
        assert_eq!(key(&mut h, 7, 0xfff, 0x10, false), None, "before its start");
        assert_eq!(
            key(&mut h, 7, 0x1000, 0x10, true),
            None,
            "a READ lease is no WRITE lease"
        );
        assert_eq!(key(&mut h, 8, 0x1000, 0x10, false), None, "another MR");
        assert_eq!(key(&mut h, 7, u64::MAX, 2, false), None, "overflow");
        h.forget(7);
        assert_eq!(key(&mut h, 7, 0x1000, 0x10, false), None);
    }

    #[test]
    fn a_held_lease_is_used_for_half_its_time_from_the_request() {
        let mut h = HeldLeases::default();
        let long_ago = Instant::now() - Duration::from_millis(60);
        h.keep(7, (0, 4096), true, 5, 100, 1, long_ago);
        assert_eq!(
            key(&mut h, 7, 0, 8, true),
            None,
            "60 ms of 100: past the half"
        );
        h.keep(7, (0, 4096), true, 6, 200, 1, long_ago);
        assert_eq!(key(&mut h, 7, 0, 8, true), Some(6), "60 ms of 200: usable");
    }

    #[test]
    fn a_lease_is_given_back_after_its_time_once_nothing_uses_it() {
        let mut h = HeldLeases::default();
        let t0 = Instant::now();
        h.keep(7, (0, 4096), false, 5, 100, 1, t0);
        // A renewal (same key): the later grant number, a later time of use.
        h.keep(
            7,
            (0, 4096),
            false,
            5,
            100,
            2,
            t0 + Duration::from_millis(10),
        );
        let (k, op) = h.find(7, 0, 8, false).expect("usable");
        assert_eq!(k, 5);
        let after = t0 + Duration::from_millis(70);
        assert!(
            h.retire(after).is_empty(),
            "an operation is in flight on it"
        );
        drop(op);
        assert_eq!(h.retire(after), vec![(5, 2)], "the last grant seen");
        assert!(h.retire(after).is_empty());
    }

    #[test]
    fn held_leases_are_bounded() {
        let mut h = HeldLeases::default();
        let t = Instant::now();
        for i in 0..MAX_HELD as u32 {
            assert_eq!(
                h.keep(1, (u64::from(i) * 4096, 4096), false, i, 1000, 1, t),
                None
            );
        }
        assert_eq!(
            h.keep(1, (1 << 30, 4096), false, 77, 1000, 3, t),
            Some((77, 3)),
            "no room: given back at once"
        );
        assert_eq!(h.held.len(), MAX_HELD);
    }

    #[test]
    fn a_small_request_is_lent_its_page_when_it_comes_back() {
        let mut s = SeenPages::default();
        assert!(!s.again(0), "first touch");
        assert!(s.again(0), "second touch");
        for p in 1..=SEEN as u64 {
            assert!(!s.again(p));
        }
        assert!(!s.again(0), "forgotten after {SEEN} other pages");
    }

    #[test]
    fn a_lease_needs_every_qp_in_its_pd_with_its_right() {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        assert!(may_grant(
            1,
            Access::REMOTE_WRITE,
            [(1, rw), (1, rw)].into_iter()
        ));
        assert!(!may_grant(
            1,
            Access::REMOTE_WRITE,
            [(1, rw), (2, rw)].into_iter()
        ));
        assert!(!may_grant(
            1,
            Access::REMOTE_WRITE,
            [(1, rw), (1, Access::REMOTE_READ)].into_iter()
        ));
        assert!(may_grant(
            1,
            Access::REMOTE_READ,
            [(1, Access::REMOTE_READ)].into_iter()
        ));
    }
}
