//! Out-of-band exchange with the target (perftest's TCP handshake): JSON lines over
//! TCP for set-up and window preparation; the data path is the software RNIC's
//! shared-memory transport between the two processes. Also the target handle the
//! runner uses, in-process or remote.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use crate::setup::QpAddr;
use crate::spec::{Fault, Mode};
use crate::target::{DeviceInfo, Target, TargetCounters, Window};

/// Client -> server messages.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum Req {
    Hello {
        mode: Mode,
        data_len: usize,
        recv_len: usize,
    },
    Connect {
        peer: QpAddr,
    },
    Prepare {
        fault: Fault,
        bytes: usize,
    },
    Counters,
    Device {
        depth: usize,
        reads: usize,
    },
    Bye,
}

/// Server -> client messages.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum Resp {
    Qp { qp: QpAddr },
    Ok,
    Window { w: Window },
    Counters { c: TargetCounters },
    Device { d: Option<DeviceInfo> },
    Error { msg: String },
}

/// What the runner needs from the target, wherever it runs.
pub trait TargetHandle {
    fn qp_addr(&mut self) -> Result<QpAddr>;
    fn connect(&mut self, peer: &QpAddr) -> Result<()>;
    fn prepare(&mut self, fault: Fault, bytes: usize) -> Result<Window>;
    fn counters(&mut self) -> Result<TargetCounters>;
    /// The target's swap I/O and device baseline (`None`: no pager).
    fn device(&mut self, depth: usize, reads: usize) -> Result<Option<DeviceInfo>>;
}

impl TargetHandle for Target {
    fn qp_addr(&mut self) -> Result<QpAddr> {
        Ok(Target::qp_addr(self))
    }
    fn connect(&mut self, peer: &QpAddr) -> Result<()> {
        Target::connect(self, peer)
    }
    fn prepare(&mut self, fault: Fault, bytes: usize) -> Result<Window> {
        Target::prepare(self, fault, bytes)
    }
    fn counters(&mut self) -> Result<TargetCounters> {
        Ok(Target::counters(self))
    }
    fn device(&mut self, depth: usize, reads: usize) -> Result<Option<DeviceInfo>> {
        Ok(Target::device(self, depth, reads))
    }
}

/// A target in another process, driven over TCP.
pub struct RemoteTarget {
    rd: BufReader<TcpStream>,
    wr: TcpStream,
    qp: QpAddr,
}

pub(crate) fn send<T: Serialize>(w: &mut TcpStream, m: &T) -> Result<()> {
    let mut s = serde_json::to_string(m)?;
    s.push('\n');
    w.write_all(s.as_bytes())?;
    Ok(())
}

pub(crate) fn recv<T: for<'a> Deserialize<'a>>(r: &mut BufReader<TcpStream>) -> Result<T> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(CliError::Peer("connection closed".into()));
    }
    Ok(serde_json::from_str(&line)?)
}

impl RemoteTarget {
    /// Connect to a server at `host:port` and set up its target.
    pub fn connect(
        host: &str,
        port: u16,
        mode: Mode,
        data_len: usize,
        recv_len: usize,
    ) -> Result<RemoteTarget> {
        let mut last = None;
        let mut stream = None;
        // The server may still be starting: retry for up to 10 s.
        for _ in 0..100 {
            match TcpStream::connect((host, port)) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        let s = stream.ok_or_else(|| {
            CliError::Peer(format!("cannot connect to {host}:{port}: {:?}", last))
        })?;
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        s.set_nodelay(true)?;
        let mut wr = s.try_clone()?;
        let mut rd = BufReader::new(s);
        send(
            &mut wr,
            &Req::Hello {
                mode,
                data_len,
                recv_len,
            },
        )?;
        let qp = match recv(&mut rd)? {
            Resp::Qp { qp } => qp,
            Resp::Error { msg } => return Err(CliError::Peer(msg)),
            r => return Err(CliError::Peer(format!("unexpected answer {r:?}"))),
        };
        Ok(RemoteTarget { rd, wr, qp })
    }

    fn call(&mut self, req: &Req) -> Result<Resp> {
        send(&mut self.wr, req)?;
        match recv(&mut self.rd)? {
            Resp::Error { msg } => Err(CliError::Peer(msg)),
            r => Ok(r),
        }
    }
}

impl Drop for RemoteTarget {
    fn drop(&mut self) {
        let _ = send(&mut self.wr, &Req::Bye);
    }
}

impl TargetHandle for RemoteTarget {
    fn qp_addr(&mut self) -> Result<QpAddr> {
        Ok(self.qp.clone())
    }
    fn connect(&mut self, peer: &QpAddr) -> Result<()> {
        match self.call(&Req::Connect { peer: peer.clone() })? {
            Resp::Ok => Ok(()),
            r => Err(CliError::Peer(format!("unexpected answer {r:?}"))),
        }
    }
    fn prepare(&mut self, fault: Fault, bytes: usize) -> Result<Window> {
        match self.call(&Req::Prepare { fault, bytes })? {
            Resp::Window { w } => Ok(w),
            r => Err(CliError::Peer(format!("unexpected answer {r:?}"))),
        }
    }
    fn counters(&mut self) -> Result<TargetCounters> {
        match self.call(&Req::Counters)? {
            Resp::Counters { c } => Ok(c),
            r => Err(CliError::Peer(format!("unexpected answer {r:?}"))),
        }
    }
    fn device(&mut self, depth: usize, reads: usize) -> Result<Option<DeviceInfo>> {
        match self.call(&Req::Device { depth, reads })? {
            Resp::Device { d } => Ok(d),
            r => Err(CliError::Peer(format!("unexpected answer {r:?}"))),
        }
    }
}

/// Serve one client session on `listener` (the `--server` side / the spawned peer):
/// build the target the client asks for, then answer until it says goodbye.
pub fn serve_one(listener: &TcpListener) -> Result<()> {
    let (s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut wr = s.try_clone()?;
    let mut rd = BufReader::new(s);
    let mut target: Option<Target> = None;
    loop {
        let req: Req = match recv(&mut rd) {
            Ok(r) => r,
            Err(CliError::Peer(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let resp = match (req, target.as_mut()) {
            (Req::Bye, _) => return Ok(()),
            (
                Req::Hello {
                    mode,
                    data_len,
                    recv_len,
                },
                _,
            ) => match Target::new(mode, data_len, recv_len) {
                Ok(t) => {
                    let qp = t.qp_addr();
                    target = Some(t);
                    Resp::Qp { qp }
                }
                Err(e) => Resp::Error { msg: e.to_string() },
            },
            (_, None) => Resp::Error {
                msg: "hello first".into(),
            },
            (Req::Connect { peer }, Some(t)) => match t.connect(&peer) {
                Ok(()) => Resp::Ok,
                Err(e) => Resp::Error { msg: e.to_string() },
            },
            (Req::Prepare { fault, bytes }, Some(t)) => match t.prepare(fault, bytes) {
                Ok(w) => Resp::Window { w },
                Err(e) => Resp::Error { msg: e.to_string() },
            },
            (Req::Counters, Some(t)) => Resp::Counters {
                c: Target::counters(t),
            },
            (Req::Device { depth, reads }, Some(t)) => Resp::Device {
                d: Target::device(t, depth, reads),
            },
        };
        send(&mut wr, &resp)?;
    }
}
