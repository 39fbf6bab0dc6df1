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
//! completes). [`OrderMode::Strict`] treats every operation as order-before, i.e.
//! at most one in flight.
//!
//! **Pipelining behind optimistic ops (replay)** ([`OrderConfig::pipeline`],
//! on by default). The RC data QP executes
//! NIC WRs in post order, so an op that conflicts only with in-flight ops
//! still in their *optimistic one-sided phase* (their NIC WRs are posted,
//! their check is not done yet; the owner reports this with
//! [`OrderTable::on_nic`]) may issue at once: its NIC WRs execute after
//! theirs. Only plain one-sided READ/WRITE ([`OpDesc::optimistic`]) qualify,
//! on both sides of the conflict, and only if the new op does not write
//! memory the earlier one reads (a write-after-read: the earlier op's
//! fallback would see the later bytes, and replaying cannot undo a write)
//! nor *part* of the earlier op's local destination (its data lands before
//! the earlier op's check, which samples one word per DMA atom: covering
//! the sampled word of a torn atom would hide the rest of it — found by the
//! long chaos test; an identical destination, a same-buffer window, is
//! fine: the later op replaces all of it and is checked itself); messages, atomics, order-before/after and
//! [`OrderMode::Strict`] keep the parking rule above, and so does a conflict
//! with an op that is not (or no longer) optimistic. Two consequences:
//!
//! * an op issued behind optimistic conflicts may not *finish* (complete,
//!   or fall back to the two-sided path) while an earlier conflicting op is
//!   still in flight: [`OrderTable::must_wait`] holds it, and
//!   [`OrderTable::complete_into`] hands it back once its predecessors are
//!   done;
//! * when an optimistic op's check fails ([`OrderTable::fail`]), it goes
//!   two-sided and finishes later. Every later in-flight op that conflicts
//!   with it — transitively — has its one-sided result discarded and is
//!   re-parked in post order ahead of everything parked: it re-executes
//!   after the failed op (a READ re-reads, a WRITE rewrites), so the final
//!   local and remote bytes and the completion order are those of RC.
//!
//! **Superseded destinations.** In a same-buffer window (perftest's
//! bandwidth loop: every READ lands in one local buffer) a later READ that
//! writes exactly the same local ranges *supersedes* an earlier one: RC
//! leaves the later op's bytes there, whatever the earlier one read. When
//! the earlier op's check fails and it goes two-sided, replaying every
//! later READ of the window behind it would resolve their faults one at a
//! time (each failure replays the rest: quadratic work, one fault per round
//! trip). Instead, if its two-sided answer can be dropped
//! ([`OpDesc::suppressible`]: a small READ answered inline), a superseding
//! op is not replayed for it, may finish or go two-sided itself without
//! waiting for it, and the earlier op's answer is *dead*
//! ([`OrderTable::data_dead`]): the owner completes it without writing its
//! bytes, so they can never land on top of the later op's. Faults of a
//! whole window are then resolved concurrently.
//!
//! *Weakening:* while such a replay is pending, a concurrent observer of
//! the remote memory may transiently see a later overlapping WRITE's bytes
//! before (and then again after) an earlier one's; the final state and the
//! completion order are RC's.
//!
//! The table is a plain data structure (no locking, no I/O): the QP's owner
//! calls [`OrderTable::submit`] when the application posts,
//! [`OrderTable::on_nic`] when an op's NIC WRs are posted and
//! [`OrderTable::complete`] when an operation finishes; they hand back the
//! operations to issue (or to finish) now, in order. The in-flight set is
//! scanned linearly: it is bounded by the QP depth.
//!
//! **Twins.** A deep window of the same kind of op (perftest's READs of
//! distinct remote pages into one buffer, up to the QP depth in flight) would
//! make every event a scan of the whole window. Two ops are *twins* if they
//! differ at most in the remote memory they only read: same local touches,
//! same bits, no remote write, no message, no loopback. Against any op that
//! writes no remote memory, twins conflict, supersede and overwrite alike.
//! Consecutive in-flight twins form a *run* (a label per entry; a run is
//! always a contiguous stretch of the in-flight set), and the table answers
//! within a run from one member: a new op that meets its twin while nothing
//! in flight writes remote memory gets the twin's admission for everything
//! older; a failing op whose later ops are all its run decides them at
//! once; holding and burying inside a run need one flag per entry. The
//! answers are exactly the full scans' (a test drives both side by side).

