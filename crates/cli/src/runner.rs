//! `nprdma perf`: argument handling, setting up the two sides (in-process, spawned
//! peer process, or --server/--client), and printing the table or JSON.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use clap::Args;

use crate::error::{CliError, Result};
use crate::initiator::Initiator;
use crate::mem::{page_size, parse_size};
use crate::perf::{self, PerfResult};
use crate::spec::{Fault, Mode, Op, Spec, Test};
use crate::target::Target;
use crate::wire::{serve_one, RemoteTarget, TargetHandle};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    Inproc,
    Shm,
}

#[derive(Args, Debug, Clone)]
pub struct PerfArgs {
    /// Operation.
    #[arg(long, value_enum, default_value_t = Op::Read)]
    pub op: Op,
    /// Memory mode of both sides.
    #[arg(long, value_enum, default_value_t = Mode::Nprdma)]
    pub mode: Mode,
    /// Page-fault scenario at the target buffer (see above).
    #[arg(long, value_enum, default_value_t = Fault::None)]
    pub fault: Fault,
    /// Message size (e.g. 2, 4096, 64K, 8M).
    #[arg(long, value_parser = parse_size, default_value = "2", conflicts_with = "all")]
    pub size: u64,
    /// All sizes 2 B .. 8 MB (powers of two).
    #[arg(long)]
    pub all: bool,
    /// Iterations per size.
    #[arg(long, default_value_t = 1000)]
    pub iters: usize,
    /// WRs in flight (bandwidth test).
    #[arg(long, default_value_t = 128)]
    pub tx_depth: usize,
    /// Signal one WR in N (bandwidth test; the last WR is always signaled).
    /// Capped at --tx-depth, as perftest caps its cq_mod.
    #[arg(long, default_value_t = 100)]
    pub signal_every: usize,
    /// Latency test (the default).
    #[arg(long, conflicts_with = "bw")]
    pub lat: bool,
    /// Bandwidth test.
    #[arg(long)]
    pub bw: bool,
    /// Transport between the two hosts.
    #[arg(long, value_enum, default_value_t = Transport::Inproc)]
    pub transport: Transport,
    /// Run as the target (server) of a two-process run; serves one client.
    #[arg(long, conflicts_with = "client")]
    pub server: bool,
    /// Run as the initiator against a server on HOST (same machine).
    #[arg(long, value_name = "HOST")]
    pub client: Option<String>,
    /// TCP port of the handshake.
    #[arg(long, default_value_t = 18515)]
    pub port: u16,
    /// JSON lines (one object per size, the table's fields) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// All sizes of `--all`: 2 B .. 8 MB.
pub fn all_sizes() -> Vec<usize> {
    (1..=23).map(|i| 1usize << i).collect()
}

impl PerfArgs {
    pub fn test(&self) -> Test {
        if self.bw {
            Test::Bw
        } else {
            Test::Lat
        }
    }
    pub fn specs(&self) -> Result<Vec<Spec>> {
        let sizes = if self.all {
            all_sizes()
        } else {
            vec![usize::try_from(self.size).map_err(|_| CliError::Arg("size too large".into()))?]
        };
        let test = self.test();
        let specs: Vec<Spec> = sizes
            .into_iter()
            .map(|size| Spec {
                op: self.op,
                mode: self.mode,
                fault: self.fault,
                test,
                size,
                iters: self.iters,
                tx_depth: if test == Test::Lat { 1 } else { self.tx_depth },
                signal_every: if test == Test::Lat {
                    1
                } else {
                    self.signal_every.min(self.tx_depth)
                },
            })
            .collect();
        for s in &specs {
            s.validate().map_err(CliError::Arg)?;
        }
        Ok(specs)
    }
}

/// A connected initiator + target pair able to run a list of specs of one mode.
pub struct Session {
    pub ini: Initiator,
    pub tgt: Box<dyn TargetHandle>,
    pub transport: &'static str,
    _peer: Option<PeerProcess>,
}

/// A spawned peer process (`nprdma serve-peer`, `nprdma app-peer`), waited for
/// on drop.
pub(crate) struct PeerProcess(pub(crate) Child);

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // The peer exits once the RemoteTarget said goodbye (dropped before us);
        // give it a moment, then make sure it is gone.
        for _ in 0..50 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Target and initiator sizes that fit every spec.
fn sizing(specs: &[Spec]) -> (usize, usize, usize, usize) {
    let page = page_size();
    let data = specs
        .iter()
        .map(|s| s.window_bytes(page))
        .max()
        .unwrap_or(8);
    let msg = specs.iter().map(|s| s.msg_len()).max().unwrap_or(8);
    let depth = specs.iter().map(|s| s.tx_depth).max().unwrap_or(1);
    (data, msg, msg, depth)
}

impl Session {
    /// Set up `mode` for `specs` over `transport` (client = remote server host).
    pub fn open(
        mode: Mode,
        specs: &[Spec],
        transport: Transport,
        client: Option<(&str, u16)>,
        np_cfg: nprdma::Config,
    ) -> Result<Session> {
        crate::setup::check_mode(mode)?;
        let (data_len, recv_len, buf_len, depth) = sizing(specs);
        let (mut tgt, peer, name): (Box<dyn TargetHandle>, Option<PeerProcess>, &'static str) =
            match (transport, client) {
                (Transport::Inproc, None) => (
                    Box::new(Target::new(mode, data_len, recv_len)?),
                    None,
                    "inproc",
                ),
                (Transport::Inproc, Some(_)) => {
                    return Err(CliError::Arg("--client needs --transport shm".into()));
                }
                (Transport::Shm, Some((host, port))) => (
                    Box::new(RemoteTarget::connect(host, port, mode, data_len, recv_len)?),
                    None,
                    "shm",
                ),
                (Transport::Shm, None) => {
                    let (child, port) = spawn_peer("serve-peer")?;
                    let peer = PeerProcess(child);
                    let t = RemoteTarget::connect("127.0.0.1", port, mode, data_len, recv_len)?;
                    (Box::new(t), Some(peer), "shm (2 processes)")
                }
            };
        let mut ini = Initiator::new(mode, buf_len, depth + 8, np_cfg)?;
        let taddr = tgt.qp_addr()?;
        tgt.connect(&ini.qp_addr())?;
        ini.connect(&taddr)?;
        Ok(Session {
            ini,
            tgt,
            transport: name,
            _peer: peer,
        })
    }

    pub fn run(&mut self, spec: &Spec) -> Result<PerfResult> {
        perf::run(spec, &mut self.ini, self.tgt.as_mut(), self.transport)
    }
}

/// Re-exec this binary as `<cmd> --port 0` (a hidden peer subcommand) and read
/// the port it listens on.
pub(crate) fn spawn_peer(cmd: &str) -> Result<(Child, u16)> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([cmd, "--port", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| CliError::Peer("no stdout".into()))?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let port = line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| {
            let _ = child.kill();
            CliError::Peer(format!(
                "peer process did not report its port (got {line:?})"
            ))
        })?;
    Ok((child, port))
}

/// `nprdma serve-peer`: listen on localhost, print the port, serve one session.
pub fn cmd_serve_peer(port: u16) -> Result<()> {
    let l = TcpListener::bind(("127.0.0.1", port))?;
    println!("PORT {}", l.local_addr()?.port());
    use std::io::Write;
    std::io::stdout().flush()?;
    serve_one(&l)
}

/// `nprdma perf`.
pub fn cmd_perf(a: PerfArgs) -> Result<()> {
    if a.server {
        if a.transport != Transport::Shm {
            return Err(CliError::Arg("--server needs --transport shm".into()));
        }
        let l = TcpListener::bind(("0.0.0.0", a.port))?;
        eprintln!("nprdma: waiting for one client on port {}", a.port);
        return serve_one(&l);
    }
    let specs = a.specs()?;
    let client = a.client.as_deref().map(|h| (h, a.port));
    let mut s = Session::open(
        a.mode,
        &specs,
        a.transport,
        client,
        nprdma::Config::default(),
    )?;
    let mut first = true;
    for spec in &specs {
        let r = s.run(spec)?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            if first {
                println!("{}", crate::output::banner(&r));
                println!("{}", crate::output::header(r.test));
                first = false;
            }
            println!("{}", crate::output::row(&r));
            if let Some(l) = crate::output::device_line(&r) {
                println!("{l}");
            }
        }
    }
    Ok(())
}
