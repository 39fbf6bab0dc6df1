//! Unreliable-datagram QPs on every data path (direct in-process, trusting hosts,
//! the target-enforced ring, and across processes): SEND / SEND_WITH_IMM to the
//! destination each WR names; a receive gets the 40-byte GRH (sender's and receiver's
//! GIDs) before the payload, its completion src_qp, IBV_WC_GRH and the immediate;
//! nothing is acknowledged — a datagram the responder refuses (wrong Q_Key, absent QP,
//! no receive, a receive too small, a QP not ready) is dropped and the sender's WR
//! completes successfully, as does one longer than the port MTU (never sent, as rxe).
//! Datagrams forged into a UD QP's ring by another process never reach past the
//! receive they land in.

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::*;
use std::sync::atomic::Ordering;

const QKEY: u32 = 0x1111_1111;

/// RESET -> INIT (P_Key index, port, Q_Key) -> RTR -> RTS (SQ PSN), as ibv_ud_pingpong.
fn ud_up(qp: &Qp, qkey: u32) {
    use QpAttrMask as M;
    let a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey,
        ..Default::default()
    };
    qp.modify(&a, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY).unwrap();
    let a = QpAttr {
        qp_state: QpState::Rtr,
        ..Default::default()
    };
    qp.modify(&a, M::STATE).unwrap();
    let a = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: 7,
        ..Default::default()
    };
    qp.modify(&a, M::STATE | M::SQ_PSN).unwrap();
}

fn ud_end(host: &Host) -> End {
    let e = end_of(host, &QpInitAttr::default(), QpType::Ud);
    ud_up(&e.qp, QKEY);
    e
}

/// Two UD QPs on two hosts made with `cfg`, for each data path.
fn each_path(f: impl Fn(End, End)) {
    for cfg in [HostConfig::default(), ring_cfg(), secure_cfg()] {
        let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg).unwrap());
        let (a, b) = (ud_end(&ha), ud_end(&hb));
        assert_eq!(a.qp.qp_type(), QpType::Ud);
        f(a, b);
    }
}

