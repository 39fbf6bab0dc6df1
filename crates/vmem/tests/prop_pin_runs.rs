//! Property test: `pin` of a range whose pages are a random mix of never
//! touched, resident and swapped out (in random slot order, so runs of
//! consecutive slots come and go, some longer than one batched run) brings
//! every page in exactly once, byte-exact, without a fault, counts each kind
//! once, frees every slot, and leaves exactly one pin per page.

mod common;
use common::*;
use proptest::prelude::*;
use vmem::{Error, Pager, PagerConfig, PAGE_SIZE as PG};

const PAGES: usize = 80;

#[derive(Clone, Copy, Debug, PartialEq)]
enum St {
    Untouched,
    Resident,
    Swapped,
}

fn st() -> impl Strategy<Value = St> {
    prop_oneof![1 => Just(St::Untouched), 1 => Just(St::Resident), 3 => Just(St::Swapped)]
}

fn byte(page: usize, i: usize) -> u8 {
    (page as u8).wrapping_mul(37) ^ (i as u8).wrapping_mul(11) ^ 0x5a
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn pin_of_a_mixed_range_is_exact(
        states in proptest::collection::vec(st(), PAGES),
        // Swap-out order: a permutation seed (rotated chunks keep some runs).
        rot in 0..PAGES,
        chunk in 1..40usize,
        first in 0..PAGES / 2,
        len in PAGES / 2..PAGES,
    ) {
        let p = Pager::new(PagerConfig {
            swap_size: (4 * PAGES * PG) as u64,
            ..Default::default()
        })
        .unwrap();
        let mut r = p.alloc(PAGES * PG).unwrap();
        {
            let m = r.as_mut_slice();
            for (pg, s) in states.iter().enumerate() {
                if *s != St::Untouched {
                    for i in 0..PG {
                        m[pg * PG + i] = byte(pg, i);
                    }
                }
            }
        }
        // Swap pages out chunk by chunk, in rotated order: consecutive
        // slots inside a chunk, jumps between chunks.
        let order: Vec<usize> = (0..PAGES).map(|k| (k + rot) % PAGES).collect();
        for c in order.chunks(chunk) {
            for &pg in c {
                if states[pg] == St::Swapped {
                    assert_eq!(p.swap_out(r.addr() + pg * PG, PG).unwrap(), 1);
                }
            }
        }
        let (a, b) = (first, (first + len).min(PAGES));
        let count = |k: St| states[a..b].iter().filter(|s| **s == k).count() as u64;
        let s0 = p.stats();
        p.pin(r.addr() + a * PG, (b - a) * PG).unwrap();
        let s1 = p.stats();
        prop_assert_eq!(s1.major_faults + s1.minor_faults, s0.major_faults + s0.minor_faults, "pin takes no fault");
        prop_assert_eq!(s1.pin_swap_ins - s0.pin_swap_ins, count(St::Swapped));
        prop_assert_eq!(s1.zero_fills - s0.zero_fills, count(St::Untouched));
        prop_assert_eq!(r.resident_count().unwrap() as u64 >= (b - a) as u64, true);
        prop_assert_eq!(
            s1.swap_slots_used,
            states.iter().enumerate().filter(|(pg, s)| **s == St::Swapped && (*pg < a || *pg >= b)).count(),
            "slots of the pinned pages freed, the others kept"
        );
        // Pinned pages are not evicted; the others are.
        r.swap_out().unwrap();
        for pg in a..b {
            prop_assert!(p.is_resident(r.addr() + pg * PG), "page {} pinned", pg);
        }
        let faults = p.stats().major_faults + p.stats().minor_faults;
        let m = r.as_slice();
        for (pg, s) in states.iter().enumerate().take(b).skip(a) {
            for i in 0..PG {
                let want = if *s == St::Untouched { 0 } else { byte(pg, i) };
                prop_assert_eq!(m[pg * PG + i], want, "page {} byte {}", pg, i);
            }
        }
        prop_assert_eq!(p.stats().major_faults + p.stats().minor_faults, faults, "pinned pages read without a fault");
        // Exactly one pin per page.
        p.unpin(r.addr() + a * PG, (b - a) * PG).unwrap();
        prop_assert!(matches!(p.unpin(r.addr() + a * PG, PG), Err(Error::NotPinned(_))));
        // The rest of the region is intact too (brought back by faults).
        let m = r.as_slice();
        for (pg, s) in states.iter().enumerate() {
            let want = if *s == St::Untouched { 0 } else { byte(pg, 7) };
            prop_assert_eq!(m[pg * PG + 7], want, "page {}", pg);
        }
    }
}

#[test]
fn runs_of_more_than_one_batch_pin_everything() {
    with_timeout(60, || {
        let p = Pager::new(PagerConfig {
            swap_size: (1024 * PG) as u64,
            ..Default::default()
        })
        .unwrap();
        let mut r = p.alloc(300 * PG).unwrap();
        for (i, x) in r.as_mut_slice()[..200 * PG].iter_mut().enumerate() {
            *x = (i / PG) as u8 ^ (i as u8);
        }
        assert_eq!(r.swap_out().unwrap(), 200);
        p.pin(r.addr(), 300 * PG).unwrap();
        let s = p.stats();
        assert_eq!(s.pin_swap_ins, 200);
        assert_eq!(s.zero_fills, 100);
        assert_eq!(s.swap_slots_used, 0);
        assert_eq!(r.resident_count().unwrap(), 300);
        assert_eq!(
            s.major_faults + s.minor_faults,
            200,
            "only the writes above faulted"
        );
        for (i, x) in r.as_slice().iter().enumerate() {
            let want = if i < 200 * PG {
                (i / PG) as u8 ^ (i as u8)
            } else {
                0
            };
            assert_eq!(*x, want, "byte {i}");
        }
        p.unpin(r.addr(), 300 * PG).unwrap();
    });
}
