//! The engine's modes, each over READ/WRITE with remote and local faults:
//! retry mode (Receiver-Ready), page-versioning READ, interrupt mode, and
//! no inline path (every fault through a reverse operation).

mod common;

use std::time::Duration;

use common::*;
use nprdma::{Config, Opcode, SendWr};

const LEN: usize = 128 * 1024;

fn exercise(cfg: Config) -> (nprdma::Stats, nprdma::Stats) {
    let a = side_with(cfg.clone());
    let b = side_with(cfg);
    let (qa, _qb) = connect(&a, &b, 16);
    let cases: [(usize, usize); 4] = [(0, 8), (300, 3000), (4096, 20000), (1000, 70000)];
    for (k, &(off, len)) in cases.iter().enumerate() {
        for fault in 0..4 {
            let pa = pattern(10 + k as u64, LEN);
            let pb = pattern(20 + k as u64, LEN);
            let la = Buf::with(&a, LEN, Some(&pa));
            let rb = Buf::with(&b, LEN, if fault == 2 { None } else { Some(&pb[..]) });
            match fault {
                1 => rb.swap_out(),
                3 => la.swap_out(),
                _ => {}
            }
            let pb = if fault == 2 { vec![0; LEN] } else { pb };
            qa.post_send(&[SendWr::new(
                1,
                Opcode::Read,
                Some(la.mr.sge(off as u64, len as u32)),
                rb.addr() + off as u64,
                rb.mr.rkey(),
            )])
            .unwrap();
            let c = a.cq.poll_wait(1, Duration::from_secs(10));
            assert_eq!(c.len(), 1);
            assert_eq!(c[0].status, 0, "READ {off}+{len} fault {fault}");
            assert!(la.bytes()[off..off + len] == pb[off..off + len]);
            if fault == 1 {
                rb.swap_out();
            }
            let src = LEN - len;
            qa.post_send(&[SendWr::new(
                2,
                Opcode::Write,
                Some(la.mr.sge(src as u64, len as u32)),
                rb.addr() + off as u64,
                rb.mr.rkey(),
            )])
            .unwrap();
            let c = a.cq.poll_wait(1, Duration::from_secs(10));
            assert_eq!(c.len(), 1);
            assert_eq!(c[0].status, 0, "WRITE {off}+{len} fault {fault}");
            let mut want = pb.clone();
            want[off..off + len].copy_from_slice(&la.bytes()[src..src + len]);
            assert!(
                rb.bytes() == &want[..],
                "WRITE data {off}+{len} fault {fault}"
            );
        }
    }
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
    (a.ctx.stats(), b.ctx.stats())
}

#[test]
fn retry_mode() {
    let (sa, sb) = exercise(Config {
        retry_mode: true,
        ..Config::default()
    });
    assert!(sa.retries > 0 && sb.served > 0, "{sa:?} {sb:?}");
}

#[test]
fn versioned_read() {
    let mut cfg = Config::default();
    cfg.plan.read_version_threshold = Some(0);
    let (sa, _) = exercise(cfg);
    assert!(sa.optimistic_ok > 0 && sa.two_sided > 0, "{sa:?}");
}

#[test]
fn interrupt_mode() {
    exercise(Config {
        interrupt_mode: true,
        ..Config::default()
    });
}

#[test]
fn no_inline_path() {
    let mut cfg = Config::default();
    cfg.plan.inline_max = 0;
    exercise(cfg);
}

#[test]
fn readback_only_writes() {
    let mut cfg = Config::default();
    cfg.plan.write_version_threshold = 1 << 20;
    exercise(cfg);
}

/// Two sides checking every READ and WRITE by page versions, connected; the
/// target's pages that the CPU brings back are mapped in at once (the eager
/// swap-in notice).
fn versioned_sides() -> (Side, Side, nprdma::Qp, nprdma::Qp) {
    let mut cfg = Config::default();
    cfg.plan.write_version_threshold = 0;
    cfg.plan.read_version_threshold = Some(0);
    let a = side_with(cfg.clone());
    let pc = vmem::PagerConfig {
        eager_swap_in_notify: true,
        ..pager_cfg()
    };
    let b = side_paged(rnic::HostConfig::default(), pc, cfg);
    let (qa, qb) = connect(&a, &b, 16);
    (a, b, qa, qb)
}

/// An initiator side, its QP, its buffer and the target's buffer.
struct Pair<'a> {
    a: &'a Side,
    qa: &'a nprdma::Qp,
    la: &'a Buf,
    rb: &'a Buf,
}

impl Pair<'_> {
    /// Post one signaled `opcode` of `len` bytes between `la + src` and
    /// `rb + off`, and wait for its successful completion.
    fn op(&self, id: u64, opcode: Opcode, src: usize, off: usize, len: usize) {
        self.qa
            .post_send(&[SendWr::new(
                id,
                opcode,
                Some(self.la.mr.sge(src as u64, len as u32)),
                self.rb.addr() + off as u64,
                self.rb.mr.rkey(),
            )])
            .unwrap();
        let c = self.a.cq.poll_wait(1, Duration::from_secs(10));
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].wr_id, c[0].status), (id, 0), "{opcode:?} {off}+{len}");
    }
}

