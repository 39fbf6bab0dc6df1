//! The perftest-style measurement loops (latency: one WR at a time; bandwidth: a
//! window of `tx_depth` WRs with every `signal_every`-th signaled) and their result.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::initiator::Initiator;
use crate::mem::page_size;
use crate::spec::{Fault, Mode, Op, Spec, Test};
use crate::wire::TargetHandle;

/// A completion that takes longer than this fails the run.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(20);

/// One measured row (the table line and the JSON object carry the same fields).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PerfResult {
    pub op: Op,
    pub mode: Mode,
    pub mode_label: String,
    pub fault: Fault,
    pub test: Test,
    pub transport: String,
    pub bytes: usize,
    pub iterations: usize,
    pub tx_depth: usize,
    pub signal_every: usize,
    /// Latency (µs), `--lat`.
    pub t_min_us: Option<f64>,
    pub t_typical_us: Option<f64>,
    pub t_avg_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p99_9_us: Option<f64>,
    pub t_max_us: Option<f64>,
    /// Bandwidth, `--bw` (GB/s = 1e9 bytes/s).
    pub bw_avg_gbps: Option<f64>,
    pub mops: Option<f64>,
    /// Target pages made non-resident by the scenario over the run (0 for pinned:
    /// its memory cannot fault, the row is the pinned reference).
    pub fault_pages_prepared: u64,
    /// Target pager counters over the run.
    pub target_minor_faults: u64,
    pub target_major_faults: u64,
    /// NP-RDMA: operations that passed their optimistic check / went two-sided.
    pub np_optimistic_ok: Option<u64>,
    pub np_two_sided: Option<u64>,
    /// Non-resident DMA attempts seen by the target NIC (must be 0).
    pub nonresident_dma: u64,
    /// Major-fault rows of a target with a pager: how its swap file is read
    /// ("O_DIRECT", or a buffered label), and the swap device's own 4 KiB
    /// random-read latency measured in the same run on the same swap file
    /// (O_DIRECT reads of written slots, after the timed windows): median,
    /// min and max (µs) and reads/s one at a time; reads/s and median at
    /// `device_depth` reads in flight.
    #[serde(default)]
    pub swap_io: Option<String>,
    #[serde(default)]
    pub device_read_4k_us: Option<f64>,
    #[serde(default)]
    pub device_read_4k_min_us: Option<f64>,
    #[serde(default)]
    pub device_read_4k_max_us: Option<f64>,
    /// The device's 4 KiB read, depth 1, waited for by polling (as NP-RDMA's
    /// polling thread waits for its swap reads): median µs.
    #[serde(default)]
    pub device_read_4k_polled_us: Option<f64>,
    #[serde(default)]
    pub device_iops: Option<f64>,
    #[serde(default)]
    pub device_depth: Option<usize>,
    #[serde(default)]
    pub device_iops_at_depth: Option<f64>,
    #[serde(default)]
    pub device_read_4k_at_depth_us: Option<f64>,
    /// Why the device baseline is missing from a major-fault row.
    #[serde(default)]
    pub device_error: Option<String>,
}

impl PerfResult {
    /// Every figure of the row is finite (for the smoke test and the report).
    pub fn all_finite(&self) -> bool {
        let v = [
            self.t_min_us,
            self.t_typical_us,
            self.t_avg_us,
            self.p99_us,
            self.p99_9_us,
            self.t_max_us,
            self.bw_avg_gbps,
            self.mops,
        ];
        let present = v.iter().flatten().count();
        present > 0 && v.iter().flatten().all(|x| x.is_finite() && *x >= 0.0)
    }
}

fn wait_one(ini: &mut Initiator, deadline: Instant) -> Result<usize> {
    loop {
        let n = ini.poll()?;
        if n > 0 {
            return Ok(n);
        }
        if Instant::now() > deadline {
            return Err(CliError::Timeout("no completion within 20 s".into()));
        }
        std::hint::spin_loop();
    }
}

