//! The host's RoCEv2 engine: its receive socket and the thread that blocks on it
//! (packets in batches: responses to the requesters, requests to the responders, the
//! coalesced ACKs of each batch, the retransmission timers), the peers across the
//! network (a shadow of each peer's tables that the ordinary requester fills, see
//! `tx`), and the QPs' connections, made and ended by QP state changes through the
//! peer's [`Link`].

use crate::config::HostConfig;
use crate::error::{Error, Result};
use crate::hw::peer::{Link, LinkConn, Peer};
use crate::hw::segment::Segment;
use crate::nic::qp_ctx::HostQps;
use crate::nic::state::Nic;
use crate::sys;
use crate::verbs::{HostAddr, QpState};
use crate::wire::conn::{self, is_read_response, wire_nonce, Counters, Path};
use crate::wire::inject::{Faults, Injector};
use crate::wire::rx::RxConn;
use crate::wire::socket::{RxSocket, HEADROOM, ROCE_PORT};
use crate::wire::tx::{TxConn, TxParams};
use parking_lot::Mutex;
use roce::opcode::Op;
use roce::udp::UdpRepr;
use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// `HostAddr::fd` of a peer across the network (its `pid` is 0).
pub const WIRE_FD: u32 = u32::MAX;

/// The longest the receive thread blocks (it then looks at `stop`).
const MAX_BLOCK: Duration = Duration::from_millis(10);

struct PeerRec {
    local: [u8; 16],
    remote: [u8; 16],
    shadow: Arc<Segment>,
}

/// A host's RoCEv2 engine (see the module docs).
pub struct Wire {
    nic: Arc<Nic>,
    qps: Arc<HostQps>,
    pub counters: Counters,
    inject: Option<Arc<Mutex<Injector>>>,
    peers: Mutex<HashMap<u64, PeerRec>>,
    /// Requester and responder states by local QP number.
    tx: Mutex<HashMap<u32, (u64, TxConn)>>,
    rx: Mutex<HashMap<u32, RxConn>>,
    /// Each connected QP's path (shared by its two sides).
    paths: Mutex<HashMap<u32, Arc<Path>>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    me: Weak<Wire>,
}

/// The `Link` of one peer: the engine and the peer's nonce.
struct WireLink {
    wire: Weak<Wire>,
    nonce: u64,
}

impl Link for WireLink {
    fn doorbell(&self) {
        if let Some(w) = self.wire.upgrade() {
            w.transmit(Some(self.nonce));
        }
    }
    fn alive(&self) -> bool {
        self.wire.upgrade().is_some_and(|w| !w.stop.load(Ordering::Relaxed))
    }
    fn shadow_qp(&self, dest_qpn: u32, my_nonce: u64, my_qpn: u32) -> Option<u32> {
        let w = self.wire.upgrade()?;
        let shadow = w.peers.lock().get(&self.nonce)?.shadow.clone();
        shadow_qp(&shadow, dest_qpn, my_nonce, my_qpn)
    }
    fn connect(&self, c: &LinkConn) -> Result<()> {
        let w = self
            .wire
            .upgrade()
            .ok_or(Error::Unreachable("the RoCE engine stopped".into()))?;
        w.connect(self.nonce, c)
    }
    fn disconnect(&self, qpn: u32) {
        if let Some(w) = self.wire.upgrade() {
            w.disconnect(qpn);
        }
    }
}

/// The shadow record standing for the peer's QP `dest_qpn` (connected to our QP
/// `my_qpn`), made on first use.
fn shadow_qp(shadow: &Segment, dest_qpn: u32, my_nonce: u64, my_qpn: u32) -> Option<u32> {
    let i = shadow.find_qp(dest_qpn).or_else(|| {
        (0..shadow.p.max_qp).find(|&i| shadow.qp(i).is_some_and(|r| r.in_use.load(Ordering::Acquire) == 0))
    })?;
    let r = shadow.qp(i)?;
    r.qpn.store(dest_qpn, Ordering::Relaxed);
    r.state.store(QpState::Rts as u32, Ordering::Relaxed);
    r.peer_nonce.store(my_nonce, Ordering::Relaxed);
    r.peer_qpn.store(my_qpn, Ordering::Relaxed);
    r.in_use.store(1, Ordering::Release);
    Some(i)
}

