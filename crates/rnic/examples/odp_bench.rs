//! ODP-model costs on the software RNIC (a MODEL of an ODP NIC, not hardware): READ
//! latency of a pinned-style MR vs an ON_DEMAND MR with no fault, a local fault (NIC->host
//! interrupt round trip to the NIC thread) and a remote fault (NAK + `odp_timeout`
//! retransmission). Two hosts in one process.
//!
//! `cargo run --release -p rnic --example odp_bench [-- SIZE]`

use rnic::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const P: usize = 4096;

struct Side {
    host: Host,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    _rcq: Cq,
}

fn side(host: &Host) -> Side {
    let ctx = host.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let rcq = ctx.create_cq(64, None).unwrap();
    let qp = pd.create_qp(&cq, &rcq, &QpInitAttr::default()).unwrap();
    Side {
        host: host.clone(),
        pd,
        cq,
        qp,
        _rcq: rcq,
    }
}

fn acc() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE
}

/// Page-aligned leaked buffer (lives for the whole run).
fn pages(n: usize) -> usize {
    let v = vec![0u8; (n + 1) * P].leak();
    (v.as_mut_ptr() as usize + P - 1) & !(P - 1)
}

fn read_lat(a: &Side, l: (usize, u32), r: (usize, u32), size: usize, iters: usize, before: impl Fn()) -> Vec<f64> {
    let sge = [Sge {
        addr: l.0 as u64,
        length: size as u32,
        lkey: l.1,
    }];
    let mut wc = [Wc::default(); 1];
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        before();
        let t = Instant::now();
        let wr = SendWr {
            remote_addr: r.0 as u64,
            rkey: r.1,
            ..SendWr::new(1, WrOpcode::Read, &sge)
        };
        a.qp.post_send(&[wr]).unwrap();
        loop {
            if a.cq.poll(&mut wc).unwrap() == 1 {
                break;
            }
        }
        assert_eq!(wc[0].status, WcStatus::Success);
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(|x, y| x.partial_cmp(y).unwrap());
    v
}

fn row(name: &str, v: &[f64]) {
    let avg = v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "{name:<28} {:>6} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
        v.len(),
        v[0],
        v[v.len() / 2],
        avg,
        v[v.len() * 99 / 100]
    );
}

fn main() {
    let size: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    assert!(size <= P);
    let cfg = HostConfig::default();
    let (ha, hb) = (Host::new(cfg.clone()).unwrap(), Host::new(cfg.clone()).unwrap());
    let (a, b) = (side(&ha), side(&hb));
    a.qp.connect(acc(), hb.addr(), b.qp.qpn(), 7).unwrap();
    b.qp.connect(acc(), ha.addr(), a.qp.qpn(), 7).unwrap();
    for h in [&ha, &hb] {
        h.set_odp_fault_handler(Arc::new(|_, _| Ok(())));
    }
    let (la, ra) = (pages(1), pages(1));
    let (loda, roda) = (pages(1), pages(1));
    ha.frames().track(loda, P, true).unwrap();
    hb.frames().track(roda, P, true).unwrap();
    // SAFETY: leaked buffers live for the whole process.
    let (ml, mr, mlo, mro) = unsafe {
        (
            a.pd.reg_mr(la, P, acc()).unwrap(),
            b.pd.reg_mr(ra, P, acc()).unwrap(),
            a.pd.reg_mr(loda, P, acc() | Access::ON_DEMAND).unwrap(),
            b.pd.reg_mr(roda, P, acc() | Access::ON_DEMAND).unwrap(),
        )
    };
    println!(
        "# ODP MODEL (software RNIC, not hardware): {size} B READ, odp_timeout {:?}",
        cfg.odp_timeout
    );
    println!(
        "{:<28} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "case", "iters", "min_us", "p50_us", "avg_us", "p99_us"
    );
    let (l, r) = ((la, ml.lkey()), (ra, mr.rkey()));
    let (lo, ro) = ((loda, mlo.lkey()), (roda, mro.rkey()));
    read_lat(&a, l, r, size, 2000, || ()); // warm-up
    row("pinned-style MR", &read_lat(&a, l, r, size, 20000, || ()));
    row("ODP MR, no fault", &read_lat(&a, lo, ro, size, 20000, || ()));
    let s0 = ha.stats();
    row(
        "ODP local fault",
        &read_lat(&a, lo, ro, size, 1000, || a.host.odp_invalidate(loda, P).unwrap()),
    );
    let s1 = ha.stats();
    row(
        "ODP remote fault",
        &read_lat(&a, lo, ro, size, 100, || b.host.odp_invalidate(roda, P).unwrap()),
    );
    let s2 = ha.stats();
    println!(
        "# counters: local faults {} (of 1000), remote faults {} (of 100), retransmissions {}, nonresident_dma {}",
        s1.odp_faults_local - s0.odp_faults_local,
        s2.odp_faults_remote - s1.odp_faults_remote,
        s2.retransmissions - s1.retransmissions,
        s2.nonresident_dma + hb.stats().nonresident_dma
    );
    let _ = (Duration::ZERO, &b.cq, &b.host);
}
