//! Unit tests of the engine's two-sided paths, its control-message handlers
//! (`serve`), the exit of operations (`retire`) and replay, driven the way smoltcp
//! drives its TCP socket: one engine QP faces a hand-driven peer — a bare
//! pair of QPs on another NIC, written against the `nic` traits — that sends
//! hand-made control messages and reads what the engine answers. No second
//! engine is involved, so every message on the wire is the test's or the
//! engine's. Every test runs twice: over the software RNIC (`over_rnic`)
//! and over the fake NIC with IOMMU control (`over_fake`).

use std::borrow::Cow;
use std::time::{Duration, Instant};

use super::qp::CTRL_QPN_BIT;
use super::{
    Access, Backend, Completion, Config, Context, Cq, Endpoint, Mr, Opcode, Pd, Qp, RecvWr, SendWr,
};
use crate::adapt::RnicNic;
use crate::cmdq::{self, Reassembler};
use crate::ctrl::{
    AtomicKind, AtomicRequest, CtrlConfig, FaultKind, FaultRequest, Repr, Status, SLOT,
};
use crate::nic::{
    CompOp, Nic, NicBuf, NicCq, NicMr, NicQp, PeerAddr, QpSpec, RecvRequest, Sge, WcStatus,
    WorkRequest, WrOp,
};
use crate::testutil::FakeNic;

/// Command slots the peer keeps posted for the engine's messages.
const PEER_SLOTS: u32 = 64;
/// `wr_id` of the peer's slot receives (`+ slot`); its sends use 0.
const RECV_BASE: u64 = 1 << 32;
const WAIT: Duration = Duration::from_secs(10);

/// A backend the tests run the engine on: two NICs that reach each other,
/// one for the engine's context and one for the hand-driven peer.
trait TestNic: Backend + Sized {
    fn pair() -> (Self, Self);
}

/// The software RNIC: two hosts of this process.
impl TestNic for RnicNic {
    fn pair() -> (Self, Self) {
        let host = |what| rnic::Host::new(rnic::HostConfig::default()).expect(what);
        (
            RnicNic::open(&host("host")).expect("nic"),
            RnicNic::open(&host("peer host")).expect("peer nic"),
        )
    }
}

/// The fake NIC with IOMMU control (verbs executed at post time).
impl TestNic for FakeNic {
    fn pair() -> (Self, Self) {
        FakeNic::pair_with_iommu()
    }
}

/// The SGE of inline payload `s` (copied at post time: no key).
fn inline_sge(s: &[u8]) -> [Sge; 1] {
    [Sge {
        addr: s.as_ptr() as u64,
        length: s.len() as u32,
        lkey: 0,
    }]
}

/// The hand-driven peer: a data QP (unused but connected, as the engine's
/// data QP needs a partner) and a control QP at the data QP's number with
/// [`CTRL_QPN_BIT`], receiving into a ring of command slots.
struct Peer<N: Nic> {
    data: N::Qp,
    ctrl: N::Qp,
    ring: N::Buf,
    cq: N::Cq,
    reasm: Reassembler,
    cfg: CtrlConfig,
    /// Dropped last (its QPs, CQ and buffers first).
    nic: N,
}

impl<N: Nic> Peer<N> {
    fn new(nic: N) -> Peer<N> {
        let cq = nic.create_cq(1024).expect("peer cq");
        let spec = |qpn| QpSpec {
            qpn,
            max_send_wr: 256,
            max_recv_wr: PEER_SLOTS,
            max_sge: 1,
            max_inline: SLOT as u32,
            domain: 0,
        };
        let data = nic.create_qp(&spec(None), &cq, &cq).expect("peer data qp");
        let ctrl = nic
            .create_qp(&spec(Some(data.qpn() | CTRL_QPN_BIT)), &cq, &cq)
            .expect("peer ctrl qp");
        let ring = nic
            .alloc_buf(PEER_SLOTS as usize * SLOT, Access::LOCAL_WRITE)
            .expect("peer ring");
        let cfg = CtrlConfig::default();
        Peer {
            data,
            ctrl,
            ring,
            cq,
            reasm: Reassembler::new(&cfg),
            cfg,
            nic,
        }
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            addr: self.nic.addr().0,
            qpn: self.data.qpn(),
            ctrl_qpn: 0,
        }
    }

    /// Connect to the engine QP at `ep` (the engine connects to
    /// [`Peer::endpoint`]).
    fn connect(&self, ep: &Endpoint) {
        let acc = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let dest = PeerAddr(ep.addr);
        self.data
            .connect(dest, ep.qpn, acc)
            .expect("peer data connect");
        self.ctrl
            .connect(dest, ep.qpn | CTRL_QPN_BIT, acc)
            .expect("peer ctrl connect");
        for s in 0..PEER_SLOTS {
            self.post_slot(s);
        }
    }

    fn post_slot(&self, s: u32) {
        let sge = self.ring.sge(s as usize * SLOT, SLOT as u32);
        self.ctrl
            .post_recv(&[RecvRequest {
                wr_id: RECV_BASE + u64::from(s),
                sg_list: &[sge],
            }])
            .expect("peer slot posted");
    }

    /// Send `msg` to the engine (one inline SEND per slot).
    fn send(&self, msg: &Repr<'_>) {
        let mut buf = vec![0; msg.buffer_len()];
        msg.emit(&mut buf, &self.cfg).expect("emit");
        let sges: Vec<[Sge; 1]> = cmdq::slots(&buf).map(inline_sge).collect();
        let wrs: Vec<WorkRequest<'_>> = sges
            .iter()
            .map(|s| WorkRequest::new(0, WrOp::Send, s).inline())
            .collect();
        self.ctrl.post_send(&wrs).expect("peer send");
    }

    /// The next control message from the engine, if one arrives in `t`.
    fn recv_within(&mut self, t: Duration) -> Option<Repr<'static>> {
        let t0 = Instant::now();
        let mut wc = [Completion::default(); 1];
        while t0.elapsed() < t {
            if self.cq.poll(&mut wc).expect("peer poll") == 0 {
                std::thread::yield_now();
                continue;
            }
            assert_eq!(wc[0].status, Completion::SUCCESS, "peer WR failed");
            let Some(s) = wc[0].wr_id.checked_sub(RECV_BASE) else {
                continue; // one of our own SENDs
            };
            let mut slot = [0u8; SLOT];
            self.ring.read(s as usize * SLOT, &mut slot);
            self.post_slot(s as u32);
            if let Some(b) = self.reasm.push(&slot).expect("control stream") {
                let msg = Repr::parse_bytes(b, &self.cfg).expect("engine message");
                return Some(msg.into_owned());
            }
        }
        None
    }

    /// The next control message from the engine (panics after [`WAIT`]).
    fn recv(&mut self) -> Repr<'static> {
        self.recv_within(WAIT).expect("no message from the engine")
    }

    /// The next control message that is not a [`Status::RnrWait`] refresh
    /// (one may still be on its way when a RECV is posted).
    fn answer(&mut self) -> Repr<'static> {
        loop {
            match self.recv() {
                Repr::Completion {
                    status: Status::RnrWait,
                    ..
                } => continue,
                m => return m,
            }
        }
    }
}

