//! `nprdma`: perftest-style runs of pinned RDMA, NP-RDMA and the ODP model on the
//! project's software RNIC (`perf`), MR registration cost (`reg`), and the paper's
//! evaluation as a Markdown + SVG report (`eval`), and applications on NP-RDMA
//! beside today's designs (`app cache`, `app shuffle`).

mod app;
mod ctrlplane;
mod error;
mod eval;
mod initiator;
mod machine;
mod mem;
#[cfg(feature = "odp")]
mod odp;
mod output;
mod perf;
mod reg;
mod runner;
mod setup;
mod spec;
mod svg;
mod target;
mod trust;
mod wire;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "nprdma",
    version,
    about = "NP-RDMA (RDMA without pinning) on a software RNIC: perftest-style runs, registration cost, and the paper's evaluation report"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// perftest-style latency / bandwidth run (ib_read_lat, ib_write_bw, ... in one).
    #[command(long_about = PERF_HELP)]
    Perf(runner::PerfArgs),
    /// MR registration time and resident memory (the paper's Spark-initialisation
    /// experiment, scaled to this machine).
    Reg(reg::RegArgs),
    /// The paper's evaluation, side by side: Markdown report + SVG plots.
    Eval(eval::EvalArgs),
    /// Applications on NP-RDMA beside today's designs: a remote memory cache and
    /// a Spark-like shuffle (the paper's Applications section, scaled to this machine).
    App(app::AppArgs),
    /// This machine: CPUs, memory, kernel and the cross-core cache-line round trip
    /// (the state two-process figures depend on; printed beside benchmarks).
    Machine,
    /// (internal) the target process of a two-process shm run.
    #[command(hide = true, name = "serve-peer")]
    ServePeer {
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// (internal) the back-end process of an `app` run.
    #[command(hide = true, name = "app-peer")]
    AppPeer {
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
}

const PERF_HELP: &str = "perftest-style latency (--lat) or bandwidth (--bw) run.

Modes (both sides use the same mode):
  pinned  standard RDMA: buffers are mmap'ed, mlock'ed (every page resident) and
          registered as plain rnic MRs; the NIC never checks anything.
  nprdma  NP-RDMA: buffers are pager (vmem) regions registered with the nprdma layer
          without pinning; optimistic one-sided ops with checks, two-sided fault path.
  odp     ODP model: pager (vmem) buffers registered as ON_DEMAND MRs of the software
          RNIC (nothing pinned). A remote page fault is NAKed and retransmitted after
          the RNIC's odp_timeout (2 ms) with go-back-N; the host's fault handler
          (vmem prefetch) runs on the NIC thread. Always labelled 'ODP (model)'.
          (Cargo feature `odp`, on by default.)

Fault scenarios (at the TARGET buffer; produced before each window of operations,
outside the timed region; each operation of a window targets its own pages):
  none    the target buffer is resident (and, for NP-RDMA, mapped in its NIC views).
  minor   every operation hits pages nobody has touched yet: consecutive page-aligned
          slices of a fresh vmem region (a new region + MR when 256 MiB are used up;
          its key is learnt by an untimed READ outside the window).
  major   every operation hits pages swapped out to the pager's swap file: one vmem
          region, written once, then `swap_out` of the window's pages before each
          window (NP-RDMA: its listener remaps them to signature/black-hole frames;
          ODP model: the NIC page table is invalidated first, odp_invalidate_then).
          The swap file is read and written with O_DIRECT (like Linux swap: a major
          fault reads the device); NPRDMA_SWAP_BUFFERED=1 makes it buffered (page
          cache), and the banner says which. Each major row is followed by the swap
          device's own 4 KiB O_DIRECT read latency and IOPS (depth 1 and the pager's
          depth), measured in the same run on the same swap file (JSON: swap_io,
          device_read_4k_us, device_iops_at_depth, ...).
  Pinned memory cannot fault: with minor/major, pinned runs are the pinned reference
  (fault_pages_prepared = 0 in the JSON).

Transports:
  inproc  both sides in this process (two software hosts).
  shm     two processes on this machine, data over the rnic shared-memory transport.
          Without --server/--client, `nprdma perf` spawns its own peer process.
          With --server it waits for one client (which chooses every parameter);
          with --client HOST it connects to such a server (HOST must be this machine:
          the shm transport is same-host; TCP is only for the handshake).

Latency: post one signaled WR, spin on the CQ until its completion; t_typical is the
median. Bandwidth: keep --tx-depth WRs in flight, every --signal-every-th signaled
(like ib_write_bw's cq_mod); GB/s = 1e9 bytes/s over the timed windows.";

fn main() {
    tracing_subscriber_init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Perf(a) => runner::cmd_perf(a),
        Cmd::Reg(a) => reg::cmd_reg(a),
        Cmd::Eval(a) => eval::cmd_eval(a),
        Cmd::ServePeer { port } => runner::cmd_serve_peer(port),
        Cmd::App(a) => app::cmd_app(a),
        Cmd::AppPeer { port } => app::cmd_app_peer(port),
        Cmd::Machine => {
            println!("{}", machine::describe());
            Ok(())
        }
    };
    if let Err(e) = r {
        eprintln!("nprdma: error: {e}");
        std::process::exit(1);
    }
}

/// The libraries log through `tracing`: warnings and errors reach stderr by
/// default, `RUST_LOG` (e.g. `RUST_LOG=nprdma=debug`) selects more.
fn tracing_subscriber_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
