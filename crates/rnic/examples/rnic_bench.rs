//! RNIC benchmark: READ/WRITE latency (median, p99) and throughput on the in-process
//! and shared-memory (two processes) transports, with same-run baselines (memcpy,
//! process_vm_readv/writev of the same sizes).
//!
//! Run: `cargo run --release -p rnic --example rnic_bench` (env RNIC_BENCH_ITERS to
//! change the latency iteration count, default 20000).
//!
//! The "pinned vs IOVA" rows compare, per transport and in the same run, the same
//! page-aligned buffers registered plainly (identity MTT) and through IOVA ranges
//! statically mapped to their own pages (the IOMMU in the path), alternating blocks of
//! the two (`RNIC_BENCH_IOVA_ONLY=1` runs only these rows).
//!
//! Protection across processes: the default is target-enforced (every shm request
//! served by the target's NIC thread, in parts of `RNIC_BENCH_RING_MAX` bytes, default
//! rnic's 4096); `RNIC_BENCH_TRUSTED=1` runs both processes as trusting hosts (the
//! initiator copies with process_vm_*). Run both back to back to compare.

use hdrhistogram::Histogram;
use rnic::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LAT_SIZES: [usize; 4] = [2, 64, 4096, 65536];
const TPUT_SIZES: [usize; 2] = [65536, 1 << 20];
const BUF: usize = 4 << 20;

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC
}

struct Side {
    host: Host,
    _ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
}

fn side(host: &Host) -> Side {
    let ctx = host.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None).unwrap();
    let qp = pd
        .create_qp(
            &cq,
            &cq,
            &QpInitAttr {
                max_send_wr: 256,
                max_recv_wr: 256,
                ..Default::default()
            },
        )
        .unwrap();
    Side {
        host: host.clone(),
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// A page-aligned buffer of `BUF` bytes filled with `fill`, leaked for the whole run.
fn aligned_buf(fill: u8) -> usize {
    let l = std::alloc::Layout::from_size_align(BUF, 4096).unwrap();
    // SAFETY: non-zero size layout; the memory is never freed (the MRs over it live
    // until the process exits).
    let p = unsafe { std::alloc::alloc(l) };
    assert!(!p.is_null());
    // SAFETY: p is valid for BUF bytes.
    unsafe { std::ptr::write_bytes(p, fill, BUF) };
    p as usize
}

/// The same leaked buffer registered plainly and through an IOVA range statically
/// mapped to its own pages.
struct Pair {
    plain: Mr,
    iova: Mr,
}

fn pinned_and_iova(host: &Host, pd: &Pd, fill: u8) -> Pair {
    let addr = aligned_buf(fill);
    let n = (BUF / Iommu::PAGE_SIZE) as u64;
    let r = host.iommu().alloc_range(n).unwrap();
    let frames: Vec<Frame> = (0..n as usize)
        .map(|i| Frame::Ram(addr + i * Iommu::PAGE_SIZE))
        .collect();
    // SAFETY: the leaked buffer stays valid for the whole process.
    unsafe {
        host.iommu().map_range(&r, 0, &frames).unwrap();
        Pair {
            plain: pd.reg_mr(addr, BUF, all()).unwrap(),
            iova: pd.reg_mr_iova(addr, BUF, all(), &r).unwrap(),
        }
    }
}

/// The configuration of the two shm processes (see the module docs).
fn shm_cfg() -> HostConfig {
    let d = HostConfig::default();
    HostConfig {
        trusted_peers: std::env::var("RNIC_BENCH_TRUSTED").is_ok_and(|v| v == "1"),
        ring_max: std::env::var("RNIC_BENCH_RING_MAX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d.ring_max),
        ..d
    }
}

fn server() {
    let host = Host::new(shm_cfg()).unwrap();
    let s = side(&host);
    let mr = s.pd.reg_mr_owned(vec![7u8; BUF], all()).unwrap();
    let cmp = pinned_and_iova(&host, &s.pd, 7);
    println!(
        "INFO {} {} {} {} {} {} {}",
        host.addr().to_hex(),
        s.qp.qpn(),
        mr.addr(),
        mr.rkey(),
        cmp.plain.addr(),
        cmp.plain.rkey(),
        cmp.iova.rkey()
    );
    std::io::stdout().flush().unwrap();
    let mut peer = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["PEER", a, q] => {
                let p = (HostAddr::from_hex(a).unwrap(), q.parse().unwrap());
                s.qp.connect(all(), p.0, p.1, 7).unwrap();
                peer = Some(p);
                println!("READY");
                std::io::stdout().flush().unwrap();
            }
            ["ECHO", pool] => {
                echo(&s, *pool == "1");
                let p = peer.expect("PEER before ECHO");
                reconnect(&s, p.0, p.1);
                println!("DONE");
                std::io::stdout().flush().unwrap();
            }
            ["EXIT"] => break,
            _ => {}
        }
    }
}

