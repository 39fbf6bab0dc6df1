//! The send queue (rxe's requester task loop): progressing a QP's software send queue
//! in post order — starting every WR that may start (direct or through the target's
//! request ring, with the implicit fences RC ordering needs), handing finished ones to
//! the completer, keeping the QP on the NIC thread's list while work is deferred and
//! its send CQ's busy count in step.

use crate::hw::scratch::{scratch_slot, Scratch};
use crate::nic::completer;
use crate::nic::qp_ctx::{EState, Entry, QpCtx, Sq};
use crate::nic::requester::{self, Outcome};
use crate::sys;
use crate::verbs::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl QpCtx {
    /// Progress the send queue if nobody else is doing it right now.
    pub fn progress(&self) {
        if let Some(mut sq) = self.sq.try_lock() {
            self.progress_locked(&mut sq);
        }
    }

    /// Progress the send queue (its lock held): free answered zombie slots, flush an
    /// ERR/RESET QP, else start and retire WRs until nothing changes; then update the
    /// QP's NIC-thread bookkeeping and its send CQ's busy count.
    pub(crate) fn progress_locked(&self, sq: &mut Sq) {
        if sq.entries.is_empty()
            && sq.zombies.is_empty()
            && self.outstanding.load(Ordering::Relaxed) == 0
            && self.deadline.load(Ordering::Relaxed) == 0
        {
            // Nothing queued, issued or waiting: no clock read, no bookkeeping (this
            // runs on every CQ poll of a spinning application). An ERR/RESET QP with an
            // empty SQ has nothing to flush either.
            self.note_busy(sq);
            return;
        }
        let now = sys::now_ns();
        self.last_progress.store(now, Ordering::Relaxed);
        completer::reap_zombies(self, sq, now);
        loop {
            if matches!(self.state(), QpState::Err | QpState::Reset) {
                self.flush_all(sq);
                break;
            }
            let mut changed = self.issue(sq, now);
            changed |= self.retire(sq, now);
            if !changed {
                break;
            }
        }
        let issued = sq
            .entries
            .iter()
            .filter(|e| matches!(e.st, EState::Issued { .. }))
            .count()
            + sq.zombies.len();
        self.outstanding.store(issued as u32, Ordering::Relaxed);
        let dl = sq
            .entries
            .iter()
            .find_map(|e| {
                if let EState::Rnr { until } | EState::OdpNak { until } = e.st {
                    Some(until)
                } else {
                    None
                }
            })
            .unwrap_or(0);
        let old_dl = self.deadline.swap(dl, Ordering::Relaxed);
        if (issued > 0 || dl != 0) && !self.in_active.swap(true, Ordering::AcqRel) {
            if let Some(me) = self.me.upgrade() {
                self.qps.active.lock().push(Arc::downgrade(&me));
            }
        }
        if dl != 0 && dl != old_dl {
            // A new RNR timer: make the NIC thread recompute its sleep.
            self.nic.kick_nic();
        }
        self.note_busy(sq);
    }

    /// Keep the send CQ's `busy_qps` count in step with this SQ (call under the SQ
    /// lock after any change): busy while WRs are queued, issued or waiting on a timer
    /// (all in `entries`) or zombie ring slots remain; otherwise `progress` is a no-op
    /// and an idle `Cq::poll` may skip this QP.
    pub(crate) fn note_busy(&self, sq: &Sq) {
        let busy = !sq.entries.is_empty() || !sq.zombies.is_empty();
        if busy != self.busy.load(Ordering::Relaxed) {
            self.busy.store(busy, Ordering::Relaxed);
            let n = &self.send_cq.busy_qps;
            if busy {
                n.fetch_add(1, Ordering::Release);
            } else {
                n.fetch_sub(1, Ordering::Release);
            }
        }
    }

    /// Start every WR that may start now. Returns whether anything changed.
    pub(crate) fn issue(&self, sq: &mut Sq, now: u64) -> bool {
        if self.qp_type == QpType::Ud {
            return self.issue_ud(sq, now);
        }
        let changed = self.issue_rc(sq, now);
        // One wake-up of the target's NIC thread for this pass's ring requests.
        if std::mem::take(&mut sq.bells) > 0 {
            if let Some(peer) = &sq.peer {
                match &peer.link {
                    // Across the network: the requests leave as packets now.
                    Some(l) => l.doorbell(),
                    None => peer.seg.wake_for_doorbells(),
                }
            }
        }
        changed
    }

    /// [`QpCtx::issue`] for a connected QP (its ring requests' doorbells are set, the
    /// target's NIC thread not yet woken for the last of them).
    fn issue_rc(&self, sq: &mut Sq, now: u64) -> bool {
        let mut changed = false;
        let mut i = 0;
        let mut earlier_issued = false;
        // An issued READ/atomic writes local memory only when it completes; a ring WR
        // that gathers local memory when issued waits for those whose local ranges it
        // overlaps (an implicit fence where the data would be stale; IB needs FENCE).
        let mut local_writes = Scratch::take(&LOCAL_WRITES);
        let mut odp_retries = 0;
        let slots = self.nic.seg.p.ring_slots as u64;
        while i < sq.entries.len() {
            match sq.entries[i].st {
                EState::Done { status, .. } => {
                    if !status.is_ok() {
                        break;
                    }
                    i += 1;
                    continue;
                }
                EState::Issued { sent, alone, .. } => {
                    earlier_issued = true;
                    note_local_writes(&sq.entries[i], &mut local_writes);
                    let parts = requester::ring_parts(&sq.entries[i], chunk(sq));
                    if sent < parts {
                        // Partly issued: its next parts first, nothing behind it before
                        // its last part.
                        match requester::issue_ring(self, sq, i, now, alone) {
                            requester::Issue::Issued => changed = true,
                            requester::Issue::Full => {}
                            requester::Issue::Failed(status) => {
                                self.fail_issued(sq, i, status, now);
                                return true;
                            }
                        }
                        if matches!(sq.entries[i].st, EState::Issued { sent, .. } if sent < parts) {
                            break;
                        }
                    }
                    if alone {
                        break;
                    }
                    i += 1;
                    continue;
                }
                EState::Rnr { until } | EState::OdpNak { until } if now < until => break,
                _ => {}
            }
            if requester::uses_ring(self, sq, &sq.entries[i]) {
                let op = sq.entries[i].op;
                // A ring WR gathers its payload from local memory when issued: it waits
                // for earlier READs/atomics into the same memory, whose data lands when
                // they complete.
                let gathers = !writes_local(&op);
                let odp = requester::ring_odp(sq, &sq.entries[i]);
                if (sq.entries[i].flags.contains(SendFlags::FENCE) && earlier_issued)
                    || (gathers && overlaps_local(&sq.entries[i], &local_writes))
                    || (odp && earlier_issued)
                {
                    break;
                }
                if sq.ring_prod - sq.ring_cons >= slots {
                    break;
                }
                if matches!(sq.entries[i].st, EState::OdpNak { .. }) {
                    self.go_back_n(sq, i);
                }
                match requester::issue_ring(self, sq, i, now, odp) {
                    requester::Issue::Issued => {
                        earlier_issued = true;
                        note_local_writes(&sq.entries[i], &mut local_writes);
                        changed = true;
                        let parts = requester::ring_parts(&sq.entries[i], chunk(sq));
                        if odp || matches!(sq.entries[i].st, EState::Issued { sent, .. } if sent < parts) {
                            break;
                        }
                    }
                    requester::Issue::Failed(status) => {
                        self.fail_issued(sq, i, status, now);
                        return true;
                    }
                    requester::Issue::Full => break,
                }
            } else {
                if earlier_issued {
                    break;
                }
                changed = true;
                if matches!(sq.entries[i].st, EState::OdpNak { .. }) {
                    self.go_back_n(sq, i);
                }
                self.note_issuing();
                match requester::exec_direct(self, sq, i) {
                    Outcome::OdpNak => {
                        self.odp_nak(sq, i, now);
                        return true;
                    }
                    Outcome::OdpRetry => {
                        odp_retries += 1;
                        if odp_retries > ODP_MAX_RETRIES {
                            sq.entries[i].st = EState::Done {
                                status: WcStatus::LocProtErr,
                                byte_len: 0,
                            };
                            return true;
                        }
                        continue;
                    }
                    Outcome::Done(WcStatus::RetryExcErr, _) => {
                        self.unanswered(sq, i, now);
                        return true;
                    }
                    Outcome::Done(status, byte_len) => {
                        let (status, byte_len) = self.sent_status(status, byte_len, sq.entries[i].len());
                        sq.entries[i].st = EState::Done { status, byte_len };
                        if !status.is_ok() {
                            return true;
                        }
                    }
                    Outcome::Rnr(timer) => {
                        self.rnr(sq, i, timer, now);
                        return true;
                    }
                }
            }
            i += 1;
        }
        changed
    }

    /// UD: every pending WR goes out now, in post order, and is done once sent
    /// (nothing is acknowledged); a local error stops the queue there (the completer
    /// fails the QP and flushes the rest). A destination whose ring is full holds
    /// the queue (retried shortly, as a lossless fabric holds a packet) until the
    /// transport timeout, or its host's death, drops the datagram.
    fn issue_ud(&self, sq: &mut Sq, now: u64) -> bool {
        let mut changed = false;
        let timeout = self.nic.cfg.transport_timeout.as_nanos() as u64;
        for e in sq.entries.iter_mut() {
            match e.st {
                EState::Done { status, .. } if !status.is_ok() => break,
                EState::Pending => {}
                EState::Rnr { until } if now >= until => {}
                EState::Rnr { .. } => break,
                _ => continue,
            }
            let Some(status) = requester::send_ud(self, e) else {
                // `atoms` (unused by a datagram) keeps when it first found no room.
                if e.atoms == 0 {
                    e.atoms = now;
                }
                let gone = e.ud.as_ref().is_some_and(|t| !t.peer.alive());
                if !gone && now.saturating_sub(e.atoms) < timeout {
                    e.st = EState::Rnr {
                        until: now + UD_FULL_RETRY_NS,
                    };
                    break;
                }
                e.atoms = 0;
                e.st = EState::Done {
                    status: WcStatus::Success,
                    byte_len: e.len() as u32,
                };
                changed = true;
                continue;
            };
            e.atoms = 0;
            let byte_len = if status.is_ok() { e.len() as u32 } else { 0 };
            e.st = EState::Done { status, byte_len };
            changed = true;
            if !status.is_ok() {
                break;
            }
        }
        changed
    }

    /// Ring WR `i` failed locally (before or between its parts): the parts still out
    /// are answered into zombie slots.
    fn fail_issued(&self, sq: &mut Sq, i: usize, status: WcStatus, now: u64) {
        let Sq { entries, zombies, .. } = sq;
        entries[i].abandon_parts(zombies, now);
        if status == WcStatus::RetryExcErr {
            // No target QP to take it (yet): resent until the retries run out.
            self.unanswered(sq, i, now);
        } else {
            sq.entries[i].st = EState::Done { status, byte_len: 0 };
        }
    }

    /// ODP model: retransmit WR `i` after its NAK timeout together with every later
    /// WR already executed behind it (they go back to pending and are redone).
    fn go_back_n(&self, sq: &mut Sq, i: usize) {
        let mut n = 1;
        for e in sq.entries.iter_mut().skip(i + 1) {
            if !e.inflight {
                break;
            }
            e.inflight = false;
            e.atoms = 0;
            e.st = EState::Pending;
            n += 1;
        }
        self.nic.seg.stats().retransmissions.fetch_add(n, Ordering::Relaxed);
    }
}