/// The engine under test: a context with one QP connected to a [`Peer`],
/// and one registered buffer.
struct Rig<N: TestNic> {
    ctx: Context<N>,
    _pd: Pd<N>,
    cq: Cq<N>,
    rcq: Cq<N>,
    qp: Qp<N>,
    mr: Mr<N>,
    region: vmem::Region,
    peer: Peer<N>,
    _pager: vmem::Pager,
}

const BUF: usize = 4 * 4096;

fn rig_with<N: TestNic>(cfg: Config) -> Rig<N> {
    let (nic, peer_nic) = N::pair();
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 16 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::with_nic(nic, &pager, cfg).expect("context");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(256).expect("cq");
    let rcq = ctx.create_cq(256).expect("rcq");
    let qp = pd.create_qp(&cq, &rcq, 16).expect("qp");
    let region = pager.alloc(BUF).expect("region");
    let acc =
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // SAFETY: private anonymous memory of the pager; the MR is dropped
    // before the region (field order of `Rig`).
    #[allow(unsafe_code)]
    let mr = unsafe { pd.reg_mr(region.addr() as u64, BUF as u64, acc) }.expect("reg_mr");
    let peer = Peer::new(peer_nic);
    qp.connect(&peer.endpoint()).expect("connect");
    peer.connect(&qp.endpoint());
    Rig {
        ctx,
        _pd: pd,
        cq,
        rcq,
        qp,
        mr,
        region,
        peer,
        _pager: pager,
    }
}

fn rig<N: TestNic>() -> Rig<N> {
    rig_with(Config::default())
}

impl<N: TestNic> Rig<N> {
    fn addr(&self, off: usize) -> u64 {
        self.region.addr() as u64 + off as u64
    }
    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.region.as_slice()[off..off + len].to_vec()
    }
    fn write(&mut self, off: usize, data: &[u8]) {
        self.region.as_mut_slice()[off..off + data.len()].copy_from_slice(data);
    }
    /// A signaled SEND of `len` bytes at `off`.
    fn send_wr(&self, wr_id: u64, off: usize, len: u32) -> SendWr {
        SendWr::new(
            wr_id,
            Opcode::Send,
            Some(self.mr.sge(off as u64, len)),
            0,
            0,
        )
    }
    fn wait(&self, cq: &Cq<N>, n: usize) -> Vec<Completion> {
        let v = cq.poll_wait(n, WAIT);
        assert_eq!(v.len(), n, "completions: {v:?}");
        v
    }
    /// A signaled FETCH_ADD of 1 at peer address `raddr` into `off`.
    fn fetch_add(&self, wr_id: u64, off: usize, raddr: u64) -> SendWr {
        SendWr::new(
            wr_id,
            Opcode::FetchAdd { add: 1 },
            Some(self.mr.sge(off as u64, 8)),
            raddr,
            77,
        )
    }
    /// The atomic request the peer receives next.
    fn peer_gets_atomic(&mut self) -> AtomicRequest {
        match self.peer.recv() {
            Repr::Atomic(a) => a,
            m => panic!("expected an atomic request, got {m:?}"),
        }
    }
    /// For `d`, the peer hears nothing but that its messages are still held
    /// for a RECV ([`Status::RnrWait`], at least once if `d` is long enough).
    fn peer_gets_only_rnr_waits(&mut self, d: Duration) {
        let t = std::time::Instant::now();
        let mut seen = 0;
        while let Some(m) = self.peer.recv_within(d.saturating_sub(t.elapsed())) {
            match m {
                Repr::Completion {
                    status: Status::RnrWait,
                    byte_len: 0,
                    ..
                } => seen += 1,
                m => panic!("expected only RnrWait, got {m:?}"),
            }
            if t.elapsed() >= d {
                break;
            }
        }
        assert!(
            d < Duration::from_millis(60) || seen > 0,
            "no RnrWait within {d:?}"
        );
    }

    /// The request id of the SEND the peer receives next (and its data).
    fn peer_gets_send(&mut self) -> (u32, Vec<u8>) {
        match self.peer.recv() {
            Repr::SendInline { req_id, data, .. } => (req_id, data.into_owned()),
            m => panic!("expected SendInline, got {m:?}"),
        }
    }
}

fn code(s: WcStatus) -> u32 {
    s.code()
}

// ---- serve: the target side of the peer's requests ----

fn inline_write_and_read_are_served_and_answered_once<N: TestNic>() {
    let mut r = rig::<N>();
    let (addr, rkey) = (r.addr(100), r.mr.rkey());
    r.peer.send(&Repr::WriteInline {
        req_id: 7,
        remote_addr: addr,
        rkey,
        want_lease: false,
        data: Cow::Borrowed(b"hello"),
    });
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 7,
            status: Status::Ok,
            byte_len: 5
        }
    );
    assert_eq!(r.bytes(100, 5), b"hello");
    r.peer.send(&Repr::ReadInline {
        req_id: 8,
        remote_addr: addr,
        rkey,
        want_lease: false,
        len: 5,
    });
    assert_eq!(
        r.peer.recv(),
        Repr::ReadInlineResp {
            req_id: 8,
            status: Status::Ok,
            data: Cow::Owned(b"hello".to_vec())
        }
    );
    // A never-touched page reads as zeroes (the answer-first path).
    r.peer.send(&Repr::ReadInline {
        req_id: 9,
        remote_addr: r.addr(3 * 4096 + 8),
        rkey,
        want_lease: false,
        len: 16,
    });
    assert_eq!(
        r.peer.recv(),
        Repr::ReadInlineResp {
            req_id: 9,
            status: Status::Ok,
            data: Cow::Owned(vec![0; 16])
        }
    );
    assert_eq!(r.ctx.stats().served, 3);
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
}

