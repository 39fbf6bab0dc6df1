//! Two-host integration tests for every error case: post-time errors, completion
//! statuses, QP -> ERR and the WR_FLUSH_ERR of everything behind an error.

mod common;
use common::*;
use rnic::*;

fn each_path(f: impl Fn(End, End)) {
    let (a, b) = pair();
    f(a, b);
    let (a, b) = pair_cfg(ring_cfg());
    f(a, b);
}

/// Post `wr` followed by a signaled WRITE; expect `status` then WR_FLUSH_ERR.
fn expect_fail(a: &End, wr: SendWr, status: WcStatus) {
    let s = buf(&a.pd, 8, 0);
    let sge = [s.sge(0, 8)];
    let follow = SendWr::new(999, WrOpcode::Write, &sge).remote(0, 0);
    a.qp.post_send(&[wr, follow]).unwrap();
    let w = a.cq.poll_wait(2, T).unwrap();
    assert_eq!(w[0].status, status, "{:?}", w[0]);
    assert_eq!(w[0].wr_id, wr.wr_id);
    assert_eq!((w[1].status, w[1].wr_id), (WcStatus::WrFlushErr, 999));
    assert_eq!(a.qp.state(), QpState::Err);
    assert_empty(&a.cq);
}

#[test]
fn bad_rkey_is_remote_access_error_and_errors_both_qps() {
    each_path(|a, b| {
        let l = buf(&a.pd, 64, 0);
        let r = buf(&b.pd, 64, 0);
        let rs = [r.sge(0, 8)];
        b.qp.post_recv(&[RecvWr {
            wr_id: 42,
            sg_list: &rs,
        }])
        .unwrap();
        let sge = [l.sge(0, 64)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Read, &sge).remote(r.addr() as u64, r.rkey() ^ 0x100),
            WcStatus::RemAccessErr,
        );
        assert_eq!(b.qp.state(), QpState::Err);
        let rw = wait1(&b.rcq);
        assert_eq!((rw.wr_id, rw.status), (42, WcStatus::WrFlushErr));
    });
}

#[test]
fn remote_errors_per_opcode() {
    // (opcode, remote offset, rkey-mangler, QP access, MR access, expected)
    type Case = (WrOpcode, u64, bool, Access, Access, WcStatus);
    let all = all_access();
    let cases: Vec<Case> = vec![
        (WrOpcode::Write, 0, true, all, all, WcStatus::RemAccessErr),
        (WrOpcode::Write, 60, false, all, all, WcStatus::RemAccessErr), // out of bounds
        (
            WrOpcode::Write,
            0,
            false,
            all,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
            WcStatus::RemAccessErr,
        ),
        (
            WrOpcode::Read,
            0,
            false,
            all,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            WcStatus::RemAccessErr,
        ),
        (
            WrOpcode::Write,
            0,
            false,
            Access::REMOTE_READ,
            all,
            WcStatus::RemInvReqErr,
        ), // QP access
        (
            WrOpcode::Read,
            0,
            false,
            Access::REMOTE_WRITE,
            all,
            WcStatus::RemInvReqErr,
        ),
        (
            WrOpcode::FetchAdd { add: 1 },
            4,
            false,
            all,
            all,
            WcStatus::RemInvReqErr,
        ), // misaligned
        (
            WrOpcode::FetchAdd { add: 1 },
            0,
            false,
            all,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
            WcStatus::RemAccessErr,
        ),
        (
            WrOpcode::CmpSwap { compare: 0, swap: 1 },
            0,
            false,
            Access::REMOTE_READ,
            all,
            WcStatus::RemInvReqErr,
        ),
        (WrOpcode::WriteImm(1), 0, true, all, all, WcStatus::RemAccessErr),
    ];
    for cfg in [HostConfig::default(), ring_cfg()] {
        for (i, &(op, off, bad_key, qacc, macc, exp)) in cases.iter().enumerate() {
            let ha = Host::new(cfg.clone()).unwrap();
            let hb = Host::new(cfg.clone()).unwrap();
            let a = end(&ha, &QpInitAttr::default());
            let b = end(&hb, &QpInitAttr::default());
            connect(&a, &b, qacc, 7);
            let l = buf(&a.pd, 64, 0);
            let r = b.pd.reg_mr_owned(vec![0; 64], macc).unwrap();
            b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }]).unwrap();
            let sge = [l.sge(0, 8)];
            let rkey = if bad_key { r.rkey() + 0x1000 } else { r.rkey() };
            expect_fail(
                &a,
                SendWr::new(i as u64, op, &sge).remote(r.addr() as u64 + off, rkey),
                exp,
            );
            assert_eq!(r.to_vec(0, 64), vec![0; 64], "case {i}: target memory untouched");
            assert_eq!(b.qp.state(), QpState::Err, "case {i}: responder QP in ERR");
        }
    }
}