/// Whether a WR writes local memory when it completes (READ, atomics): a later WR
/// that gathers local memory at issue waits for it.
fn writes_local(op: &WrOpcode) -> bool {
    matches!(op, WrOpcode::Read) || op.is_atomic()
}

scratch_slot!(LOCAL_WRITES: (u64, u64));

/// Record the local ranges an issued READ / atomic `e` writes when it completes.
fn note_local_writes(e: &Entry, out: &mut Vec<(u64, u64)>) {
    if writes_local(&e.op) && !e.flags.contains(SendFlags::INLINE) {
        out.extend(
            e.sges
                .iter()
                .filter(|s| s.length > 0)
                .map(|s| (s.addr, s.length as u64)),
        );
    }
}

/// Whether a WR that gathers local memory (`e`'s gather list) reads any of `writes`.
fn overlaps_local(e: &Entry, writes: &[(u64, u64)]) -> bool {
    !writes.is_empty()
        && !e.flags.contains(SendFlags::INLINE)
        && e.sges.iter().any(|s| {
            writes
                .iter()
                .any(|&(a, l)| s.addr < a + l && a < s.addr + s.length as u64)
        })
}

/// Bytes per ring part towards the SQ's peer.
fn chunk(sq: &Sq) -> u64 {
    sq.peer.as_ref().map_or(1, |p| p.seg.p.ring_max as u64)
}

/// How soon a UD send that found its destination's ring full tries again.
const UD_FULL_RETRY_NS: u64 = 20_000;

/// Re-executions of one WR whose local ODP pages were invalidated mid-copy.
const ODP_MAX_RETRIES: u32 = 16;
