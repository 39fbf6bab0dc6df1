//! `nprdma app`: applications on the NP-RDMA API run side by side with the
//! designs in use today — a remote memory cache (`cache`: NP-RDMA vs an
//! in-memory pinned pool vs copy-through RPC) and a Spark-like shuffle
//! (`shuffle`: NP-RDMA vs pinned). The back-end runs in its own process
//! (spawned, or `--server` / `--client` like `nprdma perf`); data moves over
//! the software RNIC's shared-memory transport.

pub mod backend;
pub mod cache;
pub mod front;
pub mod item;
pub mod proto;
pub mod report;
pub mod shuffle;

use std::net::TcpListener;
use std::time::Duration;

use clap::{Args, Subcommand};

use crate::error::{CliError, Result};
use crate::mem::parse_size;
use proto::Design;

#[derive(Args, Debug, Clone)]
pub struct AppArgs {
    #[command(subcommand)]
    pub cmd: AppCmd,
}

#[derive(Subcommand, Debug, Clone)]
pub enum AppCmd {
    /// Remote memory cache: 8 KiB items in a back-end pool several times its
    /// DRAM budget (the rest on the swap device), served to front-end threads
    /// by one-sided READ/WRITE (nprdma, pinned) or two-sided RPC (copy-through).
    Cache(CacheArgs),
    /// Spark-like shuffle: map tasks write partitions into a large pool
    /// registered at start-up, reducers in another process READ them.
    Shuffle(ShuffleArgs),
}

/// Back-end placement, as in `nprdma perf`.
#[derive(Args, Debug, Clone)]
pub struct NetArgs {
    /// Run as the back-end (server) of a two-process run; serves one client.
    #[arg(long, conflicts_with = "client")]
    pub server: bool,
    /// Run the front-end against a back-end server on HOST (same machine).
    #[arg(long, value_name = "HOST")]
    pub client: Option<String>,
    /// TCP port of the handshake.
    #[arg(long, default_value_t = 18516)]
    pub port: u16,
    /// JSON lines (one object per design) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Key distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Dist {
    Uniform,
    Zipf,
}

#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// Designs to run, one after the other on the same machine and disk
    /// (`odp` = the ODP model, labelled as a model; not in the default list).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "nprdma,pinned,copy-through"
    )]
    pub designs: Vec<Design>,
    /// Pool size (items fill it).
    #[arg(long, value_parser = parse_size, default_value = "320M")]
    pub pool: u64,
    /// DRAM budget of the swapping designs' pool (resident pages).
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    pub budget: u64,
    /// Swap device (file) size; default: the pool size.
    #[arg(long, value_parser = parse_size)]
    pub swap: Option<u64>,
    /// Item size.
    #[arg(long, value_parser = parse_size, default_value = "8K")]
    pub item: u64,
    /// Key distribution.
    #[arg(long, value_enum, default_value_t = Dist::Zipf)]
    pub dist: Dist,
    /// Zipfian exponent θ.
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    /// Percent of operations that are writes.
    #[arg(long, default_value_t = 10)]
    pub writes: u32,
    /// Front-end threads (one QP each).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Measured run length (seconds).
    #[arg(long, default_value_t = 3.0)]
    pub secs: f64,
    /// Warm-up before the measured run (seconds; values are verified, not timed).
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Seed of the key streams.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten)]
    pub net: NetArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ShuffleArgs {
    /// Designs of the executor's pool.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pinned,nprdma"
    )]
    pub designs: Vec<Design>,
    /// Pool registered at start-up.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    pub pool: u64,
    /// DRAM budget of the NP-RDMA pool.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub budget: u64,
    /// Swap device (file) size; default: the pool size.
    #[arg(long, value_parser = parse_size)]
    pub swap: Option<u64>,
    /// Map tasks.
    #[arg(long, default_value_t = 8)]
    pub maps: usize,
    /// Partitions per map task (= reduce tasks).
    #[arg(long, default_value_t = 8)]
    pub parts: usize,
    /// Partition size.
    #[arg(long, value_parser = parse_size, default_value = "1M")]
    pub part: u64,
    /// Jobs run one after the other on the same pool (a long-running
    /// executor's queries); the first touches the pool's pages.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[command(flatten)]
    pub net: NetArgs,
}

fn secs(x: f64, what: &str) -> Result<Duration> {
    if !(x.is_finite() && (0.0..=86_400.0).contains(&x)) {
        return Err(CliError::Arg(format!("--{what} must be 0 .. 86400 s")));
    }
    Ok(Duration::from_secs_f64(x))
}

fn usize_of(x: u64, what: &str) -> Result<usize> {
    usize::try_from(x).map_err(|_| CliError::Arg(format!("--{what} too large")))
}

