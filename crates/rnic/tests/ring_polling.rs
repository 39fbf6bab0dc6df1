//! An external thread of the target serving its request rings in the NIC thread's
//! place (`Host::set_ring_polling` / `Host::serve_rings`): every request is served
//! exactly once, with the right data, by whichever thread holds the rings, and
//! turning the external polling off serves what rang meanwhile.

mod common;
use common::*;
use rnic::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

fn quiet_nic_cfg() -> HostConfig {
    HostConfig {
        // The NIC thread sleeps right after its work: requests that ring while
        // the external poller is on are left to it (or to the hand-back).
        nic_spin: std::time::Duration::ZERO,
        ..ring_cfg()
    }
}

#[test]
fn external_poller_serves_reads_writes_and_atomics() {
    let (a, b) = pair_cfg(quiet_nic_cfg());
    let t = buf(&b.pd, 8192, 0);
    t.write(0, &pattern(4096, 3));
    let l = buf(&a.pd, 8192, 0);
    b.host.set_ring_polling(true);
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let poller = {
        let (host, stop, served) = (b.host.clone(), stop.clone(), served.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                if host.serve_rings() {
                    served.fetch_add(1, Ordering::Relaxed);
                }
                std::hint::spin_loop();
            }
            host.set_ring_polling(false);
        })
    };
    let before = b.host.stats().ring_requests;
    let n = 200u64;
    for i in 0..n {
        let off = (i as usize * 40) % 4000;
        let rs = [l.sge(0, 32)];
        let ws = [l.sge(4096, 16)];
        let fs = [l.sge(8000, 8)];
        l.write(4096, &pattern(16, i as u8));
        a.qp.post_send(&[
            SendWr::new(1, WrOpcode::Read, &rs).remote(t.addr() as u64 + off as u64, t.rkey()),
            SendWr::new(2, WrOpcode::Write, &ws).remote(t.addr() as u64 + 4096, t.rkey()),
            SendWr::new(3, WrOpcode::FetchAdd { add: 1 }, &fs).remote(t.addr() as u64 + 8176, t.rkey()),
        ])
        .unwrap();
        let wcs = a.cq.poll_wait(3, T).unwrap();
        for (k, w) in wcs.iter().enumerate() {
            assert_eq!((w.wr_id, w.status), (k as u64 + 1, WcStatus::Success), "{w:?}");
        }
        assert_eq!(l.to_vec(0, 32), t.to_vec(off, 32), "READ {i}");
        assert_eq!(t.to_vec(4096, 16), pattern(16, i as u8), "WRITE {i}");
        assert_eq!(
            l.to_vec(8000, 8),
            i.to_le_bytes(),
            "FetchAdd {i} saw every earlier one once"
        );
    }
    stop.store(true, Ordering::Release);
    poller.join().unwrap();
    assert_eq!(t.to_vec(8176, 8), n.to_le_bytes(), "each FetchAdd applied exactly once");
    assert_eq!(b.host.stats().ring_requests - before, 3 * n, "all through the ring");
    assert!(
        served.load(Ordering::Relaxed) > 0,
        "the external poller served requests"
    );
}

#[test]
fn turning_polling_off_serves_what_rang_meanwhile() {
    let (a, b) = pair_cfg(quiet_nic_cfg());
    let t = buf(&b.pd, 4096, 0);
    let l = buf(&a.pd, 4096, 0);
    let mut handed_back = 0;
    for i in 0..100u8 {
        t.write(0, &pattern(64, i));
        b.host.set_ring_polling(true);
        let rs = [l.sge(0, 64)];
        a.qp.post_send(&[SendWr::new(u64::from(i), WrOpcode::Read, &rs).remote(t.addr() as u64, t.rkey())])
            .unwrap();
        // Nobody serves while it is on (the sleeping NIC thread was not woken)...
        std::thread::sleep(std::time::Duration::from_micros(200));
        // ... until it is turned off.
        if b.host.set_ring_polling(false) {
            handed_back += 1;
        }
        let w = a.cq.poll_wait(1, T).unwrap();
        assert_eq!((w[0].wr_id, w[0].status), (u64::from(i), WcStatus::Success));
        assert_eq!(l.to_vec(0, 64), pattern(64, i), "READ {i}");
    }
    // The NIC thread may serve a few itself (its periodic re-check), but the
    // hand-back must have served requests that no wake-up announced.
    assert!(handed_back > 50, "hand-back served {handed_back} of 100");
}

/// One signaled 64 B READ from `a` into `l` of `t`, waited for after a pause
/// (the requester does not spin meanwhile: the target's threads get the cores).
fn read_once(a: &End, l: &OwnedMr, t: &OwnedMr, i: u64) {
    std::thread::sleep(std::time::Duration::from_micros(200));
    let rs = [l.sge(0, 64)];
    a.qp.post_send(&[SendWr::new(i, WrOpcode::Read, &rs).remote(t.addr() as u64, t.rkey())])
        .unwrap();
    let w = a.cq.poll_wait(1, T).unwrap();
    assert_eq!((w[0].wr_id, w[0].status), (i, WcStatus::Success));
}

