//! Opt-in timestamp trace of the two-sided (fault) path, for latency
//! breakdowns: each step of a fault records `(step, wall-clock ns)` into a
//! process-wide preallocated buffer. Off by default (one relaxed atomic load
//! per step); on with `NPRDMA_TRACE=1` at [`crate::Context::new`] or
//! [`enable`]. Timestamps are `CLOCK_REALTIME` nanoseconds so that the
//! initiator's and the target's traces (two processes on one machine) can be
//! merged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// One step of the two-sided path (`I*` initiator, `T*` target).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Step {
    /// Initiator: the optimistic attempt's NIC completion is handled.
    IOptDone = 0,
    /// Initiator: the check failed, the two-sided path starts.
    ICheckFail = 1,
    /// Initiator: local buffer pinned and mapped.
    ILocalPinned = 2,
    /// Initiator: the request left (control SEND posted).
    ISent = 3,
    /// Either side: a control receive is handled (its CQE was polled).
    CtrlRecv = 4,
    /// Initiator: the application completion is queued.
    IDone = 5,
    /// Either side: a control message is emitted into slots (its NIC SEND
    /// is posted next).
    CtrlEmitted = 6,
    /// Target: the request is parsed (handler entered).
    TParsed = 11,
    /// Target: validated (key, bounds, rights).
    TValidated = 12,
    /// Target: pages pinned (zero-fill / swap-in done).
    TPinned = 13,
    /// Target: IOMMU views mapped in.
    TMapped = 14,
    /// Target: data copied / reverse op posted, pin dropped.
    TCopied = 15,
    /// Target: the answer left (control SEND posted).
    TSent = 16,
}

impl Step {
    /// All steps in path order.
    pub const ALL: [Step; 13] = [
        Step::IOptDone,
        Step::ICheckFail,
        Step::ILocalPinned,
        Step::ISent,
        Step::CtrlRecv,
        Step::TParsed,
        Step::TValidated,
        Step::TPinned,
        Step::TMapped,
        Step::TCopied,
        Step::TSent,
        Step::IDone,
        Step::CtrlEmitted,
    ];

    /// The step with number `n` (inverse of `as u8`).
    pub fn from_u8(n: u8) -> Option<Step> {
        Step::ALL.iter().copied().find(|s| *s as u8 == n)
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static BUF: Mutex<Vec<(Step, u64)>> = Mutex::new(Vec::new());
const CAP: usize = 1 << 20;

/// Wall-clock nanoseconds (comparable across processes of one machine).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Turn recording on or off (the buffer is allocated on first enable).
pub fn enable(on: bool) {
    if on {
        let mut b = BUF.lock();
        let more = CAP - b.len();
        b.reserve(more);
    }
    ON.store(on, Ordering::Release);
}

/// Whether recording is on.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Record `step` now (no-op unless enabled; drops records beyond 1 Mi).
#[inline]
pub fn mark(step: Step) {
    if ON.load(Ordering::Relaxed) {
        record(step);
    }
}

#[cold]
fn record(step: Step) {
    let t = now_ns();
    let mut b = BUF.lock();
    if b.len() < CAP {
        b.push((step, t));
    }
}

/// Take (and clear) everything recorded so far, in recording order.
pub fn take() -> Vec<(Step, u64)> {
    std::mem::take(&mut *BUF.lock())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_enabled_and_round_trips_step_numbers() {
        for s in Step::ALL {
            assert_eq!(Step::from_u8(s as u8), Some(s));
        }
        assert_eq!(Step::from_u8(99), None);
        // Other tests of this binary never enable the trace.
        mark(Step::CtrlRecv);
        enable(true);
        mark(Step::CtrlRecv);
        mark(Step::TSent);
        enable(false);
        mark(Step::IDone);
        let v = take();
        let steps: Vec<Step> = v.iter().map(|x| x.0).collect();
        assert_eq!(steps, [Step::CtrlRecv, Step::TSent]);
        assert!(v[0].1 <= v[1].1 && v[0].1 > 0);
        assert!(take().is_empty());
    }
}
