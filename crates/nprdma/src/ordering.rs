//! Configurable ordering: the per-QP table of in-flight operations that
//! decides whether a new operation may be issued now or must be parked
//! (paper § "Configurable Ordering").
//!
//! NP-RDMA completes most operations optimistically, but an operation that
//! hits a page fault falls back to the two-sided path and finishes tens of µs
//! (or an SSD read) later. Plain RC ordering would make every later operation
//! on the QP wait for it. Instead, an operation waits only for in-flight
//! operations it *conflicts* with:
//!
//! * memory overlap on the same side (local vs local, remote vs remote — and
//!   local vs remote too on a loopback QP) where at least one of the two
//!   writes that memory (read/read never conflicts);
//! * message operations (SEND, SEND_WITH_IMM, WRITE_WITH_IMM) consume the
//!   receiver's RECVs in order, so they conflict with each other;
//! * by default ([`OrderConfig::messages_fence_writes`]) a message also
//!   conflicts with in-flight remote writes (in either order), so the common
//!   "WRITE data, then SEND a notice" pattern stays correct without
//!   application flags.
//!
//! Once one operation parks, every later operation of the QP parks behind it
//! (head-of-line: the pending buffer is FIFO), so the issue order within a QP
//! always equals the post order. Two per-WR bits give strict ordering where
//! the heuristic is not enough: *order-before* (wait until nothing is in
//! flight) and *order-after* (nothing issues behind this operation until it
//! completes). [`Mode::Strict`] treats every operation as order-before, i.e.
//! at most one in flight.
//!
//! The table is a plain data structure (no locking, no I/O): the QP's owner
//! calls [`OrderTable::submit`] when the application posts and
//! [`OrderTable::complete`] when an operation finishes; both hand back the
//! operations to issue now, in order. The in-flight set is scanned linearly:
//! it is bounded by the QP depth and almost always tiny.

use std::collections::VecDeque;

use smallvec::{smallvec, SmallVec};

/// Spans of one side of an op (inline for the common 1–2 SGE case).
pub type Spans = SmallVec<[Span; 2]>;

/// Half-open byte range `[addr, addr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Range {
    pub addr: u64,
    pub len: u64,
}

impl Range {
    /// A range; see [`Range::end`] for overflow handling.
    pub const fn new(addr: u64, len: u64) -> Range {
        Range { addr, len }
    }
    /// End address, or `None` if `addr + len` overflows.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }
    /// Whether two ranges share at least one byte (empty ranges never do).
    pub fn overlaps(&self, other: &Range) -> bool {
        self.len != 0
            && other.len != 0
            && self.addr < other.addr.saturating_add(other.len)
            && other.addr < self.addr.saturating_add(self.len)
    }
}

/// How an operation touches a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only read.
    Read,
    /// Written (or read-modify-written).
    Write,
}

/// One range an operation touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    pub range: Range,
    pub access: Access,
}

/// What the ordering logic needs to know about one application WR.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpDesc {
    /// Local memory (initiator side), one span per SGE.
    pub local: Spans,
    /// Remote memory (target side).
    pub remote: Spans,
    /// Consumes a RECV at the peer (SEND, SEND_WITH_IMM, WRITE_WITH_IMM).
    pub message: bool,
    /// Wait until nothing is in flight before issuing.
    pub order_before: bool,
    /// Issue nothing behind this op until it completes.
    pub order_after: bool,
}

fn span(addr: u64, len: u64, access: Access) -> Span {
    Span {
        range: Range::new(addr, len),
        access,
    }
}

