//! `nprdma app cache`: the remote memory cache (the paper's enterprise-storage
//! application). A back-end exposes a pool of `item`-byte items (8 KiB by
//! default), several times its DRAM budget in the swapping designs;
//! front-end threads serve reads and writes of items with a uniform or
//! zipfian key stream, each value checked against what was written.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::app::front::{Conn, Remote};
use crate::app::item::{self, KeyDist, Rng};
use crate::app::proto::{human, App, Design, PoolSpec, RPC_GET, RPC_HDR, RPC_PUT};
use crate::error::{CliError, Result};

/// One cache workload (everything but the design).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub pool: u64,
    pub budget: u64,
    pub swap: u64,
    pub item: usize,
    /// None = uniform; Some(θ) = zipfian.
    pub theta: Option<f64>,
    /// Percent of operations that are writes.
    pub write_pct: u32,
    pub threads: usize,
    pub warmup: Duration,
    pub run: Duration,
    pub seed: u64,
}

/// One design's measured row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheResult {
    pub design: Design,
    pub label: String,
    pub pool_bytes: u64,
    pub budget_bytes: u64,
    /// Pool / DRAM budget.
    pub ratio: f64,
    pub items: u64,
    pub item_bytes: usize,
    pub dist: String,
    pub theta: Option<f64>,
    pub write_pct: u32,
    pub threads: usize,
    /// Share of operations on the most popular keys that fit the budget
    /// (the workload's hot set), by construction of the distribution.
    pub hot_mass: f64,
    pub ops: u64,
    pub reads: u64,
    pub writes: u64,
    pub secs: f64,
    pub kops: f64,
    pub mb_s: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p99_9_us: f64,
    pub max_us: f64,
    /// Bytes read and checked against what was written (header, version,
    /// checksum): every read of the run, warm-up included.
    pub verified_bytes: u64,
    pub verified_reads: u64,
    /// Back-end set-up: allocation + registration, and the fill (ms).
    pub init_ms: f64,
    pub fill_ms: f64,
    /// Back-end pager traffic over the measured window.
    pub swap_ins: u64,
    pub swap_outs: u64,
    pub pool_rss_peak: u64,
    /// Pager evictions aborted by a racing pin / access (measured window).
    #[serde(default)]
    pub evict_aborts: u64,
    /// Pager CLOCK victims spared because the NIC had accessed them
    /// (IOMMU accessed bits; measured window).
    #[serde(default)]
    pub young_spared: u64,
    /// NP-RDMA: two-sided requests (fault path) the back-end served.
    #[serde(default)]
    pub np_served: u64,
    pub rpcs: u64,
    pub nonresident_dma: u64,
    /// The machine's cross-core cache-line round trip (ns) just before the
    /// run's warm-up and just after its window (`machine::core_round_trip_ns`;
    /// `None` with one CPU). On a VM it flips between states that move every
    /// cross-core figure, so a comparison is fair only between runs measured
    /// in one state.
    #[serde(default)]
    pub core_rtt_ns: [Option<f64>; 2],
}

struct ThreadOut {
    hist: Histogram<u64>,
    sum_ns: u128,
    ops: u64,
    reads: u64,
    writes: u64,
    verified: u64,
    verified_reads: u64,
}

/// The pool request of workload `w` in `design`.
pub fn pool_spec(w: &Workload, design: Design) -> PoolSpec {
    PoolSpec {
        app: App::Cache { item: w.item },
        design,
        pool: w.pool,
        budget: w.budget,
        swap: w.swap,
        qps: w.threads,
    }
}

