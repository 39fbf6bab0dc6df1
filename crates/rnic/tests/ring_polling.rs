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