impl OpDesc {
    /// RDMA READ: reads remote, writes local.
    pub fn read(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            local: smallvec![span(local.addr, local.len, Access::Write)],
            remote: smallvec![span(remote.addr, remote.len, Access::Read)],
            ..OpDesc::default()
        }
    }
    /// RDMA WRITE: reads local, writes remote.
    pub fn write(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            local: smallvec![span(local.addr, local.len, Access::Read)],
            remote: smallvec![span(remote.addr, remote.len, Access::Write)],
            ..OpDesc::default()
        }
    }
    /// WRITE_WITH_IMM: a WRITE that also consumes a RECV.
    pub fn write_imm(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            message: true,
            ..OpDesc::write(local, remote)
        }
    }
    /// Atomic on 8 remote bytes, result written to 8 local bytes.
    pub fn atomic(local_addr: u64, remote_addr: u64) -> OpDesc {
        OpDesc {
            local: smallvec![span(local_addr, 8, Access::Write)],
            remote: smallvec![span(remote_addr, 8, Access::Write)],
            ..OpDesc::default()
        }
    }
    /// SEND: reads local, consumes a RECV.
    pub fn send(local: Range) -> OpDesc {
        OpDesc {
            local: smallvec![span(local.addr, local.len, Access::Read)],
            message: true,
            ..OpDesc::default()
        }
    }
    /// Add a local span (further SGEs).
    pub fn with_local(mut self, range: Range, access: Access) -> OpDesc {
        self.local.push(Span { range, access });
        self
    }
    /// Set the order-before bit.
    pub fn order_before(mut self, on: bool) -> OpDesc {
        self.order_before = on;
        self
    }
    /// Set the order-after bit.
    pub fn order_after(mut self, on: bool) -> OpDesc {
        self.order_after = on;
        self
    }
    fn writes_remote(&self) -> bool {
        self.remote
            .iter()
            .any(|s| s.access == Access::Write && s.range.len != 0)
    }
    fn validate(&self) -> Result<(), OrderError> {
        for s in self.local.iter().chain(&self.remote) {
            if s.range.end().is_none() {
                return Err(OrderError::InvalidRange {
                    addr: s.range.addr,
                    len: s.range.len,
                });
            }
        }
        Ok(())
    }
}

fn spans_conflict(a: &[Span], b: &[Span]) -> bool {
    a.iter().any(|x| {
        b.iter().any(|y| {
            (x.access == Access::Write || y.access == Access::Write) && x.range.overlaps(&y.range)
        })
    })
}

/// Ordering policy of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Overlap heuristic plus the per-WR bits (the paper's default).
    #[default]
    Relaxed,
    /// Every op is order-before: at most one op in flight.
    Strict,
}

/// Configuration of one QP's ordering table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderConfig {
    pub mode: Mode,
    /// Local and remote addresses share one address space (QP connected to
    /// the same host and process): compare local spans against remote ones.
    pub loopback: bool,
    /// Messages conflict with in-flight remote writes (see module docs).
    pub messages_fence_writes: bool,
}

impl Default for OrderConfig {
    fn default() -> Self {
        OrderConfig {
            mode: Mode::Relaxed,
            loopback: false,
            messages_fence_writes: true,
        }
    }
}

impl OrderConfig {
    /// Whether `a` and `b` may not be in flight at the same time.
    pub fn conflicts(&self, a: &OpDesc, b: &OpDesc) -> bool {
        if a.message && b.message {
            return true;
        }
        if self.messages_fence_writes
            && ((a.message && b.writes_remote()) || (b.message && a.writes_remote()))
        {
            return true;
        }
        if spans_conflict(&a.local, &b.local) || spans_conflict(&a.remote, &b.remote) {
            return true;
        }
        self.loopback
            && (spans_conflict(&a.local, &b.remote) || spans_conflict(&a.remote, &b.local))
    }
}

/// Sequence number the table gives each submitted op (post order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// Outcome of [`OrderTable::submit`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admit<T> {
    /// Issue now (the op is recorded as in flight; the payload comes back).
    Issue(Ticket, T),
    /// Parked: the table keeps the payload and hands it back from
    /// [`OrderTable::complete`] when the op may issue.
    Parked(Ticket),
}

/// Ordering errors (caller bugs or bad input, never panics).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrderError {
    #[error("range at {addr:#x} with length {len} wraps the address space")]
    InvalidRange { addr: u64, len: u64 },
    #[error("ticket {0:?} is not in flight")]
    NotInFlight(Ticket),
}

/// Bounding ranges of an op's spans (all, and written ones only) per
/// side plus its flags: a few comparisons tell that two ops cannot
/// conflict, so scanning a full window of in-flight ops stays cheap; only
/// ops whose bounds meet get the exact span-by-span test.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    local_all: (u64, u64),
    local_w: (u64, u64),
    remote_all: (u64, u64),
    remote_w: (u64, u64),
    message: bool,
    order_after: bool,
}

/// `[lo, hi)` covering `spans` (only written ones if `writes`); empty
/// ranges are skipped, an empty result is `(u64::MAX, 0)`.
fn bound(spans: &[Span], writes: bool) -> (u64, u64) {
    spans
        .iter()
        .filter(|s| s.range.len != 0 && (!writes || s.access == Access::Write))
        .fold((u64::MAX, 0), |(lo, hi), s| {
            let end = s.range.addr.saturating_add(s.range.len);
            (lo.min(s.range.addr), hi.max(end))
        })
}

