//! `nprdma app shuffle`: a Spark-like shuffle over a large, mostly cold memory
//! pool. The executor (back-end process) registers its pool at start-up —
//! pinned, or NP-RDMA without pinning — map tasks write their partitions into
//! it, and reduce tasks in another process fetch every partition with
//! one-sided READs and verify it. Measured: pool initialisation, map and
//! reduce time, and the pool's physical memory (/proc, sampled every 2 ms).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::app::front::{Conn, Remote};
use crate::app::item;
use crate::app::proto::{human, App, Design, PoolSpec};
use crate::error::{CliError, Result};

/// One shuffle job (everything but the design).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub pool: u64,
    pub budget: u64,
    pub swap: u64,
    pub maps: usize,
    pub parts: usize,
    pub part_bytes: usize,
    /// Jobs run one after the other on the same pool (queries of one
    /// long-running executor); round k writes block version k.
    pub rounds: usize,
}

impl Job {
    /// Bytes one round shuffles.
    pub fn data_bytes(&self) -> u64 {
        (self.maps * self.parts * self.part_bytes) as u64
    }
}

/// One design's measured job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShuffleResult {
    pub design: Design,
    pub label: String,
    pub pool_bytes: u64,
    pub budget_bytes: u64,
    pub data_bytes: u64,
    pub maps: usize,
    pub parts: usize,
    pub part_bytes: usize,
    /// Pool allocation + registration (pinned: mlock + register).
    pub init_ms: f64,
    pub rounds: usize,
    /// Map and reduce time, summed over the rounds.
    pub map_ms: f64,
    pub reduce_ms: f64,
    /// map + reduce over all rounds (the job proper).
    pub job_ms: f64,
    /// The first round (map + reduce: pool pages touched for the first time)
    /// and the mean of the later ones (`None` with one round).
    pub first_round_ms: f64,
    pub later_round_ms: Option<f64>,
    /// init + job.
    pub total_ms: f64,
    /// Pool physical memory during the job (back-end RSS above its level
    /// before the pool, /proc/self/statm every 2 ms).
    pub pool_rss_peak: u64,
    pub pool_rss_mean: u64,
    pub rss_samples: u64,
    pub swap_ins: u64,
    pub swap_outs: u64,
    /// Over all rounds.
    pub verified_bytes: u64,
    pub partitions_verified: usize,
    pub nonresident_dma: u64,
}

pub fn pool_spec(j: &Job, design: Design) -> PoolSpec {
    PoolSpec {
        app: App::Shuffle,
        design,
        pool: j.pool,
        budget: j.budget,
        swap: j.swap,
        qps: 1,
    }
}