/// Run the workload against a back-end of `design` (spawned, or the server
/// at `client`).
pub fn run(w: &Workload, design: Design, client: Option<(&str, u16)>) -> Result<CacheResult> {
    let spec = pool_spec(w, design);
    let mut be = Remote::open(&spec, client)?;
    let items = spec.items();
    let item_len = w.item;
    // Local buffer: [request header | item] then [reply item].
    let buf_len = 2 * (RPC_HDR + item_len) + 64;
    let conns = (0..w.threads)
        .map(|_| Conn::new(design, buf_len))
        .collect::<Result<Vec<_>>>()?;
    be.connect(conns.iter().map(|c| c.addr()).collect())?;
    for (c, q) in conns.iter().zip(&be.ready.qps) {
        c.connect(q)?;
    }
    let (base, rkey) = (be.ready.base, be.ready.rkey);
    let rtt_before = crate::machine::core_round_trip_ns();
    let t0 = Instant::now();
    let warm_end = t0 + w.warmup;
    let end = warm_end + w.run;
    let threads = w.threads as u64;
    let outs: Vec<Result<ThreadOut>> = std::thread::scope(|s| {
        let hs: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(t, mut c)| {
                s.spawn(move || {
                    let mine = (items + threads - 1 - t as u64) / threads;
                    let dist = KeyDist::new(mine, w.theta);
                    let mut rng = Rng::new(w.seed ^ (t as u64) << 32);
                    let mut versions = vec![0u64; mine as usize];
                    thread_loop(
                        &mut c,
                        design,
                        &dist,
                        &mut rng,
                        &mut versions,
                        (t as u64, threads),
                        (base, rkey, item_len),
                        w.write_pct,
                        (warm_end, end),
                    )
                })
            })
            .collect();
        // The back-end's counters cover the measured window only.
        let now = Instant::now();
        if warm_end > now {
            std::thread::sleep(warm_end - now);
        }
        let marked = be.mark();
        let mut v: Vec<Result<ThreadOut>> = hs
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CliError::Peer("front-end thread panicked".into())))
            })
            .collect();
        if let Err(e) = marked {
            v.push(Err(e));
        }
        v
    });
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
        .map_err(|e| CliError::Arg(e.to_string()))?;
    let (mut sum, mut ops, mut reads, mut writes, mut ver, mut vr) = (0u128, 0, 0, 0, 0, 0);
    for o in outs {
        let o = o?;
        hist.add(&o.hist)
            .map_err(|e| CliError::Arg(e.to_string()))?;
        sum += o.sum_ns;
        ops += o.ops;
        reads += o.reads;
        writes += o.writes;
        ver += o.verified;
        vr += o.verified_reads;
    }
    let rtt_after = crate::machine::core_round_trip_ns();
    let st = be.stats()?;
    if ops == 0 {
        return Err(CliError::Completion(
            "no operation completed in the measured window (raise --secs)".into(),
        ));
    }
    let secs = w.run.as_secs_f64();
    let us = |ns: u64| ns as f64 / 1000.0;
    let dist = KeyDist::new(items, w.theta);
    Ok(CacheResult {
        design,
        label: design.label().into(),
        pool_bytes: w.pool,
        budget_bytes: w.budget,
        ratio: w.pool as f64 / w.budget as f64,
        items,
        item_bytes: item_len,
        dist: match w.theta {
            None => "uniform".into(),
            Some(t) => format!("zipf θ={t}"),
        },
        theta: w.theta,
        write_pct: w.write_pct,
        threads: w.threads,
        hot_mass: dist.mass_of_top(w.budget / item_len as u64),
        ops,
        reads,
        writes,
        secs,
        kops: ops as f64 / secs / 1e3,
        mb_s: ops as f64 * item_len as f64 / secs / 1e6,
        mean_us: sum as f64 / ops as f64 / 1000.0,
        p50_us: us(hist.value_at_quantile(0.5)),
        p99_us: us(hist.value_at_quantile(0.99)),
        p99_9_us: us(hist.value_at_quantile(0.999)),
        max_us: us(hist.max()),
        verified_bytes: ver,
        verified_reads: vr,
        init_ms: be.ready.init_us / 1e3,
        fill_ms: be.ready.fill_us / 1e3,
        swap_ins: st.swap_ins,
        swap_outs: st.swap_outs,
        pool_rss_peak: st.pool_rss_peak,
        evict_aborts: st.evict_aborts,
        young_spared: st.young_spared,
        np_served: st.np_served,
        rpcs: st.rpcs,
        nonresident_dma: st.nonresident_dma,
        core_rtt_ns: [rtt_before, rtt_after],
    })
}