/// Wait until `b`'s host served `n` more ring requests than `before` (on the ring
/// path a datagram is in flight until then; elsewhere it arrived at the send).
fn served(b: &End, before: u64, n: u64) {
    let t = std::time::Instant::now();
    while b.host.stats().ring_requests < before + n && t.elapsed() < T {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

fn recv(b: &End, wr_id: u64, m: &OwnedMr, len: u32) {
    let sge = [m.sge(0, len)];
    b.qp.post_recv(&[RecvWr { wr_id, sg_list: &sge }]).unwrap();
}

/// Send `len` bytes of `src` from `a` to QP `qpn` of `b`'s host presenting `qkey`.
#[allow(clippy::too_many_arguments)]
fn send(a: &End, b: &End, wr_id: u64, op: WrOpcode, src: &OwnedMr, len: u32, qpn: u32, qkey: u32) {
    let ah = a.pd.create_ah(b.host.addr()).unwrap();
    let sge = [src.sge(0, len)];
    a.qp.post_send(&[SendWr::new(wr_id, op, &sge).to(ah.to(qpn, qkey))])
        .unwrap();
    let wc = wait1(&a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (wr_id, WcStatus::Success, WcOpcode::Send)
    );
}

#[test]
fn a_datagram_arrives_after_its_grh() {
    each_path(|a, b| {
        let src = buf(&a.pd, 4096, 0);
        let data = pattern(4096, 5);
        src.write(0, &data);
        let dst = buf(&b.pd, 4096 + 40, 0xee);
        let dst2 = buf(&b.pd, 100, 0);
        recv(&b, 9, &dst, 4096 + 40);
        send(&a, &b, 1, WrOpcode::SendImm(0x1234_5678), &src, 100, b.qp.qpn(), QKEY);
        let wc = wait1(&b.rcq);
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (9, WcStatus::Success, WcOpcode::Recv));
        assert_eq!((wc.byte_len, wc.src_qp, wc.qp_num), (140, a.qp.qpn(), b.qp.qpn()));
        assert_eq!(wc.wc_flags, WcFlags::GRH | WcFlags::WITH_IMM);
        assert_eq!(wc.imm_data, 0x1234_5678);
        let got = dst.to_vec(0, 140);
        assert_eq!(got[..40], grh(&a.host.addr(), &b.host.addr(), 100, true));
        assert_eq!(got[8..24], a.host.addr().to_bytes(), "sgid = the sender's GID");
        assert_eq!(got[40..], data[..100]);
        assert_eq!(dst.to_vec(140, 10), vec![0xee; 10]);
        // A whole MTU, no immediate.
        recv(&b, 10, &dst, 4096 + 40);
        send(&a, &b, 2, WrOpcode::Send, &src, 4096, b.qp.qpn(), QKEY);
        let wc = wait1(&b.rcq);
        assert_eq!((wc.wr_id, wc.byte_len, wc.wc_flags), (10, 4136, WcFlags::GRH));
        assert_eq!(dst.to_vec(40, 4096), data);
        // A zero-byte datagram is its GRH.
        recv(&b, 11, &dst, 40);
        send(&a, &b, 3, WrOpcode::Send, &src, 0, b.qp.qpn(), QKEY);
        assert_eq!(wait1(&b.rcq).byte_len, 40);
        // Inline, unsignaled then signaled: one completion, both delivered.
        recv(&b, 12, &dst, 100);
        recv(&b, 13, &dst2, 100);
        let ah = a.pd.create_ah(b.host.addr()).unwrap();
        let to = ah.to(b.qp.qpn(), QKEY);
        a.qp.post_send(&[
            SendWr::new(4, WrOpcode::Send, &[])
                .inline(&data[..50])
                .flags(SendFlags::INLINE)
                .to(to),
            SendWr::new(5, WrOpcode::SendImm(3), &[]).inline(&data[..60]).to(to),
        ])
        .unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
        assert_empty(&a.cq);
        let wcs = b.rcq.poll_wait(2, T).unwrap();
        assert_eq!(
            (wcs[0].wr_id, wcs[0].byte_len, wcs[1].wr_id, wcs[1].byte_len),
            (12, 90, 13, 100)
        );
        assert_eq!(dst.to_vec(40, 50), data[..50]);
        assert_eq!(dst2.to_vec(40, 60), data[..60]);
    });
}

#[test]
fn refused_datagrams_are_dropped_and_the_sender_never_hears() {
    each_path(|a, b| {
        let src = buf(&a.pd, 8192, 0);
        src.write(0, &pattern(8192, 1));
        let dst = buf(&b.pd, 8192, 0);
        // No receive posted: dropped, not delivered once one is.
        let before = b.host.stats().ring_requests;
        send(&a, &b, 1, WrOpcode::Send, &src, 10, b.qp.qpn(), QKEY);
        if b.host.config().inproc_ring && !b.host.config().trusted_peers {
            served(&b, before, 1);
        }
        recv(&b, 7, &dst, 200);
        assert_empty(&b.rcq);
        // Another Q_Key: dropped; the receive stays.
        send(&a, &b, 2, WrOpcode::Send, &src, 10, b.qp.qpn(), QKEY + 1);
        // A receive too small for GRH + payload: dropped, the receive stays.
        send(&a, &b, 3, WrOpcode::Send, &src, 161, b.qp.qpn(), QKEY);
        // Longer than the port MTU: never sent, yet successful (C10-93.1.1).
        send(&a, &b, 4, WrOpcode::Send, &src, PORT_MTU + 1, b.qp.qpn(), QKEY);
        // No such QP; a QP that is not UD; a UD QP not yet ready.
        send(&a, &b, 5, WrOpcode::Send, &src, 10, 0xab_cdef, QKEY);
        let rc = end(&b.host, &QpInitAttr::default());
        send(&a, &b, 6, WrOpcode::Send, &src, 10, rc.qp.qpn(), QKEY);
        let init = end_of(&b.host, &QpInitAttr::default(), QpType::Ud);
        init.qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Init,
                    port_num: 1,
                    qkey: QKEY,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY,
            )
            .unwrap();
        let isge = [dst.sge(0, 100)];
        init.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: &isge,
            }])
            .unwrap();
        send(&a, &b, 7, WrOpcode::Send, &src, 10, init.qp.qpn(), QKEY);
        assert_empty(&init.rcq);
        assert_empty(&b.rcq);
        assert_eq!((b.qp.state(), a.qp.state()), (QpState::Rts, QpState::Rts));
        // The receive is still there: a Q_Key with the high bit set means the
        // sender's own (the same here).
        send(&a, &b, 8, WrOpcode::Send, &src, 160, b.qp.qpn(), 0x8000_0000);
        let wc = wait1(&b.rcq);
        assert_eq!((wc.wr_id, wc.status, wc.byte_len), (7, WcStatus::Success, 200));
    });
}