use std::collections::VecDeque;

use smallvec::{smallvec, SmallVec};

/// Touches of one side of an op (inline for the common 1–2 SGE case).
pub type Touches = SmallVec<[Touch; 2]>;

/// Half-open byte range `[addr, addr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Range {
    /// Start.
    pub addr: u64,
    /// Length in bytes.
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
pub struct Touch {
    /// The bytes.
    pub range: Range,
    /// Read or write.
    pub access: Access,
}

/// What the ordering logic needs to know about one application WR.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpDesc {
    /// Local memory (initiator side), one span per SGE.
    pub local: Touches,
    /// Remote memory (target side).
    pub remote: Touches,
    /// Consumes a RECV at the peer (SEND, SEND_WITH_IMM, WRITE_WITH_IMM).
    pub message: bool,
    /// Wait until nothing is in flight before issuing.
    pub order_before: bool,
    /// Issue nothing behind this op until it completes.
    pub order_after: bool,
    /// A plain one-sided READ/WRITE that runs optimistically on the data
    /// QP: it may be pipelined behind (and ahead of) other such ops it
    /// overlaps (module docs, "replay").
    pub optimistic: bool,
    /// Its two-sided result reaches local memory only through the owner
    /// (an inline READ answer the CPU copies), so the owner can drop it
    /// when a later op overwrites the whole destination (module docs,
    /// "superseded destinations").
    pub suppressible: bool,
}

fn touch(addr: u64, len: u64, access: Access) -> Touch {
    Touch {
        range: Range::new(addr, len),
        access,
    }
}