/// RECV slots each side keeps posted in the SEND ping-pong.
const ECHO_SLOTS: usize = 64;
/// SEND size of the ping-pong (NP-RDMA's control message).
const ECHO_SIZE: usize = 64;
/// First byte of the message that ends the server's echo loop.
const ECHO_STOP: u8 = 0xff;

/// RECV buffers (one `ECHO_SIZE` slot per posted RECV) and the SEND source buffer.
struct EchoBufs {
    recv: Mr,
    send: Mr,
    _keep: Vec<Box<dyn std::any::Any>>,
}

fn echo_bufs(s: &Side, pool: bool) -> EchoBufs {
    let send = s.pd.reg_mr_owned(vec![5u8; ECHO_SIZE], all()).unwrap();
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    let (addr, len) = if pool {
        // RECV slots in the host's NIC-shared DMA pool: the peer's SEND is a memcpy.
        let b = s.host.alloc_dma_buffer(ECHO_SLOTS * ECHO_SIZE).unwrap();
        let r = (b.addr(), b.len());
        keep.push(Box::new(b));
        r
    } else {
        let b = s.pd.reg_mr_owned(vec![0u8; ECHO_SLOTS * ECHO_SIZE], all()).unwrap();
        let r = (b.addr(), b.len());
        keep.push(Box::new(b));
        r
    };
    // SAFETY: the buffers are kept alive in `_keep`, which drops after these MRs
    // (field order).
    let (r, w) = unsafe {
        (
            s.pd.reg_mr(addr, len, all()).unwrap(),
            s.pd.reg_mr(send.addr(), send.len(), all()).unwrap(),
        )
    };
    keep.push(Box::new(send));
    EchoBufs {
        recv: r,
        send: w,
        _keep: keep,
    }
}

fn post_recv_slot(s: &Side, b: &EchoBufs, i: usize) {
    let sge = [b.recv.sge(i * ECHO_SIZE, ECHO_SIZE as u32)];
    s.qp.post_recv(&[RecvWr {
        wr_id: i as u64,
        sg_list: &sge,
    }])
    .unwrap();
}

/// Server side of the SEND ping-pong: every 64 B RECV is reposted and answered with
/// a 64 B SEND, until a message starting with `ECHO_STOP` arrives.
fn echo(s: &Side, pool: bool) {
    let b = echo_bufs(s, pool);
    for i in 0..ECHO_SLOTS {
        post_recv_slot(s, &b, i);
    }
    println!("ECHOING");
    std::io::stdout().flush().unwrap();
    let sge = [b.send.sge(0, ECHO_SIZE as u32)];
    let mut wc = [Wc::default(); 16];
    loop {
        let n = s.cq.poll(&mut wc).unwrap();
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            if w.opcode != WcOpcode::Recv {
                continue;
            }
            let i = w.wr_id as usize;
            // SAFETY: slot i of the live RECV buffer, written by the completed RECV.
            let first = unsafe { *((b.recv.addr() + i * ECHO_SIZE) as *const u8) };
            if first == ECHO_STOP {
                return;
            }
            post_recv_slot(s, &b, i);
            s.qp.post_send(&[SendWr::new(1, WrOpcode::Send, &sge)]).unwrap();
        }
    }
}

