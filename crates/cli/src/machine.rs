//! What the machine is while a benchmark runs: CPUs, memory, kernel, and the
//! time a cache line takes to go from one core to another and back — on a VM
//! that figure changes when the host moves its virtual CPUs (this project's
//! 2-core VM swings between ~60 ns and ~330 ns), and every two-process figure
//! (perftest, the remote-memory cache) moves with it, so reports print it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// Round trips measured per call.
const ROUNDS: u64 = 200_000;

/// Pin the calling thread to CPU `cpu`.
fn pin(cpu: usize) -> bool {
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).is_ok()
}

/// The first two CPUs this process may run on.
fn two_cpus() -> Option<(usize, usize, CpuSet)> {
    let mine = sched_getaffinity(None).ok()?;
    let mut it = (0..CpuSet::MAX_CPU).filter(|&c| mine.is_set(c));
    Some((it.next()?, it.next()?, mine))
}

/// Nanoseconds for one cache-line round trip between the first two CPUs the
/// process may use (two threads pinned to them bounce one atomic word), or
/// `None` with fewer than two CPUs. Takes a few tens of milliseconds; the
/// calling thread's affinity is restored.
pub fn core_round_trip_ns() -> Option<f64> {
    let (a, b, mine) = two_cpus()?;
    let flag = Arc::new(AtomicU64::new(0));
    let f2 = flag.clone();
    // Both sides bounce every round whether or not their pin took (the
    // result is then discarded), so neither can wait forever.
    let other = std::thread::spawn(move || {
        let pinned = pin(b);
        for i in 0..ROUNDS {
            while f2.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            f2.store(2 * i + 2, Ordering::Release);
        }
        pinned
    });
    let pinned = pin(a);
    let t0 = Instant::now();
    for i in 0..ROUNDS {
        flag.store(2 * i + 1, Ordering::Release);
        while flag.load(Ordering::Acquire) != 2 * i + 2 && !other.is_finished() {
            std::hint::spin_loop();
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / ROUNDS as f64;
    let _ = sched_setaffinity(None, &mine);
    let both = other.join().unwrap_or(false) && pinned;
    both.then_some(ns)
}

/// One line: CPUs, available memory, kernel, and the cross-core round trip.
pub fn describe() -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = crate::mem::mem_available().unwrap_or(0) >> 30;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cpus} CPUs, {mem} GiB available, Linux {}, {}",
        kernel.trim(),
        round_trip_text()
    )
}

/// "cross-core cache-line round trip N ns" (or why it was not measured).
pub fn round_trip_text() -> String {
    match core_round_trip_ns() {
        Some(ns) => format!("cross-core cache-line round trip {ns:.0} ns"),
        None => "cross-core round trip not measured (one CPU)".into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_round_trip_takes_some_time_or_is_not_measured() {
        if let Some(ns) = super::core_round_trip_ns() {
            // A cache line crosses cores in tens to hundreds of ns; a
            // microsecond would mean the two threads shared a core.
            assert!(ns > 1.0 && ns < 100_000.0, "{ns}");
        }
    }
}