#[test]
fn on_a_shared_receive_queue_a_receive_too_small_completes_in_error() {
    for cfg in [HostConfig::default(), secure_cfg()] {
        let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg).unwrap());
        let a = ud_end(&ha);
        let ctx = hb.open_context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let rcq = ctx.create_cq(16, None).unwrap();
        let srq = pd.create_srq(8, 1).unwrap();
        let qp = pd
            .create_qp_of(QpType::Ud, &rcq, &rcq, Some(&srq), &QpInitAttr::default())
            .unwrap();
        ud_up(&qp, QKEY);
        let dst = buf(&pd, 4096, 0);
        let post = |wr_id: u64, len: u32| {
            let sge = [dst.sge(0, len)];
            srq.post_recv(&[RecvWr { wr_id, sg_list: &sge }]).unwrap();
        };
        let src = buf(&a.pd, 256, 0);
        src.write(0, &pattern(256, 2));
        let ah = a.pd.create_ah(hb.addr()).unwrap();
        let go = |wr_id: u64, len: u32| {
            let sge = [src.sge(0, len)];
            a.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Send, &sge).to(ah.to(qp.qpn(), QKEY))])
                .unwrap();
            assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        };
        // rxe's class E: the shared receive completes REM_INV_REQ_ERR, the QP stays.
        post(1, 100);
        go(1, 100);
        let wc = wait1(&rcq);
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemInvReqErr));
        assert_eq!(qp.state(), QpState::Rts);
        post(2, 200);
        go(2, 100);
        let wc = wait1(&rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len, wc.qp_num),
            (2, WcStatus::Success, 140, qp.qpn())
        );
        assert_eq!(dst.to_vec(40, 100), pattern(100, 2));
    }
}

#[test]
fn a_full_ring_holds_the_sender_until_the_transport_timeout_and_a_reset_recovers_it() {
    let cfg = HostConfig {
        transport_timeout: std::time::Duration::from_millis(100),
        ..secure_cfg()
    };
    let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg).unwrap());
    let (a, b) = (ud_end(&ha), ud_end(&hb));
    let src = buf(&a.pd, 64, 0);
    let dst = buf(&b.pd, 64, 0);
    // Every slot claimed by producers that died mid-fill.
    let addr = hb.addr();
    let seg = segment::Segment::open(addr.pid, addr.fd, addr.nonce).unwrap();
    let tq = seg.find_qp(b.qp.qpn()).unwrap();
    for s in 0..seg.p.ring_slots as u64 {
        seg.slot(tq, s).0.state.store(segment::SLOT_FILL, Ordering::Release);
    }
    recv(&b, 1, &dst, 64);
    let t = std::time::Instant::now();
    send(&a, &b, 1, WrOpcode::Send, &src, 8, b.qp.qpn(), QKEY);
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    assert_empty(&b.rcq);
    // A reset empties the ring.
    b.qp.modify(
        &QpAttr {
            qp_state: QpState::Reset,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    ud_up(&b.qp, QKEY);
    recv(&b, 2, &dst, 64);
    send(&a, &b, 2, WrOpcode::Send, &src, 8, b.qp.qpn(), QKEY);
    let wc = wait1(&b.rcq);
    assert_eq!((wc.wr_id, wc.byte_len), (2, 48));
}

#[test]
fn only_addressed_sends_are_posted() {
    let h = Host::new(HostConfig::default()).unwrap();
    let (a, b) = (ud_end(&h), ud_end(&h));
    let src = buf(&a.pd, 64, 0);
    let sge = [src.sge(0, 8)];
    let ah = a.pd.create_ah(h.addr()).unwrap();
    let to = ah.to(b.qp.qpn(), QKEY);
    for op in [
        WrOpcode::Write,
        WrOpcode::WriteImm(1),
        WrOpcode::Read,
        WrOpcode::FetchAdd { add: 1 },
        WrOpcode::CmpSwap { compare: 0, swap: 1 },
    ] {
        let e =
            a.qp.post_send(&[SendWr::new(1, op, &sge).remote(src.addr() as u64, src.rkey()).to(to)]);
        assert!(matches!(e.unwrap_err().err, Error::InvalidArgument(_)), "{op:?}");
    }
    let e = a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap_err();
    assert!(matches!(e.err, Error::InvalidArgument(_)));
    // A bad lkey fails the WR locally (and the QP, as on rxe).
    let bad = [Sge {
        addr: src.addr() as u64,
        length: 8,
        lkey: 0xdead,
    }];
    a.qp.post_send(&[SendWr::new(2, WrOpcode::Send, &bad).to(to)]).unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::LocProtErr);
    assert_eq!(a.qp.state(), QpState::Err);
    // An address handle for no host.
    let nobody = HostAddr {
        pid: std::process::id(),
        fd: 1,
        nonce: 42,
    };
    assert!(a.pd.create_ah(nobody).is_err());
    assert_eq!(ah.dest(), h.addr());
}