#[test]
fn a_cq_poll_serves_the_rings_and_counts_a_pass() {
    let (a, b) = pair_cfg(quiet_nic_cfg());
    let t = buf(&b.pd, 4096, 0);
    let l = buf(&a.pd, 4096, 0);
    // Nobody wakes the NIC thread: the target's (empty) CQ polls serve.
    b.host.set_ring_polling(true);
    for i in 0..20u8 {
        t.write(0, &pattern(64, i));
        let passes = b.host.ring_passes();
        let rs = [l.sge(0, 64)];
        a.qp.post_send(&[SendWr::new(u64::from(i), WrOpcode::Read, &rs).remote(t.addr() as u64, t.rkey())])
            .unwrap();
        let mut out = [Wc::default(); 1];
        let t0 = std::time::Instant::now();
        let w = loop {
            assert_eq!(
                b.cq.poll(&mut out).unwrap(),
                0,
                "the target's CQ has nothing of its own"
            );
            if a.cq.poll(&mut out).unwrap() == 1 {
                break out[0];
            }
            assert!(t0.elapsed() < T, "READ {i} not served by the target's CQ polls");
        };
        assert_eq!((w.wr_id, w.status), (u64::from(i), WcStatus::Success));
        assert_eq!(l.to_vec(0, 64), pattern(64, i), "READ {i}");
        // Serving inside a CQ poll is a pass a spinning poller can see.
        assert!(b.host.ring_passes() > passes, "READ {i}: no pass counted");
    }
    b.host.set_ring_polling(false);
}

#[test]
fn the_nic_thread_spins_for_a_passive_target_and_not_beside_a_polling_one() {
    // A spin window far longer than the gaps between requests.
    let (a, b) = pair_cfg(HostConfig {
        nic_spin: std::time::Duration::from_millis(500),
        ..secure_cfg()
    });
    let t = buf(&b.pd, 4096, 7);
    let l = buf(&a.pd, 4096, 0);
    let n = 100;
    read_once(&a, &l, &t, 0);
    // Nobody of the target polls: its NIC thread serves, spinning between requests.
    let before = b.host.stats().nic_sleeps;
    for i in 1..=n {
        read_once(&a, &l, &t, i);
    }
    let passive = b.host.stats().nic_sleeps - before;
    assert!(
        passive <= 5,
        "a passive target's NIC thread slept {passive} times in {n} READs"
    );
    // A thread of the target polls its CQ (and so serves the rings): the NIC
    // thread stops spinning.
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (cq, stop) = (b.cq.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut out = [Wc::default(); 4];
            while !stop.load(Ordering::Acquire) {
                assert_eq!(cq.poll(&mut out).unwrap(), 0);
                std::hint::spin_loop();
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(5));
    let before = b.host.stats().nic_sleeps;
    for i in 1..=n {
        read_once(&a, &l, &t, n + i);
    }
    let polled = b.host.stats().nic_sleeps - before;
    stop.store(true, Ordering::Release);
    poller.join().unwrap();
    assert!(
        polled >= n / 2,
        "beside a thread polling the target's CQ its NIC thread slept only {polled} times in {n} READs"
    );
    assert_eq!(l.to_vec(0, 64), vec![7; 64]);
}

#[test]
fn the_nic_thread_wakes_a_blocked_ring_poller_when_it_serves() {
    let (a, b) = pair_cfg(quiet_nic_cfg());
    let t = buf(&b.pd, 4096, 9);
    let l = buf(&a.pd, 4096, 0);
    // A poller blocked on its completion channel (no CQ of it armed: only
    // the waker can end the wait before the timeout).
    let chan = b.ctx.create_comp_channel().unwrap();
    let id = b.host.add_ring_waker(Arc::new(chan.waker()));
    let waiter = {
        let chan = chan.clone();
        std::thread::spawn(move || chan.get_event_or_wake(Some(T)).map(|c| c.is_none()))
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    read_once(&a, &l, &t, 1);
    assert!(
        matches!(waiter.join().unwrap(), Ok(true)),
        "the READ the NIC thread served woke the blocked poller"
    );
    assert_eq!(l.to_vec(0, 64), vec![9; 64]);
    // While a thread polls the rings, the NIC thread does not serve: no wake-up.
    b.host.set_ring_polling(true);
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (host, stop) = (b.host.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                host.serve_rings();
                std::hint::spin_loop();
            }
        })
    };
    for i in 2..20 {
        read_once(&a, &l, &t, i);
    }
    stop.store(true, Ordering::Release);
    poller.join().unwrap();
    b.host.set_ring_polling(false);
    assert!(
        matches!(
            chan.get_event_or_wake(Some(std::time::Duration::from_millis(1))),
            Err(Error::Timeout)
        ),
        "woken although a thread polled the rings"
    );
    // Removed: no wake-up either.
    b.host.remove_ring_waker(id);
    read_once(&a, &l, &t, 20);
    assert!(matches!(
        chan.get_event_or_wake(Some(std::time::Duration::from_millis(1))),
        Err(Error::Timeout)
    ));
}