impl OpDesc {
    /// RDMA READ: reads remote, writes local.
    pub fn read(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            local: smallvec![touch(local.addr, local.len, Access::Write)],
            remote: smallvec![touch(remote.addr, remote.len, Access::Read)],
            optimistic: true,
            ..OpDesc::default()
        }
    }
    /// RDMA WRITE: reads local, writes remote.
    pub fn write(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            local: smallvec![touch(local.addr, local.len, Access::Read)],
            remote: smallvec![touch(remote.addr, remote.len, Access::Write)],
            optimistic: true,
            ..OpDesc::default()
        }
    }
    /// WRITE_WITH_IMM: a WRITE that also consumes a RECV.
    pub fn write_imm(local: Range, remote: Range) -> OpDesc {
        OpDesc {
            message: true,
            optimistic: false,
            ..OpDesc::write(local, remote)
        }
    }
    /// Atomic on 8 remote bytes, result written to 8 local bytes.
    pub fn atomic(local_addr: u64, remote_addr: u64) -> OpDesc {
        OpDesc {
            local: smallvec![touch(local_addr, 8, Access::Write)],
            remote: smallvec![touch(remote_addr, 8, Access::Write)],
            ..OpDesc::default()
        }
    }
    /// SEND: reads local, consumes a RECV.
    pub fn send(local: Range) -> OpDesc {
        OpDesc {
            local: smallvec![touch(local.addr, local.len, Access::Read)],
            message: true,
            ..OpDesc::default()
        }
    }
    /// Add a local span (further SGEs).
    pub fn with_local(mut self, range: Range, access: Access) -> OpDesc {
        self.local.push(Touch { range, access });
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
    /// Set the optimistic bit (see [`OpDesc::optimistic`]).
    pub fn optimistic(mut self, on: bool) -> OpDesc {
        self.optimistic = on;
        self
    }
    /// Set the suppressible bit (see [`OpDesc::suppressible`]).
    pub fn suppressible(mut self, on: bool) -> OpDesc {
        self.suppressible = on;
        self
    }
    /// May be pipelined behind / ahead of optimistic conflicts.
    fn pipelines(&self) -> bool {
        self.optimistic && !self.message && !self.order_before && !self.order_after
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

fn touches_conflict(a: &[Touch], b: &[Touch]) -> bool {
    a.iter().any(|x| {
        b.iter().any(|y| {
            (x.access == Access::Write || y.access == Access::Write) && x.range.overlaps(&y.range)
        })
    })
}

/// Whether `a` writes memory that `b` only reads.
fn overwrites_reads(a: &[Touch], b: &[Touch]) -> bool {
    a.iter().any(|x| {
        x.access == Access::Write
            && b.iter()
                .any(|y| y.access == Access::Read && x.range.overlaps(&y.range))
    })
}

/// Whether `a` writes part, but not exactly all, of a range `b` writes.
fn clobbers_partly(a: &[Touch], b: &[Touch]) -> bool {
    a.iter().any(|x| {
        x.access == Access::Write
            && b.iter().any(|y| {
                y.access == Access::Write && x.range.overlaps(&y.range) && x.range != y.range
            })
    })
}

/// Ordering policy of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderMode {
    /// Overlap heuristic plus the per-WR bits (the paper's default).
    #[default]
    Relaxed,
    /// Every op is order-before: at most one op in flight.
    Strict,
}

/// Configuration of one QP's ordering table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderConfig {
    /// Ordering mode.
    pub mode: OrderMode,
    /// Local and remote addresses share one address space (QP connected to
    /// the same host and process): compare local spans against remote ones.
    pub loopback: bool,
    /// Messages conflict with in-flight remote writes (see module docs).
    pub messages_fence_writes: bool,
    /// Pipeline overlapping optimistic READ/WRITEs with replay (see module
    /// docs); on by default. Off = the paper's parking for every overlap.
    pub pipeline: bool,
}

impl Default for OrderConfig {
    fn default() -> Self {
        OrderConfig {
            mode: OrderMode::Relaxed,
            loopback: false,
            messages_fence_writes: true,
            pipeline: true,
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
        if touches_conflict(&a.local, &b.local) || touches_conflict(&a.remote, &b.remote) {
            return true;
        }
        self.loopback
            && (touches_conflict(&a.local, &b.remote) || touches_conflict(&a.remote, &b.local))
    }
}

impl OrderConfig {
    /// Whether `later` may not pipeline behind `earlier` although both are
    /// optimistic: it writes memory that `earlier` reads (a write-after-read
    /// hazard: replaying `later` cannot undo that), or it overwrites *part*
    /// of `earlier`'s local destination. The latter lands before
    /// `earlier`'s check, which samples one word per DMA atom of its own
    /// data: a partial overwrite can cover the sampled word of a torn
    /// (signature) atom and leave the rest of it behind. Identical
    /// destinations (a same-buffer window) are fine: `later` replaces all
    /// of it and is checked itself.
    fn overwrites(&self, later: &OpDesc, earlier: &OpDesc) -> bool {
        overwrites_reads(&later.local, &earlier.local)
            || overwrites_reads(&later.remote, &earlier.remote)
            || clobbers_partly(&later.local, &earlier.local)
            || (self.loopback
                && (overwrites_reads(&later.local, &earlier.remote)
                    || overwrites_reads(&later.remote, &earlier.local)
                    || clobbers_partly(&later.remote, &earlier.local)))
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
    /// The range wraps the address space.
    InvalidRange {
        /// Address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    #[error("ticket {0:?} is not in flight")]
    /// The ticket is not in flight (an engine bug).
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
    /// The one local range, if the op writes exactly one non-empty local
    /// range and nothing else locally (a READ's destination).
    local_sig: Option<(u64, u64)>,
    pipelines: bool,
    suppressible: bool,
}

/// `[lo, hi)` covering `spans` (only written ones if `writes`); empty
/// ranges are skipped, an empty result is `(u64::MAX, 0)`.
fn bound(spans: &[Touch], writes: bool) -> (u64, u64) {
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
            local_sig: match op.local.as_slice() {
                [s] if s.access == Access::Write && s.range.len != 0 => {
                    Some((s.range.addr, s.range.len))
                }
                _ => None,
            },
            pipelines: op.pipelines(),
            suppressible: op.suppressible,
        }
    }