#[test]
fn ud_transitions_take_a_qkey_and_no_access_flags() {
    use QpAttrMask as M;
    let h = Host::new(HostConfig::default()).unwrap();
    let e = end_of(&h, &QpInitAttr::default(), QpType::Ud);
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey: 5,
        ..Default::default()
    };
    let err = e.qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT).unwrap_err();
    assert!(matches!(err, Error::InvalidMask(_)), "{err:?}");
    let err =
        e.qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY | M::ACCESS_FLAGS)
            .unwrap_err();
    assert!(matches!(err, Error::InvalidMask(_)), "{err:?}");
    e.qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY)
        .unwrap();
    assert_eq!(e.qp.query().qkey, 5);
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        dest_qp_num: 3,
        ..Default::default()
    };
    assert!(e.qp.modify(&rtr, M::STATE | M::DEST_QPN).is_err());
    e.qp.modify(&rtr, M::STATE).unwrap();
    let rts = QpAttr {
        qp_state: QpState::Rts,
        qkey: 9,
        ..Default::default()
    };
    assert!(e.qp.modify(&rts, M::STATE).is_err(), "SQ_PSN is required");
    e.qp.modify(&rts, M::STATE | M::SQ_PSN | M::QKEY).unwrap();
    assert_eq!((e.qp.state(), e.qp.query().qkey), (QpState::Rts, 9));
}

#[test]
fn many_senders_one_receiver_through_the_ring() {
    let cfg = secure_cfg();
    let rx = ud_end(&Host::new(cfg.clone()).unwrap());
    let txs: Vec<End> = (0..3).map(|_| ud_end(&Host::new(cfg.clone()).unwrap())).collect();
    let dst = buf(&rx.pd, 64 * 100, 0);
    for i in 0..60u32 {
        let sge = [dst.sge(i as usize * 100, 100)];
        rx.qp
            .post_recv(&[RecvWr {
                wr_id: i as u64,
                sg_list: &sge,
            }])
            .unwrap();
    }
    let srcs: Vec<OwnedMr> = txs.iter().map(|t| buf(&t.pd, 64, 0)).collect();
    // More than the ring's slots at once from each sender: a full ring holds the
    // sender (lossless), so every datagram arrives.
    for (t, s) in txs.iter().zip(&srcs) {
        let ah = t.pd.create_ah(rx.host.addr()).unwrap();
        let sge = [s.sge(0, 60)];
        let wrs: Vec<SendWr> = (0..20)
            .map(|i| SendWr::new(i, WrOpcode::Send, &sge).to(ah.to(rx.qp.qpn(), QKEY)))
            .collect();
        t.qp.post_send(&wrs).unwrap();
    }
    for t in &txs {
        assert_eq!(t.cq.poll_wait(20, T).unwrap().len(), 20);
    }
    let wcs = rx.rcq.poll_wait(60, T).unwrap();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success && w.byte_len == 100));
    // Each sender's GRH names it.
    let mut from: Vec<Vec<u8>> = wcs.iter().map(|w| dst.to_vec(w.wr_id as usize * 100 + 8, 16)).collect();
    from.sort();
    from.dedup();
    assert_eq!(from.len(), 3);
}