fn meet(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Bounds {
    fn of(op: &OpDesc) -> Bounds {
        Bounds {
            local_all: bound(&op.local, false),
            local_w: bound(&op.local, true),
            remote_all: bound(&op.remote, false),
            remote_w: bound(&op.remote, true),
            message: op.message,
            order_after: op.order_after,
        }
    }

    /// False only if the two ops certainly do not conflict (exact for
    /// messages, a superset test for memory).
    fn may_conflict(&self, o: &Bounds, cfg: &OrderConfig) -> bool {
        if self.message || o.message || cfg.loopback {
            return true;
        }
        meet(self.local_w, o.local_all)
            || meet(o.local_w, self.local_all)
            || meet(self.remote_w, o.remote_all)
            || meet(o.remote_w, self.remote_all)
    }
}

/// The per-QP table: in-flight ops and the FIFO of parked ops.
#[derive(Debug)]
pub struct OrderTable<T> {
    cfg: OrderConfig,
    next: u64,
    inflight: Vec<(Ticket, OpDesc)>,
    /// `Bounds` of `inflight[i]` (kept in step with it).
    bounds: Vec<Bounds>,
    parked: VecDeque<(Ticket, OpDesc, T)>,
}

impl<T> OrderTable<T> {
    /// An empty table.
    pub fn new(cfg: OrderConfig) -> Self {
        OrderTable {
            cfg,
            next: 0,
            inflight: Vec::new(),
            bounds: Vec::new(),
            parked: VecDeque::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &OrderConfig {
        &self.cfg
    }

    /// Ops in flight.
    pub fn inflight_len(&self) -> usize {
        self.inflight.len()
    }

    /// Ops parked.
    pub fn parked_len(&self) -> usize {
        self.parked.len()
    }

    /// Nothing in flight or parked.
    pub fn is_idle(&self) -> bool {
        self.inflight.is_empty() && self.parked.is_empty()
    }

    /// Whether `t` is in flight.
    pub fn is_inflight(&self, t: Ticket) -> bool {
        self.inflight.iter().any(|(x, _)| *x == t)
    }

    /// Whether `op` may issue given the current in-flight set (ignoring
    /// parked ops).
    fn may_issue(&self, op: &OpDesc) -> bool {
        if self.inflight.is_empty() {
            return true;
        }
        if op.order_before || self.cfg.mode == Mode::Strict {
            return false;
        }
        let b = Bounds::of(op);
        !self.bounds.iter().zip(&self.inflight).any(|(fb, (_, f))| {
            fb.order_after || (fb.may_conflict(&b, &self.cfg) && self.cfg.conflicts(op, f))
        })
    }

    /// Submit a newly posted op. It issues now unless something is parked
    /// already or it must wait (see module docs).
    pub fn submit(&mut self, op: OpDesc, payload: T) -> Result<Admit<T>, OrderError> {
        op.validate()?;
        let t = Ticket(self.next);
        self.next += 1;
        if self.parked.is_empty() && self.may_issue(&op) {
            self.bounds.push(Bounds::of(&op));
            self.inflight.push((t, op));
            Ok(Admit::Issue(t, payload))
        } else {
            tracing::trace!(ticket = t.0, "ordering: op parked");
            self.parked.push_back((t, op, payload));
            Ok(Admit::Parked(t))
        }
    }

    /// Record the completion of in-flight op `t` and append to `out`, in
    /// post order, the parked ops that may issue now (they become in flight).
    pub fn complete_into(
        &mut self,
        t: Ticket,
        out: &mut Vec<(Ticket, T)>,
    ) -> Result<(), OrderError> {
        let i = self
            .inflight
            .iter()
            .position(|(x, _)| *x == t)
            .ok_or(OrderError::NotInFlight(t))?;
        self.inflight.swap_remove(i);
        self.bounds.swap_remove(i);
        while let Some((_, op, _)) = self.parked.front() {
            if !self.may_issue(op) {
                break;
            }
            let Some((pt, op, payload)) = self.parked.pop_front() else {
                break;
            };
            self.bounds.push(Bounds::of(&op));
            self.inflight.push((pt, op));
            out.push((pt, payload));
        }
        Ok(())
    }

    /// [`OrderTable::complete_into`] returning a fresh vector.
    pub fn complete(&mut self, t: Ticket) -> Result<Vec<(Ticket, T)>, OrderError> {
        let mut out = Vec::new();
        self.complete_into(t, &mut out)?;
        Ok(out)
    }

    /// Remove every parked op (QP error or teardown: the caller completes
    /// each with a flush status so every WR still yields one completion).
    pub fn drain_parked(&mut self) -> Vec<(Ticket, T)> {
        self.parked.drain(..).map(|(t, _, p)| (t, p)).collect()
    }
}

#[cfg(test)]
mod tests;
