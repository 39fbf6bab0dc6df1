//! Pins of application memory taken by the engine (recorded in the MR's
//! shadow and mapped into the NIC views) and the temporary NIC MRs over
//! them: the holds of two-sided operations and served requests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::backend::Backend;
use super::mr::MrEntry;
use super::regcache::{RegCache, TempMr};
use super::views::Views;
use crate::adapt::VmemMm;
use crate::ctrl::Status;
use crate::nic::{Access, PinFor, Pinned};
use crate::shadow::MrShadow;
use crate::trace::{mark, Step};

/// Temporary NIC MR + pin of a two-sided operation (dropped in this
/// order: the MR waits for DMA, then the pages are unpinned).
pub(super) struct Hold<N: Backend> {
    pub(super) mr: Option<TempMr<N>>,
    pub(super) pin: Option<EnginePin<N>>,
}

impl<N: Backend> Default for Hold<N> {
    fn default() -> Self {
        Hold {
            mr: None,
            pin: None,
        }
    }
}

/// A pager pin recorded in the MR's shadow: released by noting the unpin
/// in the shadow first, then unpinning.
pub(super) struct EnginePin<N: Backend> {
    pub(super) shadow: Arc<MrShadow<Views<N>>>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) pin: Option<Pinned<VmemMm>>,
}

/// Pages the engine holds pinned now (all contexts of the process; a
/// range pinned twice counts twice), and the most it held at once: the
/// part of resident memory above the pager's budget and slack that
/// in-flight two-sided operations may keep (reported in the stats).
static PINNED: AtomicUsize = AtomicUsize::new(0);
static PINNED_HIGH: AtomicUsize = AtomicUsize::new(0);

/// (pages the engine holds pinned now, the most it held at once).
pub fn pinned_pages() -> (usize, usize) {
    (
        PINNED.load(Ordering::Relaxed),
        PINNED_HIGH.load(Ordering::Relaxed),
    )
}

fn pages_of(addr: u64, len: u64) -> usize {
    crate::check::page_span(addr, len, super::types::PS as usize).map_or(0, |(_, n)| n as usize)
}

impl<N: Backend> Drop for EnginePin<N> {
    fn drop(&mut self) {
        self.shadow.unpinned(self.addr, self.len);
        drop(self.pin.take());
        PINNED.fetch_sub(pages_of(self.addr, self.len), Ordering::Relaxed);
    }
}

/// A pin of part of an application MR for a NIC of this host that reaches it
/// through a plain NIC MR over the application's memory (the verbs shim's UD
/// views): the pages are pinned in the pager, resident in the NIC's frame map
/// and mapped in the MR's NIC views while it lives, and counted with the
/// engine's other pins (`engine_pinned_high`). Dropping it releases the pin.
pub struct NicPin<N: Backend> {
    _pin: EnginePin<N>,
}

impl<N: Backend> NicPin<N> {
    pub(super) fn new(p: EnginePin<N>) -> Self {
        NicPin { _pin: p }
    }
}

/// Pin `[addr, addr+len)` of `mr` (faulting it in on this thread) for what
/// `for_` says is done with it, and map it into the NIC views.
pub(super) fn engine_pin<N: Backend>(
    mm: &VmemMm,
    mr: &MrEntry<N>,
    addr: u64,
    len: u64,
    for_: PinFor,
) -> Result<EnginePin<N>, ()> {
    pin_for_peer(mm, mr, addr, len, for_).map_err(|_| ())
}

/// [`engine_pin`] for a peer's request, failing with what the peer is told: memory
/// the application unmapped is a remote access error (as a deregistered MR's is),
/// any other failure a remote operational error.
pub(super) fn pin_for_peer<N: Backend>(
    mm: &VmemMm,
    mr: &MrEntry<N>,
    addr: u64,
    len: u64,
    for_: PinFor,
) -> Result<EnginePin<N>, Status> {
    let p = Pinned::new_for(mm.clone(), addr, len, for_).map_err(|e| {
        tracing::warn!(addr, len, error = %e, "pin failed");
        if matches!(e, vmem::Error::Unmapped(_)) {
            Status::RemoteAccess
        } else {
            Status::NoResources
        }
    })?;
    mark(Step::TPinned);
    let k = pages_of(addr, len);
    PINNED_HIGH.fetch_max(
        PINNED.fetch_add(k, Ordering::Relaxed) + k,
        Ordering::Relaxed,
    );
    let g = EnginePin {
        shadow: mr.shadow.clone(),
        addr,
        len,
        pin: Some(p),
    };
    if let Err(e) = mr.shadow.pinned_map_in(addr, len) {
        tracing::error!(error = %e, "map-in failed");
        return Err(Status::NoResources);
    }
    mark(Step::TMapped);
    Ok(g)
}

/// A temporary NIC MR over `[addr, addr+len)` (pinned by the caller):
/// from the registration cache, or registered now (whole pages when the
/// cache keeps it).
pub(super) fn temp_mr<N: Backend>(
    nic: &N,
    cache: &RegCache<N>,
    addr: u64,
    len: u64,
    acc: Access,
    domain: u32,
) -> Result<TempMr<N>, ()> {
    // `ANY_QP`: the peer's reverse operation reaches it whatever the
    // application's flags on the QP (the MR's own rights still apply); in
    // sub-domain `domain` (the operation's QP's PD; 0 for an MR only this
    // side's NIC uses), only through a QP of that PD.
    let acc = acc | Access::ANY_QP;
    if let Some(m) = cache.lookup(addr, len, acc, domain) {
        return Ok(m);
    }
    let (start, rlen) = if cache.enabled() {
        RegCache::<N>::span(addr, len)
    } else {
        (addr, len)
    };
    #[allow(unsafe_code)]
    // SAFETY: the range is inside a registered application MR (mapped while
    // registered; the cache's span only rounds it out to the pages the pin
    // holds) and pinned by the caller while the operation uses the MR (the
    // `Hold` drops its reference before the pin). A reference the cache
    // keeps longer is dropped before those pages are evicted or unmapped, or
    // the application MR deregistered (`RegCache` is a swap listener).
    let mr = unsafe { nic.reg_mr_in_domain(start, rlen, acc, domain) }.map_err(|e| {
        tracing::warn!(error = %e, "temporary MR failed");
    })?;
    let mr = Arc::new(mr);
    cache.insert(start, rlen, acc, domain, &mr);
    Ok(mr)
}