#[test]
fn wrong_pd_remote_and_local() {
    each_path(|a, b| {
        let other_pd = b.ctx.alloc_pd().unwrap();
        let r = buf(&other_pd, 64, 0);
        let l = buf(&a.pd, 64, 0);
        let sge = [l.sge(0, 8)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Write, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::RemAccessErr,
        );
    });
    each_path(|a, b| {
        let other_pd = a.ctx.alloc_pd().unwrap();
        let l = buf(&other_pd, 64, 0);
        let r = buf(&b.pd, 64, 0);
        let sge = [l.sge(0, 8)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Write, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::LocProtErr,
        );
        assert_eq!(b.qp.state(), QpState::Rts, "local errors do not touch the responder");
    });
}

#[test]
fn local_protection_errors() {
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let l = buf(&a.pd, 64, 0);
        // bad lkey
        let sge = [Sge {
            addr: l.addr() as u64,
            length: 8,
            lkey: l.lkey() + 0x1000,
        }];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Write, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::LocProtErr,
        );
    });
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let l = buf(&a.pd, 64, 0);
        // local out of bounds
        let sge = [l.sge(60, 8)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Read, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::LocProtErr,
        );
    });
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        // READ into a local MR without LOCAL_WRITE
        let l = a.pd.reg_mr_owned(vec![0; 64], Access::REMOTE_READ).unwrap();
        let sge = [l.sge(0, 8)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Read, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::LocProtErr,
        );
        assert_eq!(l.to_vec(0, 8), vec![0; 8]);
    });
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let l = buf(&a.pd, 64, 0);
        // atomic with a local length other than 8
        let sge = [l.sge(0, 4)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::FetchAdd { add: 1 }, &sge).remote(r.addr() as u64, r.rkey()),
            WcStatus::LocLenErr,
        );
    });
}

#[test]
fn deregistered_mr_is_rejected() {
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let (addr, rkey) = (r.addr() as u64, r.rkey());
        drop(r);
        let l = buf(&a.pd, 64, 0);
        let sge = [l.sge(0, 8)];
        expect_fail(
            &a,
            SendWr::new(1, WrOpcode::Read, &sge).remote(addr, rkey),
            WcStatus::RemAccessErr,
        );
    });
}

#[test]
fn receive_too_small_and_bad_recv_lkey() {
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let rs = [r.sge(0, 4)];
        b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &rs }, RecvWr { wr_id: 6, sg_list: &rs }])
            .unwrap();
        let data = [1u8; 8];
        let s = buf(&a.pd, 8, 0);
        let sge = [s.sge(0, 8)];
        let _ = data;
        expect_fail(&a, SendWr::new(1, WrOpcode::Send, &sge), WcStatus::RemInvReqErr);
        let w = b.rcq.poll_wait(2, T).unwrap();
        assert_eq!((w[0].wr_id, w[0].status), (5, WcStatus::LocLenErr));
        assert_eq!((w[1].wr_id, w[1].status), (6, WcStatus::WrFlushErr));
        assert_eq!(b.qp.state(), QpState::Err);
    });
    each_path(|a, b| {
        let r = buf(&b.pd, 64, 0);
        let rs = [Sge {
            addr: r.addr() as u64,
            length: 64,
            lkey: r.lkey() ^ 0x300,
        }];
        b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &rs }]).unwrap();
        let s = buf(&a.pd, 8, 0);
        let sge = [s.sge(0, 8)];
        expect_fail(&a, SendWr::new(1, WrOpcode::Send, &sge), WcStatus::RemOpErr);
        let w = wait1(&b.rcq);
        assert_eq!((w.wr_id, w.status), (5, WcStatus::LocProtErr));
    });
}

