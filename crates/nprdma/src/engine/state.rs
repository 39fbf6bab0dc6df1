//! The context's shared state: [`Shared`] (the device plus the one lock)
//! and [`State`] under it (QPs, MRs, key table, the ready queue, counters).
//! Everything the engine does runs under that lock, in whichever thread
//! progresses (the polling thread, or an application thread polling its CQ).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::backend::Backend;
use super::dev::Dev;
use super::idhash::IdMap;
use super::mr::MrEntry;
use super::op::Op;
use super::qp::QpState;
use super::types::{Stats, PS};
use super::ucq::{ArmedCqs, Direct};
use crate::keymap::KeyTable;
use crate::nic::Completion;
use crate::ordering::Ticket;

/// A context's device and its engine state (behind the one lock).
pub(crate) struct Shared<N: Backend> {
    pub dev: Dev<N>,
    pub st: Mutex<State<N>>,
    pub stop: AtomicBool,
    /// Bumped by every application CQ poll (the polling thread steps aside
    /// while it moves).
    pub app_polls: AtomicU64,
    /// How many of the context's CQs are armed: an application waiting for a
    /// completion event depends on the polling thread, which then does not
    /// step aside for its polls.
    pub armed_cqs: Arc<ArmedCqs>,
}

impl<N: Backend> std::ops::Deref for Shared<N> {
    type Target = Dev<N>;
    fn deref(&self) -> &Dev<N> {
        &self.dev
    }
}

impl<N: Backend> Shared<N> {
    /// An application thread is polling: the polling thread stays asleep
    /// for a while (the application progresses inline).
    pub fn mark_app_active(&self) {
        // A plain load + store, not a locked read-modify-write: the polling
        // thread only watches for a change; an increment lost between two
        // racing pollers is harmless (each stores a value it did not read).
        let n = self.app_polls.load(Ordering::Relaxed);
        self.app_polls.store(n.wrapping_add(1), Ordering::Relaxed);
    }
}

pub(crate) struct State<N: Backend> {
    pub(super) qps: Vec<Option<QpState<N>>>,
    pub(super) gens: Vec<u8>,
    pub mrs: IdMap<Arc<MrEntry<N>>>,
    pub keys: KeyTable,
    pub(super) ready: VecDeque<(usize, u32)>,
    pub next_pd: u32,
    pub stats: Stats,
    pub(super) next_req: u32,
    pub(super) last_sweep: Instant,
    pub(super) progress_calls: u32,
    /// The NIC completion buffer of `progress::progress` (allocated once).
    pub(super) wcs: Vec<Completion>,
    pub(super) flush_qps: Vec<usize>,
    pub(super) cq_failed: bool,
    /// Ops the ordering table releases on a completion (reused buffer).
    pub(super) released: Vec<(Ticket, u32)>,
    /// Lean-path completions for the user CQ an application thread is
    /// polling right now (`progress::progress_app_into`), handed straight to its
    /// array instead of through the CQ's queue.
    pub(super) direct: Direct,
    /// Pins + map-ins owed after an answer-first inline READ (target side):
    /// done when a progress pass finds no new NIC completion, so a request
    /// that is already waiting is served first.
    pub(super) post_answer: VecDeque<(Arc<MrEntry<N>>, u64, u64)>,
    /// `ZERO_BUF` zero bytes registered for the NIC: the source of reverse
    /// WRITEs answering READs of never-populated memory (made on first use).
    pub(super) zero: Option<N::Buf>,
    /// READs of swapped-out pages held back until the end of the current
    /// batch of completions (`serve::serve_swap_wait`).
    pub(super) swap_wait: Vec<super::serve::SwapWait>,
}

impl<N: Backend> State<N> {
    pub fn new() -> State<N> {
        State {
            qps: Vec::new(),
            gens: Vec::new(),
            mrs: IdMap::default(),
            keys: KeyTable::new(PS as usize).expect("page size is a power of two"),
            ready: VecDeque::new(),
            next_pd: 0,
            stats: Stats::default(),
            next_req: 1,
            last_sweep: Instant::now(),
            progress_calls: 0,
            wcs: vec![Completion::default(); 64],
            flush_qps: Vec::new(),
            cq_failed: false,
            released: Vec::new(),
            direct: Direct::default(),
            post_answer: VecDeque::new(),
            zero: None,
            swap_wait: Vec::new(),
        }
    }

    pub fn insert_qp(&mut self, q: QpState<N>) -> (usize, u8) {
        let i = match self.qps.iter().position(|q| q.is_none()) {
            Some(i) => i,
            None => {
                self.qps.push(None);
                self.gens.push(0);
                self.qps.len() - 1
            }
        };
        let gen = self.gens[i];
        let mut q = q;
        q.idx = i;
        q.gen = gen;
        self.qps[i] = Some(q);
        (i, gen)
    }

    /// QP `i` if it is still the one of generation `gen` (the application's
    /// handle; a destroyed QP's slot may hold a new one).
    pub fn qp_mut(&mut self, i: usize, gen: u8) -> Option<&mut QpState<N>> {
        if self.gens.get(i) != Some(&gen) {
            return None;
        }
        self.qp(i)
    }

    /// QP `qi` (the engine's own index: NIC completions and queued work of
    /// a destroyed QP were dropped with it, or fail the generation check).
    #[inline]
    pub(super) fn qp(&mut self, qi: usize) -> Option<&mut QpState<N>> {
        self.qps.get_mut(qi).and_then(|q| q.as_mut())
    }

    /// Operation `id` of QP `qi`.
    #[inline]
    pub(super) fn op_mut(&mut self, qi: usize, id: u32) -> Option<&mut Op<N>> {
        self.qp(qi)?.ops.get_mut(id)
    }

    /// QP `qi` with the rest of the state beside it ([`At`]).
    #[inline]
    pub(super) fn at(&mut self, qi: usize) -> Option<At<'_, N>> {
        let State {
            qps,
            mrs,
            keys,
            stats,
            ready,
            released,
            next_req,
            direct,
            post_answer,
            zero,
            ..
        } = self;
        Some(At {
            qp: qps.get_mut(qi).and_then(|q| q.as_mut())?,
            mrs,
            keys,
            stats,
            ready,
            released,
            next_req,
            direct,
            post_answer,
            zero,
        })
    }

    /// [`State::at`] for the application's handle of generation `gen`.
    #[inline]
    pub(super) fn at_gen(&mut self, qi: usize, gen: u8) -> Option<At<'_, N>> {
        if self.gens.get(qi) != Some(&gen) {
            return None;
        }
        self.at(qi)
    }
}

/// QP `qi` and the parts of the state its handlers use beside it, borrowed
/// apart ([`State::at`]): the one opening of every handler that needs more
/// than the QP.
pub(super) struct At<'a, N: Backend> {
    pub qp: &'a mut QpState<N>,
    pub mrs: &'a IdMap<Arc<MrEntry<N>>>,
    pub keys: &'a KeyTable,
    pub stats: &'a mut Stats,
    pub ready: &'a mut VecDeque<(usize, u32)>,
    pub released: &'a mut Vec<(Ticket, u32)>,
    pub next_req: &'a mut u32,
    pub direct: &'a mut Direct,
    pub post_answer: &'a mut VecDeque<(Arc<MrEntry<N>>, u64, u64)>,
    pub zero: &'a mut Option<N::Buf>,
}
