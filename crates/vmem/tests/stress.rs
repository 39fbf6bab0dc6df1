//! Concurrency: application threads reading and writing while eviction,
//! explicit swap-outs, pins and prefetches run; every byte checked against a
//! shadow copy. Short by default; `VMEM_STRESS_SECS=60` for a long run.

mod common;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use vmem::{Pager, PagerConfig, PAGE_SIZE as PG};

fn secs() -> u64 {
    std::env::var("VMEM_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Worker `t` of `nt` owns the u64 words `w` with `w % nt == t` of every page,
/// so all workers write every page concurrently and each shadow is exact.
fn worker(
    base: usize,
    pages: usize,
    t: usize,
    nt: usize,
    stop: &AtomicBool,
    seed: u64,
    pin_pager: Option<&Pager>,
) -> u64 {
    let words_per_page = PG / 8;
    let mine: Vec<usize> = (0..pages * words_per_page)
        .filter(|w| w % nt == t)
        .collect();
    let mut shadow = vec![0u64; mine.len()];
    let mut rng = Rng(seed | 1);
    let mut ops = 0u64;
    while !stop.load(Relaxed) {
        for _ in 0..64 {
            let k = rng.below(mine.len());
            let ptr = (base + mine[k] * 8) as *mut u64;
            if rng.next() % 2 == 0 {
                let v = rng.next();
                // SAFETY: the word lies in a live region and only this thread uses it.
                unsafe { std::ptr::write_volatile(ptr, v) };
                shadow[k] = v;
            } else {
                // SAFETY: as above.
                let got = unsafe { std::ptr::read_volatile(ptr) };
                assert_eq!(
                    got,
                    shadow[k],
                    "worker {t} word {} (page {})",
                    mine[k],
                    mine[k] / words_per_page
                );
            }
            ops += 1;
        }
        if let Some(p) = pin_pager {
            // Pin a random page, check it is resident and stays so, write through it.
            let k = rng.below(mine.len());
            let page_addr = (base + mine[k] * 8) & !(PG - 1);
            p.pin(page_addr, PG).unwrap();
            assert!(p.is_resident(page_addr), "pinned page not resident");
            let v = rng.next();
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile((base + mine[k] * 8) as *mut u64, v) };
            shadow[k] = v;
            std::thread::yield_now();
            assert!(p.is_resident(page_addr), "pinned page evicted");
            p.unpin(page_addr, PG).unwrap();
        }
    }
    for (k, &w) in mine.iter().enumerate() {
        // SAFETY: as above.
        let got = unsafe { std::ptr::read_volatile((base + w * 8) as *const u64) };
        assert_eq!(got, shadow[k], "final check worker {t} word {w}");
    }
    ops
}

/// A listener that checks, for every announced page, that it is still mapped
/// (mincore) and recorded resident: listeners run before reclaim.
struct PresentChecker {
    pager: vmem::WeakPager,
    pages: AtomicU64,
    violations: AtomicU64,
}

impl vmem::SwapListener for PresentChecker {
    fn before_swap_out(&self, pages: &[usize]) -> bool {
        let p = self.pager.upgrade();
        for &a in pages {
            let mut v = 0u8;
            // SAFETY: one page, one output byte.
            let r = unsafe { libc::mincore(a as *mut _, PG, &mut v) };
            let recorded = p.as_ref().is_some_and(|p| p.is_resident(a));
            if r != 0 || v & 1 == 0 || !recorded {
                self.violations.fetch_add(1, Relaxed);
            }
        }
        self.pages.fetch_add(pages.len() as u64, Relaxed);
        true
    }
}

fn run_stress(
    pages: usize,
    budget: usize,
    nt: usize,
    with_pins: bool,
    with_swapper: bool,
    o_direct: bool,
) {
    let dur = secs();
    with_timeout(dur + 120, move || {
        let cfg = PagerConfig {
            budget_pages: Some(budget),
            swap_size: (pages * PG * 2) as u64,
            o_direct,
            ..Default::default()
        };
        let p = Pager::new(cfg).unwrap();
        let checker = Arc::new(PresentChecker {
            pager: p.downgrade(),
            pages: AtomicU64::new(0),
            violations: AtomicU64::new(0),
        });
        p.add_listener(checker.clone());
        let r = p.alloc(pages * PG).unwrap();
        let base = r.addr();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(nt + 2));
        let mut hs = Vec::new();
        for t in 0..nt {
            let (stop, start, p) = (stop.clone(), start.clone(), p.clone());
            hs.push(std::thread::spawn(move || {
                start.wait();
                worker(
                    base,
                    pages,
                    t,
                    nt,
                    &stop,
                    0x1234_5678 + t as u64 * 7919,
                    with_pins.then_some(&p),
                )
            }));
        }
        let swaps = Arc::new(AtomicU64::new(0));
        let sw = {
            let (stop, start, p, swaps) = (stop.clone(), start.clone(), p.clone(), swaps.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut rng = Rng(99);
                while !stop.load(Relaxed) {
                    if with_swapper {
                        let a = rng.below(pages);
                        let n = 1 + rng.below(32.min(pages - a));
                        swaps.fetch_add(p.swap_out(base + a * PG, n * PG).unwrap() as u64, Relaxed);
                        if rng.next() % 4 == 0 {
                            let a = rng.below(pages);
                            p.prefetch(base + a * PG, PG).unwrap();
                        }
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        start.wait();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(dur) {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Relaxed);
        let ops: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        sw.join().unwrap();
        let s = p.stats();
        eprintln!(
            "ops {ops} explicit swap-outs {} stats {s:?}",
            swaps.load(Relaxed)
        );
        assert!(
            s.swap_outs > 0 && s.major_faults > 0,
            "eviction really happened"
        );
        assert!(
            checker.pages.load(Relaxed) >= s.swap_outs,
            "every swapped-out page was announced"
        );
        assert_eq!(
            checker.violations.load(Relaxed),
            0,
            "a listener saw a page already gone"
        );
        // The budget holds once the workers stop.
        assert!(
            wait_until(10, || p.stats().resident_pages <= budget),
            "resident {} > budget {budget}",
            p.stats().resident_pages
        );
        // The evictor reclaims a little below the budget in batches, so it may
        // still be moving pages when the budget first holds: once it is done, the
        // pager's view and the kernel's page tables agree page for page.
        let agree = || {
            r.resident().unwrap() == pagemap_present(r.addr(), r.len())
                && r.resident_count().unwrap() == p.stats().resident_pages
        };
        assert!(
            wait_until(10, agree),
            "pager residency != pagemap after 10 s"
        );
        drop(r);
        assert_eq!(p.stats().swap_slots_used, 0);
        assert_eq!(p.stats().resident_pages, 0);
    });
}

#[test]
fn budget_well_below_working_set() {
    run_stress(1024, 96, 3, false, false, false);
}

#[test]
fn evictor_swapper_pins_and_writers_race() {
    run_stress(512, 64, 3, true, true, false);
}

#[test]
fn race_with_o_direct_swap() {
    run_stress(256, 48, 2, true, true, true);
}

/// A single hot page written continuously while it is swapped out over and
/// over: no write may be lost (the UFFDIO_MOVE path).
#[test]
fn hot_page_write_vs_swap_out() {
    with_timeout(60, || {
        let p = Pager::new(PagerConfig {
            background_evictor: false,
            ..small_cfg()
        })
        .unwrap();
        let r = p.alloc(2 * PG).unwrap();
        let base = r.addr();
        let stop = Arc::new(AtomicBool::new(false));
        let counter = base as *mut u64;
        let st = stop.clone();
        let writer = std::thread::spawn(move || {
            let c = base as *mut u64;
            let mut n = 0u64;
            while !st.load(Relaxed) {
                n += 1;
                // SAFETY: only this thread writes the word; the region is live.
                unsafe { std::ptr::write_volatile(c, n) };
                // SAFETY: as above.
                assert_eq!(unsafe { std::ptr::read_volatile(c) }, n);
            }
            n
        });
        let mut outs = 0;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(1500) {
            outs += p.swap_out(base, 2 * PG).unwrap();
        }
        stop.store(true, Relaxed);
        let n = writer.join().unwrap();
        assert_eq!(
            // SAFETY: the region is live; the writer has stopped.
            unsafe { std::ptr::read_volatile(counter) },
            n,
            "last write survived"
        );
        assert!(outs > 10, "swapped out {outs} times");
        eprintln!("writes {n} swap-outs {outs} stats {:?}", p.stats());
    });
}

/// Application threads fault on one region while another thread keeps
/// munmapping registered memory: the kernel refuses fills (EAGAIN) while each
/// UNMAP event is pending, and no fault may hang or be served wrongly.
#[test]
fn faults_while_the_application_unmaps() {
    with_timeout(120, || {
        let p = Pager::new(PagerConfig {
            budget_pages: Some(32),
            ..small_cfg()
        })
        .unwrap();
        let r = p.alloc(128 * PG).unwrap();
        let base = r.addr();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..2 {
            let stop = stop.clone();
            hs.push(std::thread::spawn(move || {
                worker(base, 128, t, 2, &stop, 77 + t as u64, None)
            }));
        }
        let unmapper = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    let m = mmap_anon(16 * PG);
                    // SAFETY: the mapping is live; it is unmapped below on purpose.
                    let reg = unsafe { p.register(m, 16 * PG) }.unwrap();
                    // SAFETY: the mapping is live.
                    unsafe { std::ptr::write_bytes(m as *mut u8, 1, 16 * PG) };
                    let _ = p.swap_out(m, 8 * PG);
                    // SAFETY: the mapping is live.
                    assert!((0..16).all(|i| unsafe { *((m + i * PG) as *const u8) } == 1));
                    // SAFETY: our mapping (the pager follows the UNMAP event).
                    unsafe { libc::munmap(m as *mut _, 16 * PG) };
                    drop(reg);
                    n += 1;
                }
                n
            })
        };
        std::thread::sleep(Duration::from_secs(secs()));
        stop.store(true, Relaxed);
        let ops: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        let rounds = unmapper.join().unwrap();
        let s = p.stats();
        eprintln!("ops {ops} unmap rounds {rounds} stats {s:?}");
        assert!(rounds > 10 && s.major_faults > 0);
        drop(r);
        assert!(wait_until(5, || p.stats().swap_slots_used == 0));
        assert_eq!(p.stats().registered_pages, 0);
    });
}