#[test]
fn recv_posted_on_err_qp_is_flushed() {
    let (_a, b) = pair();
    let (at, m) = (
        QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        },
        QpAttrMask::STATE,
    );
    b.qp.modify(&at, m).unwrap();
    let r = buf(&b.pd, 8, 0);
    let rs = [r.sge(0, 8)];
    b.qp.post_recv(&[RecvWr {
        wr_id: 77,
        sg_list: &rs,
    }])
    .unwrap();
    let w = wait1(&b.rcq);
    assert_eq!(
        (w.wr_id, w.status, w.opcode),
        (77, WcStatus::WrFlushErr, WcOpcode::Recv)
    );
    // sends posted on an ERR QP are flushed too
    let s = buf(&b.pd, 8, 0);
    let sge = [s.sge(0, 8)];
    b.qp.post_send(&[SendWr::new(3, WrOpcode::Write, &sge)]).unwrap();
    let w = wait1(&b.cq);
    assert_eq!((w.wr_id, w.status), (3, WcStatus::WrFlushErr));
}

#[test]
fn post_time_errors() {
    let ha = Host::new(HostConfig::default()).unwrap();
    let hb = Host::new(HostConfig::default()).unwrap();
    let attr = QpInitAttr {
        max_send_wr: 4,
        max_recv_wr: 2,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: 16,
        ..Default::default()
    };
    let a = end(&ha, &attr);
    let b = end(&hb, &attr);
    let s = buf(&a.pd, 64, 0);
    let sge = [s.sge(0, 8)];
    let wr = SendWr::new(1, WrOpcode::Send, &sge);
    // wrong state: RESET, INIT, RTR
    let e = a.qp.post_send(&[wr]).unwrap_err();
    assert_eq!(e.err, Error::WrongQpState(QpState::Reset));
    assert!(b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }]).is_err());
    let (at, m) = QpAttr::init(all_access());
    a.qp.modify(&at, m).unwrap();
    assert_eq!(
        a.qp.post_send(&[wr]).unwrap_err().err,
        Error::WrongQpState(QpState::Init)
    );
    let (at, m) = QpAttr::rtr(hb.addr(), b.qp.qpn());
    a.qp.modify(&at, m).unwrap();
    assert_eq!(
        a.qp.post_send(&[wr]).unwrap_err().err,
        Error::WrongQpState(QpState::Rtr)
    );
    let (at, m) = QpAttr::rts(7);
    a.qp.modify(&at, m).unwrap();
    b.qp.connect(all_access(), ha.addr(), a.qp.qpn(), 7).unwrap();
    // too many SGEs (second WR of the list)
    let sges3 = [s.sge(0, 1), s.sge(1, 1), s.sge(2, 1)];
    let e =
        a.qp.post_send(&[
            SendWr::new(1, WrOpcode::Write, &sge)
                .remote(0, 0)
                .flags(SendFlags::empty()),
            SendWr::new(2, WrOpcode::Write, &sges3),
        ])
        .unwrap_err();
    assert_eq!(e.bad_wr_index, 1);
    assert!(matches!(e.err, Error::InvalidArgument(_)));
    // the first WR of that list was posted (and fails remotely: rkey 0)
    let w = a.cq.poll_wait(1, T).unwrap();
    assert_eq!(w[0].status, WcStatus::RemAccessErr);
    // fresh pair for the remaining checks
    let a = end(&ha, &attr);
    let b = end(&hb, &attr);
    connect(&a, &b, all_access(), 7);
    let big = [0u8; 17];
    let e =
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &[]).inline(&big)])
            .unwrap_err();
    assert!(matches!(e.err, Error::InvalidArgument(_)));
    // SQ overflow: SENDs stall on RNR (no receive posted, infinite retry)
    let s = buf(&a.pd, 64, 0);
    let sge = [s.sge(0, 8)];
    let wrs: Vec<SendWr> = (0..5).map(|i| SendWr::new(i, WrOpcode::Send, &sge)).collect();
    let e = a.qp.post_send(&wrs).unwrap_err();
    assert_eq!((e.bad_wr_index, e.err.clone()), (4, Error::QueueFull("send queue")));
    // RQ overflow
    let r = buf(&b.pd, 64, 0);
    let rs = [r.sge(0, 8)];
    let rs2 = [r.sge(0, 8), r.sge(8, 8)];
    let e =
        b.qp.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &rs2,
        }])
        .unwrap_err();
    assert!(matches!(e.err, Error::InvalidArgument(_)));
    // the stalled sends consume receives as soon as they are posted
    for i in 0..4 {
        b.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &rs }]).unwrap();
        wait1(&b.rcq);
    }
    assert_eq!(
        a.cq.poll_wait(4, T)
            .unwrap()
            .iter()
            .filter(|w| w.status.is_ok())
            .count(),
        4
    );
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &rs }, RecvWr { wr_id: 2, sg_list: &rs }])
        .unwrap();
    let e = b.qp.post_recv(&[RecvWr { wr_id: 3, sg_list: &rs }]).unwrap_err();
    assert_eq!(e.err, Error::QueueFull("receive queue"));
}

