//! One application operation's record while it is outstanding ([`Op`] and
//! its [`Stage`]), the lean-path operation ([`FastOp`]), a served
//! request's record ([`TReq`]), read-back batches, scratch buffers and the
//! local page-version snapshots the optimistic checks compare.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use super::backend::Backend;
use super::lease::InFlight;
use super::mr::MrEntry;
use super::pin::{EnginePin, Hold};
use super::types::{SendWr, PS};
use crate::adapt::VmemMm;
use crate::check::page_span;
use crate::nic::{CompOp, IommuControl, WcStatus};
use crate::ordering::Ticket;
use crate::plan::{AppOp, Strategy};
use crate::shadow::MrShadow;

pub(super) enum Scratch<N: Backend> {
    Slot(u32),
    Own(N::Buf),
}

pub(super) enum Stage {
    Queued,
    Failed(WcStatus),
    KeyWait,
    OneSided {
        strat: Strategy,
        /// NIC WRs posted (only the last one is signaled).
        steps: u8,
        /// NIC completions still expected.
        left: u8,
        err: WcStatus,
        vlen: u64,
    },
    TwoSided,
    ImmNotify,
    /// Unsignaled small WRITE done on the NIC, read-back deferred.
    Deferred,
    /// Its read-back is in flight (batch).
    Checking,
    /// Passed its check, waiting for earlier conflicting ops (the `replay` file).
    HeldOk(u32),
    /// Needs the two-sided path once earlier conflicting ops are done.
    HeldTwoSided,
}

/// Retry mode's round of a two-sided READ/WRITE (`Config::retry_mode`):
/// the fault request asks the target for Receiver-Ready (pages pinned and
/// mapped), the initiator retries one-sided with page versions, then
/// releases the target's pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Retry {
    /// No retry-mode request sent (the op's first attempts).
    #[default]
    NotTried,
    /// A fault request asking for Receiver-Ready is out.
    AwaitingReady,
    /// The one-sided retry is in flight.
    InFlight,
    /// Retried (and Release sent): a further failure takes the reverse
    /// path.
    Done,
}

pub(super) struct Op<N: Backend> {
    /// Pins and temporary MR: dropped before `lmr` (the registration).
    pub(super) hold: Hold<N>,
    /// When the current two-sided request was sent (for the timeout).
    pub(super) sent: Option<Instant>,
    pub(super) wr: SendWr,
    pub(super) laddr: u64,
    pub(super) len: u64,
    pub(super) seq: u64,
    pub(super) ticket: Option<Ticket>,
    pub(super) lmr: Option<Arc<MrEntry<N>>>,
    pub(super) stage: Stage,
    /// The KeyQuery this op waits for (0: none sent yet).
    pub(super) key_req: u32,
    /// That query has been answered (an unknown key is then an error).
    pub(super) key_answered: bool,
    pub(super) scratch: Option<Scratch<N>>,
    pub(super) lver: Versions,
    /// Where the op is in retry mode's Receiver-Ready round ([`Retry`]).
    pub(super) retry: Retry,
    /// Replayed while its NIC WRs (or read-back) were still out: the
    /// result is discarded when they complete (the `replay` file).
    pub(super) stale: bool,
    /// Re-issued by the ordering table while stale: start again then.
    pub(super) restart: bool,
    /// The peer's lease it runs on, counted in flight (user-space mode).
    pub(super) lease: Option<InFlight>,
}

#[derive(Clone, Copy)]
pub(super) enum TKind {
    Fault {
        len: u32,
    },
    /// Retry mode: pages pinned until the initiator's Release.
    Retry,
    Rendezvous {
        recv_wr_id: u64,
        len: u32,
        imm: Option<u32>,
        /// The SEND asked for a solicited event.
        solicited: bool,
    },
}

/// One read-back READ covering consecutive deferred WRITEs.
pub(super) struct RbBatch<N: Backend> {
    pub(super) remote_addr: u64,
    pub(super) members: Vec<u32>,
    pub(super) scratch: Option<Scratch<N>>,
}

pub(super) struct TReq<N: Backend> {
    pub(super) reply: u32,
    pub(super) kind: TKind,
    pub(super) _tmr: Option<super::regcache::TempMr<N>>,
    pub(super) _pin: Option<EnginePin<N>>,
    pub(super) _mr: Arc<MrEntry<N>>,
}

/// An operation on the lean path (at most one per QP).
pub(super) struct FastOp<N: Backend> {
    pub(super) wr: SendWr,
    pub(super) laddr: u64,
    pub(super) len: u64,
    pub(super) lmr: Arc<MrEntry<N>>,
    pub(super) strat: Strategy,
    /// NIC WRs posted (only the last one is signaled).
    pub(super) steps: u8,
    /// NIC completions still expected.
    pub(super) left: u8,
    pub(super) err: WcStatus,
    pub(super) vlen: u64,
    pub(super) scratch: Option<Scratch<N>>,
    pub(super) lver: Versions,
}

/// Page versions of a local range (inline up to 8 pages: no allocation).
pub(super) type Versions = SmallVec<[u32; 8]>;

#[inline]
pub(super) fn local_versions<I: IommuControl>(
    shadow: &MrShadow<I>,
    addr: u64,
    len: u64,
) -> Versions {
    let Some((first, n)) = page_span(addr, len, PS as usize) else {
        return Versions::new();
    };
    let mut v: Versions = smallvec::smallvec![0u32; n as usize];
    if let Some(i) = shadow.page_index(first) {
        shadow.versions().snapshot(i, &mut v);
    }
    v
}

/// The optimistic check's version condition, read in place: a fresh
/// `local_versions(shadow, addr, len)` equals `before` and every version is
/// odd (each page's word is read once; a range outside the table reads as
/// even versions, i.e. fails, as in `local_versions`).
pub(super) fn versions_unchanged<I: IommuControl>(
    shadow: &MrShadow<I>,
    addr: u64,
    len: u64,
    before: &[u32],
) -> bool {
    let Some((first, n)) = page_span(addr, len, PS as usize) else {
        return before.is_empty();
    };
    if n as usize != before.len() {
        return false;
    }
    if n == 0 {
        return true;
    }
    let Some(i) = shadow.page_index(first) else {
        return false;
    };
    let vt = shadow.versions();
    before.iter().enumerate().all(|(k, &b)| {
        i.checked_add(k)
            .and_then(|j| vt.get(j))
            .is_some_and(|v| v == b && v % 2 == 1)
    })
}

pub(super) fn comp_op(op: AppOp) -> CompOp {
    match op {
        AppOp::Read => CompOp::Read,
        AppOp::Write | AppOp::WriteImm(_) => CompOp::Write,
        AppOp::Send | AppOp::SendImm(_) => CompOp::Send,
        AppOp::CmpSwap { .. } => CompOp::CmpSwap,
        AppOp::FetchAdd { .. } => CompOp::FetchAdd,
    }
}

pub(super) fn is_atomic(op: AppOp) -> bool {
    matches!(op, AppOp::CmpSwap { .. } | AppOp::FetchAdd { .. })
}

/// Whether op `op`'s local memory is no longer its to write: its MR was
/// deregistered, or the application unmapped the buffer (the address may
/// hold other memory now).
pub(super) fn local_fenced<N: Backend>(mm: &VmemMm, op: &Op<N>) -> bool {
    op.lmr.as_ref().is_some_and(|m| {
        m.is_fenced()
            || (op.len > 0
                && m.shadow.some_unmapped()
                && (mm.0.is_gone(op.laddr as usize)
                    || mm.0.is_gone((op.laddr + op.len - 1) as usize)))
    })
}
