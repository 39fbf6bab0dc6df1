//! Property test: random overlapping registrations, unregistrations and
//! swap-outs over one mapping behave like a per-page reference-count model,
//! and never change the memory's contents.

mod common;
use common::*;
use proptest::prelude::*;
use std::collections::HashMap;
use vmem::{Error, Pager, PAGE_SIZE as PG};

const PAGES: usize = 24;

#[derive(Clone, Debug)]
enum Op {
    /// Register pages [a, a+n) with byte offsets (unaligned start/end).
    Reg(usize, usize, usize),
    Unreg(usize),
    SwapOut(usize, usize),
    Write(usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..PAGES, 1..8usize, 0..PG).prop_map(|(a, n, off)| Op::Reg(a, n.min(PAGES - a), off)),
        2 => (0..16usize).prop_map(Op::Unreg),
        2 => (0..PAGES, 1..PAGES).prop_map(|(a, n)| Op::SwapOut(a, n.min(PAGES - a))),
        2 => (0..PAGES, any::<u8>()).prop_map(|(a, v)| Op::Write(a, v)),
    ]
}

#[test]
fn registry_matches_refcount_model() {
    with_timeout(300, || {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 48,
            ..ProptestConfig::default()
        });
        if let Err(e) = runner.run(&proptest::collection::vec(op(), 1..40), check) {
            panic!("{e}");
        }
    });
}

fn check(ops: Vec<Op>) -> Result<(), TestCaseError> {
    {
        let p = Pager::new(small_cfg()).unwrap();
        let base = mmap_anon(PAGES * PG);
        let mut model = [0usize; PAGES];
        let mut shadow = [0u8; PAGES];
        let mut regs: Vec<(vmem::Region, usize, usize)> = Vec::new();
        let mut dead: HashMap<usize, vmem::RegionId> = HashMap::new();
        for op in ops {
            match op {
                Op::Reg(a, n, off) => {
                    // Unaligned byte range covering exactly pages a..a+n (never
                    // empty: with n = 1 and off = PG - 1 an end one byte short of
                    // the page made it so).
                    let start = base + a * PG + off.min(PG - 1);
                    let end = base + (a + n) * PG - usize::from(off == 0);
                    // SAFETY: the mapping outlives every region (dropped below first).
                    let r = unsafe { p.register(start, end - start) }.unwrap();
                    prop_assert_eq!(r.addr(), base + a * PG);
                    prop_assert_eq!(r.len(), n * PG);
                    for m in &mut model[a..a + n] {
                        *m += 1;
                    }
                    regs.push((r, a, n));
                }
                Op::Unreg(i) => {
                    if regs.is_empty() {
                        continue;
                    }
                    let (mut r, a, n) = regs.remove(i % regs.len());
                    let id = r.id();
                    r.unregister().unwrap();
                    prop_assert!(matches!(r.unregister(), Err(Error::AlreadyUnregistered(_))));
                    dead.insert(dead.len(), id);
                    for m in &mut model[a..a + n] {
                        *m -= 1;
                    }
                }
                Op::SwapOut(a, n) => {
                    let res = p.swap_out(base + a * PG, n * PG);
                    if model[a..a + n].iter().all(|&m| m > 0) {
                        prop_assert!(res.is_ok());
                    } else {
                        prop_assert!(matches!(res, Err(Error::NotRegistered(_))));
                    }
                }
                Op::Write(a, v) => {
                    // SAFETY: inside the live mapping.
                    unsafe { std::ptr::write_volatile((base + a * PG + 5) as *mut u8, v) };
                    shadow[a] = v;
                }
            }
            for (i, &m) in model.iter().enumerate() {
                let q = p.resident(base + i * PG, PG);
                prop_assert_eq!(q.is_ok(), m > 0, "page {} model {}", i, m);
            }
            prop_assert_eq!(
                p.stats().registered_pages,
                model.iter().filter(|&&m| m > 0).count()
            );
            for (i, &v) in shadow.iter().enumerate() {
                prop_assert_eq!(
                    // SAFETY: inside the live mapping.
                    unsafe { std::ptr::read_volatile((base + i * PG + 5) as *const u8) },
                    v
                );
            }
        }
        for id in dead.values() {
            prop_assert!(matches!(
                p.unregister(*id),
                Err(Error::AlreadyUnregistered(_))
            ));
        }
        drop(regs);
        let s = p.stats();
        prop_assert_eq!(s.registered_pages, 0);
        prop_assert_eq!(s.swap_slots_used, 0);
        prop_assert_eq!(s.resident_pages, 0);
        for (i, &v) in shadow.iter().enumerate() {
            prop_assert_eq!(
                // SAFETY: inside the live mapping.
                unsafe { std::ptr::read_volatile((base + i * PG + 5) as *const u8) },
                v
            );
        }
        // SAFETY: our mapping; no region refers to it any more.
        unsafe { libc::munmap(base as *mut _, PAGES * PG) };
    }
    Ok(())
}