#[test]
fn cq_overflow_is_an_error() {
    let (a, b) = pair();
    let cq = a.ctx.create_cq(2, None).unwrap();
    let qa = a.pd.create_qp(&cq, &a.rcq, &QpInitAttr::default()).unwrap();
    let qb = b.pd.create_qp(&b.cq, &b.rcq, &QpInitAttr::default()).unwrap();
    qa.connect(all_access(), b.host.addr(), qb.qpn(), 7).unwrap();
    qb.connect(all_access(), a.host.addr(), qa.qpn(), 7).unwrap();
    let s = buf(&a.pd, 8, 0);
    let r = buf(&b.pd, 8, 0);
    let sge = [s.sge(0, 8)];
    let wr = SendWr::new(1, WrOpcode::Write, &sge).remote(r.addr() as u64, r.rkey());
    qa.post_send(&[wr, wr, wr]).unwrap();
    let mut w = [Wc::default(); 4];
    assert_eq!(cq.poll(&mut w).unwrap(), 2);
    assert_eq!(cq.poll(&mut w), Err(Error::CqOverflow));
    assert_eq!(qa.state(), QpState::Err);
}

#[test]
fn qp_not_connected_to_us_is_a_transport_error() {
    let ha = Host::new(HostConfig::default()).unwrap();
    let hb = Host::new(HostConfig::default()).unwrap();
    let a = end(&ha, &QpInitAttr::default());
    let b = end(&hb, &QpInitAttr::default());
    let c = end(&ha, &QpInitAttr::default());
    a.qp.connect(all_access(), hb.addr(), b.qp.qpn(), 7).unwrap();
    // b is connected to c, not to a
    b.qp.connect(all_access(), ha.addr(), c.qp.qpn(), 7).unwrap();
    let r = buf(&b.pd, 8, 0);
    let l = buf(&a.pd, 8, 0);
    let sge = [l.sge(0, 8)];
    expect_fail(
        &a,
        SendWr::new(1, WrOpcode::Write, &sge).remote(r.addr() as u64, r.rkey()),
        WcStatus::RetryExcErr,
    );
    assert_eq!(b.qp.state(), QpState::Rts);
}

