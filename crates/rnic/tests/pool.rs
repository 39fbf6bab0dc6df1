//! The NIC-shared DMA pool: allocation (pinned, bounds, exhaustion, freed on drop)
//! and cross-process SEND / WRITE / READ into and out of pool buffers (memcpy through
//! the peer's pool mapping: byte-exact, the usual key/bounds errors, a dead peer's
//! pool gives an error completion).

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::*;

/// Locked memory of this process (`VmLck` in /proc/self/status), in KiB.
fn vm_locked_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmLck:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn alloc_is_pinned_bounded_and_freed_on_drop() {
    let host = Host::new(HostConfig {
        dma_pool_size: 64 * 4096,
        ..Default::default()
    })
    .unwrap();
    assert!(host.alloc_dma_buffer(0).is_err(), "zero length");
    let b = host.alloc_dma_buffer(5000).unwrap();
    assert_eq!((b.len(), b.addr() % 4096), (5000, 0));
    b.write_at(4990, &[1; 10]).unwrap();
    assert!(b.write_at(4991, &[1; 10]).is_err(), "write past the end");
    assert!(b.write_at(usize::MAX, &[1]).is_err(), "overflowing offset");
    let mut r = [0u8; 12];
    assert!(b.read_at(4990, &mut r).is_err(), "read past the end");
    b.read_at(4988, &mut r[..12]).unwrap();
    assert_eq!(r, [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
    // The rest of the pool (62 pages, 248 KiB) is locked while allocated, and not
    // one page more is available. (Other tests of this binary may lock or unlock a
    // page concurrently: hence the 8 KiB slack.)
    let before = vm_locked_kib();
    let rest = host.alloc_dma_buffer(62 * 4096).unwrap();
    let with = vm_locked_kib();
    assert!(with >= before + 248 - 8, "pinned: VmLck {before} -> {with} KiB");
    assert!(matches!(host.alloc_dma_buffer(1), Err(Error::NoResources(_))));
    drop(rest);
    let after = vm_locked_kib();
    assert!(after + 248 - 8 <= with, "unpinned on drop: VmLck {with} -> {after} KiB");
    let addr = b.addr();
    drop(b);
    // Freed pages come back zeroed (punched out of the memfd) and reusable.
    let all = host.alloc_dma_buffer(64 * 4096).unwrap();
    assert_eq!(all.addr(), addr);
    let mut z = vec![1u8; 64 * 4096];
    all.read_at(0, &mut z).unwrap();
    assert!(z.iter().all(|&x| x == 0), "freed pages were released");
    let off = Host::new(HostConfig {
        dma_pool_size: 0,
        ..Default::default()
    })
    .unwrap();
    assert!(matches!(off.alloc_dma_buffer(64), Err(Error::NoResources(_))));
}

#[test]
fn in_process_send_into_pool_buffer() {
    let (a, b) = pair();
    let rmr =
        b.pd.reg_dma_buffer(b.host.alloc_dma_buffer(4096).unwrap(), all_access())
            .unwrap();
    let rb = rmr.buffer();
    assert_eq!((rmr.addr(), rmr.len()), (rb.addr(), 4096));
    let rs = [rmr.sge(0, 64)];
    b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &rs }]).unwrap();
    let src = buf(&a.pd, 64, 0);
    src.write(0, &pattern(64, 3));
    a.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &[src.sge(0, 64)])])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::Success);
    let w = wait1(&b.rcq);
    assert_eq!((w.wr_id, w.status, w.byte_len), (5, WcStatus::Success, 64));
    let mut got = [0u8; 64];
    rb.read_at(0, &mut got).unwrap();
    assert_eq!(got[..], pattern(64, 3)[..]);
    assert_eq!(a.host.stats().pool_copies, 0, "in-process copies are plain memmoves");
}

const POOL: usize = 64 * 1024;