/// Run `spec` between `ini` and `tgt` (both already connected).
pub fn run(
    spec: &Spec,
    ini: &mut Initiator,
    tgt: &mut dyn TargetHandle,
    transport: &str,
) -> Result<PerfResult> {
    spec.validate().map_err(CliError::Arg)?;
    let page = page_size();
    let len = spec.msg_len();
    let stride = spec.stride(page) as u64;
    let wops = spec.window_ops(page);
    let wbytes = spec.window_bytes(page);
    let c0 = tgt.counters()?;
    let np0 = ini.np_stats();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
        .map_err(|e| CliError::Arg(e.to_string()))?;
    let (mut sum_ns, mut min_ns, mut max_ns) = (0u128, u64::MAX, 0u64);
    let mut bw_time = Duration::ZERO;
    let mut prepared = 0u64;
    let mut wr_id = 0u64;

    // Warm-up (untimed): first-use key sync, caches, NIC thread awake.
    if spec.fault == Fault::None {
        let w = tgt.prepare(Fault::None, wbytes)?;
        for _ in 0..(spec.iters / 10).clamp(1, 100) {
            wr_id += 1;
            ini.post(spec.op, wr_id, len, w.base, w.rkey, true)?;
            wait_one(ini, Instant::now() + COMPLETION_TIMEOUT)?;
        }
    }

    let mut done = 0usize;
    while done < spec.iters {
        let n = wops.min(spec.iters - done);
        let bytes = if spec.fault == Fault::None {
            wbytes
        } else {
            n * stride as usize
        };
        let w = tgt.prepare(spec.fault, bytes)?;
        prepared += w.pages_prepared;
        if spec.fault != Fault::None && w.renewed && spec.op != Op::Send {
            // A new target MR: let the initiator learn its key outside the timing,
            // with a READ of a page outside the window.
            wr_id += 1;
            ini.post(Op::Read, wr_id, 8, w.sync_addr, w.rkey, true)?;
            wait_one(ini, Instant::now() + COMPLETION_TIMEOUT)?;
        }
        match spec.test {
            Test::Lat => {
                for i in 0..n {
                    wr_id += 1;
                    let raddr = w.base + i as u64 * stride;
                    let t0 = Instant::now();
                    ini.post(spec.op, wr_id, len, raddr, w.rkey, true)?;
                    wait_one(ini, t0 + COMPLETION_TIMEOUT)?;
                    let ns = t0.elapsed().as_nanos() as u64;
                    hist.record(ns.max(1))
                        .map_err(|e| CliError::Arg(e.to_string()))?;
                    sum_ns += ns as u128;
                    min_ns = min_ns.min(ns);
                    max_ns = max_ns.max(ns);
                }
            }
            Test::Bw => {
                bw_time += bw_window(spec, ini, &w, n, stride, &mut wr_id)?;
            }
        }
        done += n;
    }

    let c1 = tgt.counters()?;
    let np1 = ini.np_stats();
    // The device's own read latency, same run, same swap file (untimed by the
    // windows above, after them).
    let dev = if spec.fault == Fault::Major {
        tgt.device(crate::target::device_depth(), crate::target::DEVICE_READS)?
    } else {
        None
    };
    let base = dev.as_ref().and_then(|d| d.baseline.as_ref().ok());
    let us = |ns: u64| ns as f64 / 1000.0;
    let lat = spec.test == Test::Lat;
    let secs = bw_time.as_secs_f64().max(1e-9);
    Ok(PerfResult {
        op: spec.op,
        mode: spec.mode,
        mode_label: spec.mode.label().into(),
        fault: spec.fault,
        test: spec.test,
        transport: transport.into(),
        bytes: len,
        iterations: spec.iters,
        tx_depth: spec.tx_depth,
        signal_every: spec.signal_every,
        t_min_us: lat.then(|| us(min_ns)),
        t_typical_us: lat.then(|| us(hist.value_at_quantile(0.5).min(max_ns))),
        t_avg_us: lat.then(|| sum_ns as f64 / spec.iters as f64 / 1000.0),
        p99_us: lat.then(|| us(hist.value_at_quantile(0.99).min(max_ns))),
        p99_9_us: lat.then(|| us(hist.value_at_quantile(0.999).min(max_ns))),
        t_max_us: lat.then(|| us(max_ns)),
        bw_avg_gbps: (!lat).then(|| (len * spec.iters) as f64 / secs / 1e9),
        mops: (!lat).then(|| spec.iters as f64 / secs / 1e6),
        fault_pages_prepared: prepared,
        target_minor_faults: c1.minor_faults - c0.minor_faults,
        target_major_faults: c1.major_faults - c0.major_faults,
        np_optimistic_ok: np1.zip(np0).map(|(a, b)| a.optimistic_ok - b.optimistic_ok),
        np_two_sided: np1.zip(np0).map(|(a, b)| a.two_sided - b.two_sided),
        nonresident_dma: c1.nonresident_dma,
        swap_io: dev.as_ref().map(|d| d.swap_io.clone()),
        device_read_4k_us: base.map(|b| b.median_us),
        device_read_4k_min_us: base.map(|b| b.min_us),
        device_read_4k_max_us: base.map(|b| b.max_us),
        device_read_4k_polled_us: base.and_then(|b| b.median_polled_us),
        device_iops: base.map(|b| b.iops),
        device_depth: base.map(|b| b.depth),
        device_iops_at_depth: base.map(|b| b.iops_at_depth),
        device_read_4k_at_depth_us: base.map(|b| b.median_us_at_depth),
        device_error: dev
            .as_ref()
            .and_then(|d| d.baseline.as_ref().err().cloned()),
    })
}

/// One bandwidth window: keep up to `tx_depth` WRs outstanding, every
/// `signal_every`-th (and the last) signaled; time from the first post to the last
/// completion.
fn bw_window(
    spec: &Spec,
    ini: &mut Initiator,
    w: &crate::target::Window,
    n: usize,
    stride: u64,
    wr_id: &mut u64,
) -> Result<Duration> {
    let len = spec.msg_len();
    let mut batches: VecDeque<usize> = VecDeque::new();
    let (mut posted, mut completed, mut outstanding, mut unsig) = (0usize, 0usize, 0usize, 0usize);
    let t0 = Instant::now();
    let mut last_progress = t0;
    while completed < n {
        while posted < n && outstanding < spec.tx_depth {
            let signaled = (posted + 1) % spec.signal_every == 0 || posted + 1 == n;
            *wr_id += 1;
            let raddr = w.base + posted as u64 * stride;
            ini.post(spec.op, *wr_id, len, raddr, w.rkey, signaled)?;
            posted += 1;
            outstanding += 1;
            unsig += 1;
            if signaled {
                batches.push_back(unsig);
                unsig = 0;
            }
        }
        let k = ini.poll()?;
        if k > 0 {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > COMPLETION_TIMEOUT {
            return Err(CliError::Timeout(format!(
                "bandwidth window stalled with {outstanding} WRs outstanding"
            )));
        }
        for _ in 0..k {
            let b = batches
                .pop_front()
                .ok_or_else(|| CliError::Completion("more completions than signaled WRs".into()))?;
            completed += b;
            outstanding -= b;
        }
    }
    Ok(t0.elapsed())
}