fn requests_outside_an_mr_or_its_rights_are_refused_not_served<N: TestNic>() {
    let mut r = rig::<N>();
    let rkey = r.mr.rkey();
    r.peer.send(&Repr::WriteInline {
        req_id: 1,
        remote_addr: r.addr(0),
        rkey: rkey ^ 0x5a5a_0000,
        want_lease: false,
        data: Cow::Borrowed(b"xx"),
    });
    match r.peer.recv() {
        Repr::Completion { req_id, status, .. } => {
            assert_eq!((req_id, status), (1, Status::RemoteAccess))
        }
        m => panic!("{m:?}"),
    }
    r.peer.send(&Repr::ReadInline {
        req_id: 2,
        remote_addr: r.addr(BUF - 4),
        rkey,
        want_lease: false,
        len: 8,
    });
    match r.peer.recv() {
        Repr::ReadInlineResp {
            req_id,
            status,
            data,
        } => {
            assert_eq!((req_id, status), (2, Status::RemoteAccess));
            assert!(data.is_empty());
        }
        m => panic!("{m:?}"),
    }
    // The QP's own access flags: REMOTE_WRITE revoked → REM_INV_REQ.
    r.qp.set_remote_access(Access::REMOTE_READ).expect("access");
    r.peer.send(&Repr::WriteInline {
        req_id: 3,
        remote_addr: r.addr(0),
        rkey,
        want_lease: false,
        data: Cow::Borrowed(b"yy"),
    });
    match r.peer.recv() {
        Repr::Completion { req_id, status, .. } => {
            assert_eq!((req_id, status), (3, Status::RemoteInvalid))
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(r.bytes(0, 2), [0, 0]);
}

fn atomics_are_applied_by_the_target_cpu<N: TestNic>() {
    let mut r = rig::<N>();
    r.write(64, &40u64.to_le_bytes());
    let a = |req_id, kind, off, compare_add, swap| {
        Repr::Atomic(AtomicRequest {
            req_id,
            kind,
            remote_addr: r.addr(off),
            rkey: r.mr.rkey(),
            compare_add,
            swap,
        })
    };
    let (fa, cs, bad) = (
        a(1, AtomicKind::FetchAdd, 64, 2, 0),
        a(2, AtomicKind::CmpSwap, 64, 42, 7),
        a(3, AtomicKind::FetchAdd, 65, 1, 0),
    );
    r.peer.send(&fa);
    assert_eq!(
        r.peer.recv(),
        Repr::AtomicResp {
            req_id: 1,
            status: Status::Ok,
            original: 40
        }
    );
    r.peer.send(&cs);
    assert_eq!(
        r.peer.recv(),
        Repr::AtomicResp {
            req_id: 2,
            status: Status::Ok,
            original: 42
        }
    );
    assert_eq!(r.bytes(64, 8), 7u64.to_le_bytes());
    r.peer.send(&bad);
    match r.peer.recv() {
        Repr::AtomicResp { req_id, status, .. } => {
            assert_eq!((req_id, status), (3, Status::RemoteInvalid))
        }
        m => panic!("{m:?}"),
    }
}

fn a_key_query_is_answered_with_the_key_table<N: TestNic>() {
    let mut r = rig::<N>();
    r.peer.send(&Repr::KeyQuery {
        req_id: 5,
        rkey: None,
    });
    match r.peer.recv() {
        Repr::KeySync {
            req_id,
            more,
            entries,
        } => {
            assert_eq!((req_id, more), (5, false));
            assert_eq!(entries.len(), 1);
            assert_eq!(entries[0].app_rkey, r.mr.rkey());
            assert_eq!(entries[0].region_va, r.addr(0));
        }
        m => panic!("{m:?}"),
    }
}

fn inbound_sends_wait_for_a_recv_and_are_checked_against_it<N: TestNic>() {
    let mut r = rig::<N>();
    r.peer.send(&Repr::SendInline {
        req_id: 11,
        imm: Some(9),
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"payload"),
    });
    // No RECV posted: no completion, and no answer but that the message is
    // still held (its rnr_retry is 7).
    r.peer_gets_only_rnr_waits(Duration::from_millis(80));
    assert!(r.rcq.poll(&mut [Completion::default(); 1]) == 0);
    let recv = |wr_id, off, len| RecvWr {
        wr_id,
        sge: Some(r.mr.sge(off, len)),
    };
    r.qp.post_recv(&[recv(100, 200, 64), recv(101, 300, 4)])
        .expect("recv");
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len, c.imm),
        (100, 0, CompOp::Recv, 7, Some(9))
    );
    assert_eq!(r.bytes(200, 7), b"payload");
    assert_eq!(
        r.peer.answer(),
        Repr::Completion {
            req_id: 11,
            status: Status::Ok,
            byte_len: 7
        }
    );
    // Longer than the next RECV: LOC_LEN_ERR here, REM_INV_REQ there.
    r.peer.send(&Repr::SendInline {
        req_id: 12,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"too long"),
    });
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!((c.wr_id, c.status), (101, code(WcStatus::LocLenErr)));
    match r.peer.answer() {
        Repr::Completion { req_id, status, .. } => {
            assert_eq!((req_id, status), (12, Status::RemoteInvalid))
        }
        m => panic!("{m:?}"),
    }
}

fn an_inbound_send_out_of_rnr_retries_fails_and_drops_what_follows<N: TestNic>() {
    let mut r = rig::<N>();
    let send = |req_id, rnr_retry| Repr::SendInline {
        req_id,
        imm: None,
        solicited: false,
        rnr_retry,
        data: Cow::Borrowed(b"x"),
    };
    // rnr_retry 0 and no RECV: answered RNR at once (the sender's QP fails);
    // the message behind it, and one arriving later, are dropped.
    r.peer.send(&send(40, 0));
    r.peer.send(&send(41, 7));
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 40,
            status: Status::RnrNoRecv,
            byte_len: 0
        }
    );
    r.peer.send(&send(42, 7));
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
    r.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sge: Some(r.mr.sge(0, 8)),
    }])
    .expect("recv");
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
    assert!(r.rcq.poll(&mut [Completion::default(); 1]) == 0);
}

// ---- the initiator's two-sided path and the exit of its operations ----

fn two_sided_ops_complete_in_post_order_whatever_the_answer_order<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.post_send(&[r.fetch_add(1, 0, 0x1000), r.fetch_add(2, 8, 0x2000)])
        .expect("post");
    let a1 = r.peer_gets_atomic();
    let a2 = r.peer_gets_atomic();
    assert_eq!((a1.remote_addr, a2.remote_addr), (0x1000, 0x2000));
    r.peer.send(&Repr::AtomicResp {
        req_id: a2.req_id,
        status: Status::Ok,
        original: 22,
    });
    // The second is done, but the first is not: nothing is delivered.
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.cq.poll(&mut [Completion::default(); 2]), 0);
    assert_eq!(r.qp.outstanding(), 1);
    r.peer.send(&Repr::AtomicResp {
        req_id: a1.req_id,
        status: Status::Ok,
        original: 11,
    });
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter()
            .map(|c| (c.wr_id, c.status, c.op, c.byte_len))
            .collect::<Vec<_>>(),
        [(1, 0, CompOp::FetchAdd, 8), (2, 0, CompOp::FetchAdd, 8)]
    );
    assert_eq!(
        r.bytes(0, 16),
        [11u64.to_le_bytes(), 22u64.to_le_bytes()].concat()
    );
    assert_eq!(r.qp.outstanding(), 0);
    // An answer for no outstanding request is ignored.
    r.peer.send(&Repr::AtomicResp {
        req_id: a1.req_id,
        status: Status::Ok,
        original: 99,
    });
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.cq.poll(&mut [Completion::default(); 1]), 0);
    assert_eq!(r.bytes(0, 8), 11u64.to_le_bytes());
}

