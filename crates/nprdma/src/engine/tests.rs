//! Unit tests of the engine's two-sided paths, its control-message handlers
//! (`serve`), the exit of operations (`retire`) and replay, driven the way smoltcp
//! drives its TCP socket: one engine QP faces a hand-driven peer — a bare
//! pair of software-NIC QPs on another host — that sends hand-made control
//! messages and reads what the engine answers. No second engine is
//! involved, so every message on the wire is the test's or the engine's.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use super::qp::CTRL_QPN_BIT;
use super::{
    Access, Completion, Config, Context, Cq, Endpoint, Mr, Opcode, Pd, Qp, RecvWr, SendWr,
};
use crate::cmdq::{self, Reassembler};
use crate::ctrl::{AtomicKind, AtomicRequest, CtrlConfig, Repr, Status, SLOT};
use crate::nic::{CompOp, WcStatus};

/// Command slots the peer keeps posted for the engine's messages.
const PEER_SLOTS: u32 = 64;
/// `wr_id` of the peer's slot receives (`+ slot`); its sends use 0.
const RECV_BASE: u64 = 1 << 32;
const WAIT: Duration = Duration::from_secs(10);

/// The hand-driven peer: a data QP (unused but connected, as the engine's
/// data QP needs a partner) and a control QP at the data QP's number with
/// [`CTRL_QPN_BIT`], receiving into a ring of command slots.
struct Peer {
    host: rnic::Host,
    _ctx: rnic::Context,
    pd: rnic::Pd,
    cq: rnic::Cq,
    data: rnic::Qp,
    ctrl: rnic::Qp,
    ring: rnic::OwnedMr,
    reasm: Reassembler,
    cfg: CtrlConfig,
}

impl Peer {
    fn new() -> Peer {
        let host = rnic::Host::new(rnic::HostConfig::default()).expect("peer host");
        let ctx = host.open_context().expect("peer context");
        let pd = ctx.alloc_pd().expect("peer pd");
        let cq = ctx.create_cq(1024, None).expect("peer cq");
        let attr = |qpn| rnic::QpInitAttr {
            qpn,
            max_send_wr: 256,
            max_recv_wr: PEER_SLOTS,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: SLOT as u32,
            sq_sig_all: false,
        };
        let data = pd.create_qp(&cq, &cq, &attr(None)).expect("peer data qp");
        let ctrl = pd
            .create_qp(&cq, &cq, &attr(Some(data.qpn() | CTRL_QPN_BIT)))
            .expect("peer ctrl qp");
        let ring = pd
            .reg_mr_owned(
                vec![0; PEER_SLOTS as usize * SLOT],
                rnic::Access::LOCAL_WRITE,
            )
            .expect("peer ring");
        let cfg = CtrlConfig::default();
        Peer {
            host,
            _ctx: ctx,
            pd,
            cq,
            data,
            ctrl,
            ring,
            reasm: Reassembler::new(&cfg),
            cfg,
        }
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            addr: self.host.addr().to_bytes(),
            qpn: self.data.qpn(),
        }
    }

    /// Connect to the engine QP at `ep` (the engine connects to
    /// [`Peer::endpoint`]).
    fn connect(&self, ep: &Endpoint) {
        let acc = rnic::Access::LOCAL_WRITE
            | rnic::Access::REMOTE_READ
            | rnic::Access::REMOTE_WRITE
            | rnic::Access::REMOTE_ATOMIC;
        let dest = rnic::HostAddr::from_bytes(&ep.addr);
        self.data
            .connect(acc, dest, ep.qpn, 7)
            .expect("peer data connect");
        self.ctrl
            .connect(acc, dest, ep.qpn | CTRL_QPN_BIT, 7)
            .expect("peer ctrl connect");
        for s in 0..PEER_SLOTS {
            self.post_slot(s);
        }
    }

    fn post_slot(&self, s: u32) {
        let sge = self.ring.sge(s as usize * SLOT, SLOT as u32);
        self.ctrl
            .post_recv(&[rnic::RecvWr {
                wr_id: RECV_BASE + u64::from(s),
                sg_list: &[sge],
            }])
            .expect("peer slot posted");
    }

    /// Send `msg` to the engine (one inline SEND per slot).
    fn send(&self, msg: &Repr<'_>) {
        let mut buf = vec![0; msg.buffer_len()];
        msg.emit(&mut buf, &self.cfg).expect("emit");
        let wrs: Vec<rnic::SendWr> = cmdq::slots(&buf)
            .map(|s| rnic::SendWr::new(0, rnic::WrOpcode::Send, &[]).inline(s))
            .collect();
        self.ctrl.post_send(&wrs).expect("peer send");
    }

    /// The next control message from the engine, if one arrives in `t`.
    fn recv_within(&mut self, t: Duration) -> Option<Repr<'static>> {
        let t0 = Instant::now();
        let mut wc = [rnic::Wc::default(); 1];
        while t0.elapsed() < t {
            if self.cq.poll(&mut wc).expect("peer poll") == 0 {
                std::thread::yield_now();
                continue;
            }
            assert_eq!(wc[0].status, rnic::WcStatus::Success, "peer WR failed");
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
}

/// The engine under test: a context with one QP connected to a [`Peer`],
/// and one registered buffer.
struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    rcq: Cq,
    qp: Qp,
    mr: Mr,
    region: vmem::Region,
    peer: Peer,
    _pager: vmem::Pager,
}

