//! Pager benchmarks (not tests): fault service latency vs a raw userfaultfd
//! handler measured in the same run (major faults with buffered and O_DIRECT
//! swap, each against a raw handler reading the same way), pin latency
//! (range pins in consecutive and scattered slots, with and without the swap
//! I/O threads, beside the device's own O_DIRECT read latency), swap-out cost
//! per page, residency scan, and registering 4 GiB vs mlock() of the same 4 GiB.
//!
//! `cargo run --release -p vmem --example vmem_bench [-- --quick] [--pins (only the pin table)]`

use hdrhistogram::Histogram;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::{Pager, PagerConfig, PAGE_SIZE as PG};

/// A minimal userfaultfd handler: the baseline "raw ioctl cost". It spins on
/// non-blocking reads (like the pager after a fault) or blocks in poll, and
/// resolves each fault with exactly one ioctl (zero page, or pread + COPY).
mod raw {
    use super::*;
    const UFFDIO_API: u64 = 0xc018_aa3f;
    const UFFDIO_REGISTER: u64 = 0xc020_aa00;
    const UFFDIO_COPY: u64 = 0xc028_aa03;
    const UFFDIO_ZEROPAGE: u64 = 0xc020_aa04;

    /// A fresh non-blocking userfaultfd and a fresh anonymous `len`-byte mapping
    /// (no THP) registered with it for missing faults: `(fd, addr)`. The caller
    /// owns the mapping and unmaps it.
    fn uffd_mapping(len: usize) -> (OwnedFd, usize) {
        // SAFETY: plain syscalls on fresh resources (a new fd, a new mapping the
        // kernel places); the ioctl argument arrays match the kernel ABI.
        unsafe {
            let fd =
                libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) as i32;
            assert!(fd >= 0);
            let fd = OwnedFd::from_raw_fd(fd);
            let mut api = [0xAAu64, 0, 0];
            assert_eq!(
                libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, api.as_mut_ptr()),
                0
            );
            let addr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as usize;
            libc::madvise(addr as *mut _, len, libc::MADV_NOHUGEPAGE);
            let mut reg = [addr as u64, len as u64, 1, 0];
            assert_eq!(
                libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER as _, reg.as_mut_ptr()),
                0
            );
            (fd, addr)
        }
    }

    pub struct Raw {
        pub addr: usize,
        pub len: usize,
        stop: Arc<AtomicBool>,
        t: Option<std::thread::JoinHandle<()>>,
    }

    impl Raw {
        /// `file`: Some(fd) = major faults (pread 4 KiB from the file, then
        /// COPY); None = `zero`: ZEROPAGE if true, else COPY of a zero page.
        pub fn new(len: usize, spin: bool, file: Option<std::fs::File>, zero: bool) -> Raw {
            // SAFETY: plain syscalls on fresh resources; structs match the kernel ABI.
            unsafe {
                let (fd, addr) = uffd_mapping(len);
                let stop = Arc::new(AtomicBool::new(false));
                let st = stop.clone();
                let t = std::thread::spawn(move || {
                    let buf = vec![0u8; 2 * PG];
                    let page = (buf.as_ptr() as usize).next_multiple_of(PG);
                    let mut msg = [0u64; 4];
                    while !st.load(Relaxed) {
                        let n = libc::read(fd.as_raw_fd(), msg.as_mut_ptr().cast(), 32);
                        if n != 32 {
                            if !spin {
                                let mut p = libc::pollfd {
                                    fd: fd.as_raw_fd(),
                                    events: libc::POLLIN,
                                    revents: 0,
                                };
                                libc::poll(&mut p, 1, 10);
                            }
                            continue;
                        }
                        let a = (msg[2] as usize) & !(PG - 1);
                        match &file {
                            None if zero => {
                                let mut z = [a as u64, PG as u64, 0, 0];
                                libc::ioctl(fd.as_raw_fd(), UFFDIO_ZEROPAGE as _, z.as_mut_ptr());
                            }
                            None => {
                                let mut c = [a as u64, page as u64, PG as u64, 0, 0];
                                libc::ioctl(fd.as_raw_fd(), UFFDIO_COPY as _, c.as_mut_ptr());
                            }
                            Some(f) => {
                                let off = ((a - addr) % (64 << 20)) as i64;
                                libc::pread(f.as_raw_fd(), page as *mut _, PG, off);
                                let mut c = [a as u64, page as u64, PG as u64, 0, 0];
                                libc::ioctl(fd.as_raw_fd(), UFFDIO_COPY as _, c.as_mut_ptr());
                            }
                        }
                    }
                });
                Raw {
                    addr,
                    len,
                    stop,
                    t: Some(t),
                }
            }
        }
    }

    /// Cost of one UFFDIO_COPY of a zero page into a registered, missing
    /// page with no waiter (the floor of pin() on a never-touched page).
    pub fn copy_ioctl_cost(pages: usize) -> Histogram<u64> {
        let mut h = super::hist();
        // SAFETY: as in Raw::new; the ranges are our own fresh mapping.
        unsafe {
            let len = pages * PG;
            let (fd, addr) = uffd_mapping(len);
            let buf = vec![0u8; 2 * PG];
            let page = (buf.as_ptr() as usize).next_multiple_of(PG);
            for i in 0..pages {
                let mut c = [(addr + i * PG) as u64, page as u64, PG as u64, 0, 0];
                let t = Instant::now();
                let r = libc::ioctl(fd.as_raw_fd(), UFFDIO_COPY as _, c.as_mut_ptr());
                h.record(t.elapsed().as_nanos() as u64).unwrap();
                assert_eq!(r, 0);
            }
            libc::munmap(addr as *mut _, len);
        }
        h
    }

    impl Drop for Raw {
        fn drop(&mut self) {
            self.stop.store(true, Relaxed);
            if let Some(t) = self.t.take() {
                t.join().unwrap();
            }
            // SAFETY: our mapping; the handler thread has stopped.
            unsafe { libc::munmap(self.addr as *mut _, self.len) };
        }
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).unwrap()
}