fn sends_are_issued_one_at_a_time_in_post_order<N: TestNic>() {
    let mut r = rig::<N>();
    r.write(0, b"first...second..");
    r.qp.post_send(&[r.send_wr(1, 0, 8), r.send_wr(2, 8, 8)])
        .expect("post");
    let (id1, d1) = r.peer_gets_send();
    assert_eq!(d1, b"first...");
    // The second waits for the first (the peer matches SENDs with RECVs
    // in order).
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
    r.peer.send(&Repr::Completion {
        req_id: id1,
        status: Status::Ok,
        byte_len: 8,
    });
    let (id2, d2) = r.peer_gets_send();
    assert_eq!(d2, b"second..");
    r.peer.send(&Repr::Completion {
        req_id: id2,
        status: Status::Ok,
        byte_len: 8,
    });
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter()
            .map(|c| (c.wr_id, c.status, c.op, c.byte_len))
            .collect::<Vec<_>>(),
        [(1, 0, CompOp::Send, 8), (2, 0, CompOp::Send, 8)]
    );
}

fn an_srq_feeds_its_qp_and_survives_the_qp_failing<N: TestNic>() {
    let mut r = rig::<N>();
    let srq = r._pd.create_srq(4).expect("srq");
    r.qp.attach_srq(&srq).expect("attach");
    // A message waits for a receive on the SRQ (none on the QP itself).
    r.peer.send(&Repr::SendInline {
        req_id: 31,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"one"),
    });
    r.peer_gets_only_rnr_waits(Duration::from_millis(80));
    match r.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sge: Some(r.mr.sge(700, 8)),
    }]) {
        Err((0, crate::engine::Error::Invalid(_))) => {}
        other => panic!("{other:?}"),
    }
    let recv = |wr_id, off| RecvWr {
        wr_id,
        sge: Some(r.mr.sge(off, 8)),
    };
    srq.post_recv(&[recv(70, 800), recv(71, 900), recv(72, 1000)])
        .expect("srq recv");
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.byte_len), (70, 0, 3));
    assert_eq!(r.bytes(800, 3), b"one");
    assert!(matches!(
        r.peer.answer(),
        Repr::Completion {
            req_id: 31,
            status: Status::Ok,
            ..
        }
    ));
    // The QP fails: the SRQ's receives are not its to flush.
    r.qp.set_error().expect("err");
    assert_eq!(r.rcq.poll(&mut [Completion::default(); 4]), 0);
    // Still holding its two: two more fill its depth of 4, a fifth does not fit.
    match srq.post_recv(&[recv(73, 1100), recv(74, 1200), recv(75, 1300)]) {
        Err((2, crate::engine::Error::QueueFull)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(srq.depth(), 4);
}

fn uc_drops_what_its_receive_cannot_take_and_answers_ok<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.set_unreliable().expect("uc");
    // No RECV posted: dropped at once (not held for one), answered as taken.
    r.peer.send(&Repr::SendInline {
        req_id: 21,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"lost"),
    });
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 21,
            status: Status::Ok,
            byte_len: 0
        }
    );
    r.qp.post_recv(&[RecvWr {
        wr_id: 60,
        sge: Some(r.mr.sge(600, 4)),
    }])
    .expect("recv");
    // Longer than the RECV: dropped, the RECV stays posted, the QP stays up.
    r.peer.send(&Repr::SendInline {
        req_id: 22,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"too long"),
    });
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 22,
            status: Status::Ok,
            byte_len: 0
        }
    );
    assert_eq!(r.rcq.poll(&mut [Completion::default(); 1]), 0);
    assert!(!r.qp.is_error());
    r.peer.send(&Repr::SendInline {
        req_id: 23,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Borrowed(b"fits"),
    });
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.byte_len), (60, 0, 4));
    assert_eq!(r.bytes(600, 4), b"fits");
}

fn uc_refuses_read_and_atomics_and_completes_refused_sends_as_sent<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.set_unreliable().expect("uc");
    match r.qp.post_send(&[r.fetch_add(1, 0, 0x1000)]) {
        Err((0, crate::engine::Error::Invalid(_))) => {}
        other => panic!("{other:?}"),
    }
    r.write(0, b"message.");
    r.qp.post_send(&[r.send_wr(2, 0, 8), r.send_wr(3, 0, 8)])
        .expect("post");
    let (id, _) = r.peer_gets_send();
    // The peer refused it: on UC the requester never hears of it.
    r.peer.send(&Repr::Completion {
        req_id: id,
        status: Status::RemoteInvalid,
        byte_len: 0,
    });
    let (id, _) = r.peer_gets_send();
    r.peer.send(&Repr::Completion {
        req_id: id,
        status: Status::Ok,
        byte_len: 8,
    });
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(2, 0), (3, 0)]
    );
    assert!(!r.qp.is_error());
}

fn a_failed_answer_moves_the_qp_to_err_and_flushes_what_follows<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.post_send(&[r.fetch_add(1, 0, 0x1000), r.fetch_add(2, 8, 0x2000)])
        .expect("post");
    let a1 = r.peer_gets_atomic();
    let a2 = r.peer_gets_atomic();
    r.qp.post_recv(&[RecvWr {
        wr_id: 50,
        sge: Some(r.mr.sge(512, 64)),
    }])
    .expect("recv");
    r.peer.send(&Repr::AtomicResp {
        req_id: a2.req_id,
        status: Status::Ok,
        original: 22,
    });
    r.peer.send(&Repr::AtomicResp {
        req_id: a1.req_id,
        status: Status::RemoteInvalid,
        original: 0,
    });
    let v = r.wait(&r.cq, 2);
    // The second succeeded at the peer, but on RC nothing behind a failed
    // WR completes successfully.
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, code(WcStatus::RemInvReqErr)),
            (2, code(WcStatus::WrFlushErr))
        ]
    );
    assert!(r.qp.is_error());
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!((c.wr_id, c.status), (50, code(WcStatus::WrFlushErr)));
    // Later posts are accepted and flushed.
    r.qp.post_send(&[r.send_wr(3, 0, 4)]).expect("post in ERR");
    let c = r.wait(&r.cq, 1)[0];
    assert_eq!((c.wr_id, c.status), (3, code(WcStatus::WrFlushErr)));
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
}