/// Run the job with an executor pool of `design`.
pub fn run(j: &Job, design: Design, client: Option<(&str, u16)>) -> Result<ShuffleResult> {
    if design == Design::CopyThrough {
        return Err(CliError::Arg(
            "the shuffle compares pinned and nprdma pools (--designs pinned,nprdma)".into(),
        ));
    }
    if j.maps == 0
        || j.parts == 0
        || j.rounds == 0
        || j.part_bytes < item::HEADER
        || j.part_bytes > (64 << 20)
    {
        return Err(CliError::Arg(format!(
            "--maps, --parts and --rounds must be ≥ 1 and --part {} B .. 64 MiB",
            item::HEADER
        )));
    }
    if j.data_bytes() > j.pool {
        return Err(CliError::Arg(format!(
            "the shuffle data ({}) does not fit the pool ({})",
            human(j.data_bytes()),
            human(j.pool)
        )));
    }
    let spec = pool_spec(j, design);
    let mut be = Remote::open(&spec, client)?;
    let mut c = Conn::new(design, j.part_bytes)?;
    be.connect(vec![c.addr()])?;
    c.connect(&be.ready.qps[0])?;
    be.mark()?;
    let (mut map_ms, mut reduce_ms) = (0.0, 0.0);
    let mut round_ms = Vec::new();
    let mut verified = 0u64;
    let mut n = 0usize;
    for round in 0..j.rounds as u64 {
        let t = Instant::now();
        map_ms += be.map(j.maps, j.parts, j.part_bytes, round)? / 1e3;
        let t_red = Instant::now();
        for r in 0..j.parts {
            for m in 0..j.maps {
                let block = (m * j.parts + r) as u64;
                let raddr = be.ready.base + block * j.part_bytes as u64;
                c.one_sided(false, 0, j.part_bytes, raddr, be.ready.rkey)?;
                item::verify(&c.buf()[..j.part_bytes], block, round).map_err(|e| {
                    CliError::Completion(format!(
                        "round {round}, reducer {r}: wrong partition from map {m} ({}): {e}",
                        design.label()
                    ))
                })?;
                verified += j.part_bytes as u64;
                n += 1;
            }
        }
        reduce_ms += t_red.elapsed().as_secs_f64() * 1e3;
        round_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let job_ms: f64 = round_ms.iter().sum();
    let later = &round_ms[1..];
    let st = be.stats()?;
    let init_ms = be.ready.init_us / 1e3;
    Ok(ShuffleResult {
        design,
        label: design.label().into(),
        pool_bytes: j.pool,
        budget_bytes: j.budget,
        data_bytes: j.data_bytes(),
        maps: j.maps,
        parts: j.parts,
        part_bytes: j.part_bytes,
        init_ms,
        rounds: j.rounds,
        map_ms,
        reduce_ms,
        job_ms,
        first_round_ms: round_ms[0],
        later_round_ms: (!later.is_empty()).then(|| later.iter().sum::<f64>() / later.len() as f64),
        total_ms: init_ms + job_ms,
        pool_rss_peak: st.pool_rss_peak,
        pool_rss_mean: st.pool_rss_mean,
        rss_samples: st.rss_samples,
        swap_ins: st.swap_ins,
        swap_outs: st.swap_outs,
        verified_bytes: verified,
        partitions_verified: n,
        nonresident_dma: st.nonresident_dma,
    })
}

/// NP-RDMA against pinned: (memory saved = 1 − mean_np/mean_pinned,
/// job slowdown = job_np/job_pinned − 1, init speed-up = init_pinned/init_np).
pub fn compare(pinned: &ShuffleResult, np: &ShuffleResult) -> (f64, f64, f64) {
    (
        1.0 - np.pool_rss_mean as f64 / (pinned.pool_rss_mean as f64).max(1.0),
        np.job_ms / pinned.job_ms.max(1e-9) - 1.0,
        pinned.init_ms / np.init_ms.max(1e-9),
    )
}

/// Slowdown of the later rounds (pool pages already touched) and of the
/// first one, NP-RDMA against pinned.
pub fn round_slowdowns(pinned: &ShuffleResult, np: &ShuffleResult) -> (Option<f64>, f64) {
    (
        np.later_round_ms
            .zip(pinned.later_round_ms)
            .map(|(n, p)| n / p.max(1e-9) - 1.0),
        np.first_round_ms / pinned.first_round_ms.max(1e-9) - 1.0,
    )
}

pub fn header() -> String {
    format!(
        "{:<20} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11} {:>9} {:>10}",
        "design",
        "pool",
        "data",
        "init[ms]",
        "map[ms]",
        "reduce[ms]",
        "job[ms]",
        "1st[ms]",
        "later[ms]",
        "mem peak",
        "mem mean",
        "swap-ins",
        "verified"
    )
}

pub fn row(r: &ShuffleResult) -> String {
    format!(
        "{:<20} {:>9} {:>9} {:>9.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10} {:>11} {:>11} {:>9} {:>10}",
        r.label,
        human(r.pool_bytes),
        human(r.data_bytes),
        r.init_ms,
        r.map_ms,
        r.reduce_ms,
        r.job_ms,
        r.first_round_ms,
        r.later_round_ms.map_or("-".into(), |x| format!("{x:.1}")),
        human(r.pool_rss_peak),
        human(r.pool_rss_mean),
        r.swap_ins,
        human(r.verified_bytes)
    )
}