/// The passive side: a RECV buffer and a READ/WRITE target in its DMA pool.
#[test]
fn pool_child() {
    if std::env::var("RNIC_POOL_CHILD").is_err() {
        return;
    }
    // The pool's memcpy path is between trusting hosts only (see `connect_child`);
    // 4 KiB ring slots (the trusted protocol's former default): READ/WRITE above
    // that size go direct, through the pool mapping.
    let host = Host::new(HostConfig {
        trusted_peers: true,
        ring_max: 4096,
        ..Default::default()
    })
    .unwrap();
    let e = end(&host, &QpInitAttr::default());
    let rb = host.alloc_dma_buffer(4096).unwrap();
    let tb = host.alloc_dma_buffer(POOL).unwrap();
    tb.write_at(0, &pattern(POOL, 0x5a)).unwrap();
    // SAFETY: both buffers live until the process exits (the MRs are leaked with them).
    let (rmr, tmr) = unsafe {
        (
            e.pd.reg_mr(rb.addr(), rb.len(), all_access()).unwrap(),
            e.pd.reg_mr(tb.addr(), tb.len(), all_access()).unwrap(),
        )
    };
    let info = format!("{} {} {} {}", host.addr().to_hex(), e.qp.qpn(), tmr.addr(), tmr.rkey());
    serve(&info, |w| {
        let reply = match w {
            ["PEER", a, q] => {
                e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                    .unwrap();
                let rs = [rmr.sge(0, 4096)];
                for id in [11, 12] {
                    e.qp.post_recv(&[RecvWr {
                        wr_id: id,
                        sg_list: &rs,
                    }])
                    .unwrap();
                }
                "READY".to_string()
            }
            ["RECV", len, seed] => match e.rcq.poll_wait(1, T) {
                Ok(v) => {
                    let len: usize = len.parse().unwrap();
                    let mut got = vec![0u8; len];
                    rb.read_at(0, &mut got).unwrap();
                    let ok = got == pattern(len, seed.parse().unwrap());
                    format!("WC {} {:?} {} {}", v[0].wr_id, v[0].status, v[0].byte_len, ok)
                }
                Err(err) => format!("ERR {err}"),
            },
            ["CHECK", off, len, seed] => {
                let (off, len): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                let mut got = vec![0u8; len];
                tb.read_at(off, &mut got).unwrap();
                if got == pattern(len, seed.parse().unwrap()) {
                    "OK".into()
                } else {
                    "BAD".into()
                }
            }
            ["IOVA"] => {
                // An IOVA MR over the pool buffer's frames at an unrelated VA (the VA
                // only addresses the MR): the translated frames are pool memory.
                let io = host.iommu();
                let n = (POOL / 4096) as u64;
                let range = io.alloc_range(n).unwrap();
                let frames: Vec<Frame> = (0..n as usize).map(|i| Frame::Ram(tb.addr() + i * 4096)).collect();
                // SAFETY: `tb` lives until the process exits.
                unsafe { io.map_range(&range, 0, &frames).unwrap() };
                let va = 0x10_0000_0000usize;
                // SAFETY: as above; the VA is never dereferenced.
                let mr = unsafe { e.pd.reg_mr_iova(va, POOL, all_access(), &range).unwrap() };
                let r = format!("IOVA {} {}", va, mr.rkey());
                std::mem::forget((mr, range));
                r
            }
            ["STATE"] => format!("STATE {:?}", e.qp.state()),
            ["EXIT"] => return None,
            _ => "?".into(),
        };
        Some(reply)
    });
    std::mem::forget((rmr, tmr, rb, tb));
}

const REPLIES: &[&str] = &["INFO", "READY", "OK", "BAD", "WC", "ERR", "STATE", "IOVA"];

struct Peer {
    c: Child,
    host: Host,
    e: End,
    taddr: u64,
    trkey: u32,
}