impl Wire {
    /// Start the engine of `nic`: bind UDP port 4791 (`NPRDMA_ROCE_PORT` for tests
    /// that run several hosts in one network namespace) and start the receive thread.
    pub fn start(nic: Arc<Nic>, qps: Arc<HostQps>) -> Result<Arc<Wire>> {
        let port = std::env::var("NPRDMA_ROCE_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(ROCE_PORT);
        let sock = RxSocket::bind(port).map_err(|e| {
            Error::Io(format!(
                "RoCEv2: cannot bind UDP port {port}: {e} (one RoCE device per network namespace)"
            ))
        })?;
        let inject = Faults::from_env().map(|f| {
            tracing::warn!(?f, "RoCEv2 fault injector on (NPRDMA_WIRE_FAULTS)");
            Arc::new(Mutex::new(Injector::new(f)))
        });
        let w = Arc::new_cyclic(|me| Wire {
            nic,
            qps,
            counters: Counters::default(),
            inject,
            peers: Mutex::new(HashMap::new()),
            tx: Mutex::new(HashMap::new()),
            rx: Mutex::new(HashMap::new()),
            paths: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            me: me.clone(),
        });
        let t = w.clone();
        let j = std::thread::Builder::new()
            .name("rnic-roce".into())
            .spawn(move || t.run(sock))
            .map_err(|e| Error::Io(e.to_string()))?;
        *w.thread.lock() = Some(j);
        Ok(w)
    }

    /// Stop the receive thread (the host is going away).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(j) = self.thread.lock().take() {
            if j.thread().id() != std::thread::current().id() {
                let _ = j.join();
            }
        }
        for (_, (_, mut t)) in self.tx.lock().drain() {
            t.close();
        }
    }

    /// The address of the peer with GID `remote`, reached from our GID `local`.
    pub fn peer(&self, local: [u8; 16], remote: [u8; 16]) -> Result<HostAddr> {
        let nonce = wire_nonce(&local, &remote);
        let mut peers = self.peers.lock();
        if let std::collections::hash_map::Entry::Vacant(v) = peers.entry(nonce) {
            let mut cfg: HostConfig = self.nic.cfg.clone();
            cfg.dma_pool_size = 0;
            cfg.subnet = None;
            let shadow = Arc::new(Segment::create(&cfg, nonce)?);
            let link: Arc<dyn Link> = Arc::new(WireLink {
                wire: self.me.clone(),
                nonce,
            });
            let p = Arc::new(Peer::wire(shadow.clone(), link));
            self.nic.peers.lock().insert(nonce, p);
            v.insert(PeerRec { local, remote, shadow });
        }
        Ok(HostAddr {
            pid: 0,
            fd: WIRE_FD,
            nonce,
        })
    }

    fn connect(&self, nonce: u64, c: &LinkConn) -> Result<()> {
        let (local, remote, shadow) = {
            let p = self.peers.lock();
            let r = p.get(&nonce).ok_or(Error::Unreachable("unknown RoCE peer".into()))?;
            (r.local, r.remote, r.shadow.clone())
        };
        let path = {
            let mut paths = self.paths.lock();
            match paths.get(&c.qpn) {
                Some(p) if p.remote.ip().octets() == remote => p.clone(),
                _ => {
                    let p = Path::open(
                        Ipv6Addr::from(local),
                        Ipv6Addr::from(remote),
                        c.qpn,
                        c.mtu,
                        self.inject.clone(),
                    )
                    .map_err(|e| Error::Io(format!("RoCEv2 send socket: {e}")))?;
                    let p = Arc::new(p);
                    paths.insert(c.qpn, p.clone());
                    p
                }
            }
        };
        if !c.rts {
            let rx = RxConn::new(c.idx, remote, c.dest_qpn, nonce, path, c.rq_psn);
            self.rx.lock().insert(c.qpn, rx);
            return Ok(());
        }
        let tq = c.tq.ok_or(Error::InvalidArgument("no shadow QP"))?;
        let t = TxConn::new(
            TxParams {
                idx: c.idx,
                dest_qpn: c.dest_qpn,
                shadow,
                tq,
                path,
                sq_psn: c.sq_psn,
                timeout: c.timeout,
                retry_cnt: c.retry_cnt,
                max_rd_atomic: c.max_rd_atomic,
            },
            sys::now_ns(),
        );
        self.tx.lock().insert(c.qpn, (nonce, t));
        Ok(())
    }

    fn disconnect(&self, qpn: u32) {
        if let Some((_, mut t)) = self.tx.lock().remove(&qpn) {
            t.close();
        }
        self.rx.lock().remove(&qpn);
        self.paths.lock().remove(&qpn);
    }

    /// Send what requesters put in the shadow rings of peer `nonce` (every peer: None).
    fn transmit(&self, nonce: Option<u64>) {
        let now = sys::now_ns();
        let mut tx = self.tx.lock();
        for (n, t) in tx.values_mut() {
            if nonce.map_or(true, |x| x == *n) {
                t.transmit_new(&self.counters, now);
            }
        }
    }

    fn run(self: Arc<Wire>, mut sock: RxSocket) {
        let mut answered: Vec<u32> = Vec::new();
        while !self.stop.load(Ordering::Relaxed) && !self.nic.shutdown.load(Ordering::Relaxed) {
            let now = sys::now_ns();
            let wait = self
                .tx
                .lock()
                .values()
                .filter_map(|(_, t)| t.deadline())
                .min()
                .map_or(MAX_BLOCK, |d| {
                    Duration::from_nanos(d.saturating_sub(now)).min(MAX_BLOCK)
                });
            let got = match sock.recv(wait) {
                Ok(g) => g,
                Err(e) => {
                    tracing::error!("RoCEv2 receive: {e}");
                    std::thread::sleep(MAX_BLOCK);
                    continue;
                }
            };
            let now = sys::now_ns();
            Counters::add(&self.counters.rx_packets, got.len() as u64);
            for d in got.iter_mut() {
                // A bug met by one packet costs that packet, never the host's wire.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.packet(d, now, &mut answered)));
                if r.is_err() {
                    tracing::error!("RoCEv2: a packet's processing panicked; dropped");
                    Counters::add(&self.counters.bad_packets, 1);
                }
            }
            // One ACK per connection for what this batch brought in order.
            {
                let mut rx = self.rx.lock();
                for r in rx.values_mut().filter(|r| r.ack_due) {
                    let a = r.ack();
                    Counters::add(&self.counters.tx_packets, 1);
                    r.path.send(vec![a]);
                }
            }
            {
                let mut tx = self.tx.lock();
                for (q, (_, t)) in tx.iter_mut() {
                    if t.tick(&self.counters, now) {
                        answered.push(*q);
                    }
                }
            }
            self.wake(&mut answered);
        }
    }

    /// Let the QPs whose slots were answered take their completions, and send what
    /// the freed window lets go.
    fn wake(&self, answered: &mut Vec<u32>) {
        if answered.is_empty() {
            return;
        }
        answered.sort_unstable();
        answered.dedup();
        std::sync::atomic::fence(Ordering::SeqCst);
        for qpn in answered.drain(..) {
            let idx = self.tx.lock().get(&qpn).map(|(_, t)| t.idx);
            if let Some(q) = idx.and_then(|i| self.qps.get(i)) {
                q.progress();
            }
            if let Some((_, t)) = self.tx.lock().get_mut(&qpn) {
                t.transmit_new(&self.counters, sys::now_ns());
            }
        }
        self.nic.seg.kick_answer();
    }

    /// One received datagram.
    fn packet(&self, d: &mut crate::wire::socket::RxDatagram, now: u64, answered: &mut Vec<u32>) {
        let ip = conn::ip_repr(d.src.ip(), &d.dst);
        let udp = UdpRepr { src_port: d.src.port() };
        let hl = roce::packet::rebuilt_len(&ip);
        let start = HEADROOM - hl;
        if roce::packet::rebuild_headers(&mut d.buf[start..HEADROOM], &ip, &udp, d.len).is_err() {
            Counters::add(&self.counters.bad_packets, 1);
            return;
        }
        let pkt = &d.buf[start..HEADROOM + d.len];
        let (repr, range) = match roce::packet::parse_rebuilt(pkt, ip, udp) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!("RoCEv2 packet dropped: {e}");
                Counters::add(&self.counters.bad_packets, 1);
                return;
            }
        };
        if repr.bth.opcode.transport() != roce::opcode::Transport::Rc {
            // UD and UC are not carried across the network yet.
            Counters::add(&self.counters.stray_packets, 1);
            return;
        }
        let payload = &pkt[range];
        let src = d.src.ip().octets();
        let qpn = repr.bth.dest_qp;
        let op = repr.bth.opcode;
        let response = is_read_response(op) || op == conn::rc(Op::Acknowledge) || op == conn::rc(Op::AtomicAcknowledge);
        if response {
            let mut tx = self.tx.lock();
            match tx.get_mut(&qpn) {
                Some((_, t)) if t.path.remote.ip().octets() == src => {
                    if t.on_response(&repr, payload, &self.counters, now) {
                        answered.push(qpn);
                    }
                }
                _ => Counters::add(&self.counters.stray_packets, 1),
            }
            return;
        }
        let mut out = Vec::new();
        let path = {
            let mut rx = self.rx.lock();
            match rx.get_mut(&qpn) {
                Some(r) if r.peer == src => {
                    r.on_request(&self.nic, &self.qps, &repr, payload, &self.counters, &mut out);
                    r.path.clone()
                }
                _ => {
                    Counters::add(&self.counters.stray_packets, 1);
                    return;
                }
            }
        };
        if !out.is_empty() {
            Counters::add(&self.counters.tx_packets, out.len() as u64);
            path.send(out);
        }
    }
}