/// Touches one byte per page (write) and records each access's latency.
fn touch_pages(addr: usize, pages: usize, write: bool) -> (Histogram<u64>, Duration) {
    let mut h = hist();
    let t0 = Instant::now();
    for i in 0..pages {
        let p = (addr + i * PG) as *mut u8;
        let t = Instant::now();
        // SAFETY: the page belongs to a live mapping under test.
        unsafe {
            if write {
                std::ptr::write_volatile(p, 1);
            } else {
                std::ptr::read_volatile(p);
            }
        }
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    (h, t0.elapsed())
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn line(name: &str, h: &Histogram<u64>, total: Duration, n: usize, base: Option<&Histogram<u64>>) {
    let ratio = base.map_or(String::new(), |b| {
        format!(
            "{:.2} / {:.2}",
            h.value_at_quantile(0.5) as f64 / b.value_at_quantile(0.5) as f64,
            h.mean() / b.mean()
        )
    });
    println!(
        "| {name} | {:.1} | {:.1} | {:.1} | {:.0} | {ratio} |",
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        h.mean() / 1000.0,
        n as f64 / total.as_secs_f64()
    );
}

fn faults(pages: usize) {
    println!("\n### Fault service (app-side latency of one access, µs; faults/s with one handler thread)\n");
    println!("Ratio = pager / raw baseline of the same kind (p50 / mean), same run.\n");
    println!(
        "| case | p50 | p99 | mean | faults/s | ratio p50 / mean |\n|---|---|---|---|---|---|"
    );
    // Swap-like file for the raw major-fault baseline.
    let f = tempfile_with(64 << 20);
    for spin in [true, false] {
        let tag = if spin { "spin" } else { "block" };
        let cfg = PagerConfig {
            spin: if spin {
                Duration::from_micros(50)
            } else {
                Duration::ZERO
            },
            swap_size: (pages * PG * 2) as u64,
            ..Default::default()
        };
        // Buffered swap here, like the raw baseline's file: the rows compare
        // the pager's own cost; the O_DIRECT pair below adds the device.
        let p = Pager::new(PagerConfig {
            o_direct: false,
            ..cfg.clone()
        })
        .unwrap();
        // Minor, read: zero page.
        let hb = raw_baseline(
            &format!("raw uffd read → ZEROPAGE ({tag}) — baseline"),
            pages,
            spin,
            None,
            true,
            false,
        );
        let reg = pager_minor(&p, &format!("pager minor, read ({tag})"), pages, false, &hb);
        service_row(&p, &format!("pager-side service time ({tag})"));
        drop(reg);
        // Minor, write: COPY of a zero page.
        let hb = raw_baseline(
            &format!("raw uffd write → COPY zeroes ({tag}) — baseline"),
            pages,
            spin,
            None,
            false,
            true,
        );
        let reg = pager_minor(&p, &format!("pager minor, write ({tag})"), pages, true, &hb);
        // Major: pread + COPY, buffered (page cache) and O_DIRECT (device).
        let pd = Pager::new(cfg).unwrap();
        for (pager, io) in [(&p, "buffered"), (&pd, "O_DIRECT")] {
            let file = if io == "O_DIRECT" {
                // The same file read with O_DIRECT (its dirty pages are
                // written back first by the kernel).
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
                    .unwrap()
            } else {
                f.try_clone().unwrap()
            };
            let hb = raw_baseline(
                &format!("raw uffd pread ({io}) + COPY ({tag}) — baseline"),
                pages,
                spin,
                Some(file),
                false,
                true,
            );
            let r = if io == "O_DIRECT" {
                pd.alloc(pages * PG).unwrap()
            } else {
                p.alloc(pages * PG).unwrap()
            };
            // SAFETY: the region is live.
            unsafe { std::ptr::write_bytes(r.as_mut_ptr(), 3, r.len()) };
            r.swap_out().unwrap();
            pager.reset_fault_histogram();
            let (h, t) = touch_pages(r.addr(), pages, true);
            line(
                &format!("pager major, swap {} ({tag})", pager.swap_io().label()),
                &h,
                t,
                pages,
                Some(&hb),
            );
            service_row(pager, &format!("pager-side service time major ({tag})"));
        }
        drop(reg);
    }
}

/// Times touching every page of a fresh raw-uffd region (`raw::Raw::new(.., zero)`),
/// prints it as a baseline row and returns its histogram.
fn raw_baseline(
    name: &str,
    pages: usize,
    spin: bool,
    file: Option<std::fs::File>,
    zero: bool,
    write: bool,
) -> Histogram<u64> {
    let (hb, t) = {
        let r = raw::Raw::new(pages * PG, spin, file, zero);
        touch_pages(r.addr, pages, write)
    };
    line(name, &hb, t, pages, None);
    hb
}

/// Times the minor faults of touching every page of a fresh pager region, prints
/// the row against `base` and returns the region.
fn pager_minor(
    p: &Pager,
    name: &str,
    pages: usize,
    write: bool,
    base: &Histogram<u64>,
) -> vmem::Region {
    let reg = p.alloc(pages * PG).unwrap();
    let (h, t) = touch_pages(reg.addr(), pages, write);
    line(name, &h, t, pages, Some(base));
    reg
}

/// Prints the pager's own fault-service time as a row.
fn service_row(p: &Pager, name: &str) {
    let s = p.stats().fault_service;
    println!(
        "| ↳ {name} | {:.1} | {:.1} | {:.1} | | |",
        us(s.p50_ns),
        us(s.p99_ns),
        s.mean_ns / 1000.0
    );
}

fn tempfile_with(len: usize) -> std::fs::File {
    let p = std::env::temp_dir().join(format!("vmem-bench-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    std::fs::remove_file(&p).unwrap();
    use std::io::Write;
    let chunk = vec![7u8; 1 << 20];
    let mut w = &f;
    for _ in 0..len >> 20 {
        w.write_all(&chunk).unwrap();
    }
    f
}

fn pins(pages: usize) {
    println!("\n### pin() in the calling thread (µs per 1-page pin+unpin)\n");
    println!("| page state | p50 | p99 | mean |\n|---|---|---|---|");
    let p = Pager::new(PagerConfig {
        swap_size: (pages * PG * 2) as u64,
        ..Default::default()
    })
    .unwrap();
    let r = p.alloc(pages * PG).unwrap();
    let run = |name: &str| {
        let mut h = hist();
        for i in 0..pages {
            let a = r.addr() + i * PG;
            let t = Instant::now();
            p.pin(a, PG).unwrap();
            p.unpin(a, PG).unwrap();
            h.record(t.elapsed().as_nanos() as u64).unwrap();
        }
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            us(h.value_at_quantile(0.5)),
            us(h.value_at_quantile(0.99)),
            h.mean() / 1000.0
        );
    };
    let h = raw::copy_ioctl_cost(pages);
    println!(
        "| baseline: bare UFFDIO_COPY ioctl of a zero page, no waiter (same run) | {:.2} | {:.2} | {:.2} |",
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        h.mean() / 1000.0
    );
    run("never touched (zero fill)");
    run("resident");
    r.swap_out().unwrap();
    run("swapped out (swap read + COPY)");
    // A two-sided NP-RDMA fault pins a whole request range at once.
    let range_run = |r: &vmem::Region, name: &str| {
        let range = 256;
        let mut h = hist();
        for i in 0..pages / range {
            let a = r.addr() + i * range * PG;
            let t = Instant::now();
            p.pin(a, range * PG).unwrap();
            h.record(t.elapsed().as_nanos() as u64 / range as u64)
                .unwrap();
            p.unpin(a, range * PG).unwrap();
        }
        println!(
            "| {name}, one pin() of {range} pages (per page) | {:.2} | {:.2} | {:.2} |",
            us(h.value_at_quantile(0.5)),
            us(h.value_at_quantile(0.99)),
            h.mean() / 1000.0
        );
    };
    r.swap_out().unwrap();
    range_run(&r, "swapped out");
    // Swapped out one page at a time, last page first: no two pages of a
    // range are in consecutive slots, so a range pin issues one read per page
    // (concurrently on the pager's swap I/O threads; 0 threads = one by one).
    for threads in [PagerConfig::default().swap_io_threads, 0] {
        let q = Pager::new(PagerConfig {
            swap_size: (pages * PG * 2) as u64,
            swap_io_threads: threads,
            ..Default::default()
        })
        .unwrap();
        let s = q.alloc(pages * PG).unwrap();
        // SAFETY: the region is live.
        unsafe { std::ptr::write_bytes(s.as_mut_ptr(), 9, s.len()) };
        for i in (0..pages).rev() {
            q.swap_out(s.addr() + i * PG, PG).unwrap();
        }
        let range = 256;
        let mut h = hist();
        for i in 0..pages / range {
            let a = s.addr() + i * range * PG;
            let t = Instant::now();
            q.pin(a, range * PG).unwrap();
            h.record(t.elapsed().as_nanos() as u64 / range as u64)
                .unwrap();
            q.unpin(a, range * PG).unwrap();
        }
        println!(
            "| swapped out, scattered slots, {threads} swap I/O threads, one pin() of {range} pages (per page) | {:.2} | {:.2} | {:.2} |",
            us(h.value_at_quantile(0.5)),
            us(h.value_at_quantile(0.99)),
            h.mean() / 1000.0
        );
    }
    match p.device_read_latency(16, 2000) {
        Ok(d) => println!(
            "| baseline: the device itself, one O_DIRECT 4 KiB random read of the swap file at a time (same run; {:.0} IOPS; at depth {}: {:.0} IOPS, median {:.1} µs) | {:.2} | {:.2} | {:.2} |",
            d.iops, d.depth, d.iops_at_depth, d.median_us_at_depth, d.median_us, d.p99_us, d.mean_us
        ),
        Err(e) => println!("| baseline: the device itself — not measured: {e} | | | |"),
    }
    println!("| swap I/O of this pager: {} | | | |", p.swap_io().label());
    let fresh = p.alloc(pages * PG).unwrap();
    range_run(&fresh, "never touched");
    range_run(&fresh, "resident");
    let mut h = hist();
    for i in 0..pages {
        let t = Instant::now();
        std::hint::black_box(p.is_resident(r.addr() + i * PG));
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    println!(
        "| is_resident() query | {:.3} | {:.3} | {:.3} |",
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        h.mean() / 1000.0
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One swap-out run: returns (cold µs/page, warm µs/page). Cold = first write
/// of those swap slots; warm = the same pages swapped out again after being
/// faulted back (slots reused, as in steady-state eviction under a budget).
fn swap_out_once(pages: usize, o_direct: bool, batch: usize) -> (f64, f64) {
    let cfg = PagerConfig {
        o_direct,
        evict_batch: batch,
        swap_size: (pages * PG * 2) as u64,
        background_evictor: false,
        ..Default::default()
    };
    let p = Pager::new(cfg).unwrap();
    let r = p.alloc(pages * PG).unwrap();
    // SAFETY: the region is live.
    unsafe { std::ptr::write_bytes(r.as_mut_ptr(), 5, r.len()) };
    let run = || {
        let t = Instant::now();
        let n: usize = if batch == 1 {
            (0..pages)
                .map(|i| p.swap_out(r.addr() + i * PG, PG).unwrap())
                .sum()
        } else {
            r.swap_out().unwrap()
        };
        assert_eq!(n, pages);
        t.elapsed().as_secs_f64() * 1e6 / pages as f64
    };
    let cold = run();
    assert_eq!(r.prefetch().unwrap(), pages);
    let warm = run();
    (cold, warm)
}

fn swap_out_cost(pages: usize) {
    println!("\n### Swap-out cost (µs per page, median of 3 runs; no listener; includes UFFDIO_MOVE, write, MADV_DONTNEED of staging)\n");
    println!("| mode | cold (fresh slots) | warm (slots reused) | pages |\n|---|---|---|---|");
    for (o_direct, batch) in [
        (false, 1usize),
        (false, 64),
        (false, 256),
        (true, 1),
        (true, 64),
        (true, 256),
    ] {
        let runs: Vec<(f64, f64)> = (0..3)
            .map(|_| swap_out_once(pages, o_direct, batch))
            .collect();
        let mode = format!(
            "{} {}",
            if o_direct { "O_DIRECT" } else { "buffered" },
            if batch == 1 {
                "single (1 page per call)".to_string()
            } else {
                format!("batched ({batch} pages)")
            }
        );
        println!(
            "| {mode} | {:.2} | {:.2} | {pages} |",
            median(runs.iter().map(|r| r.0).collect()),
            median(runs.iter().map(|r| r.1).collect())
        );
    }
    // Reference: the bare system calls of a batch, same sizes, same run.
    let f = tempfile_with(pages * PG);
    let buf = vec![5u8; 64 * PG];
    let t = Instant::now();
    for i in (0..pages).step_by(64) {
        use std::os::unix::fs::FileExt;
        f.write_all_at(&buf, (i * PG) as u64).unwrap();
    }
    println!("| reference: bare pwrite of 64-page chunks to a buffered file (rewrite) | | {:.2} | {pages} |", t.elapsed().as_secs_f64() * 1e6 / pages as f64);
}

/// One application thread touching random pages of a working set 4× the
/// budget while the background evictor keeps the budget (steady state).
fn pressure(pages: usize, secs: f64) {
    println!("\n### Memory pressure (working set 4× the budget, background CLOCK evictor)\n");
    let budget = pages / 4;
    let cfg = PagerConfig {
        budget_pages: Some(budget),
        swap_size: (pages * PG * 2) as u64,
        ..Default::default()
    };
    let p = Pager::new(cfg).unwrap();
    let r = p.alloc(pages * PG).unwrap();
    // SAFETY: the region is live.
    unsafe { std::ptr::write_bytes(r.as_mut_ptr(), 1, r.len()) };
    let s0 = p.stats();
    let mut h = hist();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let a = r.addr() + (x as usize % pages) * PG;
        let t = Instant::now();
        // SAFETY: inside the live region.
        unsafe { std::ptr::write_volatile(a as *mut u8, 2) };
        h.record(t.elapsed().as_nanos() as u64).unwrap();
        n += 1;
    }
    let dt = t0.elapsed().as_secs_f64();
    let s = p.stats();
    println!("| accesses/s | major faults/s | swap-outs/s | access p50 µs | access p99 µs | resident at end / budget |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {:.0} | {:.0} | {:.0} | {:.2} | {:.1} | {} / {} |",
        n as f64 / dt,
        (s.major_faults - s0.major_faults) as f64 / dt,
        (s.swap_outs - s0.swap_outs) as f64 / dt,
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        s.resident_pages,
        budget
    );
}

fn registration(gib: usize) {
    println!("\n### Registration of {gib} GiB (same run)\n");
    println!("| operation | ms | ms/GiB |\n|---|---|---|");
    let len = gib << 30;
    let p = Pager::new(PagerConfig {
        swap_size: 1 << 30,
        background_evictor: false,
        ..Default::default()
    })
    .unwrap();
    // SAFETY: fresh anonymous mapping owned by this function.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    } as usize;
    let row = |name: &str, d: Duration| {
        println!(
            "| {name} | {:.2} | {:.2} |",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() * 1e3 / gib as f64
        )
    };
    let t = Instant::now();
    // SAFETY: the mapping stays alive until the region is dropped.
    let r = unsafe { p.register(addr, len) }.unwrap();
    let reg = t.elapsed();
    row(
        "pager register (mincore scan + state array + UFFDIO_REGISTER)",
        reg,
    );
    let t = Instant::now();
    let cnt = r.resident_count().unwrap();
    row(
        "pager residency query over the region (state array)",
        t.elapsed(),
    );
    assert_eq!(cnt, 0);
    let t = Instant::now();
    drop(r);
    row("pager unregister", t.elapsed());
    let t = Instant::now();
    assert_eq!(
        // SAFETY: locking our own mapping.
        unsafe { libc::mlock(addr as *const _, len) },
        0,
        "mlock failed (RLIMIT_MEMLOCK?)"
    );
    let ml = t.elapsed();
    row("mlock() (baseline, same range)", ml);
    println!(
        "\nregister speed-up vs mlock: **{:.0}×**",
        ml.as_secs_f64() / reg.as_secs_f64()
    );
    // Now resident memory (as from a malloc'd, used buffer): scan costs.
    let t = Instant::now();
    // SAFETY: the mapping stays alive until the region is dropped.
    let r = unsafe { p.register(addr, len) }.unwrap();
    let reg2 = t.elapsed();
    println!();
    println!("| operation | ms | ms/GiB |\n|---|---|---|");
    row("pager register of the same range, now fully resident", reg2);
    let t = Instant::now();
    let cnt = r.resident_count().unwrap();
    row("pager residency query (state array)", t.elapsed());
    assert_eq!(cnt, len / PG);
    let t = Instant::now();
    let mut v = vec![0u8; len / PG];
    // SAFETY: v has one byte per page.
    unsafe { libc::mincore(addr as *mut _, len, v.as_mut_ptr()) };
    row("mincore scan (reference)", t.elapsed());
    let t = Instant::now();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut buf = vec![0u8; 8 * 65536];
        let mut off = 0;
        while off < len / PG {
            let n = (len / PG - off).min(65536);
            f.read_exact_at(&mut buf[..8 * n], ((addr / PG + off) * 8) as u64)
                .unwrap();
            off += n;
        }
    }
    row("/proc/self/pagemap scan (reference)", t.elapsed());
    drop(r);
    // SAFETY: our mapping.
    unsafe { libc::munmap(addr as *mut _, len) };
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let pages = if quick { 2000 } else { 20000 };
    println!(
        "vmem_bench: {} pages per fault run; machine: {} cpus",
        pages,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    if std::env::args().any(|a| a == "--pins") {
        pins(pages.min(10000));
        return;
    }
    faults(pages);
    pins(pages.min(10000));
    swap_out_cost(if quick { 4096 } else { 16384 });
    pressure(
        if quick { 4096 } else { 16384 },
        if quick { 0.5 } else { 3.0 },
    );
    registration(if quick { 1 } else { 4 });
}
