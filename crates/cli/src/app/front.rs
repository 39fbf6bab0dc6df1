//! The front-end side of an application run: one connection per front-end
//! thread (its own host, QP and local buffer, in the design's verbs: rnic for
//! pinned and copy-through, NP-RDMA for nprdma) with blocking one-sided
//! READ/WRITE and the copy-through RPC, and the handle on the back-end process
//! (spawned, or a `--server` reached with `--client`).

use std::io::BufReader;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::app::proto::{BackendStats, Design, PoolSpec, Ready, Req, Resp};
use crate::error::{CliError, Result};
use crate::mem::PinnedBuf;
use crate::runner::{spawn_peer, PeerProcess};
use crate::setup::{new_pager, np_access, rnic_access, rnic_qp, QpAddr, RnicQp, RunQp, Side};
use crate::wire::{recv, send};

/// A completion that takes longer than this fails the run (the back-end is
/// presumed gone).
pub const OP_TIMEOUT: Duration = Duration::from_secs(15);

enum Kind {
    Rnic {
        qp: rnic::Qp,
        scq: rnic::Cq,
        rcq: rnic::Cq,
        mr: rnic::Mr,
        buf: PinnedBuf,
        _pd: rnic::Pd,
        _ctx: rnic::Context,
    },
    Np {
        qp: nprdma::Qp,
        cq: nprdma::Cq,
        _rcq: nprdma::Cq,
        mr: nprdma::Mr,
        region: vmem::Region,
        _pd: nprdma::Pd,
        _ctx: nprdma::Context,
        _pager: vmem::Pager,
    },
}

/// One front-end thread's connection to the back-end.
pub struct Conn {
    kind: Kind,
    host: rnic::Host,
    wr_id: u64,
}

/// What a failed completion means to the user.
fn gone(what: &str, status: impl std::fmt::Debug) -> CliError {
    CliError::Completion(format!(
        "{what} failed with {status:?}: the back-end is gone or refused the access; the front-end stops"
    ))
}

impl Conn {
    /// A connection with a `buf_len`-byte local buffer (resident).
    pub fn new(design: Design, buf_len: usize) -> Result<Conn> {
        let host = rnic::Host::new(crate::trust::host_config())?;
        let kind = match design {
            // The ODP model concerns the back-end's pool; the front-end's own
            // buffer is pinned as in the other rnic designs.
            Design::Pinned | Design::CopyThrough | Design::Odp => {
                let RnicQp {
                    qp,
                    cq: scq,
                    rcq,
                    pd,
                    ctx,
                } = rnic_qp(&host, Side::Target)?;
                let buf = PinnedBuf::new(buf_len)?;
                // SAFETY: `buf` outlives `mr` (declared after it in `Kind::Rnic`).
                let mr = unsafe { pd.reg_mr(buf.addr(), buf.len(), rnic_access()) }?;
                Kind::Rnic {
                    qp,
                    scq,
                    rcq,
                    mr,
                    buf,
                    _pd: pd,
                    _ctx: ctx,
                }
            }
            Design::Nprdma => {
                let pager = new_pager()?;
                let ctx = nprdma::Context::new(&host, &pager, nprdma::Config::default())?;
                let pd = ctx.alloc_pd();
                let cq = ctx.create_cq(256)?;
                let rcq = ctx.create_cq(256)?;
                let qp = pd.create_qp(&cq, &rcq, 16)?;
                let mut region = pager.alloc(buf_len)?;
                region.as_mut_slice().fill(0);
                // SAFETY: private anonymous pager memory owned by `Kind::Np`,
                // whose `mr` is declared (so dropped) before `region`.
                #[allow(unsafe_code)]
                let mr = unsafe { pd.reg_mr(region.addr() as u64, buf_len as u64, np_access()) }?;
                Kind::Np {
                    qp,
                    cq,
                    _rcq: rcq,
                    mr,
                    region,
                    _pd: pd,
                    _ctx: ctx,
                    _pager: pager,
                }
            }
        };
        Ok(Conn {
            kind,
            host,
            wr_id: 0,
        })
    }