/// One front-end thread: keys `local * threads + t` (its own, so it knows
/// every value's version), operations started until `end`, recorded when they
/// complete after `warm_end` (an operation that straddles the start of the
/// window counts with its whole latency: a stall there is measured, not lost).
#[allow(clippy::too_many_arguments)]
fn thread_loop(
    c: &mut Conn,
    design: Design,
    dist: &KeyDist,
    rng: &mut Rng,
    versions: &mut [u64],
    (t, threads): (u64, u64),
    (base, rkey, item_len): (u64, u32, usize),
    write_pct: u32,
    (warm_end, end): (Instant, Instant),
) -> Result<ThreadOut> {
    let mut out = ThreadOut {
        hist: Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
            .map_err(|e| CliError::Arg(e.to_string()))?,
        sum_ns: 0,
        ops: 0,
        reads: 0,
        writes: 0,
        verified: 0,
        verified_reads: 0,
    };
    let reply_off = RPC_HDR + item_len;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let local = dist.sample(rng);
        let key = local * threads + t;
        let write = rng.below(100) < write_pct as u64;
        let raddr = base + key * item_len as u64;
        let ver = &mut versions[local as usize];
        // Prepare (untimed): the new value, or the request.
        if write {
            *ver += 1;
        }
        let copy = design == Design::CopyThrough;
        {
            let b = c.buf();
            if copy {
                let op = if write { RPC_PUT } else { RPC_GET };
                b[0..8].copy_from_slice(&op.to_le_bytes());
                b[8..16].copy_from_slice(&key.to_le_bytes());
                if write {
                    item::fill(&mut b[RPC_HDR..RPC_HDR + item_len], key, *ver);
                }
            } else if write {
                item::fill(&mut b[..item_len], key, *ver);
            }
        }
        let t_op = Instant::now();
        let got = match (copy, write) {
            (false, w) => c.one_sided(w, 0, item_len, raddr, rkey).map(|_| item_len),
            (true, true) => c.rpc(RPC_HDR + item_len, reply_off, item_len),
            (true, false) => c.rpc(RPC_HDR, reply_off, item_len),
        }?;
        let done = Instant::now();
        let ns = done.duration_since(t_op).as_nanos() as u64;
        if !write {
            let at = if copy { reply_off } else { 0 };
            if got != item_len {
                return Err(CliError::Completion(format!(
                    "key {key}: reply of {got} B, expected {item_len}"
                )));
            }
            item::verify(&c.buf()[at..at + item_len], key, *ver).map_err(|e| {
                CliError::Completion(format!("wrong value read ({}): {e}", design.label()))
            })?;
            out.verified += item_len as u64;
            out.verified_reads += 1;
        } else if copy && got != 8 {
            return Err(CliError::Completion(format!(
                "key {key}: write acknowledged with {got} B"
            )));
        }
        if done >= warm_end {
            out.hist
                .record(ns.max(1))
                .map_err(|e| CliError::Arg(e.to_string()))?;
            out.sum_ns += ns as u128;
            out.ops += 1;
            if write {
                out.writes += 1;
            } else {
                out.reads += 1;
            }
        }
    }
    Ok(out)
}

pub fn header() -> String {
    format!(
        "{:<34} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12}",
        "design",
        "pool/DRAM",
        "ops",
        "Kops/s",
        "mean[us]",
        "p50[us]",
        "p99[us]",
        "p99.9[us]",
        "swap-ins",
        "verified"
    )
}

pub fn row(r: &CacheResult) -> String {
    format!(
        "{:<34} {:>7.1}x {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>12}",
        r.label,
        r.ratio,
        r.ops,
        r.kops,
        r.mean_us,
        r.p50_us,
        r.p99_us,
        r.p99_9_us,
        r.swap_ins,
        human(r.verified_bytes)
    )
}

pub fn banner(w: &Workload, items: u64) -> String {
    format!(
        "# remote memory cache: pool {} ({} items of {}), DRAM budget {} ({:.1}x), {} , {}% writes, {} front-end thread(s) / QP(s), {:.1} s (+{:.1} s warm-up); swap {}",
        human(w.pool),
        items,
        human(w.item as u64),
        human(w.budget),
        w.pool as f64 / w.budget as f64,
        match w.theta {
            None => "uniform keys".to_string(),
            Some(t) => format!("zipfian keys θ={t}"),
        },
        w.write_pct,
        w.threads,
        w.run.as_secs_f64(),
        w.warmup.as_secs_f64(),
        if crate::setup::swap_buffered(
            std::env::var(crate::setup::SWAP_BUFFERED_ENV).ok().as_deref()
        )
        .unwrap_or(false)
        {
            "buffered (page cache)"
        } else {
            "O_DIRECT"
        }
    )
}
