//! NP-RDMA vs pinned RDMA on the same software NIC, in one run:
//! READ/WRITE latency 2 B..64 KiB, throughput, remote minor-fault and
//! major-fault 2 B READ latency, and the swap device's 4 KiB read latency.
//!
//! `cargo run --release -p nprdma --example bench [iters]`
//!
//! `NPRDMA_WRITE_VERSION_THRESHOLD=n` / `NPRDMA_READ_VERSION_THRESHOLD=n`
//! override the plan's thresholds (WRITEs / READs longer than `n` use page
//! versions), so the two checking methods can be compared in one binary.

use std::io::Read;
use std::time::{Duration, Instant};

use nprdma::{Access, Config, Context, Opcode, SendWr};
use rnic::{Wc, WrOpcode};

const SIZES: [usize; 7] = [2, 64, 512, 4096, 16384, 65536, 262144];
/// Buffer size: room for 128 distinct 256 KiB slots.
const BUF: usize = 32 << 20;

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = v[v.len() / 2];
    let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
    let avg = v.iter().sum::<f64>() / v.len() as f64;
    (med, avg, p99)
}

struct Pinned {
    qp: rnic::Qp,
    cq: rnic::Cq,
    l: rnic::Mr,
    r: rnic::Mr,
    _q2: rnic::Qp,
    /// The same buffers registered through IOVA ranges statically mapped to
    /// their pages (pinned RDMA with the IOMMU in the path).
    li: rnic::Mr,
    ri: rnic::Mr,
}

/// A page-aligned pinned buffer for the whole run (leaked on purpose).
fn aligned_buf(fill: u8) -> usize {
    let v: &'static mut [u8] = Box::leak(vec![fill; BUF + 4096].into_boxed_slice());
    let a = v.as_mut_ptr() as usize;
    (a + 4095) & !4095
}

fn plain_mr(pd: &rnic::Pd, addr: usize, acc: rnic::Access) -> rnic::Mr {
    // SAFETY: leaked heap buffer, valid for the whole process.
    #[allow(unsafe_code)]
    unsafe {
        pd.reg_mr(addr, BUF, acc).unwrap()
    }
}

fn iova_mr(h: &rnic::Host, pd: &rnic::Pd, m: &rnic::Mr, acc: rnic::Access) -> rnic::Mr {
    let n = (m.len() / 4096) as u64;
    let r = h.iommu().alloc_range(n).unwrap();
    for i in 0..n {
        // SAFETY: the leaked, page-aligned heap buffer lives forever.
        #[allow(unsafe_code)]
        unsafe {
            h.iommu()
                .map(r.base + i, rnic::Frame::Ram(m.addr() + i as usize * 4096))
                .unwrap();
        }
    }
    // SAFETY: as above.
    #[allow(unsafe_code)]
    unsafe {
        pd.reg_mr_iova(m.addr(), m.len(), acc, &r).unwrap()
    }
}

fn pinned_setup(ha: &rnic::Host, hb: &rnic::Host) -> Pinned {
    let acc = rnic::Access::LOCAL_WRITE | rnic::Access::REMOTE_READ | rnic::Access::REMOTE_WRITE;
    let (ca, cb) = (ha.open_context().unwrap(), hb.open_context().unwrap());
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let cq = ca.create_cq(4096, None).unwrap();
    let cq2 = cb.create_cq(4096, None).unwrap();
    let attr = rnic::QpInitAttr {
        max_send_wr: 256,
        ..Default::default()
    };
    let qp = pa.create_qp(&cq, &cq, &attr).unwrap();
    let q2 = pb.create_qp(&cq2, &cq2, &attr).unwrap();
    qp.connect(acc, hb.addr(), q2.qpn(), 7).unwrap();
    q2.connect(acc, ha.addr(), qp.qpn(), 7).unwrap();
    let l = plain_mr(&pa, aligned_buf(1), acc);
    let r = plain_mr(&pb, aligned_buf(2), acc);
    let li = iova_mr(ha, &pa, &l, acc);
    let ri = iova_mr(hb, &pb, &r, acc);
    Pinned {
        qp,
        cq,
        l,
        r,
        _q2: q2,
        li,
        ri,
    }
}