/// A versioned operation on pages whose versions an earlier check of the QP
/// read leaves out its "before" READ (the seen versions stand in for it);
/// once the pages went out and came back, the check fails and the
/// operation goes two-sided: no byte is lost either way.
#[test]
fn seen_versions_stand_in_for_the_before_read() {
    let (a, b, qa, _qb) = versioned_sides();
    const N: usize = 4 * 4096;
    let la = Buf::with(&a, N, Some(&pattern(1, N)));
    let rb = Buf::with(&b, N, Some(&pattern(2, N)));
    let mut want = pattern(2, N);
    let pair = Pair {
        a: &a,
        qa: &qa,
        la: &la,
        rb: &rb,
    };
    let mut id = 0;
    let mut op = |opcode: Opcode, src: usize, off: usize, len: usize| {
        id += 1;
        pair.op(id, opcode, src, off, len);
    };
    let write = |op: &mut dyn FnMut(Opcode, usize, usize, usize),
                 want: &mut Vec<u8>,
                 src: usize,
                 off: usize,
                 len: usize| {
        op(Opcode::Write, src, off, len);
        want[off..off + len].copy_from_slice(&la.bytes()[src..src + len]);
        assert!(rb.bytes() == &want[..], "WRITE {off}+{len}");
    };
    // First WRITE: nothing seen yet, three WRs.
    write(&mut op, &mut want, 0, 100, 2000);
    let s0 = a.ctx.stats();
    assert_eq!(s0.versions_seen, 0, "{s0:?}");
    // Same page, then two pages of which one was seen: only the first
    // leaves its READ out.
    write(&mut op, &mut want, 4096, 200, 64);
    write(&mut op, &mut want, 8192, 3000, 3000);
    let s1 = a.ctx.stats();
    assert_eq!(s1.versions_seen, 1, "{s1:?}");
    assert_eq!(s1.two_sided, s0.two_sided, "{s1:?}");
    // Both pages seen now: a READ across them leaves its READ out too.
    op(Opcode::Read, 0, 1000, 5000);
    assert!(la.bytes()[..5000] == want[1000..6000]);
    assert_eq!(a.ctx.stats().versions_seen, 2);
    // The pages go out (versions even) and the WRITE uses what was seen
    // before: its check fails, it goes two-sided, and the data lands.
    rb.swap_out();
    write(&mut op, &mut want, 12288, 150, 1000);
    let s2 = a.ctx.stats();
    assert_eq!(s2.versions_seen, 3, "{s2:?}");
    assert!(s2.two_sided > s1.two_sided, "{s2:?}");
    // Out and back in (the CPU reads them, the eager notice maps them in):
    // mapped again, but under newer versions than the ones seen, so the
    // check fails all the same — a seen version vouches for no page that
    // moved since.
    write(&mut op, &mut want, 0, 100, 8);
    write(&mut op, &mut want, 8, 108, 8);
    let s3 = a.ctx.stats();
    assert!(s3.versions_seen > s2.versions_seen, "{s3:?}");
    rb.swap_out();
    let touched: u64 = (0..N).step_by(4096).map(|p| rb.bytes()[p] as u64).sum();
    std::hint::black_box(touched);
    write(&mut op, &mut want, 16, 116, 8);
    let s4 = a.ctx.stats();
    assert_eq!(s4.versions_seen, s3.versions_seen + 1, "{s4:?}");
    assert!(s4.two_sided > s3.two_sided, "{s4:?}");
    // Whatever that left seen, the next ones are right.
    for k in 0..4 {
        write(&mut op, &mut want, 1000 * k, 120 + 8 * k, 8);
        op(Opcode::Read, 8192, 0, N / 2);
        assert!(la.bytes()[8192..8192 + N / 2] == want[..N / 2], "READ {k}");
    }
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}

/// Page-versioned READs and WRITEs one at a time (the lean path, where seen
/// versions stand in for the first READ) while another thread swaps the
/// target's pages out and reads some back in: every byte read is what the
/// model holds, and the target ends with the model's bytes.
#[test]
fn seen_versions_under_swapping() {
    let (a, b, qa, _qb) = versioned_sides();
    const PAGES: usize = 8;
    const N: usize = PAGES * 4096;
    let la = Buf::with(&a, 2 * N, Some(&pattern(3, 2 * N)));
    let rb = Buf::with(&b, N, Some(&pattern(4, N)));
    let pair = Pair {
        a: &a,
        qa: &qa,
        la: &la,
        rb: &rb,
    };
    let mut model = pattern(4, N);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut x = 0x2545_f491_4f6c_dd1du64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = (x % PAGES as u64) as usize;
                b.pager
                    .swap_out(rb.addr() as usize + p * 4096, 4096)
                    .expect("swap out");
                if x % 3 == 0 {
                    // The CPU brings it back (mapped in by the eager notice).
                    std::hint::black_box(rb.bytes()[p * 4096]);
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        });
        // Stops the swapper however this thread leaves (a failed assertion
        // included), so that the scope can end.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for id in 1..=20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly one or two pages, so that the last checks saw them.
            let len = [8usize, 100, 2000, 4096, 6000][(x % 5) as usize];
            let off = ((x >> 8) as usize) % (N - len);
            let src = ((x >> 24) as usize) % (2 * N - len);
            let write = (x >> 40) % 2 == 0;
            let op = if write { Opcode::Write } else { Opcode::Read };
            pair.op(id, op, src, off, len);
            if write {
                model[off..off + len].copy_from_slice(&la.bytes()[src..src + len]);
            } else {
                assert!(
                    la.bytes()[src..src + len] == model[off..off + len],
                    "READ {off}+{len} (op {id})"
                );
            }
        }
    });
    assert!(
        rb.bytes() == &model[..],
        "target memory differs from the model"
    );
    let s = a.ctx.stats();
    assert!(s.versions_seen > 100 && s.two_sided > 0, "{s:?}");
    assert_eq!(
        a.ctx.nic_stats().nonresident_dma + b.ctx.nic_stats().nonresident_dma,
        0
    );
}