fn set_error_flushes_outstanding_sends_and_recvs_once_in_post_order<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.post_send(&[
        r.fetch_add(1, 0, 0x1000),
        r.fetch_add(2, 8, 0x2000),
        r.send_wr(3, 0, 4),
    ])
    .expect("post");
    r.peer_gets_atomic();
    r.peer_gets_atomic();
    r.qp.post_recv(&[
        RecvWr {
            wr_id: 60,
            sge: None,
        },
        RecvWr {
            wr_id: 61,
            sge: None,
        },
    ])
    .expect("recv");
    assert!(!r.qp.is_error());
    r.qp.set_error().expect("set_error");
    assert!(r.qp.is_error());
    r.qp.set_error().expect("idempotent");
    let v = r.wait(&r.cq, 3);
    assert!(v.iter().all(|c| c.status == code(WcStatus::WrFlushErr)));
    assert_eq!(v.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
    let v = r.wait(&r.rcq, 2);
    assert_eq!(v.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [60, 61]);
    assert_eq!(r.qp.outstanding(), 0);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.cq.poll(&mut [Completion::default(); 4]), 0);
}

fn an_unanswered_request_times_out_as_retry_exceeded<N: TestNic>() {
    let mut r = rig_with::<N>(Config {
        two_sided_timeout: Duration::from_millis(100),
        ..Config::default()
    });
    r.qp.post_send(&[r.fetch_add(1, 0, 0x1000), r.fetch_add(2, 8, 0x2000)])
        .expect("post");
    r.peer_gets_atomic();
    r.peer_gets_atomic();
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, code(WcStatus::RetryExcErr)),
            (2, code(WcStatus::WrFlushErr))
        ]
    );
}

fn an_atomic_goes_two_sided_and_its_answer_lands_in_the_local_buffer<N: TestNic>() {
    let mut r = rig::<N>();
    let wr = SendWr::new(
        9,
        Opcode::FetchAdd { add: 5 },
        Some(r.mr.sge(128, 8)),
        0x1000,
        77,
    );
    r.qp.post_send(&[wr]).expect("post");
    let req = match r.peer.recv() {
        Repr::Atomic(a) => a,
        m => panic!("expected an atomic request, got {m:?}"),
    };
    assert_eq!(
        (req.kind, req.remote_addr, req.rkey, req.compare_add),
        (AtomicKind::FetchAdd, 0x1000, 77, 5)
    );
    // An answer of the wrong kind for it is ignored.
    r.peer.send(&Repr::ReadInlineResp {
        req_id: req.req_id,
        status: Status::Ok,
        data: Cow::Borrowed(&[1; 8]),
    });
    r.peer.send(&Repr::AtomicResp {
        req_id: req.req_id,
        status: Status::Ok,
        original: 41,
    });
    let c = r.wait(&r.cq, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len),
        (9, 0, CompOp::FetchAdd, 8)
    );
    assert_eq!(r.bytes(128, 8), 41u64.to_le_bytes());
}

fn local_protection_errors_complete_without_reaching_the_peer<N: TestNic>() {
    let mut r = rig::<N>();
    let mut bad = r.send_wr(1, 0, 8);
    bad.sge = Some(crate::nic::Sge {
        addr: r.addr(0),
        length: 8,
        lkey: r.mr.lkey() ^ 0x100,
    });
    let oversize = r.send_wr(2, BUF - 4, 8);
    r.qp.post_send(&[bad, oversize]).expect("post");
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, code(WcStatus::LocProtErr)),
            (2, code(WcStatus::WrFlushErr))
        ]
    );
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
}

// ---- replay: a failed optimistic check replays what pipelined behind it ----

/// Memory of the hand-driven peer reachable one-sided: one MR (the
/// application's Read and Write MR at once) and its page-version table.
struct PeerMem<N: Nic> {
    mr: N::Buf,
    _versions: N::Buf,
    mapping: crate::ctrl::KeyMapping,
}

impl<N: Nic> PeerMem<N> {
    fn write(&self, off: usize, data: &[u8]) {
        crate::mem::write(self.mr.addr() + off as u64, data).expect("test memory is mapped");
    }
    fn to_vec(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mr.read(off, &mut v);
        v
    }
}

impl<N: Nic> Peer<N> {
    fn mem(&self, len: usize) -> PeerMem<N> {
        let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let mr = self.nic.alloc_buf(len, acc).expect("peer mr");
        let (_, pages) = crate::check::page_span(mr.addr(), len as u64, 4096).expect("span");
        let versions = self
            .nic
            .alloc_buf(pages as usize * 4, acc)
            .expect("peer versions");
        crate::mem::write(versions.addr(), &vec![1; pages as usize * 4])
            .expect("test memory is mapped");
        let mapping = crate::ctrl::KeyMapping {
            app_rkey: mr.rkey(),
            write_rkey: mr.rkey(),
            version_rkey: versions.rkey(),
            page_count: pages as u32,
            region_va: mr.addr(),
            region_len: len as u64,
            version_va: versions.addr(),
        };
        PeerMem {
            mr,
            _versions: versions,
            mapping,
        }
    }
}

fn a_failed_check_replays_the_write_that_pipelined_behind_it<N: TestNic>() {
    let mut r = rig::<N>();
    let pm = r.peer.mem(4 * 4096);
    // The READ's source holds the signature page's magic: its one-sided
    // result cannot be told from an absent page, the check fails.
    let magic = r.peer.nic.caps().magic;
    let words: Vec<u8> = (0..16).flat_map(|_| magic.to_le_bytes()).collect();
    pm.write(0, &words);
    let (base, rkey) = (pm.mr.addr(), pm.mr.rkey());
    // A: READ peer[0..64] into local[0..64]; B: WRITE local[0..64] to
    // peer[2048..]. B reads what A writes: it pipelines behind A's NIC WR.
    let a = SendWr::new(1, Opcode::Read, Some(r.mr.sge(0, 64)), base, rkey);
    let b = SendWr::new(2, Opcode::Write, Some(r.mr.sge(0, 64)), base + 2048, rkey);
    r.qp.post_send(&[a, b]).expect("post");
    match r.peer.recv() {
        Repr::KeyQuery { req_id, .. } => r.peer.send(&Repr::KeySync {
            req_id,
            more: false,
            entries: Cow::Owned(vec![pm.mapping]),
        }),
        m => panic!("expected a key query, got {m:?}"),
    }
    // A failed its check and went two-sided; the peer answers with the
    // page's real content.
    let real: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7) | 1).collect();
    match r.peer.recv() {
        Repr::ReadInline {
            req_id,
            remote_addr,
            len,
            ..
        } => {
            assert_eq!((remote_addr, len), (base, 64));
            r.peer.send(&Repr::ReadInlineResp {
                req_id,
                status: Status::Ok,
                data: Cow::Borrowed(&real),
            });
        }
        m => panic!("expected A two-sided, got {m:?}"),
    }
    let v = r.wait(&r.cq, 2);
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, 0), (2, 0)]
    );
    assert_eq!(r.bytes(0, 64), real);
    // B ran again after A: the peer holds A's real data, not the magic
    // words B's first (discarded) attempt carried.
    assert_eq!(pm.to_vec(2048, 64), real);
    let s = r.ctx.stats();
    assert!(s.replayed >= 1, "{s:?}");
    assert_eq!(s.two_sided, 1);
}