    fn run_qp(&self) -> RunQp<'_> {
        match &self.kind {
            Kind::Rnic { qp, .. } => RunQp::Rnic(qp),
            Kind::Np { qp, .. } => RunQp::Np(qp),
        }
    }

    pub fn addr(&self) -> QpAddr {
        self.run_qp().addr(&self.host)
    }

    pub fn connect(&self, peer: &QpAddr) -> Result<()> {
        self.run_qp().connect(peer)
    }

    /// The local buffer.
    pub fn buf(&mut self) -> &mut [u8] {
        match &mut self.kind {
            Kind::Rnic { buf, .. } => buf.as_mut_slice(),
            Kind::Np { region, .. } => region.as_mut_slice(),
        }
    }

    /// One signaled one-sided READ (`write` false) into, or WRITE from, local
    /// `[loff, loff+len)`, waited for.
    pub fn one_sided(
        &mut self,
        write: bool,
        loff: usize,
        len: usize,
        raddr: u64,
        rkey: u32,
    ) -> Result<()> {
        self.wr_id += 1;
        let id = self.wr_id;
        let what = if write { "WRITE" } else { "READ" };
        match &self.kind {
            Kind::Rnic { qp, scq, mr, .. } => {
                let sge = [mr.sge(loff, len as u32)];
                let op = if write {
                    rnic::WrOpcode::Write
                } else {
                    rnic::WrOpcode::Read
                };
                let wr = rnic::SendWr::new(id, op, &sge)
                    .flags(rnic::SendFlags::SIGNALED)
                    .remote(raddr, rkey);
                qp.post_send(&[wr]).map_err(|e| CliError::Nic(e.err))?;
                wait_rnic(scq, 1, what)
            }
            Kind::Np { qp, cq, mr, .. } => {
                let op = if write {
                    nprdma::Opcode::Write
                } else {
                    nprdma::Opcode::Read
                };
                let wr =
                    nprdma::SendWr::new(id, op, Some(mr.sge(loff as u64, len as u32)), raddr, rkey);
                qp.post_send(&[wr]).map_err(|(_, e)| CliError::Np(e))?;
                wait_np(cq, 1, what)
            }
        }
    }

    /// The copy-through RPC: SEND local `[0, send_len)`, receive the reply into
    /// `[recv_off, recv_off+recv_len)`; returns the reply's length.
    pub fn rpc(&mut self, send_len: usize, recv_off: usize, recv_len: usize) -> Result<usize> {
        self.wr_id += 1;
        let id = self.wr_id;
        match &self.kind {
            Kind::Rnic {
                qp, scq, rcq, mr, ..
            } => {
                let rsge = [mr.sge(recv_off, recv_len as u32)];
                qp.post_recv(&[rnic::RecvWr {
                    wr_id: id,
                    sg_list: &rsge,
                }])
                .map_err(|e| CliError::Nic(e.err))?;
                let sge = [mr.sge(0, send_len as u32)];
                let wr = rnic::SendWr::new(id, rnic::WrOpcode::Send, &sge)
                    .flags(rnic::SendFlags::SIGNALED);
                qp.post_send(&[wr]).map_err(|e| CliError::Nic(e.err))?;
                wait_rnic(scq, 1, "request SEND")?;
                let deadline = Instant::now() + OP_TIMEOUT;
                let mut wc = [rnic::Wc::default(); 1];
                loop {
                    if rcq.poll(&mut wc)? == 1 {
                        if wc[0].status != rnic::WcStatus::Success {
                            return Err(gone("reply RECV", wc[0].status));
                        }
                        return Ok(wc[0].byte_len as usize);
                    }
                    if Instant::now() > deadline {
                        return Err(CliError::Timeout(format!(
                            "no copy-through reply within {OP_TIMEOUT:?}: the back-end is gone or stuck"
                        )));
                    }
                    std::hint::spin_loop();
                }
            }
            Kind::Np { .. } => Err(CliError::Arg(
                "the copy-through RPC runs on pinned buffers (rnic verbs)".into(),
            )),
        }
    }
}

fn wait_rnic(cq: &rnic::Cq, n: usize, what: &str) -> Result<()> {
    let deadline = Instant::now() + OP_TIMEOUT;
    let mut wc = [rnic::Wc::default(); 4];
    let mut got = 0;
    while got < n {
        let k = cq.poll(&mut wc)?;
        for w in &wc[..k] {
            if w.status != rnic::WcStatus::Success {
                return Err(gone(what, w.status));
            }
        }
        got += k;
        if k == 0 {
            if Instant::now() > deadline {
                return Err(CliError::Timeout(format!(
                    "{what}: no completion within {OP_TIMEOUT:?}: the back-end is gone or stuck"
                )));
            }
            std::hint::spin_loop();
        }
    }
    Ok(())
}

