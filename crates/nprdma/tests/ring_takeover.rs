//! The polling thread and the NIC thread on a passive target, with
//! `Config::ring_takeover`: after a pause long enough for the target's
//! polling thread to block, a stream of peers' READs wakes it through the NIC
//! thread (`Nic::add_ring_waker`), and it takes the request rings back — the
//! NIC thread does not serve the stream with a sleep and a wake-up per
//! request.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_blocked_polling_thread_takes_the_rings_back_from_the_nic_thread() {
    // Target-enforced protection inside one process (every READ through the
    // target's request ring), and a NIC thread that sleeps right after its
    // work (the shim's NP-RDMA setting).
    let hc = rnic::HostConfig {
        inproc_ring: true,
        nic_spin: Duration::ZERO,
        ..rnic::HostConfig::default()
    };
    let cfg = nprdma::Config {
        ring_takeover: true,
        ..nprdma::Config::default()
    };
    let a = side_on(hc.clone(), cfg.clone());
    let b = side_on(hc, cfg);
    let (qa, _qb) = connect(&a, &b, 16);
    let pb = pattern(5, 4096);
    let la = Buf::with(&a, 4096, None);
    let rb = Buf::with(&b, 4096, Some(&pb));
    let read = |id: u64| {
        qa.post_send(&[rd(id, &la, 0, &rb, 0, 64)]).expect("post");
        let c = wait1(&a.cq);
        assert_eq!((c.wr_id, c.status), (id, 0));
        assert!(la.bytes()[..64] == pb[..64], "READ {id}");
    };
    for id in 0..10 {
        read(id);
    }
    for round in 0..3u64 {
        // Long enough for the target's polling thread to block (its spin
        // window is at most 40 × 50 µs).
        std::thread::sleep(Duration::from_millis(50));
        let before = b.host.stats().nic_sleeps;
        let n = 300;
        for i in 0..n {
            read(1000 * (round + 1) + i);
        }
        let sleeps = b.host.stats().nic_sleeps - before;
        // Without the takeover the NIC thread sleeps once per READ (301 for 300
        // with `ring_takeover: false`); with it 0–79 were seen on the 2-core VM,
        // the high ones while the machine was loaded (n / 10 failed 5 of 20 runs
        // there on main before this bound): a third separates the two.
        assert!(
            sleeps <= n / 3,
            "round {round}: the target's NIC thread slept {sleeps} times serving {n} READs"
        );
    }
}