/// The NP-RDMA usage pattern: a "NIC" writes pages only while its own table
/// says they are mapped; a swap-out listener unmaps them (under the NIC's
/// lock) before reclaim; an unmapped page is made resident by a pin in the
/// NIC's thread ("two-sided path") and mapped again. The NIC must never find
/// a mapped page absent, and no byte may be lost, while application threads
/// write the same pages and the evictor runs under a small budget.
#[test]
fn nic_model_never_touches_absent_pages() {
    nic_model(false);
}

/// The same with eager swap-in notifications: the NIC maps pages as soon as
/// the pager brings them in (faults, pins, prefetches).
#[test]
fn nic_model_with_eager_swap_in() {
    nic_model(true);
}

fn nic_model(eager: bool) {
    with_timeout(secs() + 120, move || {
        const PAGES: usize = 256;
        struct Nic {
            mapped: parking_lot::Mutex<Vec<bool>>,
            base: usize,
        }
        impl vmem::SwapListener for Nic {
            fn before_swap_out(&self, pages: &[usize]) -> bool {
                let mut m = self.mapped.lock();
                for &a in pages {
                    m[(a - self.base) / PG] = false;
                }
                true
            }
            fn after_swap_in(&self, pages: &[usize]) {
                let mut m = self.mapped.lock();
                for &a in pages {
                    if let Some(x) = m.get_mut(a.wrapping_sub(self.base) / PG) {
                        *x = true;
                    }
                }
            }
        }
        let cfg = PagerConfig {
            budget_pages: Some(48),
            eager_swap_in_notify: eager,
            ..small_cfg()
        };
        let p = Pager::new(cfg).unwrap();
        let r = p.alloc(PAGES * PG).unwrap();
        let base = r.addr();
        let swapper = {
            let (p, stop) = (p.clone(), Arc::new(AtomicBool::new(false)));
            let st = stop.clone();
            let h = std::thread::spawn(move || {
                let mut rng = Rng(31337);
                while !st.load(Relaxed) {
                    let a = rng.below(PAGES);
                    let n = 1 + rng.below(16.min(PAGES - a));
                    p.swap_out(base + a * PG, n * PG).unwrap();
                    let a = rng.below(PAGES);
                    p.prefetch(base + a * PG, PG).unwrap();
                    std::thread::sleep(Duration::from_micros(300));
                }
            });
            (stop, h)
        };
        let nic = Arc::new(Nic {
            mapped: parking_lot::Mutex::new(vec![false; PAGES]),
            base,
        });
        p.add_listener(nic.clone());
        let stop = Arc::new(AtomicBool::new(false));
        // Application: workers 0 and 1 of 3 (the NIC owns word slot 2).
        let apps: Vec<_> = (0..2)
            .map(|t| {
                let stop = stop.clone();
                std::thread::spawn(move || worker(base, PAGES, t, 3, &stop, 5 + t as u64, None))
            })
            .collect();
        let nic_thread = {
            let (p, nic, stop) = (p.clone(), nic.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(4242);
                let mut shadow = vec![0u64; PAGES];
                let (mut one_sided, mut two_sided, mut violations) = (0u64, 0u64, 0u64);
                // The NIC's word in each page: one with global word index
                // w % 3 == 2 (the share of the absent "worker 2"; 512 % 3 == 2).
                let word = |pg: usize| (base + pg * PG + ((2 + pg) % 3) * 8) as *mut u64;
                while !stop.load(Relaxed) {
                    let pg = rng.below(PAGES);
                    let v = rng.next();
                    {
                        let m = nic.mapped.lock();
                        if m[pg] {
                            let mut inc = 0u8;
                            // SAFETY: one page, one output byte.
                            unsafe { libc::mincore((base + pg * PG) as *mut _, PG, &mut inc) };
                            if inc & 1 == 0 || !p.is_resident(base + pg * PG) {
                                violations += 1;
                            }
                            // SAFETY: the page is live; only the NIC uses this word.
                            unsafe { std::ptr::write_volatile(word(pg), v) };
                            shadow[pg] = v;
                            one_sided += 1;
                            continue;
                        }
                    }
                    // Two-sided: pin in this thread, map, access, unpin.
                    p.pin(base + pg * PG, PG).unwrap();
                    {
                        let mut m = nic.mapped.lock();
                        m[pg] = true;
                        // SAFETY: pinned and live; only the NIC uses this word.
                        unsafe { std::ptr::write_volatile(word(pg), v) };
                        shadow[pg] = v;
                    }
                    p.unpin(base + pg * PG, PG).unwrap();
                    two_sided += 1;
                }
                for (pg, &v) in shadow.iter().enumerate() {
                    assert_eq!(
                        // SAFETY: as above.
                        unsafe { std::ptr::read_volatile(word(pg)) },
                        v,
                        "NIC word of page {pg}"
                    );
                }
                (one_sided, two_sided, violations)
            })
        };
        std::thread::sleep(Duration::from_secs(secs()));
        stop.store(true, Relaxed);
        let ops: u64 = apps.into_iter().map(|h| h.join().unwrap()).sum();
        let (one, two, violations) = nic_thread.join().unwrap();
        swapper.0.store(true, Relaxed);
        swapper.1.join().unwrap();
        let s = p.stats();
        eprintln!("app ops {ops} nic one-sided {one} two-sided {two} stats {s:?}");
        assert_eq!(violations, 0, "the NIC found a mapped page absent");
        assert!(one > 0 && two > 0 && s.swap_outs > 0);
    });
}