fn set_error_after_a_failed_answer_flushes_what_is_still_out_and_sends_nothing_more<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.post_send(&[
        r.fetch_add(1, 0, 0x1000),
        r.fetch_add(2, 8, 0x2000),
        r.send_wr(3, 0, 4),
    ])
    .expect("post");
    let a1 = r.peer_gets_atomic();
    r.peer_gets_atomic();
    // The first fails at the peer; the second is never answered.
    r.peer.send(&Repr::AtomicResp {
        req_id: a1.req_id,
        status: Status::RemoteInvalid,
        original: 0,
    });
    let c = r.wait(&r.cq, 1)[0];
    assert_eq!((c.wr_id, c.status), (1, code(WcStatus::RemInvReqErr)));
    assert!(r.qp.is_error());
    // The application moves the QP to ERR: what is still out completes now (not at
    // the two-sided timeout), and the SEND behind it never reaches the peer.
    let t = std::time::Instant::now();
    r.qp.set_error().expect("set_error");
    let v = r.wait(&r.cq, 2);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (2, code(WcStatus::WrFlushErr)),
            (3, code(WcStatus::WrFlushErr))
        ]
    );
    assert_eq!(r.qp.outstanding(), 0);
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
}

fn a_send_parked_behind_a_failed_send_is_flushed_not_sent<N: TestNic>() {
    let mut r = rig::<N>();
    r.write(0, b"first...second..");
    r.qp.post_send(&[r.send_wr(1, 0, 8), r.send_wr(2, 8, 8)])
        .expect("post");
    let (id1, _) = r.peer_gets_send();
    // The second waits for the first; the first fails at the peer.
    r.peer.send(&Repr::Completion {
        req_id: id1,
        status: Status::RemoteInvalid,
        byte_len: 0,
    });
    let v = r.wait(&r.cq, 2);
    assert_eq!(v[0].wr_id, 1);
    assert_ne!(v[0].status, code(WcStatus::Success));
    assert_eq!((v[1].wr_id, v[1].status), (2, code(WcStatus::WrFlushErr)));
    // Reported flushed, so never delivered: the peer sees no second SEND.
    assert_eq!(r.peer.recv_within(Duration::from_millis(100)), None);
}

// ---- the two-sided paths through reverse operations (NIC WRs between the hosts) ----

impl<N: Nic> Peer<N> {
    /// Post one signaled one-sided WR of `op` on the peer's data QP from
    /// `local` (address, length, key) to `raddr` under `rkey`, and wait for
    /// its completion; its status.
    fn one_sided(&self, op: WrOp, local: (u64, u32, u32), raddr: u64, rkey: u32) -> u32 {
        const ID: u64 = 0x5eed;
        let sge = [Sge {
            addr: local.0,
            length: local.1,
            lkey: local.2,
        }];
        self.data
            .post_send(&[WorkRequest::new(ID, op, &sge).remote(raddr, rkey)])
            .expect("peer one-sided post");
        let t0 = Instant::now();
        let mut wc = [Completion::default(); 1];
        while t0.elapsed() < WAIT {
            if self.cq.poll(&mut wc).expect("peer poll") == 1 {
                assert_eq!(
                    wc[0].wr_id, ID,
                    "only the peer's own WR completes meanwhile"
                );
                return wc[0].status;
            }
            std::thread::yield_now();
        }
        panic!("the peer's one-sided WR never completed");
    }
}

/// `n` bytes of a recognisable pattern.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn a_fault_read_is_served_by_a_reverse_write_into_the_initiator<N: TestNic>() {
    let mut r = rig::<N>();
    let pm = r.peer.mem(4 * 4096);
    let data = pattern(8192, 0x11);
    r.write(4096, &data);
    let f = FaultRequest {
        req_id: 21,
        kind: FaultKind::Read,
        local_addr: pm.mr.addr() + 100,
        local_key: pm.mr.rkey(),
        remote_addr: r.addr(4096),
        rkey: r.mr.rkey(),
        len: 8192,
        inline_ok: false,
        retry_mode: false,
        want_lease: false,
    };
    r.peer.send(&Repr::Fault(f));
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 21,
            status: Status::Ok,
            byte_len: 8192
        }
    );
    assert_eq!(pm.to_vec(100, 8192), data);
    // Outside the MR: refused by the target's CPU, nothing written.
    r.peer.send(&Repr::Fault(FaultRequest {
        req_id: 22,
        remote_addr: r.addr(BUF - 4096),
        ..f
    }));
    match r.peer.recv() {
        Repr::Completion { req_id, status, .. } => {
            assert_eq!((req_id, status), (22, Status::RemoteAccess))
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(r.ctx.stats().served, 2);
}

fn a_fault_write_is_served_by_a_reverse_read_from_the_initiator<N: TestNic>() {
    let mut r = rig::<N>();
    let pm = r.peer.mem(4 * 4096);
    let data = pattern(8192, 0x22);
    pm.write(0, &data);
    r.peer.send(&Repr::Fault(FaultRequest {
        req_id: 31,
        kind: FaultKind::Write,
        local_addr: pm.mr.addr(),
        local_key: pm.mr.rkey(),
        remote_addr: r.addr(2048),
        rkey: r.mr.rkey(),
        len: 8192,
        inline_ok: false,
        retry_mode: false,
        want_lease: false,
    }));
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 31,
            status: Status::Ok,
            byte_len: 8192
        }
    );
    assert_eq!(r.bytes(2048, 8192), data);
}

fn a_read_failing_its_check_goes_two_sided_through_a_fault_request<N: TestNic>() {
    let mut r = rig::<N>();
    let pm = r.peer.mem(4 * 4096);
    let magic = r.peer.nic.caps().magic;
    let words: Vec<u8> = (0..1024).flat_map(|_| magic.to_le_bytes()).collect();
    pm.write(0, &words);
    let (base, rkey) = (pm.mr.addr(), pm.mr.rkey());
    // Longer than the inline limit: the fault path, with a temporary MR
    // over the (pinned) local buffer for the target's reverse WRITE.
    let len = 2048u32;
    let wr = SendWr::new(1, Opcode::Read, Some(r.mr.sge(0, len)), base, rkey);
    r.qp.post_send(&[wr]).expect("post");
    match r.peer.recv() {
        Repr::KeyQuery { req_id, .. } => r.peer.send(&Repr::KeySync {
            req_id,
            more: false,
            entries: Cow::Owned(vec![pm.mapping]),
        }),
        m => panic!("expected a key query, got {m:?}"),
    }
    let real = pattern(len as usize, 0x33);
    match r.peer.recv() {
        Repr::Fault(f) => {
            assert_eq!(
                (f.kind, f.remote_addr, f.rkey, f.len),
                (FaultKind::Read, base, rkey, len)
            );
            // The target's CPU "faults the page in", then WRITEs it into
            // the initiator's buffer through the key it was given.
            pm.write(0, &real);
            let st = r.peer.one_sided(
                WrOp::Write,
                (base, len, pm.mr.lkey()),
                f.local_addr,
                f.local_key,
            );
            assert_eq!(st, Completion::SUCCESS, "reverse WRITE");
            r.peer.send(&Repr::Completion {
                req_id: f.req_id,
                status: Status::Ok,
                byte_len: len,
            });
        }
        m => panic!("expected a fault request, got {m:?}"),
    }
    let c = r.wait(&r.cq, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len),
        (1, 0, CompOp::Read, len)
    );
    assert_eq!(r.bytes(0, len as usize), real);
    assert_eq!(r.ctx.stats().two_sided, 1);
}