/// The passive side of the cross-process tests. Does nothing unless run as the child.
#[test]
fn ud_child() {
    if std::env::var("RNIC_UD_CHILD").is_err() {
        return;
    }
    let host = Host::new(HostConfig::default()).unwrap();
    let e = ud_end(&host);
    let rbuf = buf(&e.pd, 4096 + 40, 0);
    let canary = buf(&e.pd, 4096, 0x77);
    let info = format!("{} {}", host.addr().to_hex(), e.qp.qpn());
    serve(&info, |w| {
        let reply = match w {
            ["POST"] => {
                recv(&e, 3, &rbuf, 4096 + 40);
                "READY".to_string()
            }
            ["RECV", len, seed] => match e.rcq.poll_wait(1, T) {
                Ok(v) => {
                    let len: usize = len.parse().unwrap();
                    let ok = rbuf.to_vec(40, len) == pattern(len, seed.parse().unwrap());
                    let sgid = HostAddr::from_bytes(&rbuf.to_vec(8, 16).try_into().unwrap());
                    format!(
                        "WC {:?} {} {} {} {} {}",
                        v[0].status,
                        v[0].byte_len,
                        v[0].src_qp,
                        v[0].wc_flags.bits(),
                        sgid.to_hex(),
                        ok
                    )
                }
                Err(err) => format!("ERR {err}"),
            },
            ["SEND", a, q, len, seed] => {
                let len: usize = len.parse().unwrap();
                let s = buf(&e.pd, len.max(1), 0);
                s.write(0, &pattern(len, seed.parse().unwrap()));
                let ah = e.pd.create_ah(HostAddr::from_hex(a).unwrap()).unwrap();
                let sge = [s.sge(0, len as u32)];
                e.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge).to(ah.to(q.parse().unwrap(), QKEY))])
                    .unwrap();
                format!("WC {:?}", e.cq.poll_wait(1, T).unwrap()[0].status)
            }
            ["SMALL"] => {
                // A 48-byte receive inside a buffer of canaries.
                let sge = [canary.sge(100, 48)];
                e.qp.post_recv(&[RecvWr {
                    wr_id: 4,
                    sg_list: &sge,
                }])
                .unwrap();
                "READY".to_string()
            }
            ["CANARY", wait] => {
                // `wait` completions are awaited first: a responder makes its receive
                // completions visible only after it freed the ring slot (`Held`).
                let mut wc = [Wc::default(); 8];
                let mut n = 0;
                if *wait == "1" {
                    wc[0] = e.rcq.poll_wait(1, T).unwrap()[0];
                    n = 1;
                }
                n += e.rcq.poll(&mut wc[n..]).unwrap();
                let v = canary.to_vec(0, 4096);
                let untouched = v[..100].iter().chain(&v[148..]).all(|&b| b == 0x77);
                let got: Vec<String> = wc[..n].iter().map(|w| format!("{}:{}", w.wr_id, w.byte_len)).collect();
                format!("WC [{}] {} {:?}", got.join(","), untouched, e.qp.state())
            }
            ["EXIT"] => return None,
            _ => "?".into(),
        };
        Some(reply)
    });
}

const REPLIES: &[&str] = &["INFO", "READY", "WC", "ERR"];

/// Forge a datagram into slot `slot` of UD QP `tq`'s ring of `seg` (bypassing every
/// check of a requester) and wait until the target freed it.
#[allow(clippy::too_many_arguments)]
fn forge(seg: &segment::Segment, tq: u32, slot: u64, op: u32, len: u32, qpn: u32, qkey: u32, data: &[u8]) {
    let (h, area) = seg.slot(tq, slot);
    assert_eq!(h.state.load(Ordering::Acquire), segment::SLOT_FREE);
    h.op.store(op, Ordering::Relaxed);
    h.len.store(len, Ordering::Relaxed);
    h.raddr.store(0x1234_0000_0005, Ordering::Relaxed);
    h.rkey.store(qkey, Ordering::Relaxed);
    h.src_qpn.store(77, Ordering::Relaxed);
    h.src_nonce.store(99, Ordering::Relaxed);
    h.cmp.store(u64::from(qpn) << 32, Ordering::Relaxed);
    h.swp.store(slot, Ordering::Relaxed);
    // SAFETY: the slot's data area holds ring_max (>= 4096) bytes; data is smaller.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), area, data.len()) };
    h.state.store(segment::SLOT_REQ, Ordering::Release);
    seg.ring_doorbell(tq);
    let t = std::time::Instant::now();
    while h.state.load(Ordering::Acquire) != segment::SLOT_FREE {
        assert!(t.elapsed() < T, "a forged datagram was never served");
        std::thread::yield_now();
    }
}