    /// Whether an op with these bounds (`self`, the later one) supersedes
    /// one with `earlier` (module docs, "superseded destinations"): both
    /// pipeline, `earlier`'s answer can be dropped, both write exactly the
    /// same single local range and nothing else locally, and their remote
    /// ranges certainly do not conflict. Conservative: `false` keeps the
    /// ordinary rules.
    fn supersedes(&self, earlier: &Bounds, cfg: &OrderConfig) -> bool {
        earlier.suppressible
            && self.local_sig.is_some()
            && self.local_sig == earlier.local_sig
            && self.pipelines
            && earlier.pipelines
            && cfg.pipeline
            && cfg.mode == OrderMode::Relaxed
            && !cfg.loopback
            && !meet(self.remote_w, earlier.remote_all)
            && !meet(earlier.remote_w, self.remote_all)
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

/// Phase of an in-flight op (module docs, "replay").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Admitted; not (or no longer) on the optimistic one-sided path:
    /// nothing conflicting may issue behind it.
    Issued,
    /// Its NIC WRs are posted and its check is pending: conflicting
    /// optimistic ops may issue behind it.
    Optimistic,
}

/// One in-flight op.
#[derive(Debug)]
struct Entry<T> {
    ticket: Ticket,
    op: OpDesc,
    bounds: Bounds,
    payload: T,
    phase: Phase,
    /// Issued while a conflicting op was in flight.
    behind: bool,
    /// Waiting (in [`OrderTable::must_wait`]) for earlier conflicting ops.
    held: bool,
    /// Its check failed and it went two-sided ([`OrderTable::fail`]): it
    /// is never replayed again.
    failed: bool,
    /// A later op supersedes it: its two-sided answer must not be written
    /// ([`OrderTable::data_dead`]).
    dead: bool,
    /// Its run of twins (module docs, "twins"): entries with one label are
    /// consecutive in flight.
    run: u64,
}

/// The per-QP table: in-flight ops and the FIFO of parked ops.
#[derive(Debug)]
pub struct OrderTable<T> {
    cfg: OrderConfig,
    next: u64,
    /// In flight, in ticket (post) order (completions mostly remove the
    /// oldest, posts append).
    inflight: VecDeque<Entry<T>>,
    parked: VecDeque<(Ticket, OpDesc, T)>,
    /// Next run label.
    next_run: u64,
    /// In-flight ops that are not [`plain`] (they tell twins apart).
    specials: usize,
    /// In-flight ops that are held (see [`OrderTable::must_wait`]): a
    /// completion looks for ops to hand back only while there are some.
    holding: usize,
    /// In-flight ops that went two-sided ([`OrderTable::fail`]): only those
    /// can be buried.
    failing: usize,
    /// Answer from twins and runs (off only in tests, to compare with the
    /// full scans).
    shortcuts: bool,
}

/// An op that writes no remote memory, is no message and carries no
/// ordering bit: the kind of op that has twins.
fn plain(op: &OpDesc, b: &Bounds) -> bool {
    !op.message && !op.order_before && !op.order_after && b.remote_w.0 >= b.remote_w.1
}

impl<T: Clone> OrderTable<T> {
    /// An empty table.
    pub fn new(cfg: OrderConfig) -> Self {
        OrderTable {
            cfg,
            next: 0,
            inflight: VecDeque::new(),
            parked: VecDeque::new(),
            next_run: 0,
            specials: 0,
            holding: 0,
            failing: 0,
            shortcuts: true,
        }
    }