fn a_rendezvous_send_is_read_into_the_posted_recv<N: TestNic>() {
    let mut r = rig::<N>();
    let pm = r.peer.mem(2 * 4096);
    let data = pattern(3000, 0x44);
    pm.write(0, &data);
    r.qp.post_recv(&[RecvWr {
        wr_id: 70,
        sge: Some(r.mr.sge(4096, 4096)),
    }])
    .expect("recv");
    r.peer.send(&Repr::SendRendezvous {
        req_id: 41,
        addr: pm.mr.addr(),
        len: 3000,
        key: pm.mr.rkey(),
        imm: Some(5),
        solicited: false,
        rnr_retry: 7,
    });
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len, c.imm),
        (70, 0, CompOp::Recv, 3000, Some(5))
    );
    assert_eq!(r.bytes(4096, 3000), data);
    assert_eq!(
        r.peer.recv(),
        Repr::Completion {
            req_id: 41,
            status: Status::Ok,
            byte_len: 3000
        }
    );
}

fn destroying_a_qp_flushes_its_outstanding_ops_once<N: TestNic>() {
    let mut r = rig::<N>();
    r.qp.post_send(&[r.fetch_add(1, 0, 0x1000), r.send_wr(2, 8, 4)])
        .expect("post");
    r.peer_gets_atomic();
    let before = r.bytes(0, 8);
    let Rig { qp, cq, .. } = r;
    // The atomic is out (two-sided), the SEND parked behind it: both
    // complete once, flushed, in post order, when the QP goes.
    drop(qp);
    let v = cq.poll_wait(2, WAIT);
    assert_eq!(
        v.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, code(WcStatus::WrFlushErr)),
            (2, code(WcStatus::WrFlushErr))
        ]
    );
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(cq.poll(&mut [Completion::default(); 2]), 0);
    assert_eq!(r.region.as_slice()[..8], before[..]);
}

/// Each test above, once over each backend.
macro_rules! over_both_backends {
    ($($t:ident),* $(,)?) => {
        /// The tests over the software RNIC.
        mod over_rnic {
            $(#[test]
            fn $t() {
                super::$t::<super::RnicNic>();
            })*
        }
        /// The same tests over the fake NIC (with IOMMU control).
        mod over_fake {
            $(#[test]
            fn $t() {
                super::$t::<super::FakeNic>();
            })*
        }
    };
}

over_both_backends!(
    destroying_a_qp_flushes_its_outstanding_ops_once,
    a_fault_read_is_served_by_a_reverse_write_into_the_initiator,
    a_fault_write_is_served_by_a_reverse_read_from_the_initiator,
    a_read_failing_its_check_goes_two_sided_through_a_fault_request,
    a_rendezvous_send_is_read_into_the_posted_recv,
    inline_write_and_read_are_served_and_answered_once,
    requests_outside_an_mr_or_its_rights_are_refused_not_served,
    atomics_are_applied_by_the_target_cpu,
    a_key_query_is_answered_with_the_key_table,
    inbound_sends_wait_for_a_recv_and_are_checked_against_it,
    an_inbound_send_out_of_rnr_retries_fails_and_drops_what_follows,
    two_sided_ops_complete_in_post_order_whatever_the_answer_order,
    sends_are_issued_one_at_a_time_in_post_order,
    a_failed_answer_moves_the_qp_to_err_and_flushes_what_follows,
    uc_drops_what_its_receive_cannot_take_and_answers_ok,
    an_srq_feeds_its_qp_and_survives_the_qp_failing,
    uc_refuses_read_and_atomics_and_completes_refused_sends_as_sent,
    set_error_flushes_outstanding_sends_and_recvs_once_in_post_order,
    an_unanswered_request_times_out_as_retry_exceeded,
    an_atomic_goes_two_sided_and_its_answer_lands_in_the_local_buffer,
    local_protection_errors_complete_without_reaching_the_peer,
    a_failed_check_replays_the_write_that_pipelined_behind_it,
    set_error_after_a_failed_answer_flushes_what_is_still_out_and_sends_nothing_more,
    a_send_parked_behind_a_failed_send_is_flushed_not_sent,
);

/// Two engines, each on its own pager, over `na` and `nb`, with one QP each
/// (depth 16, on one CQ) connected to the other's.
struct TwoEngines<N: Backend> {
    pa: vmem::Pager,
    pb: vmem::Pager,
    a: Context<N>,
    b: Context<N>,
    da: Pd<N>,
    db: Pd<N>,
    ca: Cq<N>,
    cb: Cq<N>,
    qa: Qp<N>,
    qb: Qp<N>,
}

fn two_engines<N: Backend>(na: N, nb: N) -> TwoEngines<N> {
    let pager = |what| {
        vmem::Pager::new(vmem::PagerConfig {
            swap_size: 16 << 20,
            ..vmem::PagerConfig::default()
        })
        .expect(what)
    };
    let (pa, pb) = (pager("pager a"), pager("pager b"));
    let a = Context::with_nic(na, &pa, Config::default()).expect("context a");
    let b = Context::with_nic(nb, &pb, Config::default()).expect("context b");
    let (da, db) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (
        a.create_cq(64).expect("cq a"),
        b.create_cq(64).expect("cq b"),
    );
    let qa = da.create_qp(&ca, &ca, 16).expect("qp a");
    let qb = db.create_qp(&cb, &cb, 16).expect("qp b");
    qa.connect(&qb.endpoint()).expect("connect a");
    qb.connect(&qa.endpoint()).expect("connect b");
    TwoEngines {
        pa,
        pb,
        a,
        b,
        da,
        db,
        ca,
        cb,
        qa,
        qb,
    }
}

/// Post `w` on `qp` and wait for its successful completion on `cq`.
fn post_ok<N: Backend>(qp: &Qp<N>, cq: &Cq<N>, w: SendWr) {
    qp.post_send(&[w]).map_err(|(_, e)| e).expect("post");
    let v = cq.poll_wait(1, WAIT);
    assert_eq!((v.len(), v[0].status), (1, 0), "{v:?}");
}