#[test]
fn state_machine_rules() {
    let h = Host::new(HostConfig::default()).unwrap();
    let a = end(&h, &QpInitAttr::default());
    assert_eq!(a.qp.state(), QpState::Reset);
    // RESET -> RTR is illegal
    let (at, m) = QpAttr::rtr(h.addr(), 1);
    assert!(matches!(a.qp.modify(&at, m), Err(Error::IllegalTransition { .. })));
    // missing required attributes
    let (at, _) = QpAttr::init(all_access());
    assert!(matches!(
        a.qp.modify(&at, QpAttrMask::STATE),
        Err(Error::InvalidMask(_))
    ));
    // attribute not allowed in this transition
    let (at, m) = QpAttr::init(all_access());
    assert!(matches!(
        a.qp.modify(&at, m | QpAttrMask::SQ_PSN),
        Err(Error::InvalidMask(_))
    ));
    a.qp.modify(&at, m).unwrap();
    assert_eq!(a.qp.state(), QpState::Init);
    assert_eq!(a.qp.query().qp_access_flags, all_access());
    // INIT -> RTS illegal
    let (at, m) = QpAttr::rts(7);
    assert!(a.qp.modify(&at, m).is_err());
    // wrong cur_state
    let at2 = QpAttr {
        qp_state: QpState::Err,
        cur_qp_state: QpState::Rts,
        ..Default::default()
    };
    assert!(a.qp.modify(&at2, QpAttrMask::STATE | QpAttrMask::CUR_STATE).is_err());
    let (at, m) = QpAttr::rtr(h.addr(), a.qp.qpn());
    a.qp.modify(&at, m).unwrap();
    let (at, m) = QpAttr::rts(3);
    a.qp.modify(&at, m).unwrap();
    assert_eq!(a.qp.query().rnr_retry, 3);
    assert_eq!(a.qp.state(), QpState::Rts);
    // RTS -> RTS with an allowed optional attribute
    let at = QpAttr {
        qp_state: QpState::Rts,
        min_rnr_timer: 5,
        ..Default::default()
    };
    a.qp.modify(&at, QpAttrMask::STATE | QpAttrMask::MIN_RNR_TIMER).unwrap();
    // any -> ERR -> RESET -> INIT
    a.qp.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    assert!(a
        .qp
        .modify(
            &QpAttr {
                qp_state: QpState::Rts,
                ..Default::default()
            },
            QpAttrMask::STATE
        )
        .is_err());
    a.qp.modify(
        &QpAttr {
            qp_state: QpState::Reset,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    let (at, m) = QpAttr::init(all_access());
    a.qp.modify(&at, m).unwrap();
}

#[test]
fn object_creation_limits() {
    let cfg = HostConfig {
        max_qp: 4,
        max_mr: 4,
        max_cq: 3,
        ..Default::default()
    };
    let h = Host::new(cfg).unwrap();
    let ctx = h.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    assert!(ctx.create_cq(0, None).is_err());
    assert!(ctx.create_cq(h.config().max_cqe + 1, None).is_err());
    let cq = ctx.create_cq(8, None).unwrap();
    let big = QpInitAttr {
        max_send_wr: h.config().max_wr + 1,
        ..Default::default()
    };
    assert!(pd.create_qp(&cq, &cq, &big).is_err());
    let with_qpn = |qpn: u32| {
        pd.create_qp(
            &cq,
            &cq,
            &QpInitAttr {
                qpn: Some(qpn),
                ..Default::default()
            },
        )
    };
    let q1 = with_qpn(0x12345).unwrap();
    assert_eq!(q1.qpn(), 0x12345);
    assert!(with_qpn(0x12345).is_err());
    assert!(with_qpn(1 << 24).is_err());
    let auto = pd.create_qp(&cq, &cq, &QpInitAttr::default()).unwrap();
    assert!(auto.qpn() < 1 << 23);
    let _q3 = pd.create_qp(&cq, &cq, &QpInitAttr::default()).unwrap();
    let _q4 = pd.create_qp(&cq, &cq, &QpInitAttr::default()).unwrap();
    assert!(matches!(
        pd.create_qp(&cq, &cq, &QpInitAttr::default()),
        Err(Error::NoResources(_))
    ));
    drop(q1);
    let again = with_qpn(0x12345).unwrap();
    assert_eq!(again.qpn(), 0x12345);
    // MR rules
    assert!(pd.reg_mr_owned(vec![0; 8], Access::REMOTE_WRITE).is_err());
    assert!(pd.reg_mr_owned(vec![0; 8], Access::REMOTE_ATOMIC).is_err());
    assert!(pd.reg_mr_owned(vec![], Access::LOCAL_WRITE).is_err());
    let m: Vec<_> = (0..4)
        .map(|_| pd.reg_mr_owned(vec![0; 8], Access::LOCAL_WRITE).unwrap())
        .collect();
    assert!(matches!(
        pd.reg_mr_owned(vec![0; 8], Access::LOCAL_WRITE),
        Err(Error::NoResources(_))
    ));
    let keys: std::collections::HashSet<u32> = m.iter().map(|x| x.lkey()).collect();
    assert_eq!(keys.len(), 4);
    let old = m[0].lkey();
    drop(m);
    let m2 = pd.reg_mr_owned(vec![0; 8], Access::LOCAL_WRITE).unwrap();
    assert_ne!(m2.lkey(), old, "a recycled MR slot gets a new key");
    let d = ctx.query_device();
    assert_eq!((d.max_tlp, d.signature_magic, d.atomic_cap), (256, 0xdeadbeef, 1));
}

/// `Access::ANY_QP` waives the QP's access flags for that MR only: a READ through a
/// QP that grants no remote access reaches an ANY_QP MR with REMOTE_READ, fails with
/// REM_INV_REQ on an ordinary one, and an ANY_QP MR's own rights still apply.
#[test]
fn any_qp_mr_waives_qp_access_flags_only() {
    for cfg in [HostConfig::default(), ring_cfg()] {
        let cases = [
            (Access::REMOTE_READ | Access::ANY_QP, WrOpcode::Read, WcStatus::Success),
            (Access::REMOTE_READ, WrOpcode::Read, WcStatus::RemInvReqErr),
            (
                Access::LOCAL_WRITE | Access::REMOTE_READ | Access::ANY_QP,
                WrOpcode::Write,
                WcStatus::RemAccessErr,
            ),
        ];
        for (i, (macc, op, exp)) in cases.into_iter().enumerate() {
            let ha = Host::new(cfg.clone()).unwrap();
            let hb = Host::new(cfg.clone()).unwrap();
            let a = end(&ha, &QpInitAttr::default());
            let b = end(&hb, &QpInitAttr::default());
            connect(&a, &b, Access::LOCAL_WRITE, 7);
            let l = buf(&a.pd, 64, 0);
            let r = b.pd.reg_mr_owned(vec![5; 64], macc).unwrap();
            let sge = [l.sge(0, 8)];
            let mut wr = SendWr::new(i as u64, op, &sge).remote(r.addr() as u64, r.rkey());
            wr.flags |= SendFlags::SIGNALED;
            if exp == WcStatus::Success {
                a.qp.post_send(&[wr]).unwrap();
                let w = wait1(&a.cq);
                assert_eq!(w.status, exp, "case {i}: {w:?}");
                assert_eq!(l.to_vec(0, 8), vec![5; 8], "case {i}: data read");
            } else {
                expect_fail(&a, wr, exp);
            }
        }
    }
}

/// A standard (passthrough) MR in a protection sub-domain (`Pd::reg_mr_in_domain`,
/// the NP-RDMA layer's temporary MRs) is reached with its rkey only through a
/// QP of that domain: from another domain's QP the READ fails with
/// REM_ACCESS_ERR and the WRITE leaves the bytes as they were.
#[test]
fn a_standard_mr_in_a_sub_domain_is_reached_only_from_that_domain() {
    for cfg in [HostConfig::default(), ring_cfg()] {
        for (qp_domain, ok) in [(5u32, true), (6, false)] {
            let ha = Host::new(cfg.clone()).unwrap();
            let hb = Host::new(cfg.clone()).unwrap();
            let a = end(&ha, &QpInitAttr::default());
            let b = end(&hb, &QpInitAttr::default());
            b.qp.set_domain(qp_domain);
            connect(&a, &b, all_access(), 7);
            let mut mem = vec![7u8; 4096];
            // SAFETY: `mem` outlives the MR (dropped at the end of the iteration,
            // after it).
            let mr = unsafe {
                b.pd.reg_mr_in_domain(mem.as_mut_ptr() as usize, mem.len(), all_access() | Access::ANY_QP, 5)
            }
            .unwrap();
            let l = buf(&a.pd, 64, 9);
            let sge = [l.sge(0, 64)];
            a.qp.post_send(&[SendWr::new(1, WrOpcode::Write, &sge).remote(mr.addr() as u64, mr.rkey())])
                .unwrap();
            let w = wait1(&a.cq);
            if ok {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
            } else {
                assert_eq!(w.status, WcStatus::RemAccessErr, "{w:?}");
            }
            drop(mr);
            assert_eq!(mem[0], if ok { 9 } else { 7 });
        }
    }
}