#[test]
fn forged_datagrams_never_reach_past_a_receive() {
    let mut c = Child::spawn("ud_child", "RNIC_UD_CHILD", "1", REPLIES);
    let info = c.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let (raddr, rqpn) = (HostAddr::from_hex(f[1]).unwrap(), f[2].parse::<u32>().unwrap());
    let seg = segment::Segment::open(raddr.pid, raddr.fd, raddr.nonce).unwrap();
    let tq = seg.find_qp(rqpn).unwrap();
    assert_eq!(c.cmd("SMALL"), "READY");
    let data = vec![0xabu8; 4096];
    // Longer than the slot, longer than the MTU, longer than the receive; another
    // QPN, Q_Key or op: all dropped, the receive untouched.
    forge(&seg, tq, 0, segment::RING_UD, u32::MAX, rqpn, QKEY, &data);
    forge(&seg, tq, 1, segment::RING_UD, PORT_MTU + 1, rqpn, QKEY, &data);
    forge(&seg, tq, 2, segment::RING_UD, 9, rqpn, QKEY, &data);
    forge(&seg, tq, 3, segment::RING_UD, 8, rqpn + 1, QKEY, &data);
    forge(&seg, tq, 4, segment::RING_UD, 8, rqpn, QKEY ^ 1, &data);
    forge(
        &seg,
        tq,
        5,
        segment::RING_SEND | segment::RING_F_FIRST | segment::RING_F_LAST,
        8,
        rqpn,
        QKEY,
        &data,
    );
    assert_eq!(c.cmd("CANARY 0"), "WC [] true Rts");
    // A well-formed one lands inside it, GRH first.
    forge(&seg, tq, 6, segment::RING_UD, 8, rqpn, QKEY, &data);
    assert_eq!(c.cmd("CANARY 1"), "WC [4:48] true Rts");
}

#[test]
fn datagrams_cross_processes_and_a_dead_destination_never_wedges() {
    let mut c = Child::spawn("ud_child", "RNIC_UD_CHILD", "1", REPLIES);
    let info = c.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let (raddr, rqpn) = (HostAddr::from_hex(f[1]).unwrap(), f[2].parse::<u32>().unwrap());
    let host = Host::new(HostConfig::default()).unwrap();
    let a = ud_end(&host);
    let src = buf(&a.pd, 4096, 0);
    src.write(0, &pattern(4096, 4));
    let ah = a.pd.create_ah(raddr).unwrap();
    let post = |wr_id: u64, len: u32| {
        let sge = [src.sge(0, len)];
        a.qp.post_send(&[SendWr::new(wr_id, WrOpcode::Send, &sge).to(ah.to(rqpn, QKEY))])
            .unwrap();
        let wc = wait1(&a.cq);
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success));
    };
    assert_eq!(c.cmd("POST"), "READY");
    post(1, 4096);
    let want = format!(
        "WC Success {} {} {} {} true",
        4096 + 40,
        a.qp.qpn(),
        WcFlags::GRH.bits(),
        host.addr().to_hex()
    );
    assert_eq!(c.cmd("RECV 4096 4"), want);
    // The other way: the child's datagram into our ring.
    let dst = buf(&a.pd, 200, 0);
    recv(&a, 5, &dst, 200);
    assert_eq!(
        c.cmd(&format!("SEND {} {} 100 6", host.addr().to_hex(), a.qp.qpn())),
        "WC Success"
    );
    let wc = wait1(&a.rcq);
    assert_eq!((wc.wr_id, wc.byte_len, wc.src_qp), (5, 140, rqpn));
    assert_eq!(dst.to_vec(40, 100), pattern(100, 6));
    assert_eq!(dst.to_vec(24, 16), host.addr().to_bytes(), "dgid = ours");
    // Kill it: sends still complete, however many (its ring fills, nobody serves it).
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = std::time::Instant::now();
    for i in 0..40 {
        post(10 + i, 64);
    }
    assert!(t.elapsed() < T, "a dead destination held the sender {:?}", t.elapsed());
}
