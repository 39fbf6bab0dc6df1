//! The pager's zero reserve and the fill-ahead of sequential first-touch
//! write streams (a test binary of their own: they allocate and populate
//! tens of MiB, which the RSS tests of `basic` must not see).

mod common;
use common::*;
use vmem::{Pager, PagerConfig, PAGE_SIZE as PG};

/// The zero reserve: pages zeroed ahead of need by a background thread that
/// then blocks; long first-touch runs (sequential fault-around, a pin of a
/// range for writing) are moved in from it. Every page reads zero before it
/// is written, keeps what is written through swap-out and back, and the
/// reserve refills once emptied.
#[test]
fn zero_reserve_fills_long_first_touch_runs() {
    with_timeout(60, || {
        let p = Pager::new(PagerConfig {
            fault_around: 16,
            fault_around_max: 512,
            zero_reserve: 512,
            ..small_cfg()
        })
        .unwrap();
        assert_eq!(p.stats().zero_reserve_pages, 512);
        // Nothing to fill yet: nothing populated, and its thread blocks.
        assert!(wait_until(5, || thread_state("vmem-zero") == Some('S')));
        let small = p.alloc(64 * PG).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            p.stats().zero_reserve_populated,
            0,
            "more than the pager could fill"
        );
        drop(small);
        let mut r = p.alloc(4096 * PG).unwrap();
        assert!(wait_until(10, || p.stats().zero_reserve_populated == 512));
        // Full: its thread blocks (it does not poll).
        assert!(wait_until(5, || thread_state("vmem-zero") == Some('S')));
        // Written first (a read would map the shared zero page instead).
        for pg in 0..1024 {
            r.as_mut_slice()[pg * PG + 9] = pg as u8 | 1;
            let b = &r.as_slice()[pg * PG..(pg + 1) * PG];
            assert!(b.iter().enumerate().all(|(i, &x)| i == 9 || x == 0));
        }
        let s = p.stats();
        // Runs of 16, 32, 64, 128, 256, 512, 512: those of 32 pages and more
        // come from the reserve as long as its chunk lasts (32+64+128+256 =
        // 480, then the last 32 of the chunk for the first 512-page run).
        assert!(s.zero_reserve_moved >= 480, "{s:?}");
        // Emptied chunks are populated again, until the reserve is full.
        let full = |s: &vmem::PagerStats| s.zero_reserve_populated == s.zero_reserve_moved + 512;
        assert!(wait_until(10, || full(&p.stats())), "{:?}", p.stats());
        assert!(p.stats().zero_reserve_populated >= 1024);
        // A pin for writing of never-touched pages takes from it too.
        let before = p.stats().zero_reserve_moved;
        r.pin(3072 * PG, 128 * PG).unwrap();
        assert_eq!(
            p.stats().zero_reserve_moved,
            before + 128,
            "moved before the pin: {before}"
        );
        r.as_mut_slice()[3072 * PG..3200 * PG].fill(7);
        r.unpin(3072 * PG, 128 * PG).unwrap();
        assert!(r.swap_out().unwrap() > 0);
        assert!((0..1024).all(|pg| {
            let b = &r.as_slice()[pg * PG..(pg + 1) * PG];
            b.iter()
                .enumerate()
                .all(|(i, &x)| x == if i == 9 { pg as u8 | 1 } else { 0 })
        }));
        assert!(r.as_slice()[1024 * PG..3072 * PG].iter().all(|&b| b == 0));
        assert!(r.as_slice()[3072 * PG..3200 * PG].iter().all(|&b| b == 7));
        assert!(r.as_slice()[3200 * PG..3300 * PG].iter().all(|&b| b == 0));
    });
}

/// The scheduler state letter (`R`, `S`, ...) of this process's thread named
/// `name`, if there is one.
fn thread_state(name: &str) -> Option<char> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let dir = e.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim() != name {
            return None;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        stat.rsplit(") ").next()?.chars().next()
    })
}

/// Fill-ahead: once a sequential write stream runs at its longest run, the
/// fault thread, while idle, fills the next two runs before the writer gets
/// there; the writer then goes through them without a userfault, and they
/// read as zeroes and keep what is written. A read stream is not filled
/// ahead (it maps the zero page and allocates nothing).
#[test]
fn a_sequential_write_stream_is_filled_ahead() {
    with_timeout(60, || {
        let p = Pager::new(PagerConfig {
            fault_around: 4,
            fault_around_max: 64,
            ..small_cfg()
        })
        .unwrap();
        let mut r = p.alloc(1024 * PG).unwrap();
        // Runs of 4, 8, 16, 32 and 64 (pages 0..124): the last one at the
        // longest, so the two after it (124..252) are filled ahead.
        for pg in 0..124 {
            r.as_mut_slice()[pg * PG + 5] = pg as u8 | 1;
        }
        assert!(
            wait_until(10, || r.resident_count().unwrap() == 252),
            "{}",
            r.resident_count().unwrap()
        );
        let faults = p.stats().minor_faults;
        assert_eq!(faults, 5);
        for pg in 124..252 {
            let b = &r.as_slice()[pg * PG..(pg + 1) * PG];
            assert!(b.iter().all(|&x| x == 0), "page {pg}");
            r.as_mut_slice()[pg * PG + 5] = pg as u8 | 1;
        }
        assert_eq!(
            p.stats().minor_faults,
            faults,
            "no userfault in the filled runs"
        );
        assert!((0..252).all(|pg| r.as_slice()[pg * PG + 5] == pg as u8 | 1));
        // A read stream maps the zero page run by run: nothing ahead of it.
        let q = p.alloc(1024 * PG).unwrap();
        let sum: u64 = (0..400).map(|pg| q.as_slice()[pg * PG] as u64).sum();
        assert_eq!(sum, 0);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(q.resident_count().unwrap() < 400 + 64);
    });
}