const BUF: usize = 4 * 4096;

fn rig_with(cfg: Config) -> Rig {
    let host = rnic::Host::new(rnic::HostConfig::default()).expect("host");
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 16 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::new(&host, &pager, cfg).expect("context");
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
    let peer = Peer::new();
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

fn rig() -> Rig {
    rig_with(Config::default())
}

impl Rig {
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
    fn wait(&self, cq: &Cq, n: usize) -> Vec<Completion> {
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

#[test]
fn inline_write_and_read_are_served_and_answered_once() {
    let mut r = rig();
    let (addr, rkey) = (r.addr(100), r.mr.rkey());
    r.peer.send(&Repr::WriteInline {
        req_id: 7,
        remote_addr: addr,
        rkey,
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

#[test]
fn requests_outside_an_mr_or_its_rights_are_refused_not_served() {
    let mut r = rig();
    let rkey = r.mr.rkey();
    r.peer.send(&Repr::WriteInline {
        req_id: 1,
        remote_addr: r.addr(0),
        rkey: rkey ^ 0x5a5a_0000,
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

#[test]
fn atomics_are_applied_by_the_target_cpu() {
    let mut r = rig();
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

#[test]
fn a_key_query_is_answered_with_the_key_table() {
    let mut r = rig();
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

#[test]
fn inbound_sends_wait_for_a_recv_and_are_checked_against_it() {
    let mut r = rig();
    r.peer.send(&Repr::SendInline {
        req_id: 11,
        imm: Some(9),
        solicited: false,
        data: Cow::Borrowed(b"payload"),
    });
    // No RECV posted: neither a completion nor an answer yet.
    assert_eq!(r.peer.recv_within(Duration::from_millis(50)), None);
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
        (100, 0, CompOp::RecvWithImm, 7, Some(9))
    );
    assert_eq!(r.bytes(200, 7), b"payload");
    assert_eq!(
        r.peer.recv(),
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
        data: Cow::Borrowed(b"too long"),
    });
    let c = r.wait(&r.rcq, 1)[0];
    assert_eq!((c.wr_id, c.status), (101, code(WcStatus::LocLenErr)));
    match r.peer.recv() {
        Repr::Completion { req_id, status, .. } => {
            assert_eq!((req_id, status), (12, Status::RemoteInvalid))
        }
        m => panic!("{m:?}"),
    }
}

// ---- the initiator's two-sided path and the exit of its operations ----

#[test]
fn two_sided_ops_complete_in_post_order_whatever_the_answer_order() {
    let mut r = rig();
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

#[test]
fn sends_are_issued_one_at_a_time_in_post_order() {
    let mut r = rig();
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

#[test]
fn a_failed_answer_moves_the_qp_to_err_and_flushes_what_follows() {
    let mut r = rig();
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

#[test]
fn set_error_flushes_outstanding_sends_and_recvs_once_in_post_order() {
    let mut r = rig();
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

#[test]
fn an_unanswered_request_times_out_as_retry_exceeded() {
    let mut r = rig_with(Config {
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

#[test]
fn an_atomic_goes_two_sided_and_its_answer_lands_in_the_local_buffer() {
    let mut r = rig();
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

#[test]
fn local_protection_errors_complete_without_reaching_the_peer() {
    let mut r = rig();
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
struct PeerMem {
    mr: rnic::OwnedMr,
    _versions: rnic::OwnedMr,
    mapping: crate::ctrl::KeyMapping,
}

impl Peer {
    fn mem(&self, len: usize) -> PeerMem {
        let pd = &self.pd;
        let acc =
            rnic::Access::LOCAL_WRITE | rnic::Access::REMOTE_READ | rnic::Access::REMOTE_WRITE;
        let mr = pd.reg_mr_owned(vec![0; len], acc).expect("peer mr");
        let (_, pages) = crate::check::page_span(mr.addr() as u64, len as u64, 4096).expect("span");
        let versions = pd
            .reg_mr_owned(vec![1; pages as usize * 4], acc)
            .expect("peer versions");
        let mapping = crate::ctrl::KeyMapping {
            app_rkey: mr.rkey(),
            write_rkey: mr.rkey(),
            version_rkey: versions.rkey(),
            page_count: pages as u32,
            region_va: mr.addr() as u64,
            region_len: len as u64,
            version_va: versions.addr() as u64,
        };
        PeerMem {
            mr,
            _versions: versions,
            mapping,
        }
    }
}

#[test]
fn a_failed_check_replays_the_write_that_pipelined_behind_it() {
    let mut r = rig();
    let pm = r.peer.mem(4 * 4096);
    // The READ's source holds the signature page's magic: its one-sided
    // result cannot be told from an absent page, the check fails.
    let magic = r.peer.host.query_device().signature_magic;
    let words: Vec<u8> = (0..16).flat_map(|_| magic.to_le_bytes()).collect();
    pm.mr.write(0, &words);
    let (base, rkey) = (pm.mr.addr() as u64, pm.mr.rkey());
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
    assert_eq!(pm.mr.to_vec(2048, 64), real);
    let s = r.ctx.stats();
    assert!(s.replayed >= 1, "{s:?}");
    assert_eq!(s.two_sided, 1);
}

#[test]
fn set_error_after_a_failed_answer_flushes_what_is_still_out_and_sends_nothing_more() {
    let mut r = rig();
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

#[test]
fn a_send_parked_behind_a_failed_send_is_flushed_not_sent() {
    let mut r = rig();
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
