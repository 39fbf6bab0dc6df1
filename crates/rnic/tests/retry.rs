//! Transport retries: a request no QP is ready to take (absent, not yet RTR) is what a
//! fabric drops unacknowledged. The requester resends it each transport timeout of its
//! QP (4.096 µs × 2^timeout) and fails it with RETRY_EXC_ERR only once `retry_cnt`
//! resends went unanswered — so a peer that reaches RTR late still gets the message,
//! and a peer that is gone costs the QP's retry budget, as on hardware.

mod common;
use common::*;
use rnic::*;
use std::time::{Duration, Instant};

/// Hosts A and B (made with `cfg`), A's QP connected to B's QP, which stays in INIT.
fn half_connected(cfg: HostConfig, timeout: u8, retry_cnt: u8) -> (End, End) {
    let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg).unwrap());
    let (a, b) = (end(&ha, &QpInitAttr::default()), end(&hb, &QpInitAttr::default()));
    let (at, m) = QpAttr::init(all_access());
    a.qp.modify(&at, m).unwrap();
    b.qp.modify(&at, m).unwrap();
    let (at, m) = QpAttr::rtr(hb.addr(), b.qp.qpn());
    a.qp.modify(&at, m).unwrap();
    let (mut at, m) = QpAttr::rts(7);
    at.timeout = timeout;
    at.retry_cnt = retry_cnt;
    a.qp.modify(&at, m).unwrap();
    (a, b)
}

fn paths() -> [HostConfig; 3] {
    [HostConfig::default(), ring_cfg(), secure_cfg()]
}

#[test]
fn a_peer_reaching_rtr_late_still_gets_the_message() {
    for cfg in paths() {
        // timeout 14: 67 ms per try, 7 resends.
        let (a, b) = half_connected(cfg, 14, 7);
        let src = buf(&a.pd, 64, 0);
        src.write(0, &pattern(64, 5));
        let sge = [src.sge(0, 64)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let (at, m) = QpAttr::rtr(a.host.addr(), a.qp.qpn());
        b.qp.modify(&at, m).unwrap();
        let dst = buf(&b.pd, 64, 0);
        let rs = [dst.sge(0, 64)];
        b.qp.post_recv(&[RecvWr { wr_id: 2, sg_list: &rs }]).unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(wait1(&b.rcq).wr_id, 2);
        assert_eq!(dst.to_vec(0, 64), pattern(64, 5));
    }
}

#[test]
fn no_qp_to_take_it_fails_once_the_retries_ran_out() {
    for cfg in paths() {
        // timeout 12: 16.8 ms per try; 3 resends = 4 tries.
        let (a, b) = half_connected(cfg, 12, 3);
        let src = buf(&a.pd, 64, 0);
        let sge = [src.sge(0, 64)];
        let t = Instant::now();
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        let wc = a.cq.poll_wait(1, Duration::from_secs(5)).unwrap()[0];
        let took = t.elapsed();
        assert_eq!(wc.status, WcStatus::RetryExcErr);
        // Three resends each waited one timeout first: it cannot have come sooner.
        assert!(took >= Duration::from_millis(3 * 16), "{took:?}");
        assert_eq!(a.qp.state(), QpState::Err);
        drop(b);
    }
}