/// WR `wr_id` of `op` from `local` to offset `off` of `remote`.
fn wr_to<N: Backend>(wr_id: u64, op: Opcode, local: Sge, remote: &Mr<N>, off: u64) -> SendWr {
    SendWr::new(wr_id, op, Some(local), remote.addr() + off, remote.rkey())
}

/// User-space mode (a NIC without IOMMU control: the fake NIC without it)
/// between two engines: READ, WRITE and an atomic, over memory never
/// touched and swapped out, all two-sided, none optimistic.
#[test]
fn user_space_mode_between_two_engines_over_the_fake_nic() {
    let (na, nb) = FakeNic::pair();
    assert!(na.iommu().is_none());
    let TwoEngines {
        pa,
        pb,
        a,
        b,
        da,
        db,
        ca,
        cb: _cb,
        qa,
        qb,
    } = two_engines(na, nb);
    let acc =
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let mut la = pa.alloc(BUF).expect("region a");
    let rb = pb.alloc(BUF).expect("region b");
    let data: Vec<u8> = (0..BUF).map(|i| (i % 251) as u8).collect();
    la.as_mut_slice().copy_from_slice(&data);
    // SAFETY: pager memory; the MRs are dropped before the regions.
    #[allow(unsafe_code)]
    let (ma, mb) = unsafe {
        (
            da.reg_mr(la.addr() as u64, BUF as u64, acc).expect("mr a"),
            db.reg_mr(rb.addr() as u64, BUF as u64, acc).expect("mr b"),
        )
    };
    let post = |w: SendWr| post_ok(&qa, &ca, w);
    // Large WRITE (reverse READ over MRs registered on the fly) into
    // untouched memory; small (inline) WRITE.
    post(wr_to(1, Opcode::Write, ma.sge(0, 8192), &mb, 0));
    post(wr_to(2, Opcode::Write, ma.sge(9000, 64), &mb, 9000));
    assert_eq!(rb.as_slice()[..8192], data[..8192]);
    assert_eq!(rb.as_slice()[9000..9064], data[9000..9064]);
    // READ back, the target swapped out.
    rb.swap_out().expect("swap out");
    post(wr_to(3, Opcode::Read, ma.sge(12288, 4096), &mb, 0));
    assert_eq!(la.as_slice()[12288..], data[..4096]);
    // An atomic on the target's CPU.
    rb.swap_out().expect("swap out");
    post(wr_to(
        4,
        Opcode::FetchAdd { add: 1 },
        ma.sge(10000, 8),
        &mb,
        0,
    ));
    assert_eq!(la.as_slice()[10000..10008], data[..8]);
    let old = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    assert_eq!(rb.as_slice()[..8], old.wrapping_add(1).to_le_bytes());
    let s = a.stats();
    assert_eq!(s.optimistic_ok, 0, "{s:?}");
    assert_eq!(s.two_sided, 4, "{s:?}");
    assert_eq!(b.stats().served, 4);
    drop((ma, mb, qa, qb));
}

/// Interoperability: a host in kernel-module mode (IOMMU control) and a
/// host in user-space mode speak the same control protocol. The IOMMU host
/// learns from the peer's key mapping (no Version MR) that nothing of it is
/// reachable one-sided and goes two-sided; the user-space host's requests
/// are served by the IOMMU host as any two-sided request.
#[test]
fn a_kernel_module_mode_host_and_a_user_space_host_interoperate() {
    let (na, nb) = FakeNic::pair_mixed();
    assert!(na.iommu().is_some() && nb.iommu().is_none());
    let TwoEngines {
        pa,
        pb,
        a,
        b,
        da,
        db,
        ca,
        cb,
        qa,
        qb,
    } = two_engines(na, nb);
    let acc =
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let data: Vec<u8> = (0..BUF).map(|i| (i % 253) as u8).collect();
    let mut ra = pa.alloc(BUF).expect("region a");
    let mut rb = pb.alloc(BUF).expect("region b");
    ra.as_mut_slice().copy_from_slice(&data);
    rb.as_mut_slice().copy_from_slice(&data);
    // SAFETY: pager memory; the MRs are dropped before the regions.
    #[allow(unsafe_code)]
    let (ma, mb) = unsafe {
        (
            da.reg_mr(ra.addr() as u64, BUF as u64, acc).expect("mr a"),
            db.reg_mr(rb.addr() as u64, BUF as u64, acc).expect("mr b"),
        )
    };
    // IOMMU host → user-space host: WRITE (large and inline), READ back.
    post_ok(
        &qa,
        &ca,
        wr_to(1, Opcode::Write, ma.sge(0, 8192), &mb, 8192),
    );
    post_ok(
        &qa,
        &ca,
        wr_to(2, Opcode::Write, ma.sge(100, 50), &mb, 16000),
    );
    post_ok(&qa, &ca, wr_to(3, Opcode::Read, ma.sge(8192, 4096), &mb, 0));
    assert!(rb.as_slice()[8192..16000] == data[..7808]);
    assert!(rb.as_slice()[16000..16050] == data[100..150]);
    assert_eq!(ra.as_slice()[8192..12288], data[..4096]);
    assert_eq!(
        a.stats().optimistic_ok,
        0,
        "nothing one-sided into user-space mode"
    );
    assert_eq!(a.stats().two_sided, 3);
    // User-space host → IOMMU host: WRITE, READ, atomic.
    ra.swap_out().expect("swap out");
    post_ok(
        &qb,
        &cb,
        wr_to(4, Opcode::Write, mb.sge(0, 4096), &ma, 4096),
    );
    post_ok(
        &qb,
        &cb,
        wr_to(5, Opcode::Read, mb.sge(12288, 4096), &ma, 4096),
    );
    post_ok(
        &qb,
        &cb,
        wr_to(6, Opcode::FetchAdd { add: 2 }, mb.sge(12288, 8), &ma, 0),
    );
    assert_eq!(ra.as_slice()[4096..8192], data[..4096]);
    assert_eq!(rb.as_slice()[12296..16384], data[8..4096]);
    assert_eq!(rb.as_slice()[12288..12296], data[..8]);
    let old = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    assert_eq!(ra.as_slice()[..8], old.wrapping_add(2).to_le_bytes());
    assert_eq!(b.stats().two_sided, 3);
    assert_eq!(a.stats().served, 3);
    drop((ma, mb, qa, qb));
}

/// A QP deeper than the device's QPs can carry is refused with a clear
/// error naming the limit (the fake NIC allows 1024 WRs per QP).
#[test]
fn a_qp_deeper_than_the_device_allows_is_refused() {
    let r = rig::<FakeNic>();
    let pd = r.ctx.alloc_pd();
    let e = pd
        .create_qp(&r.cq, &r.rcq, 1000)
        .err()
        .expect("depth 1000 needs 4016 WRs");
    assert!(e.to_string().contains("allows 1024"), "{e}");
    assert!(pd.create_qp(&r.cq, &r.rcq, 60).is_ok());
}
