//! The peer's page versions a QP saw at the end of its recent checks, kept so
//! that the next versioned operation on the same pages need not read them
//! first.
//!
//! Why a seen version may stand in for the "before" READ: page versions only
//! ever grow (a swap-out makes a page's version even, a map-in odd, each by
//! one). If a page's version was odd `v` when an earlier check read it, and
//! the READ that follows this operation's data WR reads `v` again, the page
//! made no transition in between: it was mapped from the first read to the
//! last, so the data WR, which ran between them, reached the real page. A
//! page that left and came back meanwhile shows a larger version and the
//! check fails (the operation goes two-sided, as after any failed check).
//!
//! What bounds the claim: a version table belongs to one registration (its
//! own Version MR, keyed here by that MR's rkey and the word's address), and
//! the owner QP forgets everything when the peer's key table changes
//! ([`SeenVersions::clear`]), so a re-registration reusing an rkey never
//! meets an older registration's versions; entries also expire after
//! [`TTL_MS`], far below the time 2^31 swap cycles of one page would take
//! to wrap a 32-bit version back to the same value.
#![allow(unsafe_code)] // one clock_gettime call (`now_ms`)

/// How long a seen version may stand in for a fresh READ (ms, coarse clock).
pub const TTL_MS: u32 = 1000;

/// Most pages one lookup serves (a larger operation reads its versions).
pub const MAX_PAGES: usize = 16;

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    /// Version MR rkey; 0 = empty.
    rkey: u32,
    /// Address of the version word.
    addr: u64,
    version: u32,
    /// When it was read (coarse ms).
    at_ms: u32,
}

/// A direct-mapped table of (Version MR rkey, word address) → odd version.
#[derive(Debug)]
pub struct SeenVersions {
    slots: Box<[Slot]>,
}

impl SeenVersions {
    /// A table of `n` slots (rounded up to a power of two, at least 1).
    pub fn new(n: usize) -> Self {
        SeenVersions {
            slots: vec![Slot::default(); n.max(1).next_power_of_two()].into_boxed_slice(),
        }
    }

    fn index(&self, addr: u64) -> usize {
        // Version words are 4 B apart: consecutive pages, consecutive slots.
        ((addr >> 2) as usize) & (self.slots.len() - 1)
    }

    /// Forget everything (the peer's keys changed, or the QP reconnected).
    pub fn clear(&mut self) {
        self.slots.fill(Slot::default());
    }

    /// The versions of `out.len()` consecutive words from `addr` under
    /// `rkey`, if every one is known and younger than [`TTL_MS`] at `now_ms`.
    pub fn get(&self, rkey: u32, addr: u64, now_ms: u32, out: &mut [u32]) -> bool {
        if rkey == 0 || out.is_empty() || out.len() > MAX_PAGES.min(self.slots.len()) {
            return false;
        }
        for (k, o) in out.iter_mut().enumerate() {
            let a = addr.wrapping_add(4 * k as u64);
            let s = &self.slots[self.index(a)];
            if s.rkey != rkey || s.addr != a || now_ms.wrapping_sub(s.at_ms) >= TTL_MS {
                return false;
            }
            *o = s.version;
        }
        true
    }

    /// Record versions read at `now_ms` from consecutive words at `addr`
    /// under `rkey`: an odd one is kept, an even one (page absent) drops
    /// what the slot held for that word.
    pub fn record(&mut self, rkey: u32, addr: u64, now_ms: u32, versions: &[u32]) {
        if rkey == 0 {
            return;
        }
        for (k, &v) in versions.iter().enumerate() {
            let a = addr.wrapping_add(4 * k as u64);
            let i = self.index(a);
            let s = &mut self.slots[i];
            if v % 2 == 1 {
                *s = Slot {
                    rkey,
                    addr: a,
                    version: v,
                    at_ms: now_ms,
                };
            } else if s.rkey == rkey && s.addr == a {
                *s = Slot::default();
            }
        }
    }
}

/// A coarse monotonic clock in ms (wraps every ~49 days; compared with
/// wrapping arithmetic), cheap enough for every versioned operation.
pub fn now_ms() -> u32 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration;
    // CLOCK_MONOTONIC_COARSE exists on every Linux this crate supports.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    if r != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .wrapping_mul(1000)
        .wrapping_add(ts.tv_nsec as u64 / 1_000_000) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seen_odd_version_is_served_until_it_expires() {
        let mut c = SeenVersions::new(64);
        c.record(7, 0x1000, 100, &[3, 5]);
        let mut out = [0u32; 2];
        assert!(c.get(7, 0x1000, 100 + TTL_MS - 1, &mut out));
        assert_eq!(out, [3, 5]);
        assert!(!c.get(7, 0x1000, 100 + TTL_MS, &mut out), "expired");
    }

    #[test]
    fn every_page_must_be_known_under_the_same_key() {
        let mut c = SeenVersions::new(64);
        c.record(7, 0x1000, 0, &[3]);
        let mut two = [0u32; 2];
        assert!(!c.get(7, 0x1000, 0, &mut two), "second page never seen");
        let mut one = [0u32; 1];
        assert!(!c.get(8, 0x1000, 0, &mut one), "another Version MR");
        assert!(!c.get(0, 0x1000, 0, &mut one), "no Version MR");
        assert!(c.get(7, 0x1000, 0, &mut one));
    }

    #[test]
    fn an_even_version_or_a_clear_forgets_the_page() {
        let mut c = SeenVersions::new(64);
        c.record(7, 0x1000, 0, &[3, 5]);
        c.record(7, 0x1004, 0, &[6]);
        let mut one = [0u32; 1];
        assert!(c.get(7, 0x1000, 0, &mut one));
        assert!(!c.get(7, 0x1004, 0, &mut one), "page went out");
        c.clear();
        assert!(!c.get(7, 0x1000, 0, &mut one));
    }

    #[test]
    fn a_newer_read_replaces_the_older_and_colliding_words_evict() {
        let mut c = SeenVersions::new(4);
        c.record(7, 0x1000, 0, &[3]);
        c.record(7, 0x1000, 1, &[9]);
        let mut one = [0u32; 1];
        assert!(c.get(7, 0x1000, 1, &mut one));
        assert_eq!(one, [9]);
        // 4 slots: the word 16 B further maps to the same slot.
        c.record(7, 0x1010, 1, &[1]);
        assert!(!c.get(7, 0x1000, 1, &mut one));
        assert!(c.get(7, 0x1010, 1, &mut one));
        // More pages than the table holds: never served.
        let mut many = [0u32; 5];
        assert!(!c.get(7, 0x1000, 1, &mut many));
    }

    #[test]
    fn the_clock_moves_forward() {
        let a = now_ms();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = now_ms();
        assert!(
            b.wrapping_sub(a) >= 20 && b.wrapping_sub(a) < 10_000,
            "{a} {b}"
        );
    }
}