/// A trusting host connected to a trusting child: peers copy into a pool directly only
/// when both hosts opted into `HostConfig::trusted_peers` (otherwise the target's NIC
/// thread serves every request, pool or not: `tests/xproc.rs`).
fn connect_child(cfg: HostConfig) -> Peer {
    let cfg = HostConfig {
        trusted_peers: true,
        ..cfg
    };
    let mut c = Child::spawn("pool_child", "RNIC_POOL_CHILD", "1", REPLIES);
    let info = c.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let raddr = HostAddr::from_hex(f[1]).unwrap();
    assert_ne!(raddr.pid, std::process::id());
    let host = Host::new(cfg).unwrap();
    let e = end(&host, &QpInitAttr::default());
    e.qp.connect(all_access(), raddr, f[2].parse().unwrap(), 7).unwrap();
    assert_eq!(c.cmd(&format!("PEER {} {}", host.addr().to_hex(), e.qp.qpn())), "READY");
    Peer {
        c,
        host,
        e,
        taddr: f[3].parse().unwrap(),
        trkey: f[4].parse().unwrap(),
    }
}

fn post1(e: &End, op: WrOpcode, sge: Sge, raddr: u64, rkey: u32) -> Wc {
    e.qp.post_send(&[SendWr::new(1, op, &[sge]).remote(raddr, rkey)])
        .unwrap();
    wait1(&e.cq)
}

#[test]
fn cross_process_send_write_read_through_the_pool() {
    for cfg in [
        HostConfig::default(),
        // Nothing through the target's NIC-thread ring: every READ/WRITE direct.
        HostConfig {
            ring_rw_max: Some(0),
            ..Default::default()
        },
    ] {
        let mut p = connect_child(cfg);
        let local = buf(&p.e.pd, POOL, 0);
        let c0 = p.host.stats().pool_copies;

        // SEND 64 B and 4000 B into the child's pool RECV buffer.
        for (i, (len, seed)) in [(64usize, 7u8), (4000, 8)].into_iter().enumerate() {
            local.write(0, &pattern(len, seed));
            let wc = post1(&p.e, WrOpcode::Send, local.sge(0, len as u32), 0, 0);
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(
                p.c.cmd(&format!("RECV {len} {seed}")),
                format!("WC {} Success {len} true", 11 + i)
            );
        }
        let c1 = p.host.stats().pool_copies;
        assert!(c1 >= c0 + 2, "SENDs copied through the pool mapping");

        // WRITE small (would be a ring request if not in the pool) and large.
        for (len, off, seed) in [(8usize, 0usize, 21u8), (3000, 100, 22), (POOL - 4096, 4096, 23)] {
            local.write(0, &pattern(len, seed));
            let wc = post1(
                &p.e,
                WrOpcode::Write,
                local.sge(0, len as u32),
                p.taddr + off as u64,
                p.trkey,
            );
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, len as u32), "WRITE {len}");
            assert_eq!(p.c.cmd(&format!("CHECK {off} {len} {seed}")), "OK", "WRITE {len}");
        }
        // READ back what the last WRITE left and the untouched pattern around it.
        for (len, off) in [(2usize, 4096usize), (4096, 4096), (POOL - 4096, 4096)] {
            local.fill(0);
            let wc = post1(
                &p.e,
                WrOpcode::Read,
                local.sge(0, len as u32),
                p.taddr + off as u64,
                p.trkey,
            );
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, len as u32), "READ {len}");
            assert_eq!(local.to_vec(0, len), pattern(POOL - 4096, 23)[..len], "READ {len} data");
        }
        assert!(
            p.host.stats().pool_copies >= c1 + 6,
            "READ/WRITE copied through the pool mapping"
        );
        assert_eq!(p.host.stats().nonresident_dma, 0);

        // Bounds and key errors are unchanged: one byte past the pool MR, a bad rkey.
        let wc = post1(
            &p.e,
            WrOpcode::Write,
            local.sge(0, 2),
            p.taddr + POOL as u64 - 1,
            p.trkey,
        );
        assert_eq!(wc.status, WcStatus::RemAccessErr, "past the MR end");
        assert_eq!(p.c.cmd(&format!("CHECK {} 1 23", POOL - 1)), "BAD");
        assert_eq!(
            p.c.cmd("STATE"),
            "STATE Err",
            "a responder error moves the target QP to ERR"
        );
        drop(p);

        let mut p = connect_child(HostConfig {
            ring_rw_max: Some(0),
            ..Default::default()
        });
        let local = buf(&p.e.pd, 64, 0);
        let wc = post1(&p.e, WrOpcode::Read, local.sge(0, 8), p.taddr, p.trkey ^ 0x40);
        assert_eq!(wc.status, WcStatus::RemAccessErr, "bad rkey");
        assert_eq!(p.c.cmd("STATE"), "STATE Err");
    }
}