fn pinned_op(p: &Pinned, op: WrOpcode, len: usize, id: u64, iova: bool) {
    let (sge, rkey) = if iova {
        ([p.li.sge(0, len as u32)], p.ri.rkey())
    } else {
        ([p.l.sge(0, len as u32)], p.r.rkey())
    };
    p.qp.post_send(&[rnic::SendWr::new(id, op, &sge).remote(p.r.addr() as u64, rkey)])
        .unwrap();
    let mut wc = [Wc::default(); 1];
    loop {
        if p.cq.poll(&mut wc).unwrap() == 1 {
            assert!(wc[0].status.is_ok(), "{:?}", wc[0]);
            return;
        }
    }
}

/// Offset of op `i` of a throughput loop: 0 (every op on the same
/// buffers, as perftest does), or with `distinct` a separate `len`-sized
/// slot per op of the window (no two ops in flight overlap).
fn slot_off(i: usize, len: usize, window: usize, distinct: bool) -> usize {
    if distinct {
        // More slots than ops in flight (the NP-RDMA loop keeps up to
        // window + 1 signaled, or 3 x 16 unsignaled, outstanding).
        (i % (BUF / len).clamp(1, 4 * window)) * len
    } else {
        0
    }
}

/// The NIC floor of NP-RDMA's small WRITE: a WRITE plus a READ of the same
/// remote bytes into a second local buffer, one chain, only the READ
/// signaled — on plain pinned MRs, no engine.
fn pinned_write_readback(p: &Pinned, len: usize, id: u64) {
    let src = [p.l.sge(0, len as u32)];
    let dst = [p.l.sge(BUF / 2, len as u32)];
    let raddr = p.r.addr() as u64;
    let mut w = rnic::SendWr::new(id, WrOpcode::Write, &src).remote(raddr, p.r.rkey());
    w.flags.remove(rnic::SendFlags::SIGNALED);
    let r = rnic::SendWr::new(id, WrOpcode::Read, &dst).remote(raddr, p.r.rkey());
    p.qp.post_send(&[w, r]).unwrap();
    let mut wc = [Wc::default(); 1];
    loop {
        if p.cq.poll(&mut wc).unwrap() == 1 {
            assert!(wc[0].status.is_ok(), "{:?}", wc[0]);
            return;
        }
    }
}