/// Client side: 64 B SEND, wait for its completion and for the echo. Returns (post
/// cost = the `post_send` call, which performs the SEND; half round trip) medians and
/// p99s in ns.
fn ping_pong(s: &Side, b: &EchoBufs, iters: usize) -> (Stat, Stat) {
    let sge = [b.send.sge(0, ECHO_SIZE as u32)];
    let wr = SendWr::new(1, WrOpcode::Send, &sge);
    let mut post = Histogram::<u64>::new(3).unwrap();
    let mut half = Histogram::<u64>::new(3).unwrap();
    let mut wc = [Wc::default(); 4];
    for k in 0..iters + iters / 10 {
        let t0 = Instant::now();
        s.qp.post_send(std::slice::from_ref(&wr)).unwrap();
        let t1 = Instant::now();
        let (mut sent, mut got) = (false, false);
        while !(sent && got) {
            let n = s.cq.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                if w.opcode == WcOpcode::Recv {
                    got = true;
                    post_recv_slot(s, b, w.wr_id as usize);
                } else {
                    sent = true;
                }
            }
        }
        let t2 = Instant::now();
        if k >= iters / 10 {
            post.record((t1 - t0).as_nanos() as u64).unwrap();
            half.record((t2 - t0).as_nanos() as u64 / 2).unwrap();
        }
    }
    let st = |h: &Histogram<u64>| Stat {
        median_ns: h.value_at_quantile(0.5),
        p99_ns: h.value_at_quantile(0.99),
    };
    (st(&post), st(&half))
}

/// RESET (drops the RECVs still posted) and connect again.
fn reconnect(s: &Side, dest: HostAddr, qpn: u32) {
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..Default::default()
    };
    s.qp.modify(&reset, QpAttrMask::STATE).unwrap();
    s.qp.connect(all(), dest, qpn, 7).unwrap();
}

fn stop_echo(s: &Side, b: &EchoBufs) {
    // SAFETY: the SEND buffer is live and ECHO_SIZE long; no WR uses it right now.
    unsafe { *(b.send.addr() as *mut u8) = ECHO_STOP };
    one(s, &SendWr::new(9, WrOpcode::Send, &[b.send.sge(0, ECHO_SIZE as u32)]));
    // SAFETY: as above.
    unsafe { *(b.send.addr() as *mut u8) = 5 };
}

/// SEND 64 B rows (cross-process): post cost and ping-pong half round trip, with
/// plain and (`pool`) RECV buffers on both sides, plus a 2 B READ as the same-run
/// baseline, in `blocks` alternating blocks (median of the block medians).
fn send_suite(
    s: &Side,
    peer: (HostAddr, u32),
    io: &mut (std::process::ChildStdin, BufReader<std::process::ChildStdout>),
    raddr: u64,
    rkey: u32,
    iters: usize,
    rows: &mut Vec<String>,
) {
    let local = s.pd.reg_mr_owned(vec![1u8; 4096], all()).unwrap();
    let sge = [local.sge(0, 2)];
    let rd = SendWr::new(0, WrOpcode::Read, &sge).remote(raddr, rkey);
    let blocks = 3;
    let kinds: &[bool] = &[false, true];
    // Per kind: post-cost medians, post-cost p99s, half-RTT medians, half-RTT p99s.
    type Blocks = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut res: Vec<Blocks> = vec![Default::default(); kinds.len()];
    let mut read = vec![];
    let mut pvm = vec![];
    let src = [5u8; ECHO_SIZE];
    for _ in 0..blocks {
        let st = lat(&mut || one(s, &rd), iters);
        read.push(st.median_ns as f64 / 1e3);
        let l = libc::iovec {
            iov_base: src.as_ptr() as *mut libc::c_void,
            iov_len: ECHO_SIZE,
        };
        let r = libc::iovec {
            iov_base: raddr as *mut libc::c_void,
            iov_len: ECHO_SIZE,
        };
        let st = lat(
            &mut || {
                // SAFETY: `l` is our live buffer; the remote range lies in the server's MR.
                let n = unsafe { libc::process_vm_writev(peer.0.pid as i32, &l, 1, &r, 1, 0) };
                assert_eq!(n, ECHO_SIZE as isize);
            },
            iters,
        );
        pvm.push(st.median_ns as f64 / 1e3);
        for (ki, &pool) in kinds.iter().enumerate() {
            writeln!(io.0, "ECHO {}", pool as u8).unwrap();
            io.0.flush().unwrap();
            let mut line = String::new();
            io.1.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "ECHOING");
            let b = echo_bufs(s, pool);
            for i in 0..ECHO_SLOTS {
                post_recv_slot(s, &b, i);
            }
            let (p, h) = ping_pong(s, &b, iters);
            stop_echo(s, &b);
            line.clear();
            io.1.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "DONE");
            // Drop the RECVs still posted into `b` before `b` goes away.
            reconnect(s, peer.0, peer.1);
            drop(b);
            let r = &mut res[ki];
            r.0.push(p.median_ns as f64 / 1e3);
            r.1.push(p.p99_ns as f64 / 1e3);
            r.2.push(h.median_ns as f64 / 1e3);
            r.3.push(h.p99_ns as f64 / 1e3);
        }
    }
    rows.push(format!(
        "| shm (2 processes) | READ 2 B latency (same-run baseline) | 2 B | median {:.2} us | blocks {:?} |",
        median(&mut read.clone()),
        read
    ));
    rows.push(format!(
        "| baseline | process_vm_writev {ECHO_SIZE} B (the SEND's data copy) | {ECHO_SIZE} B | median {:.2} us | blocks {:?} |",
        median(&mut pvm.clone()),
        pvm
    ));
    for (ki, &pool) in kinds.iter().enumerate() {
        let r = &mut res[ki];
        let nm = if pool { "pool" } else { "plain" };
        rows.push(format!(
            "| shm (2 processes) | SEND {ECHO_SIZE} B post_send cost, {nm} RECV buffers | {ECHO_SIZE} B | median {:.2} us | p99 {:.2} us |",
            median(&mut r.0),
            median(&mut r.1)
        ));
        rows.push(format!(
            "| shm (2 processes) | SEND {ECHO_SIZE} B ping-pong half RTT, {nm} RECV buffers | {ECHO_SIZE} B | median {:.2} us | p99 {:.2} us |",
            median(&mut r.2),
            median(&mut r.3)
        ));
    }
}

