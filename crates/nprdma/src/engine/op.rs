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
use crate::check::{check_versions, page_span};
use crate::keymap::{Translation, VERSION_WORD};
use crate::mem;
use crate::nic::{CompOp, IommuControl, WcStatus};
use crate::ordering::Ticket;
use crate::plan::{AppOp, Strategy};
use crate::seen_versions::{now_ms, SeenVersions, MAX_PAGES};
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
        /// Where the peer's version words are (Version MR rkey, address).
        ver: VersionsAt,
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
    /// A large two-sided READ/WRITE sent as a sequence of fault requests
    /// (the `two_sided` file's [`Pieces`](super::two_sided::Pieces)).
    pub(super) pieces: Option<super::two_sided::Pieces>,
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
    pub(super) ver: VersionsAt,
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

/// Where an operation's remote page versions are read from: the peer's
/// Version MR rkey and the first word's address (0, 0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct VersionsAt {
    pub(super) rkey: u32,
    pub(super) addr: u64,
}

impl VersionsAt {
    pub(super) fn of(t: &Translation) -> Self {
        VersionsAt {
            rkey: t.version_rkey,
            addr: t.version_addr,
        }
    }
}

/// Whether a versioned operation may leave out its "before" READ: if the QP
/// has seen every page's version (`seen`), they are written where that READ
/// would have put them (`before_addr`, engine-owned scratch memory) and the
/// check compares them with the READ after (see [`crate::seen_versions`]).
pub(super) fn prefill_before(
    seen: &SeenVersions,
    at: VersionsAt,
    vlen: u64,
    before_addr: u64,
) -> bool {
    let n = (vlen / VERSION_WORD) as usize;
    if n == 0 || n > MAX_PAGES || vlen % VERSION_WORD != 0 {
        return false;
    }
    let mut v = [0u32; MAX_PAGES];
    if !seen.get(at.rkey, at.addr, now_ms(), &mut v[..n]) {
        return false;
    }
    let mut b = [0u8; 4 * MAX_PAGES];
    for (c, x) in b.chunks_exact_mut(4).zip(&v[..n]) {
        c.copy_from_slice(&x.to_le_bytes());
    }
    mem::write(before_addr, &b[..4 * n]).is_ok()
}

/// The page-version check of a versioned operation whose snapshots are in
/// the scratch at `sa` (`vlen` bytes before, then `vlen` after):
/// [`check_versions`]. The versions read after are recorded as seen
/// (`seen`), whatever the outcome: they are what the pages show now.
pub(super) fn versions_pass(seen: &mut SeenVersions, at: VersionsAt, sa: u64, vlen: u64) -> bool {
    let vlen = vlen as usize;
    mem::with_slice(sa, 2 * vlen, |b| {
        let (x, y) = b.split_at(vlen);
        let words = |v: &[u8]| -> SmallVec<[u32; MAX_PAGES]> {
            v.chunks_exact(4)
                .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]))
                .collect()
        };
        let (before, after) = (words(x), words(y));
        if after.len() <= MAX_PAGES {
            seen.record(at.rkey, at.addr, now_ms(), &after);
        }
        check_versions(&before, &after).is_ok()
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