fn pinned_tput(
    p: &Pinned,
    op: WrOpcode,
    len: usize,
    n: usize,
    window: usize,
    iova: bool,
    distinct: bool,
) -> f64 {
    let (l, r) = if iova { (&p.li, &p.ri) } else { (&p.l, &p.r) };
    let mut wc = [Wc::default(); 32];
    let (mut posted, mut done) = (0, 0);
    let t0 = Instant::now();
    while done < n {
        while posted < n && posted - done < window {
            let off = slot_off(posted, len, window, distinct);
            let sge = [l.sge(off, len as u32)];
            p.qp.post_send(&[rnic::SendWr::new(posted as u64, op, &sge)
                .remote(p.r.addr() as u64 + off as u64, r.rkey())])
                .unwrap();
            posted += 1;
        }
        done += p.cq.poll(&mut wc).unwrap();
    }
    (n * len) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

struct Np {
    qp: nprdma::Qp,
    cq: nprdma::Cq,
    l: (vmem::Region, nprdma::Mr),
    r: (vmem::Region, nprdma::Mr),
}

fn np_buf(
    pd: &nprdma::Pd,
    pager: &vmem::Pager,
    len: usize,
    fill: Option<u8>,
) -> (vmem::Region, nprdma::Mr) {
    let mut reg = pager.alloc(len).unwrap();
    if let Some(b) = fill {
        reg.as_mut_slice().fill(b);
    }
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    // SAFETY: pager-allocated private anonymous memory, dropped after the MR
    // (the tuple is dropped in order... the MR is dropped explicitly first below).
    #[allow(unsafe_code)]
    let mr = unsafe { pd.reg_mr(reg.addr() as u64, len as u64, acc) }.unwrap();
    (reg, mr)
}

/// A connected QP pair between two contexts: the CQs (send and receive of
/// `a`, then of `b`; `cqe` entries for the send CQs) and the two QPs.
fn qp_pair(
    (ca, pda): (&Context, &nprdma::Pd),
    (cb, pdb): (&Context, &nprdma::Pd),
    cqe: u32,
    depth: u32,
) -> ([nprdma::Cq; 4], nprdma::Qp, nprdma::Qp) {
    let cqs = [
        ca.create_cq(cqe).unwrap(),
        ca.create_cq(16).unwrap(),
        cb.create_cq(cqe).unwrap(),
        cb.create_cq(16).unwrap(),
    ];
    let qa = pda.create_qp(&cqs[0], &cqs[1], depth).unwrap();
    let qb = pdb.create_qp(&cqs[2], &cqs[3], depth).unwrap();
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    (cqs, qa, qb)
}

fn np_op(n: &Np, op: Opcode, len: usize, raddr: u64, rkey: u32, id: u64) {
    n.qp.post_send(&[SendWr::new(
        id,
        op,
        Some(n.l.1.sge(0, len as u32)),
        raddr,
        rkey,
    )])
    .unwrap();
    let mut c = [nprdma::Completion::default(); 1];
    loop {
        if n.cq.poll(&mut c) == 1 {
            assert_eq!(c[0].status, 0, "{:?}", c[0]);
            return;
        }
    }
}

fn np_tput(
    n: &Np,
    op: Opcode,
    len: usize,
    cnt: usize,
    window: usize,
    signal_every: usize,
    distinct: bool,
) -> f64 {
    let mut c = [nprdma::Completion::default(); 32];
    let (mut posted, mut done) = (0usize, 0usize);
    let t0 = Instant::now();
    let sig_total = cnt / signal_every;
    let mut sig_done = 0;
    while sig_done < sig_total {
        while posted < cnt && posted / signal_every - done < window / signal_every.max(1) + 1 {
            let off = slot_off(posted, len, window, distinct);
            let mut wr = SendWr::new(
                posted as u64,
                op,
                Some(n.l.1.sge(off as u64, len as u32)),
                n.r.0.addr() as u64 + off as u64,
                n.r.1.rkey(),
            );
            wr.signaled = (posted + 1) % signal_every == 0;
            match n.qp.post_send(&[wr]) {
                Ok(()) => posted += 1,
                Err(_) => break,
            }
        }
        let k = n.cq.poll(&mut c);
        for x in &c[..k] {
            assert_eq!(x.status, 0);
        }
        sig_done += k;
        done = sig_done;
    }
    (cnt * len) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let mut cfg = Config::default();
    if let Some(us) = std::env::var("NPRDMA_SPIN_US")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        cfg.spin = Duration::from_micros(us);
    }
    if let Some(t) = std::env::var("NPRDMA_WRITE_VERSION_THRESHOLD")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        cfg.plan.write_version_threshold = t;
    }
    if let Some(t) = std::env::var("NPRDMA_READ_VERSION_THRESHOLD")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        cfg.plan.read_version_threshold = Some(t);
    }
    let ha = rnic::Host::new(rnic::HostConfig::default()).unwrap();
    let hb = rnic::Host::new(rnic::HostConfig::default()).unwrap();
    let pcfg = vmem::PagerConfig {
        swap_size: 512 << 20,
        ..Default::default()
    };
    let (pga, pgb) = (
        vmem::Pager::new(pcfg.clone()).unwrap(),
        vmem::Pager::new(pcfg).unwrap(),
    );
    let (ca, cb) = (
        Context::new(&ha, &pga, cfg.clone()).unwrap(),
        Context::new(&hb, &pgb, cfg).unwrap(),
    );
    let (pda, pdb) = (ca.alloc_pd(), cb.alloc_pd());
    let ([cqa, rcqa, cqb, rcqb], qa, qb) = qp_pair((&ca, &pda), (&cb, &pdb), 4096, 256);
    let np = Np {
        qp: qa,
        cq: cqa,
        l: np_buf(&pda, &pga, BUF, Some(1)),
        r: np_buf(&pdb, &pgb, BUF, Some(2)),
    };
    let pin = pinned_setup(&ha, &hb);
    if let Ok(which) = std::env::var("NPRDMA_BENCH_PROF") {
        // Profiling mode: only the NP-RDMA `which` (read|write) loop of
        // NPRDMA_BENCH_PROF_LEN bytes (default 2), e.g. under callgrind.
        let len = std::env::var("NPRDMA_BENCH_PROF_LEN")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2usize);
        if let Some(w) = which.strip_prefix("tput-") {
            // `tput-read` / `tput-write`: the window-32 signaled throughput
            // loop (`tput-write-u`: unsignaled, 1 of 16 signaled).
            let signal_every = if w.ends_with("-u") { 16 } else { 1 };
            let op = if w.starts_with("write") {
                Opcode::Write
            } else {
                Opcode::Read
            };
            let cnt = (iters / 16).max(1) * 16;
            let distinct = std::env::var("NPRDMA_BENCH_DISTINCT").is_ok_and(|v| v == "1");
            let g = np_tput(&np, op, len, cnt, 32, signal_every, distinct);
            let us = len as f64 / g / 1e3;
            println!("prof {which} {len} B x {cnt}: {g:.3} GB/s, {us:.3} us/op");
            if std::env::var("NPRDMA_BENCH_STATS").is_ok_and(|v| v == "1") {
                println!("initiator stats: {:?}", ca.stats());
            }
            return;
        }
        if which == "hog" {
            // `hog`: one QP READs NPRDMA_BENCH_PROF_LEN bytes (default 64
            // MiB) of swapped-out target memory; meanwhile a second QP of the
            // same contexts runs 8 B FETCH_ADDs (always served by the
            // target's CPU) back to back. Their latencies say how long the
            // large request keeps the target from serving anybody else.
            let big = std::env::var("NPRDMA_BENCH_PROF_LEN")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(64usize << 20);
            let ([cq2, _rcq2, _cqb2, _rcqb2], q2, _qb2) = qp_pair((&ca, &pda), (&cb, &pdb), 64, 16);
            let src = np_buf(&pdb, &pgb, big, Some(5));
            // The counter the FETCH_ADDs hit: a page of its own, atomic rights.
            let ctr = pgb.alloc(4096).unwrap();
            // SAFETY: pager-allocated private memory, dropped after the MR.
            #[allow(unsafe_code)]
            let ctr_mr = unsafe {
                pdb.reg_mr(
                    ctr.addr() as u64,
                    4096,
                    Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
                )
            }
            .unwrap();
            let dst = np_buf(&pda, &pga, big, Some(1));
            for round in 0..3 {
                src.0.swap_out().unwrap();
                let t0 = Instant::now();
                np.qp
                    .post_send(&[SendWr::new(
                        1,
                        Opcode::Read,
                        Some(dst.1.sge(0, big as u32)),
                        src.0.addr() as u64,
                        src.1.rkey(),
                    )])
                    .unwrap();
                let mut lat = Vec::new();
                let mut c = [nprdma::Completion::default(); 1];
                let mut big_us = None;
                while big_us.is_none() {
                    let t = Instant::now();
                    q2.post_send(&[SendWr::new(
                        2,
                        Opcode::FetchAdd { add: 1 },
                        Some(np.l.1.sge(0, 8)),
                        ctr.addr() as u64,
                        ctr_mr.rkey(),
                    )])
                    .unwrap();
                    loop {
                        if big_us.is_none() && np.cq.poll(&mut c) == 1 {
                            assert_eq!(c[0].status, 0, "{:?}", c[0]);
                            big_us = Some(t0.elapsed().as_secs_f64() * 1e6);
                        }
                        if cq2.poll(&mut c) == 1 {
                            break;
                        }
                    }
                    assert_eq!(c[0].status, 0, "FETCH_ADD {:?}", c[0]);
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                let big_us = big_us.expect("the READ completed");
                let n = lat.len();
                let max = lat.iter().cloned().fold(0.0, f64::max);
                let (med, _, p99) = stats(lat);
                println!(
                    "prof hog round {round}: READ {big} B of swapped-out memory {big_us:.0} us; \
                     meanwhile {n} FETCH_ADDs on another QP: median {med:.1} us, p99 {p99:.1}, max {max:.1}"
                );
            }
            drop(ctr_mr);
            return;
        }
        if ["minor", "minor-write", "major"].contains(&which.as_str()) {
            // `minor` / `minor-write` / `major`: READs / WRITEs / READs of
            // NPRDMA_BENCH_PROF_LEN bytes (default 2), each on never-touched
            // (swapped-out for `major`) remote pages (with NPRDMA_TRACE=1,
            // the step breakdown follows).
            let op = if which == "minor-write" {
                Opcode::Write
            } else {
                Opcode::Read
            };
            let span = len.next_multiple_of(4096);
            let major = which == "major";
            let minor = np_buf(&pdb, &pgb, iters * span, major.then_some(5));
            if major {
                minor.0.swap_out().unwrap();
            }
            let mut v = Vec::with_capacity(iters);
            nprdma::trace::take();
            for i in 0..iters {
                let t = Instant::now();
                let raddr = minor.0.addr() as u64 + (i * span) as u64;
                np_op(&np, op, len, raddr, minor.1.rkey(), i as u64);
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
            if nprdma::trace::enabled() {
                minor_breakdown(nprdma::trace::take());
            }
            let (med, avg, p99) = stats(v);
            println!("prof {which} {len} B: median {med:.2} us, avg {avg:.2}, p99 {p99:.2}");
            drop(minor.1);
            return;
        }
        // `pinned-read` / `pinned-write`: the same loop on plain rnic MRs;
        // `pinned-write-readback`: WRITE + READ-back chain on them (the NIC
        // work of NP-RDMA's small WRITE without the engine).
        let pinned = which.strip_prefix("pinned-");
        let write = pinned.unwrap_or(&which) == "write";
        let op = if write { Opcode::Write } else { Opcode::Read };
        let wop = if write {
            WrOpcode::Write
        } else {
            WrOpcode::Read
        };
        let (raddr, rkey) = (np.r.0.addr() as u64, np.r.1.rkey());
        let mut v = Vec::with_capacity(iters);
        for i in 0..iters {
            let t = Instant::now();
            if which == "pinned-write-readback" {
                pinned_write_readback(&pin, len, i as u64);
            } else if pinned.is_some() {
                pinned_op(&pin, wop, len, i as u64, false);
            } else {
                np_op(&np, op, len, raddr, rkey, i as u64);
            }
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let (med, avg, p99) = stats(v);
        println!("prof {which} {len} B: median {med:.2} us, avg {avg:.2}, p99 {p99:.2}");
        return;
    }
    let only_faults = std::env::var("NPRDMA_BENCH_ONLY_FAULTS").is_ok();
    if !only_faults {
        println!(
            "# NP-RDMA vs pinned, same software NIC, in-process transport, {iters} iters/size"
        );
        println!("op     size  pinned_med_us pinned_iova_med  np_med_us  vs_pinned vs_iova  pinned_avg iova_avg np_avg  np_p99");
        let (raddr, rkey) = (np.r.0.addr() as u64, np.r.1.rkey());
        for (name, wop, nop) in [
            ("READ", WrOpcode::Read, Opcode::Read),
            ("WRITE", WrOpcode::Write, Opcode::Write),
        ] {
            for &len in &SIZES {
                let n = if len >= 65536 { iters / 4 } else { iters };
                // Warm up both, then interleave in blocks so noise hits both alike.
                for i in 0..100 {
                    pinned_op(&pin, wop, len, i, false);
                    pinned_op(&pin, wop, len, i, true);
                    np_op(&np, nop, len, raddr, rkey, i);
                }
                let (mut vp, mut vi, mut vn) = (Vec::new(), Vec::new(), Vec::new());
                for blk in 0..10 {
                    for i in 0..n / 10 {
                        let t = Instant::now();
                        pinned_op(&pin, wop, len, i as u64, false);
                        vp.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    for i in 0..n / 10 {
                        let t = Instant::now();
                        pinned_op(&pin, wop, len, i as u64, true);
                        vi.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    for i in 0..n / 10 {
                        let t = Instant::now();
                        np_op(&np, nop, len, raddr, rkey, (blk * n + i) as u64);
                        vn.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                let (pm, pa, _) = stats(vp);
                let (im, ia, _) = stats(vi);
                let (nm, na, n99) = stats(vn);
                println!(
                "{name:<6} {len:>6}  {pm:>10.2}  {im:>12.2}  {nm:>12.2}  {:>+7.1}% {:>+7.1}%  {pa:>9.2} {ia:>8.2} {na:>7.2} {n99:>7.2}",
                (nm / pm - 1.0) * 100.0,
                (nm / im - 1.0) * 100.0
            );
            }
        }
        for distinct in [false, true] {
            println!(
                "# throughput GB/s, window 32, {}",
                if distinct {
                    "a distinct buffer slot per op in flight"
                } else {
                    "every op on the same buffers (NP-RDMA orders overlapping ops)"
                }
            );
            println!("op      size   pinned  pinned_iova  np(signaled)  np(unsignaled 1/16)");
            for (name, wop, nop) in [
                ("READ", WrOpcode::Read, Opcode::Read),
                ("WRITE", WrOpcode::Write, Opcode::Write),
            ] {
                for &len in &[4096usize, 65536, 262144] {
                    let cnt = (256 << 20) / len;
                    let tp = pinned_tput(&pin, wop, len, cnt, 32, false, distinct);
                    let ti = pinned_tput(&pin, wop, len, cnt, 32, true, distinct);
                    let tn = np_tput(&np, nop, len, cnt, 32, 1, distinct);
                    let tu = np_tput(&np, nop, len, cnt, 32, 16, distinct);
                    println!(
                        "{name:<6} {len:>6}   {tp:>6.2}   {ti:>6.2}       {tn:>6.2}        {tu:>6.2}"
                    );
                }
            }
        }
    }
    let st0 = ca.stats();
    // Remote minor fault: each 2 B READ targets a never-touched page.
    let pages = iters.min(4000);
    let minor = np_buf(&pdb, &pgb, pages * 4096, None);
    let mut vm = Vec::new();
    nprdma::trace::take();
    for i in 0..pages {
        let t = Instant::now();
        np_op(
            &np,
            Opcode::Read,
            2,
            minor.0.addr() as u64 + (i * 4096) as u64,
            minor.1.rkey(),
            i as u64,
        );
        vm.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if nprdma::trace::enabled() {
        minor_breakdown(nprdma::trace::take());
    }
    // Remote major fault: each 2 B READ targets a swapped-out page.
    let major = np_buf(&pdb, &pgb, pages * 4096, Some(7));
    major.0.swap_out().unwrap();
    let mut vj = Vec::new();
    for i in 0..pages {
        let t = Instant::now();
        np_op(
            &np,
            Opcode::Read,
            2,
            major.0.addr() as u64 + (i * 4096) as u64,
            major.1.rkey(),
            i as u64,
        );
        vj.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // Lazy swap-in: the page is resident again (the target touched it)
    // but still unmapped for the NIC: protocol cost without pager work.
    let mut lazy = np_buf(&pdb, &pgb, pages * 4096, Some(9));
    lazy.0.swap_out().unwrap();
    for i in 0..pages {
        lazy.0.as_mut_slice()[i * 4096] = 9;
    }
    let mut vl = Vec::new();
    for i in 0..pages {
        let t = Instant::now();
        np_op(
            &np,
            Opcode::Read,
            2,
            lazy.0.addr() as u64 + (i * 4096) as u64,
            lazy.1.rkey(),
            i as u64,
        );
        vl.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let st1 = ca.stats();
    // The swap device's 4 KiB read: pin (= swap-in in this thread) of a
    // swapped-out page, and a raw pread of 4 KiB from a file in the temp dir.
    let probe = pgb.alloc(pages * 4096).unwrap();
    {
        let mut p = probe;
        p.as_mut_slice().fill(3);
        p.swap_out().unwrap();
        let mut vs = Vec::new();
        for i in 0..pages {
            let a = p.addr() + i * 4096;
            let t = Instant::now();
            pgb.pin(a, 4096).unwrap();
            vs.push(t.elapsed().as_secs_f64() * 1e6);
            pgb.unpin(a, 4096).unwrap();
        }
        let path = std::env::temp_dir().join(format!("nprdma-bench-{}", std::process::id()));
        std::fs::write(&path, vec![5u8; pages * 4096]).unwrap();
        let mut f = std::fs::File::open(&path).unwrap();
        let mut buf = vec![0u8; 4096];
        let mut vr = Vec::new();
        for _ in 0..pages {
            let t = Instant::now();
            f.read_exact(&mut buf).unwrap();
            vr.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let _ = std::fs::remove_file(&path);
        let (mm, ma, m99) = stats(vm);
        let (jm, ja, j99) = stats(vj);
        let (lm, la, l99) = stats(vl);
        let (sm, sa, s99) = stats(vs);
        let (rm, ra, r99) = stats(vr);
        println!("# faults, {pages} pages each (med / avg / p99 us)");
        println!("remote minor fault 2B READ   {mm:>7.2} {ma:>7.2} {m99:>7.2}");
        println!("remote major fault 2B READ   {jm:>7.2} {ja:>7.2} {j99:>7.2}");
        println!("remote lazy swap-in 2B READ  {lm:>7.2} {la:>7.2} {l99:>7.2}");
        println!("swap-in 4KiB (vmem pin)      {sm:>7.2} {sa:>7.2} {s99:>7.2}");
        println!("file pread 4KiB (page cache) {rm:>7.2} {ra:>7.2} {r99:>7.2}");
        println!("major - swap-in (med)        {:>7.2}", jm - sm);
        println!(
            "# fault phase: two-sided {} optimistic {} (3 x {pages} faults); nonresident_dma A {} B {}",
            st1.two_sided - st0.two_sided,
            st1.optimistic_ok - st0.optimistic_ok,
            ca.nic_stats().nonresident_dma,
            cb.nic_stats().nonresident_dma
        );
    }
    drop(minor.1);
    drop(major.1);
    drop(lazy.1);
    drop(pin);
    let Np { qp, cq: _, l, r } = np;
    drop(qp);
    drop(l.1);
    drop(r.1);
    drop(qb);
    let _ = (rcqa, cqb, rcqb);
    std::thread::sleep(Duration::from_millis(10));
}

/// With `NPRDMA_TRACE=1`: the in-process minor-fault path step by step
/// (median ns between consecutive trace records, by step pair).
fn minor_breakdown(recs: Vec<(nprdma::trace::Step, u64)>) {
    type Pair = (nprdma::trace::Step, nprdma::trace::Step);
    let mut by: std::collections::BTreeMap<Pair, Vec<f64>> = Default::default();
    for w in recs.windows(2) {
        by.entry((w[0].0, w[1].0))
            .or_default()
            .push(w[1].1.saturating_sub(w[0].1) as f64);
    }
    println!("# minor-fault steps (in-process): median ns between consecutive records, n");
    for ((a, b), v) in by {
        let n = v.len();
        let (m, _, _) = stats(v);
        println!("{a:?} -> {b:?}: {m:.0} ns, {n}");
    }
}
