//! Per-page state words: one `AtomicU64` per page holding its residency kind,
//! a transition lock bit, the CLOCK reference bit, the eviction-in-progress
//! bit, the pin count and the swap slot. Every transition is a CAS on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Never touched since registration (or dropped by the application): a missing
/// page is served with zeroes (minor fault).
pub const UNTOUCHED: u64 = 0;
/// Present in memory.
pub const RESIDENT: u64 = 1;
/// Contents in the swap slot (major fault).
pub const SWAPPED: u64 = 2;
/// Unmapped by the application / unregistered: no longer managed.
pub const GONE: u64 = 3;

const KIND_MASK: u64 = 0b11;
/// Transition lock: the holder is moving the page in or out.
pub const BUSY: u64 = 1 << 2;
/// CLOCK reference bit.
pub const REF: u64 = 1 << 3;
/// Listener phase of an eviction: a pin arriving now aborts the eviction.
pub const EVICTING: u64 = 1 << 4;
/// The kernel refused to move this page (mlocked, shared, other protection):
/// eviction skips it from now on.
pub const NOEVICT: u64 = 1 << 5;
/// Just brought in and its eager swap-in notification not yet delivered:
/// eviction skips it, so that notification always precedes the page's next
/// swap-out announcement.
pub const NOTIFYING: u64 = 1 << 6;
const PIN_SHIFT: u32 = 8;
const PIN_BITS: u32 = 24;
pub const PIN_ONE: u64 = 1 << PIN_SHIFT;
const PIN_MASK: u64 = ((1 << PIN_BITS) - 1) << PIN_SHIFT;
pub const MAX_PINS: u64 = (1 << PIN_BITS) - 1;
const SLOT_SHIFT: u32 = 32;

#[inline]
pub fn kind(w: u64) -> u64 {
    w & KIND_MASK
}
#[inline]
pub fn pins(w: u64) -> u64 {
    (w & PIN_MASK) >> PIN_SHIFT
}
/// Swap slot held by the page, if any.
#[inline]
pub fn slot(w: u64) -> Option<u32> {
    match w >> SLOT_SHIFT {
        0 => None,
        s => Some((s - 1) as u32),
    }
}
#[inline]
pub fn with_kind(w: u64, k: u64) -> u64 {
    (w & !KIND_MASK) | k
}
#[inline]
pub fn with_slot(w: u64, s: Option<u32>) -> u64 {
    let v = s.map_or(0, |s| s as u64 + 1);
    (w & ((1 << SLOT_SHIFT) - 1)) | (v << SLOT_SHIFT)
}
#[inline]
pub fn is_resident(w: u64) -> bool {
    kind(w) == RESIDENT
}

/// The state words of a contiguous run of pages (shared by every segment view
/// that covers part of it).
pub struct PageArray {
    /// Page number (address >> 12) of `states[0]`.
    pub base: usize,
    pub states: Box<[AtomicU64]>,
    /// Externally managed (no userfaultfd; the application reports swaps).
    pub external: bool,
}

impl PageArray {
    pub fn new(base: usize, n: usize, init: impl Fn(usize) -> u64, external: bool) -> PageArray {
        let states = zeroed_words(n);
        for (i, s) in states.iter().enumerate() {
            let v = init(i);
            if v != 0 {
                s.store(v, Ordering::Relaxed);
            }
        }
        PageArray {
            base,
            states,
            external,
        }
    }
    #[inline]
    pub fn word(&self, page: usize) -> &AtomicU64 {
        &self.states[page - self.base]
    }
}

/// `n` zeroed words from a zeroed allocation (calloc: large arrays cost no
/// time until touched, which keeps registering many GiB fast).
fn zeroed_words(n: usize) -> Box<[AtomicU64]> {
    let v: Vec<u64> = vec![0u64; n];
    let mut v = std::mem::ManuallyDrop::new(v);
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: AtomicU64 has the same size, alignment and bit validity as u64,
    // and the allocation is handed over whole (same layout) to the new Vec.
    unsafe { Vec::from_raw_parts(ptr.cast::<AtomicU64>(), len, cap) }.into_boxed_slice()
}

/// Waits until `w` has no BUSY bit and returns the value seen. BUSY holders
/// never block on anything but their own I/O, so this is bounded.
pub fn wait_not_busy(w: &AtomicU64) -> u64 {
    let mut spins = 0u32;
    let start = Instant::now();
    let mut warned = false;
    loop {
        let v = w.load(Ordering::Acquire);
        if v & BUSY == 0 {
            return v;
        }
        spins += 1;
        if spins < 200 {
            std::hint::spin_loop();
        } else if spins < 400 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
            if !warned && start.elapsed() > Duration::from_secs(2) {
                tracing::warn!("page transition busy for >2 s");
                warned = true;
            }
        }
    }
}

/// Lock-free update: applies `f` until the CAS wins; `f` returning `None`
/// aborts and returns the current value as the error.
#[inline]
pub fn update(w: &AtomicU64, mut f: impl FnMut(u64) -> Option<u64>) -> Result<(u64, u64), u64> {
    let mut cur = w.load(Ordering::Acquire);
    loop {
        let new = match f(cur) {
            Some(n) => n,
            None => return Err(cur),
        };
        match w.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok((cur, new)),
            Err(v) => cur = v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode() {
        let w = with_slot(with_kind(0, SWAPPED) | (5 * PIN_ONE) | REF, Some(7));
        assert_eq!(kind(w), SWAPPED);
        assert_eq!(pins(w), 5);
        assert_eq!(slot(w), Some(7));
        assert_ne!(w & REF, 0);
        let w = with_slot(w, None);
        assert_eq!(slot(w), None);
        assert_eq!(pins(w), 5);
        let w = with_slot(w, Some(u32::MAX - 1));
        assert_eq!(slot(w), Some(u32::MAX - 1));
        assert_eq!(pins(w + (MAX_PINS - 5) * PIN_ONE), MAX_PINS);
    }
}