struct Stat {
    median_ns: u64,
    p99_ns: u64,
}

fn lat(f: &mut dyn FnMut(), iters: usize) -> Stat {
    for _ in 0..iters / 10 {
        f();
    }
    let mut h = Histogram::<u64>::new(3).unwrap();
    for _ in 0..iters {
        let t = Instant::now();
        f();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    Stat {
        median_ns: h.value_at_quantile(0.5),
        p99_ns: h.value_at_quantile(0.99),
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn one(s: &Side, wr: &SendWr) {
    s.qp.post_send(std::slice::from_ref(wr)).unwrap();
    let mut wc = [Wc::default(); 1];
    loop {
        if s.cq.poll(&mut wc).unwrap() == 1 {
            assert_eq!(wc[0].status, WcStatus::Success);
            return;
        }
    }
}

fn suite(name: &str, s: &Side, raddr: u64, rkey: u32, iters: usize, rows: &mut Vec<String>) {
    let local = s.pd.reg_mr_owned(vec![1u8; BUF], all()).unwrap();
    // Warm-up (connection, caches, the NIC thread's adaptive spin), discarded.
    {
        let sge = [local.sge(0, 2)];
        let wr = SendWr::new(0, WrOpcode::Read, &sge).remote(raddr, rkey);
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(200) {
            one(s, &wr);
        }
    }
    for op in [WrOpcode::Read, WrOpcode::Write] {
        let opn = if op == WrOpcode::Read { "READ" } else { "WRITE" };
        let lat_sizes: &[usize] = if std::env::var("RNIC_BENCH_TPUT_ONLY").is_ok() {
            &[]
        } else {
            &LAT_SIZES
        };
        for &sz in lat_sizes {
            let sge = [local.sge(0, sz as u32)];
            let wr = SendWr::new(1, op, &sge).remote(raddr, rkey);
            let n = if sz >= 65536 { iters / 10 } else { iters };
            let st = lat(&mut || one(s, &wr), n.max(100));
            rows.push(format!(
                "| {name} | {opn} latency | {sz} B | median {:.2} us | p99 {:.2} us |",
                st.median_ns as f64 / 1e3,
                st.p99_ns as f64 / 1e3
            ));
        }
        for &sz in &TPUT_SIZES {
            let depth = 8;
            // Like perftest: every WR of the window uses the same buffers (and so do
            // the baselines).
            let sges: Vec<[Sge; 1]> = (0..depth).map(|_| [local.sge(0, sz as u32)]).collect();
            let wrs: Vec<SendWr> = sges
                .iter()
                .enumerate()
                .map(|(i, g)| SendWr::new(i as u64, op, g).remote(raddr, rkey))
                .collect();
            let rounds = if sz >= 1 << 20 { 200 } else { 2000 };
            let mut wc = [Wc::default(); 16];
            let run = |rounds: usize, wc: &mut [Wc]| {
                let t = Instant::now();
                for _ in 0..rounds {
                    s.qp.post_send(&wrs).unwrap();
                    let mut got = 0;
                    while got < depth {
                        let n = s.cq.poll(wc).unwrap();
                        for w in &wc[..n] {
                            assert_eq!(w.status, WcStatus::Success);
                        }
                        got += n;
                    }
                }
                t.elapsed()
            };
            run(rounds / 10, &mut wc);
            let d = run(rounds, &mut wc);
            rows.push(format!(
                "| {name} | {opn} throughput | {sz} B | {:.2} GB/s | {:.0} kops/s |",
                gbps(sz * depth * rounds, d),
                (depth * rounds) as f64 / d.as_secs_f64() / 1e3
            ));
        }
    }
}

const CMP_SIZES: [usize; 4] = [2, 4096, 65536, 1 << 20];

/// Median latency (µs) and window-of-8 throughput (GB/s) of `op` of `sz` bytes from
/// `local` to `raddr`/`rkey`.
fn measure(s: &Side, op: WrOpcode, sz: usize, local: &Mr, raddr: u64, rkey: u32, iters: usize) -> (f64, f64) {
    let sge = [local.sge(0, sz as u32)];
    let wr = SendWr::new(1, op, &sge).remote(raddr, rkey);
    let n = (iters * 64 / (64 + sz / 1024)).max(100);
    let st = lat(&mut || one(s, &wr), n);
    let depth = 8;
    let wrs: Vec<SendWr> = (0..depth)
        .map(|i| SendWr::new(i as u64, op, &sge).remote(raddr, rkey))
        .collect();
    let rounds = ((64 << 20) / (sz * depth)).clamp(50, 20000);
    let mut wc = [Wc::default(); 16];
    let t = Instant::now();
    for _ in 0..rounds {
        s.qp.post_send(&wrs).unwrap();
        let mut got = 0;
        while got < depth {
            let k = s.cq.poll(&mut wc).unwrap();
            for w in &wc[..k] {
                assert_eq!(w.status, WcStatus::Success);
            }
            got += k;
        }
    }
    (st.median_ns as f64 / 1e3, gbps(sz * depth * rounds, t.elapsed()))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Pinned vs pinned+IOVA, READ and WRITE of `CMP_SIZES`, in 3 alternating blocks
/// (median of the blocks): the ratio IOVA / pinned is measured in one run.
fn compare(name: &str, s: &Side, local: &Pair, raddr: u64, rkeys: (u32, u32), iters: usize, rows: &mut Vec<String>) {
    for op in [WrOpcode::Read, WrOpcode::Write] {
        let opn = if op == WrOpcode::Read { "READ" } else { "WRITE" };
        for &sz in &CMP_SIZES {
            let (mut lp, mut li, mut tp, mut ti) = (vec![], vec![], vec![], vec![]);
            for _ in 0..3 {
                let (l, t) = measure(s, op, sz, &local.plain, raddr, rkeys.0, iters);
                lp.push(l);
                tp.push(t);
                let (l, t) = measure(s, op, sz, &local.iova, raddr, rkeys.1, iters);
                li.push(l);
                ti.push(t);
            }
            let (lp, li, tp, ti) = (median(&mut lp), median(&mut li), median(&mut tp), median(&mut ti));
            let tput = if sz < 4096 {
                let k = 1e6 / sz as f64; // GB/s -> kops/s
                format!("{:.0} / {:.0} kops/s", tp * k, ti * k)
            } else {
                format!("{tp:.2} / {ti:.2} GB/s")
            };
            rows.push(format!(
                "| {name} | {opn} {sz} B | median {lp:.2} / {li:.2} us (x{:.2}) | {tput} (x{:.2}) |",
                li / lp,
                ti / tp
            ));
        }
    }
}

fn memcpy_baseline(rows: &mut Vec<String>, iters: usize) {
    let src = vec![3u8; BUF];
    let mut dst = vec![0u8; BUF];
    for &sz in &LAT_SIZES {
        let st = lat(
            &mut || {
                // SAFETY: both buffers are BUF long and sz <= BUF.
                unsafe { std::ptr::copy_nonoverlapping(std::hint::black_box(src.as_ptr()), dst.as_mut_ptr(), sz) };
                std::hint::black_box(&mut dst);
            },
            iters,
        );
        rows.push(format!(
            "| baseline | memcpy latency | {sz} B | median {:.3} us | p99 {:.3} us |",
            st.median_ns as f64 / 1e3,
            st.p99_ns as f64 / 1e3
        ));
    }
    for &sz in &TPUT_SIZES {
        let rounds = (1 << 30) / sz;
        let t = Instant::now();
        for _ in 0..rounds {
            dst[..sz].copy_from_slice(&src[..sz]);
            std::hint::black_box(&mut dst);
        }
        rows.push(format!(
            "| baseline | memcpy throughput | {sz} B | {:.2} GB/s | |",
            gbps(sz * rounds, t.elapsed())
        ));
    }
}

fn pvm_baseline(rows: &mut Vec<String>, pid: u32, raddr: u64, iters: usize) {
    let mut dst = vec![0u8; BUF];
    let pvm = |sz: usize, write: bool, dst: &mut Vec<u8>| {
        let l = libc::iovec {
            iov_base: dst.as_mut_ptr() as *mut libc::c_void,
            iov_len: sz,
        };
        let r = libc::iovec {
            iov_base: raddr as *mut libc::c_void,
            iov_len: sz,
        };
        // SAFETY: l describes our live buffer; the remote range lies in the server's MR.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid as i32, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_readv(pid as i32, &l, 1, &r, 1, 0)
            }
        };
        assert_eq!(n, sz as isize);
    };
    for write in [false, true] {
        let nm = if write { "process_vm_writev" } else { "process_vm_readv" };
        for &sz in &LAT_SIZES {
            let st = lat(&mut || pvm(sz, write, &mut dst), iters);
            rows.push(format!(
                "| baseline | {nm} latency | {sz} B | median {:.2} us | p99 {:.2} us |",
                st.median_ns as f64 / 1e3,
                st.p99_ns as f64 / 1e3
            ));
        }
    }
    for &sz in &TPUT_SIZES {
        for write in [false, true] {
            let rounds = (1 << 30) / sz;
            let t = Instant::now();
            for _ in 0..rounds {
                pvm(sz, write, &mut dst);
            }
            let nm = if write { "process_vm_writev" } else { "process_vm_readv" };
            rows.push(format!(
                "| baseline | {nm} throughput | {sz} B | {:.2} GB/s | |",
                gbps(sz * rounds, t.elapsed())
            ));
        }
    }
}

/// Cost of an idle `Cq::poll` (empty CQ, its QP connected with nothing queued): what
/// a spinning poller pays per loop. Median of 200 blocks of 10000 polls.
fn idle_poll(transport: &str, a: &Side, rows: &mut Vec<String>) {
    let mut out = [Wc::default(); 16];
    let mut blocks = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        for _ in 0..10_000 {
            assert_eq!(a.cq.poll(std::hint::black_box(&mut out)).unwrap(), 0);
        }
        blocks.push(t.elapsed().as_nanos() as f64 / 10_000.0);
    }
    blocks.sort_by(|x, y| x.partial_cmp(y).unwrap());
    rows.push(format!(
        "| {transport} | idle Cq::poll (median / min of 200x10k) | 0 | {:.1} ns | {:.1} ns |",
        blocks[100], blocks[0]
    ));
}

fn main() {
    if std::env::args().any(|a| a == "--server") {
        server();
        return;
    }
    let iters: usize = std::env::var("RNIC_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000);
    let mut rows = vec![
        "| transport | measurement | size | value | value |".to_string(),
        "|---|---|---|---|---|".to_string(),
    ];
    let only = std::env::var("RNIC_BENCH_ONLY").unwrap_or_default();
    let iova_only = std::env::var("RNIC_BENCH_IOVA_ONLY").is_ok();
    if only.is_empty() && !iova_only {
        memcpy_baseline(&mut rows, iters);
    }
    let mut cmp_rows = vec![
        String::new(),
        "| transport | op size | latency pinned / IOVA (ratio) | throughput pinned / IOVA (ratio) |".to_string(),
        "|---|---|---|---|".to_string(),
    ];

    // in-process: two hosts in this process
    if only.is_empty() || only == "inproc" {
        let ha = Host::new(HostConfig::default()).unwrap();
        let hb = Host::new(HostConfig::default()).unwrap();
        let a = side(&ha);
        let b = side(&hb);
        let target = b.pd.reg_mr_owned(vec![7u8; BUF], all()).unwrap();
        a.qp.connect(all(), hb.addr(), b.qp.qpn(), 7).unwrap();
        b.qp.connect(all(), ha.addr(), a.qp.qpn(), 7).unwrap();
        if !iova_only {
            suite("in-process", &a, target.addr() as u64, target.rkey(), iters, &mut rows);
            idle_poll("in-process", &a, &mut rows);
        }
        let (lp, rp) = (pinned_and_iova(&ha, &a.pd, 1), pinned_and_iova(&hb, &b.pd, 7));
        let rkeys = (rp.plain.rkey(), rp.iova.rkey());
        compare(
            "in-process",
            &a,
            &lp,
            rp.plain.addr() as u64,
            rkeys,
            iters,
            &mut cmp_rows,
        );
        assert_eq!(a.host.stats().nonresident_dma, 0);
        assert_eq!(b.host.stats().nonresident_dma, 0);
    }

    if !(only.is_empty() || only == "shm" || only == "send") {
        for r in rows.iter().chain(&cmp_rows) {
            println!("{r}");
        }
        return;
    }
    // shared memory: a second process
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--server")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut cin = child.stdin.take().unwrap();
    let mut cout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    cout.read_line(&mut line).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    let raddr_host = HostAddr::from_hex(f[1]).unwrap();
    let (rqpn, raddr, rkey): (u32, u64, u32) = (f[2].parse().unwrap(), f[3].parse().unwrap(), f[4].parse().unwrap());
    let (cmp_addr, cmp_rkeys): (u64, (u32, u32)) =
        (f[5].parse().unwrap(), (f[6].parse().unwrap(), f[7].parse().unwrap()));
    let h = Host::new(HostConfig {
        dma_help: std::env::var("RNIC_NO_HELP").is_err(),
        ..shm_cfg()
    })
    .unwrap();
    let a = side(&h);
    a.qp.connect(all(), raddr_host, rqpn, 7).unwrap();
    writeln!(cin, "PEER {} {}", h.addr().to_hex(), a.qp.qpn()).unwrap();
    cin.flush().unwrap();
    line.clear();
    cout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "READY");
    if only == "send" {
        let mut io = (cin, cout);
        send_suite(&a, (raddr_host, rqpn), &mut io, raddr, rkey, iters, &mut rows);
        writeln!(io.0, "EXIT").unwrap();
        io.0.flush().unwrap();
        child.wait().unwrap();
        for r in &rows {
            println!("{r}");
        }
        return;
    }
    let label = if shm_cfg().trusted_peers {
        "shm (2 processes, trusted peers)".to_string()
    } else {
        format!("shm (2 processes, target-enforced, {} B parts)", shm_cfg().ring_max)
    };
    if !iova_only {
        suite(&label, &a, raddr, rkey, iters, &mut rows);
    }
    let lp = pinned_and_iova(&h, &a.pd, 1);
    compare(&label, &a, &lp, cmp_addr, cmp_rkeys, iters, &mut cmp_rows);
    assert_eq!(h.stats().nonresident_dma, 0);
    if !iova_only {
        pvm_baseline(&mut rows, raddr_host.pid, raddr, iters);
    }
    writeln!(cin, "EXIT").unwrap();
    cin.flush().unwrap();
    child.wait().unwrap();
    for r in rows.iter().chain(&cmp_rows) {
        println!("{r}");
    }
}