    /// The same table answering every question with a full scan (the
    /// reference the twin shortcuts are tested against).
    #[cfg(test)]
    pub(crate) fn without_shortcuts(cfg: OrderConfig) -> Self {
        OrderTable {
            shortcuts: false,
            ..OrderTable::new(cfg)
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
        self.pos(t).is_some()
    }

    fn pos(&self, t: Ticket) -> Option<usize> {
        // Tickets are consecutive unless ops are parked or done out of order:
        // the offset from the oldest is then the index.
        let first = self.inflight.front()?.ticket.0;
        let guess = usize::try_from(t.0.checked_sub(first)?).ok()?;
        if self.inflight.get(guess).is_some_and(|e| e.ticket == t) {
            return Some(guess);
        }
        self.inflight.binary_search_by_key(&t, |e| e.ticket).ok()
    }

    /// Whether the held and failed counts match the flags (tests).
    #[cfg(test)]
    pub(crate) fn holding_counted(&self) -> bool {
        self.holding == self.inflight.iter().filter(|e| e.held).count()
            && self.failing == self.inflight.iter().filter(|e| e.failed).count()
    }

    /// Set the held flag of in-flight op `i`, keeping the count.
    fn set_held(&mut self, i: usize, held: bool) {
        let e = &mut self.inflight[i];
        if e.held != held {
            e.held = held;
            if held {
                self.holding += 1;
            } else {
                self.holding -= 1;
            }
        }
    }

    fn conflict(&self, a: &OpDesc, ab: &Bounds, b: &OpDesc, bb: &Bounds) -> bool {
        ab.may_conflict(bb, &self.cfg) && self.cfg.conflicts(a, b)
    }

    /// Whether `a` and `b` are twins (module docs, "twins").
    fn twins(&self, a: &OpDesc, ab: &Bounds, b: &OpDesc, bb: &Bounds) -> bool {
        self.shortcuts
            && !self.cfg.loopback
            && plain(a, ab)
            && plain(b, bb)
            && a.optimistic == b.optimistic
            && a.suppressible == b.suppressible
            && a.local == b.local
    }

    /// Whether the in-flight entries `0..=i` are one run (`i` and all older
    /// entries are twins).
    fn run_from_start(&self, i: usize) -> bool {
        self.shortcuts && self.inflight[0].run == self.inflight[i].run
    }

    /// Take in-flight entry `i` out.
    fn take(&mut self, i: usize) -> Option<Entry<T>> {
        let e = self.inflight.remove(i)?;
        if !plain(&e.op, &e.bounds) {
            self.specials -= 1;
        }
        if e.held {
            self.holding -= 1;
        }
        if e.failed {
            self.failing -= 1;
        }
        Some(e)
    }

    /// Whether `op` may issue given the current in-flight set (ignoring
    /// parked ops); `Some(behind)` if so (`behind`: it overlaps an
    /// optimistic in-flight op).
    fn may_issue(&self, op: &OpDesc, b: &Bounds) -> Option<bool> {
        if self.inflight.is_empty() {
            return Some(false);
        }
        if op.order_before || self.cfg.mode == OrderMode::Strict {
            return None;
        }
        let pipelines = self.cfg.pipeline && op.pipelines();
        let mut behind = false;
        // Whether `op` overwrites what an op like itself reads (asked once).
        let mut self_overwrite: Option<bool> = None;
        // Newest first. An optimistic in-flight op with the same
        // description that `op` may pipeline behind vouches for every
        // older one: it was admitted past them with the same conflicts,
        // and none of them has failed since (a failure would have replayed
        // it, i.e. taken it out of flight). So a perftest-style window
        // checks one op, not the whole window; an in-flight twin of `op`
        // (module docs, "twins") vouches the same way while nothing in
        // flight writes remote memory.
        for e in self.inflight.iter().rev() {
            if pipelines
                && e.phase == Phase::Optimistic
                && e.op == *op
                && !*self_overwrite.get_or_insert_with(|| self.cfg.overwrites(op, op))
            {
                return Some(true);
            }
            if e.bounds.order_after {
                return None;
            }
            if b.supersedes(&e.bounds, &self.cfg) {
                // `op` replaces all `e` writes: behind an optimistic `e`
                // it pipelines (it overwrites nothing `e` reads), past a
                // two-sided one it buries it (the caller's `bury`).
                if e.phase == Phase::Optimistic || e.failed {
                    if self.specials == 0 && self.twins(op, b, &e.op, &e.bounds) {
                        // As below: older ops treat `op` as they treat `e`.
                        return Some(true);
                    }
                    behind = true;
                    continue;
                }
                return None;
            }
            if self.conflict(op, b, &e.op, &e.bounds) {
                if pipelines && e.phase == Phase::Optimistic && !self.cfg.overwrites(op, &e.op) {
                    behind = true;
                } else {
                    return None;
                }
            }
            if self.specials == 0 && self.twins(op, b, &e.op, &e.bounds) {
                // Every older op treats `op` as it treated its in-flight twin
                // `e`, which it admitted (an older op admitted after `e`, a
                // replay, conflicts with neither: `e` would have been replayed
                // with it).
                return Some(behind || e.behind);
            }
        }
        Some(behind)
    }

    fn push_inflight(
        &mut self,
        ticket: Ticket,
        op: OpDesc,
        bounds: Bounds,
        payload: T,
        behind: bool,
    ) -> usize {
        // Tickets only grow, except for replayed ops re-issued from the
        // front of the parked FIFO: keep the vector sorted.
        let at = match self.inflight.back() {
            Some(last) if last.ticket < ticket => self.inflight.len(),
            _ => self.inflight.partition_point(|e| e.ticket < ticket),
        };
        let n = self.inflight.len();
        let run = match self.inflight.back() {
            Some(last) if at == n && self.twins(&op, &bounds, &last.op, &last.bounds) => last.run,
            _ => {
                if at > 0 && at < n {
                    // Inserted inside a run: its later part gets a label of
                    // its own (a run stays contiguous).
                    let (old, new) = (self.inflight[at - 1].run, self.next_run);
                    self.next_run += 1;
                    for e in self.inflight.range_mut(at..).take_while(|e| e.run == old) {
                        e.run = new;
                    }
                }
                self.next_run += 1;
                self.next_run - 1
            }
        };
        if !plain(&op, &bounds) {
            self.specials += 1;
        }
        self.inflight.insert(
            at,
            Entry {
                ticket,
                op,
                bounds,
                payload,
                phase: Phase::Issued,
                behind,
                held: false,
                failed: false,
                dead: false,
                run,
            },
        );
        at
    }

    /// Submit a newly posted op. It issues now unless something is parked
    /// already or it must wait (see module docs).
    pub fn submit(&mut self, op: OpDesc, payload: T) -> Result<Admit<T>, OrderError> {
        op.validate()?;
        let t = Ticket(self.next);
        self.next += 1;
        let b = Bounds::of(&op);
        let admit = if self.parked.is_empty() {
            self.may_issue(&op, &b)
        } else {
            None
        };
        if let Some(behind) = admit {
            let at = self.push_inflight(t, op, b, payload.clone(), behind);
            if behind {
                self.bury(at);
            }
            Ok(Admit::Issue(t, payload))
        } else {
            tracing::trace!(ticket = t.0, "ordering: op parked");
            self.parked.push_back((t, op, payload));
            Ok(Admit::Parked(t))
        }
    }

    /// Issue parked ops (FIFO) while the head may issue.
    fn release_parked(&mut self, out: &mut Vec<(Ticket, T)>) {
        while let Some((_, op, _)) = self.parked.front() {
            let b = Bounds::of(op);
            let Some(behind) = self.may_issue(op, &b) else {
                break;
            };
            let Some((pt, op, payload)) = self.parked.pop_front() else {
                break;
            };
            out.push((pt, payload.clone()));
            let at = self.push_inflight(pt, op, b, payload, behind);
            if behind {
                self.bury(at);
            }
        }
    }

    /// In-flight op `t`'s NIC WRs are posted: if it is an optimistic op
    /// (see [`OpDesc::optimistic`]), conflicting optimistic ops may issue
    /// behind it now; they are appended to `out` in post order.
    pub fn on_nic(&mut self, t: Ticket, out: &mut Vec<(Ticket, T)>) -> Result<(), OrderError> {
        let i = self.pos(t).ok_or(OrderError::NotInFlight(t))?;
        let e = &mut self.inflight[i];
        if self.cfg.pipeline && e.op.pipelines() && self.cfg.mode == OrderMode::Relaxed {
            e.phase = Phase::Optimistic;
            self.release_parked(out);
        }
        Ok(())
    }

    /// Whether the in-flight op at index `i` must wait for an earlier
    /// in-flight op it conflicts with. An earlier op that already went
    /// two-sided and that `i` supersedes does not count (it is never
    /// replayed, and its answer is dropped: [`OrderTable::bury`]).
    fn blocked(&self, i: usize) -> bool {
        let e = &self.inflight[i];
        if !e.behind || i == 0 {
            return false;
        }
        if self.run_from_start(i) {
            // All older ops are `e`'s twins: one answer for all of them.
            let f = &self.inflight[0];
            return self.conflict(&e.op, &e.bounds, &f.op, &f.bounds)
                && (!e.bounds.supersedes(&f.bounds, &self.cfg)
                    || self.inflight.range(..i).any(|f| !f.failed));
        }
        self.inflight.range(..i).any(|f| {
            !(f.failed && e.bounds.supersedes(&f.bounds, &self.cfg))
                && self.conflict(&e.op, &e.bounds, &f.op, &f.bounds)
        })
    }

    /// Mark the two-sided ops that in-flight op `i` supersedes as dead:
    /// `i` may finish without waiting for them, so their answers must not
    /// land on its bytes.
    fn bury(&mut self, i: usize) {
        if self.failing == 0 {
            // Nothing went two-sided: nothing to bury.
            return;
        }
        if i > 0 && self.run_from_start(i) {
            // All older ops are twins of `i`: it supersedes all or none.
            if self.inflight[i]
                .bounds
                .supersedes(&self.inflight[0].bounds, &self.cfg)
            {
                for f in self.inflight.range_mut(..i).filter(|f| f.failed) {
                    f.dead = true;
                }
            }
            return;
        }
        for k in 0..i {
            if self.inflight[k].failed
                && !self.inflight[k].dead
                && self.inflight[i]
                    .bounds
                    .supersedes(&self.inflight[k].bounds, &self.cfg)
            {
                self.inflight[k].dead = true;
            }
        }
    }

    /// Whether in-flight op `t`'s two-sided answer must be dropped: a later
    /// op supersedes it (module docs, "superseded destinations"). The
    /// owner still completes `t` with the answer's status.
    pub fn data_dead(&self, t: Ticket) -> bool {
        self.pos(t).is_some_and(|i| self.inflight[i].dead)
    }

    /// In-flight op `t` has its result (success, or a failed check that
    /// sends it two-sided). `true`: an earlier conflicting op is still in
    /// flight, so `t` must not finish (nor go two-sided) yet; the table
    /// holds it and [`OrderTable::complete_into`] hands it back once those
    /// are done (it may also be replayed by a [`OrderTable::fail`] of one
    /// of them). `false`: go ahead.
    pub fn must_wait(&mut self, t: Ticket) -> Result<bool, OrderError> {
        let i = self.pos(t).ok_or(OrderError::NotInFlight(t))?;
        let wait = self.blocked(i);
        self.set_held(i, wait);
        if !wait {
            self.bury(i);
        }
        Ok(wait)
    }

    /// In-flight op `t`'s optimistic check failed and it goes two-sided
    /// (it stays in flight, no longer optimistic). The later in-flight ops
    /// that conflict with it, transitively, lose their one-sided result:
    /// they are re-parked in post order ahead of every parked op (to issue
    /// again once `t` completes) and appended to `out` in post order; the
    /// owner discards whatever they did so far.
    pub fn fail(&mut self, t: Ticket, out: &mut Vec<(Ticket, T)>) -> Result<(), OrderError> {
        let i = self.pos(t).ok_or(OrderError::NotInFlight(t))?;
        self.inflight[i].phase = Phase::Issued;
        self.set_held(i, false);
        if !self.inflight[i].failed {
            self.inflight[i].failed = true;
            self.failing += 1;
        }
        // The closure: scan later ops in ticket order; one joins if it
        // conflicts with `t` or with an op that joined before it. An op
        // that supersedes `t` does not join for `t`'s sake (its bytes
        // replace `t`'s, whose answer is then dropped).
        let mut set: SmallVec<[usize; 8]> = smallvec![i];
        let mut dead = false;
        let n = self.inflight.len();
        let mut from = i + 1;
        if from < n && self.shortcuts && self.inflight[n - 1].run == self.inflight[i].run {
            // Every later op is a twin of `t`: one answer for all of them.
            let (e, f) = (&self.inflight[from], &self.inflight[i]);
            if e.bounds.supersedes(&f.bounds, &self.cfg) {
                dead = true;
            } else if self.conflict(&e.op, &e.bounds, &f.op, &f.bounds) {
                set.extend(from..n);
            }
            from = n;
        }
        for k in from..n {
            let e = &self.inflight[k];
            let mut over = false;
            let join = set.iter().any(|&s| {
                let f = &self.inflight[s];
                if s == i && e.bounds.supersedes(&f.bounds, &self.cfg) {
                    over = true;
                    return false;
                }
                self.conflict(&e.op, &e.bounds, &f.op, &f.bounds)
            });
            if join {
                set.push(k);
            } else if over {
                dead = true;
            }
        }
        self.inflight[i].dead |= dead;
        let start = out.len();
        for &k in set[1..].iter().rev() {
            let Some(e) = self.take(k) else {
                continue;
            };
            tracing::trace!(ticket = e.ticket.0, failed = t.0, "ordering: op replayed");
            out.push((e.ticket, e.payload.clone()));
            self.parked.push_front((e.ticket, e.op, e.payload));
        }
        out[start..].reverse();
        Ok(())
    }

    /// Record the completion of in-flight op `t` and append to `out`, in
    /// post order, first the held ops (see [`OrderTable::must_wait`]) whose
    /// earlier conflicts are now all done (they stay in flight), then the
    /// parked ops that may issue now (they become in flight).
    pub fn complete_into(
        &mut self,
        t: Ticket,
        out: &mut Vec<(Ticket, T)>,
    ) -> Result<(), OrderError> {
        let i = self.pos(t).ok_or(OrderError::NotInFlight(t))?;
        self.take(i);
        let mut k = i;
        while self.holding > 0 && k < self.inflight.len() {
            if self.inflight[k].held && !self.blocked(k) {
                self.bury(k);
                self.set_held(k, false);
                let e = &self.inflight[k];
                out.push((e.ticket, e.payload.clone()));
            }
            k += 1;
        }
        self.release_parked(out);
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