#[test]
fn cross_process_iova_mr_over_pool_frames() {
    for cfg in [
        HostConfig::default(),
        HostConfig {
            ring_rw_max: Some(0),
            ..Default::default()
        },
    ] {
        let mut p = connect_child(cfg);
        let r = p.c.cmd("IOVA");
        let f: Vec<&str> = r.split_whitespace().collect();
        let (va, rkey): (u64, u32) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        let local = buf(&p.e.pd, POOL, 0);
        let c0 = p.host.stats().pool_copies;
        for (len, off, seed) in [(8usize, 8usize, 41u8), (5000, 4000, 42), (POOL - 8192, 8192, 43)] {
            local.write(0, &pattern(len, seed));
            let wc = post1(&p.e, WrOpcode::Write, local.sge(0, len as u32), va + off as u64, rkey);
            assert_eq!(wc.status, WcStatus::Success, "IOVA WRITE {len}");
            assert_eq!(p.c.cmd(&format!("CHECK {off} {len} {seed}")), "OK", "IOVA WRITE {len}");
            local.fill(0);
            let wc = post1(&p.e, WrOpcode::Read, local.sge(0, len as u32), va + off as u64, rkey);
            assert_eq!(wc.status, WcStatus::Success, "IOVA READ {len}");
            assert_eq!(local.to_vec(0, len), pattern(len, seed), "IOVA READ {len} data");
        }
        // Large ones are always direct; with ring_rw_max = 0 all six are.
        assert!(
            p.host.stats().pool_copies >= c0 + 2,
            "IOVA pages over pool frames use the pool mapping"
        );
        let wc = post1(&p.e, WrOpcode::Read, local.sge(0, 16), va + POOL as u64 - 8, rkey);
        assert_eq!(wc.status, WcStatus::RemAccessErr, "past the IOVA MR end");
    }
}

#[test]
fn a_dead_peers_pool_gives_error_completions() {
    for (kill, op) in [
        (true, WrOpcode::Send),
        (true, WrOpcode::Write),
        (true, WrOpcode::Read),
        (false, WrOpcode::Send),
    ] {
        let mut p = connect_child(HostConfig {
            ring_rw_max: Some(0),
            ..Default::default()
        });
        let local = buf(&p.e.pd, 4096, 0);
        local.write(0, &pattern(64, 1));
        assert_eq!(
            post1(&p.e, WrOpcode::Send, local.sge(0, 64), 0, 0).status,
            WcStatus::Success
        );
        assert_eq!(p.c.cmd("RECV 64 1"), "WC 11 Success 64 true");
        if kill {
            p.c.child.kill().unwrap();
        } else {
            // Orderly exit: the child drops its QP and host.
            use std::io::Write;
            writeln!(p.c.inp, "EXIT").unwrap();
            p.c.inp.flush().unwrap();
        }
        p.c.child.wait().unwrap();
        // The child's segment and pool stay mapped here; after a kill its QP record
        // still looks connected (and RECV 12 is still posted), so only the liveness
        // check stands between this WR and orphaned memory.
        let before = p.host.stats().pool_copies;
        let wc = post1(&p.e, op, local.sge(0, 64), p.taddr, p.trkey);
        assert_ne!(wc.status, WcStatus::Success, "{op:?} to a dead peer (kill={kill})");
        assert_eq!(
            p.host.stats().pool_copies,
            before,
            "nothing copied into a dead peer's pool"
        );
    }
}