fn wait_np(cq: &nprdma::Cq, n: usize, what: &str) -> Result<()> {
    let deadline = Instant::now() + OP_TIMEOUT;
    let mut wc = [nprdma::Completion::default(); 4];
    let mut got = 0;
    while got < n {
        let k = cq.poll(&mut wc);
        for w in &wc[..k] {
            if !w.is_ok() {
                return Err(gone(what, nprdma::nic::WcStatus::from_code(w.status)));
            }
        }
        got += k;
        if k == 0 {
            if Instant::now() > deadline {
                return Err(CliError::Timeout(format!(
                    "{what}: no completion within {OP_TIMEOUT:?}: the back-end is gone or stuck"
                )));
            }
            std::hint::spin_loop();
        }
    }
    Ok(())
}

/// The back-end process, driven over its TCP connection.
pub struct Remote {
    rd: BufReader<TcpStream>,
    wr: TcpStream,
    pub ready: Ready,
    _peer: Option<PeerProcess>,
}

impl Remote {
    /// Start a back-end for `spec`: a spawned `nprdma app-peer`, or the server
    /// at `client` = (host, port).
    pub fn open(spec: &PoolSpec, client: Option<(&str, u16)>) -> Result<Remote> {
        spec.validate()?;
        let (peer, host, port) = match client {
            Some((h, p)) => (None, h.to_string(), p),
            None => {
                let (child, port) = spawn_peer("app-peer")?;
                (Some(PeerProcess(child)), "127.0.0.1".to_string(), port)
            }
        };
        let mut last = None;
        let mut stream = None;
        for _ in 0..100 {
            match TcpStream::connect((host.as_str(), port)) {
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
            CliError::Peer(format!(
                "cannot connect to the back-end at {host}:{port}: {last:?}"
            ))
        })?;
        // Building a large pool (fill through the swap device) takes a while.
        s.set_read_timeout(Some(Duration::from_secs(600)))?;
        s.set_nodelay(true)?;
        let wr = s.try_clone()?;
        let mut r = Remote {
            rd: BufReader::new(s),
            wr,
            ready: Ready {
                qps: Vec::new(),
                base: 0,
                rkey: 0,
                init_us: 0.0,
                fill_us: 0.0,
            },
            _peer: peer,
        };
        match r.call(&Req::Hello { spec: *spec })? {
            Resp::Ready { r: ready } => r.ready = ready,
            x => return Err(CliError::Peer(format!("unexpected answer {x:?}"))),
        }
        Ok(r)
    }

    fn call(&mut self, req: &Req) -> Result<Resp> {
        send(&mut self.wr, req)?;
        match recv(&mut self.rd) {
            Ok(Resp::Error { msg }) => Err(CliError::Peer(msg)),
            Ok(r) => Ok(r),
            Err(CliError::Peer(m)) => Err(CliError::Peer(format!("back-end: {m}"))),
            Err(e) => Err(e),
        }
    }

    fn ok(&mut self, req: &Req) -> Result<()> {
        match self.call(req)? {
            Resp::Ok => Ok(()),
            x => Err(CliError::Peer(format!("unexpected answer {x:?}"))),
        }
    }

    pub fn connect(&mut self, peers: Vec<QpAddr>) -> Result<()> {
        self.ok(&Req::Connect { peers })
    }

    pub fn mark(&mut self) -> Result<()> {
        self.ok(&Req::Mark)
    }

    pub fn stats(&mut self) -> Result<BackendStats> {
        match self.call(&Req::Stats)? {
            Resp::Stats { s } => Ok(s),
            x => Err(CliError::Peer(format!("unexpected answer {x:?}"))),
        }
    }

    /// The shuffle's map stage at the back-end (round `version`); its time (µs).
    pub fn map(
        &mut self,
        maps: usize,
        parts: usize,
        part_bytes: usize,
        version: u64,
    ) -> Result<f64> {
        match self.call(&Req::Map {
            maps,
            parts,
            part_bytes,
            version,
        })? {
            Resp::Mapped { us } => Ok(us),
            x => Err(CliError::Peer(format!("unexpected answer {x:?}"))),
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = send(&mut self.wr, &Req::Bye);
    }
}
