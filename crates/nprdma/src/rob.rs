//! Reorder buffer for application completions of one QP. NP-RDMA lets
//! operations of a QP *finish* out of order (a faulting op goes two-sided
//! while later ones complete optimistically), but RC semantics promise the
//! application that completions appear in post order — and that a signaled
//! completion implies every earlier WR (signaled or not) has completed. So
//! finished operations wait here until all operations posted before them
//! have finished; then their completions are released in post order.
//! Unsignaled successful operations release nothing; failed ones always
//! produce a completion (as on hardware).

use std::collections::VecDeque;

/// Reorder-buffer errors (engine bugs, reported instead of panicking).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RobError {
    #[error("sequence {0} is not outstanding")]
    /// The sequence is not outstanding (an engine bug).
    NotOutstanding(u64),
    #[error("sequence {0} already finished")]
    /// The sequence already finished (an engine bug).
    AlreadyFinished(u64),
}

#[derive(Debug)]
enum Slot<C> {
    Posted { signaled: bool },
    Done { report: Option<C> },
}

/// Completions of one QP in post order. Sequence numbers are handed out by
/// [`CompletionOrder::post`] (the same order as the QP's ordering tickets).
#[derive(Debug)]
pub struct CompletionOrder<C> {
    base: u64,
    slots: VecDeque<Slot<C>>,
}

impl<C> Default for CompletionOrder<C> {
    fn default() -> Self {
        CompletionOrder {
            base: 0,
            slots: VecDeque::new(),
        }
    }
}

impl<C> CompletionOrder<C> {
    /// Empty buffer starting at sequence 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record a newly posted WR; returns its sequence number.
    pub fn post(&mut self, signaled: bool) -> u64 {
        self.slots.push_back(Slot::Posted { signaled });
        self.base + self.slots.len() as u64 - 1
    }

    /// WRs posted and not yet released.
    pub fn outstanding(&self) -> usize {
        self.slots.len()
    }

    /// Record that WR `seq` finished with completion `c` (`ok` = success).
    pub fn finish(&mut self, seq: u64, ok: bool, c: C) -> Result<(), RobError> {
        let i = seq
            .checked_sub(self.base)
            .filter(|i| *i < self.slots.len() as u64)
            .ok_or(RobError::NotOutstanding(seq))? as usize;
        match self.slots[i] {
            Slot::Posted { signaled } => {
                self.slots[i] = Slot::Done {
                    report: (signaled || !ok).then_some(c),
                };
                Ok(())
            }
            Slot::Done { .. } => Err(RobError::AlreadyFinished(seq)),
        }
    }

    /// Move the completions that may be reported now, in post order, to
    /// `out`; returns how many WRs were retired (reported or silent).
    pub fn drain_ready(&mut self, out: &mut Vec<C>) -> usize {
        self.drain_ready_with(|c| out.push(c))
    }

    /// [`Self::drain_ready`], handing each completion to `f` (no buffer).
    pub fn drain_ready_with(&mut self, mut f: impl FnMut(C)) -> usize {
        let mut n = 0;
        while let Some(Slot::Done { .. }) = self.slots.front() {
            if let Some(Slot::Done { report: Some(c) }) = self.slots.pop_front() {
                f(c);
            }
            self.base += 1;
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn later_completion_waits_for_earlier_unsignaled_write() {
        let mut r = CompletionOrder::new();
        let w = r.post(false); // unsignaled WRITE that faulted: slow
        let s = r.post(true); // signaled READ: fast
        r.finish(s, true, "read").unwrap();
        let mut out = Vec::new();
        assert_eq!(r.drain_ready(&mut out), 0);
        assert!(
            out.is_empty(),
            "signaled CQE must imply the earlier WRITE is done"
        );
        r.finish(w, true, "write").unwrap();
        assert_eq!(r.drain_ready(&mut out), 2);
        assert_eq!(out, vec!["read"]);
        assert_eq!(r.outstanding(), 0);
    }

    #[test]
    fn failures_always_report_and_misuse_is_an_error() {
        let mut r = CompletionOrder::new();
        let a = r.post(false);
        r.finish(a, false, "err").unwrap();
        assert_eq!(
            r.finish(a, false, "again"),
            Err(RobError::AlreadyFinished(a))
        );
        let mut out = Vec::new();
        r.drain_ready(&mut out);
        assert_eq!(out, vec!["err"]);
        assert_eq!(r.finish(a, true, "late"), Err(RobError::NotOutstanding(a)));
        let b = r.post(true);
        r.finish(b, true, "b").unwrap();
        assert_eq!(r.finish(b, true, "b2"), Err(RobError::AlreadyFinished(b)));
        assert_eq!(r.finish(99, true, "x"), Err(RobError::NotOutstanding(99)));
    }

    proptest! {
        #[test]
        fn released_in_post_order_exactly_once(
            wrs in prop::collection::vec((any::<bool>(), any::<bool>()), 1..60),
            order in prop::collection::vec(any::<usize>(), 60)
        ) {
            let mut r = CompletionOrder::new();
            let seqs: Vec<u64> = wrs.iter().map(|(sig, _)| r.post(*sig)).collect();
            // Finish in a random permutation.
            let mut pending: Vec<usize> = (0..wrs.len()).collect();
            let mut out: Vec<usize> = Vec::new();
            let mut finished = vec![false; wrs.len()];
            let mut k = 0;
            while !pending.is_empty() {
                let i = pending.remove(order[k % order.len()] % pending.len());
                k += 1;
                r.finish(seqs[i], wrs[i].1, i).unwrap();
                finished[i] = true;
                let before = out.len();
                r.drain_ready(&mut out);
                for &j in &out[before..] {
                    // Everything posted before j has finished.
                    prop_assert!(finished[..j].iter().all(|f| *f));
                }
            }
            let expect: Vec<usize> = (0..wrs.len()).filter(|&i| wrs[i].0 || !wrs[i].1).collect();
            prop_assert_eq!(out, expect);
            prop_assert_eq!(r.outstanding(), 0);
        }
    }
}