impl CacheArgs {
    pub fn workload(&self) -> Result<cache::Workload> {
        if self.writes > 100 {
            return Err(CliError::Arg("--writes is a percentage (0..=100)".into()));
        }
        if self.dist == Dist::Zipf
            && !(self.theta.is_finite() && (0.0..=10.0).contains(&self.theta))
        {
            return Err(CliError::Arg("--theta must be 0 .. 10".into()));
        }
        let run = secs(self.secs, "secs")?;
        if run.is_zero() {
            return Err(CliError::Arg("--secs must be above 0".into()));
        }
        Ok(cache::Workload {
            pool: self.pool,
            budget: self.budget,
            swap: self.swap.unwrap_or(self.pool),
            item: usize_of(self.item, "item")?,
            theta: (self.dist == Dist::Zipf).then_some(self.theta),
            write_pct: self.writes,
            threads: self.threads,
            warmup: secs(self.warmup, "warmup")?,
            run,
            seed: self.seed,
        })
    }
}

impl ShuffleArgs {
    pub fn job(&self) -> Result<shuffle::Job> {
        Ok(shuffle::Job {
            pool: self.pool,
            budget: self.budget,
            swap: self.swap.unwrap_or(self.pool),
            maps: self.maps,
            parts: self.parts,
            part_bytes: usize_of(self.part, "part")?,
            rounds: self.rounds,
        })
    }
}

/// `--server`: serve one front-end on `port` (all interfaces).
fn serve(port: u16) -> Result<()> {
    let l = TcpListener::bind(("0.0.0.0", port))?;
    eprintln!("nprdma: app back-end waiting for one client on port {port}");
    backend::serve_one(&l)
}

/// The back-end placement of a front-end run: spawned per design, or one
/// `--client` session (one design).
fn client<'a>(net: &'a NetArgs, designs: &[Design]) -> Result<Option<(&'a str, u16)>> {
    match &net.client {
        Some(h) if designs.len() == 1 => Ok(Some((h.as_str(), net.port))),
        Some(_) => Err(CliError::Arg(
            "--client runs one design against its server (give one --designs value)".into(),
        )),
        None => Ok(None),
    }
}

/// `nprdma app`.
pub fn cmd_app(a: AppArgs) -> Result<()> {
    match a.cmd {
        AppCmd::Cache(c) => {
            if c.net.server {
                return serve(c.net.port);
            }
            let w = c.workload()?;
            let cl = client(&c.net, &c.designs)?;
            for &d in &c.designs {
                cache::pool_spec(&w, d).validate()?;
            }
            let items = cache::pool_spec(&w, Design::Pinned).items();
            if !c.net.json {
                println!("{}", cache::banner(&w, items));
                println!("# machine: {}", crate::machine::describe());
                println!("{}", cache::header());
            }
            for &d in &c.designs {
                let r = cache::run(&w, d, cl)?;
                if c.net.json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!("{}", cache::row(&r));
                }
            }
            if !c.net.json {
                println!("# at the end: {}", crate::machine::round_trip_text());
            }
            Ok(())
        }
        AppCmd::Shuffle(s) => {
            if s.net.server {
                return serve(s.net.port);
            }
            let j = s.job()?;
            let cl = client(&s.net, &s.designs)?;
            for &d in &s.designs {
                shuffle::pool_spec(&j, d).validate()?;
            }
            if !s.net.json {
                println!(
                    "# shuffle: {} round(s) of {} maps x {} partitions of {} = {} into a pool of {} (NP-RDMA budget {})",
                    j.rounds,
                    j.maps,
                    j.parts,
                    proto::human(j.part_bytes as u64),
                    proto::human(j.data_bytes()),
                    proto::human(j.pool),
                    proto::human(j.budget)
                );
                println!("{}", shuffle::header());
            }
            let mut rows = Vec::new();
            for &d in &s.designs {
                let r = shuffle::run(&j, d, cl)?;
                if s.net.json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!("{}", shuffle::row(&r));
                }
                rows.push(r);
            }
            let p = rows.iter().find(|r| r.design == Design::Pinned);
            let n = rows.iter().find(|r| r.design == Design::Nprdma);
            if let (Some(p), Some(n), false) = (p, n, s.net.json) {
                let (saved, slow, init) = shuffle::compare(p, n);
                let (later, first) = shuffle::round_slowdowns(p, n);
                println!(
                    "# NP-RDMA vs pinned: {:.1} % of the pool's physical memory saved (mean), job {:+.1} % (first round {:+.1} %, later rounds {}), initialisation {:.1}x faster",
                    saved * 100.0,
                    slow * 100.0,
                    first * 100.0,
                    later.map_or("-".into(), |x| format!("{:+.1} %", x * 100.0)),
                    init
                );
            }
            Ok(())
        }
    }
}

/// `nprdma app-peer`: listen on localhost, print the port, serve one session.
pub fn cmd_app_peer(port: u16) -> Result<()> {
    let l = TcpListener::bind(("127.0.0.1", port))?;
    println!("PORT {}", l.local_addr()?.port());
    use std::io::Write;
    std::io::stdout().flush()?;
    backend::serve_one(&l)
}
