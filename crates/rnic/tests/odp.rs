//! ODP model: local and remote page faults on ON_DEMAND MRs, the NAK timeout, go-back-N
//! retransmission, missing handlers, and invalidation racing with traffic.

mod common;
use common::*;
use parking_lot::Mutex;
use rnic::*;
use rustix::mm;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const P: usize = 4096;

/// Page-aligned anonymous memory (the pages a pager would own).
struct Region {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: plain anonymous mapping, accessed through raw pointers only.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn new(pages: usize) -> Region {
        let len = pages * P;
        // SAFETY: fresh private anonymous mapping, no aliasing.
        let ptr = unsafe { mm::mmap_anonymous(std::ptr::null_mut(), len, RW, mm::MapFlags::PRIVATE) }.unwrap();
        Region {
            ptr: ptr as *mut u8,
            len,
        }
    }
    fn addr(&self) -> usize {
        self.ptr as usize
    }
    fn write(&self, off: usize, d: &[u8]) {
        assert!(off + d.len() <= self.len);
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::copy(d.as_ptr(), self.ptr.add(off), d.len()) }
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0; len];
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::copy(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }
    /// Register as an ON_DEMAND MR (must be dropped before the region).
    fn odp_mr(&self, pd: &Pd) -> Mr {
        // SAFETY: the mapping outlives the MR in every test (declared before it).
        unsafe { pd.reg_mr(self.addr(), self.len, all_access() | Access::ON_DEMAND) }.unwrap()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its MR was dropped (and DMA flushed) before.
        let _ = unsafe { mm::munmap(self.ptr.cast(), self.len) };
    }
}

type Calls = Arc<Mutex<Vec<(usize, usize, String)>>>;

/// A fault handler that records its calls (and the thread it ran on).
fn recording_handler(host: &Host) -> Calls {
    let calls: Calls = Default::default();
    let c = calls.clone();
    host.set_odp_fault_handler(Arc::new(move |addr, len| {
        let t = std::thread::current().name().unwrap_or("").to_string();
        c.lock().push((addr, len, t));
        Ok(())
    }));
    calls
}

fn cfg(timeout: Duration) -> HostConfig {
    HostConfig {
        odp_timeout: timeout,
        ..HostConfig::default()
    }
}

type Rdma = (u64, WrOpcode, Sge, usize, u32);

fn rdma(id: u64, op: WrOpcode, sge: Sge, raddr: usize, rkey: u32) -> Rdma {
    (id, op, sge, raddr, rkey)
}

/// Post signaled RDMA WRs in one call.
fn post(e: &End, list: &[Rdma]) {
    let wrs: Vec<SendWr> = list
        .iter()
        .map(|(id, op, sge, raddr, rkey)| SendWr {
            remote_addr: *raddr as u64,
            rkey: *rkey,
            ..SendWr::new(*id, *op, std::slice::from_ref(sge))
        })
        .collect();
    e.qp.post_send(&wrs).unwrap();
}

fn sge(addr: usize, len: usize, lkey: u32) -> Sge {
    Sge {
        addr: addr as u64,
        length: len as u32,
        lkey,
    }
}

#[test]
fn local_and_remote_faults_write_then_read() {
    let timeout = Duration::from_millis(20);
    let (a, b) = pair_cfg(cfg(timeout));
    let (ra, rb, rc) = (Region::new(4), Region::new(4), Region::new(4));
    let data = pattern(3 * P, 7);
    ra.write(100, &data);
    a.host.frames().track(ra.addr(), ra.len, false).unwrap();
    a.host.frames().track(rc.addr(), rc.len, false).unwrap();
    b.host.frames().track(rb.addr(), rb.len, false).unwrap();
    let ca = recording_handler(&a.host);
    let cb = recording_handler(&b.host);
    let (mra, mrb, mrc) = (ra.odp_mr(&a.pd), rb.odp_mr(&b.pd), rc.odp_mr(&a.pd));

    // WRITE: local fault (stall for the handler), then remote NAK + retransmission.
    let t0 = Instant::now();
    post(
        &a,
        &[rdma(
            1,
            WrOpcode::Write,
            sge(ra.addr() + 100, 3 * P, mra.lkey()),
            rb.addr() + 50,
            mrb.rkey(),
        )],
    );
    let wc = wait1(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert!(t0.elapsed() >= timeout, "a remote fault costs the NAK timeout");
    assert_eq!(rb.read(50, 3 * P), data);
    let s = a.host.stats();
    assert_eq!(s.odp_faults_local, 1, "one interrupt round trip for the WR's pages");
    assert!(s.odp_faults_remote >= 1 && s.retransmissions >= 1, "{s:?}");
    {
        let ca = ca.lock();
        assert_eq!(ca.len(), 1);
        assert_eq!((ca[0].0, ca[0].1), (ra.addr(), 4 * P), "all 4 touched pages at once");
        assert_eq!(ca[0].2, "rnic-nic", "handled on the NIC thread (interrupt hand-off)");
        let cb = cb.lock();
        assert!(!cb.is_empty() && cb.iter().all(|c| c.2 == "rnic-nic"));
        assert_eq!((cb[0].0, cb[0].1), (rb.addr(), 4 * P));
    }
    assert!(
        a.host.frames().is_resident(ra.addr() + P),
        "fault resolution marks present"
    );

    // Invalidate two target pages, then READ them into a non-present local region.
    b.host.odp_invalidate(rb.addr() + P, 2 * P).unwrap();
    assert!(!b.host.frames().is_resident(rb.addr() + P));
    let t0 = Instant::now();
    post(
        &a,
        &[rdma(
            2,
            WrOpcode::Read,
            sge(rc.addr(), 3 * P, mrc.lkey()),
            rb.addr() + 50,
            mrb.rkey(),
        )],
    );
    let wc = wait1(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert!(t0.elapsed() >= timeout);
    assert_eq!(rc.read(0, 3 * P), data);
    let s2 = a.host.stats();
    assert_eq!(s2.odp_faults_local, 2);
    assert!(s2.odp_faults_remote > s.odp_faults_remote);
    assert_eq!(cb.lock().last().map(|c| (c.0, c.1)), Some((rb.addr() + P, 2 * P)));
    assert_eq!(s2.nonresident_dma + b.host.stats().nonresident_dma, 0);
    assert_empty(&a.cq);
    drop((mra, mrb, mrc));
}

#[test]
fn go_back_n_redoes_later_wrs_and_completes_in_order() {
    let timeout = Duration::from_millis(5);
    let (a, b) = pair_cfg(cfg(timeout));
    let rb = Region::new(2);
    b.host.frames().track(rb.addr(), rb.len, true).unwrap();
    b.host.odp_invalidate(rb.addr(), P).unwrap(); // page 0 faults, page 1 present
    let _cb = recording_handler(&b.host);
    let mrb = rb.odp_mr(&b.pd);
    let local = buf(&a.pd, 6 * P, 0);
    let (p0, q1) = (pattern(P, 1), pattern(P, 2));
    local.write(0, &p0);
    local.write(P, &q1);
    let la = local.addr();
    let k = local.lkey();
    let wrs = [
        // WR0 faults at the target (NAK); WR1..WR3 are on the wire behind it.
        rdma(0, WrOpcode::Write, sge(la, P, k), rb.addr(), mrb.rkey()),
        rdma(1, WrOpcode::Read, sge(la + 2 * P, P, k), rb.addr() + P, mrb.rkey()),
        rdma(2, WrOpcode::Write, sge(la + P, P, k), rb.addr() + P, mrb.rkey()),
        rdma(3, WrOpcode::Read, sge(la + 3 * P, P, k), rb.addr() + P, mrb.rkey()),
        // WR4 reads what WR0 writes.
        rdma(4, WrOpcode::Read, sge(la + 4 * P, P, k), rb.addr(), mrb.rkey()),
    ];
    let t0 = Instant::now();
    post(&a, &wrs);
    let wcs = a.cq.poll_wait(5, T).unwrap();
    assert!(t0.elapsed() >= timeout);
    let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4], "in order, exactly once");
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_empty(&a.cq);
    // WR1 first ran before WR2 (read zeros) and was redone after WR2's first
    // execution: it now holds WR2's data (go-back-N redoes effects).
    assert_eq!(local.to_vec(2 * P, P), q1, "WR1 was re-executed");
    assert_eq!(local.to_vec(3 * P, P), q1);
    assert_eq!(local.to_vec(4 * P, P), p0, "WR4 sees WR0's data");
    assert_eq!(rb.read(0, P), p0);
    let s = a.host.stats();
    assert!(s.retransmissions >= 4, "WR0 + 3 redone: {s:?}");
    assert_eq!(s.wrs, 5, "each WR counted once");
    assert_eq!(s.nonresident_dma + b.host.stats().nonresident_dma, 0);
    drop(mrb);
}

#[test]
fn local_fault_without_handler_fails_cleanly() {
    let (a, b) = pair();
    let ra = Region::new(1);
    a.host.frames().track(ra.addr(), ra.len, false).unwrap();
    let mra = ra.odp_mr(&a.pd);
    let dst = buf(&b.pd, P, 0);
    post(
        &a,
        &[rdma(
            9,
            WrOpcode::Write,
            sge(ra.addr(), P, mra.lkey()),
            dst.addr(),
            dst.rkey(),
        )],
    );
    assert_eq!(wait1(&a.cq).status, WcStatus::LocProtErr);
    assert_eq!(a.host.stats().odp_faults_local, 1);
    assert_eq!(a.host.stats().nonresident_dma, 0);
    drop(mra);
}

#[test]
fn remote_fault_without_handler_retries_then_fails() {
    let timeout = Duration::from_millis(1);
    let (a, b) = pair_cfg(HostConfig {
        transport_timeout: Duration::from_millis(10),
        ..cfg(timeout)
    });
    assert_eq!(rnic::odp::max_naks(a.host.config()), rnic::odp::ODP_MAX_NAKS);
    let rb = Region::new(1);
    b.host.frames().track(rb.addr(), rb.len, false).unwrap();
    let mrb = rb.odp_mr(&b.pd);
    let src = buf(&a.pd, P, 3);
    let t0 = Instant::now();
    post(
        &a,
        &[
            rdma(1, WrOpcode::Write, src.sge(0, P as u32), rb.addr(), mrb.rkey()),
            rdma(2, WrOpcode::Write, src.sge(0, 8), rb.addr(), mrb.rkey()),
        ],
    );
    let wcs = a.cq.poll_wait(2, T).unwrap();
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushErr));
    assert!(t0.elapsed() >= timeout * rnic::odp::ODP_MAX_NAKS);
    // WR0's NAKs (the last one fails it), plus WR2's: on the wire behind it each time.
    assert_eq!(a.host.stats().odp_faults_remote, 2 * rnic::odp::ODP_MAX_NAKS as u64 + 1);
    assert_eq!(rb.read(0, 8), [0; 8], "a NAKed write never lands");
    assert_eq!(b.host.stats().nonresident_dma, 0);
    drop(mrb);
}

fn mprotect(addr: usize, len: usize, prot: mm::MprotectFlags) {
    // SAFETY: page-aligned range inside a test Region that stays mapped.
    unsafe { mm::mprotect(addr as *mut _, len, prot) }.unwrap();
}

const RW: mm::ProtFlags = mm::ProtFlags::READ.union(mm::ProtFlags::WRITE);
const MP_RW: mm::MprotectFlags = mm::MprotectFlags::READ.union(mm::MprotectFlags::WRITE);

/// The target's pages are really swapped out (PROT_NONE) after each invalidation: a NIC
/// touching a non-present page would crash the test.
#[test]
fn invalidation_during_traffic_never_touches_absent_pages() {
    let ms: u64 = std::env::var("RNIC_ODP_STRESS_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let (a, b) = pair_cfg(cfg(Duration::from_millis(1)));
    const N: usize = 16;
    let rb = Arc::new(Region::new(N));
    b.host.frames().track(rb.addr(), rb.len, true).unwrap();
    b.host.set_odp_fault_handler(Arc::new(|addr, len| {
        mprotect(addr, len, MP_RW);
        Ok(())
    }));
    let mrb = rb.odp_mr(&b.pd);
    let local = buf(&a.pd, 4 * P, 0);
    let stop = Arc::new(AtomicBool::new(false));
    let inv = {
        let (stop, host, rb) = (stop.clone(), b.host.clone(), rb.clone());
        std::thread::spawn(move || {
            let mut x = 0x1234_5678u64;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = rb.addr() + (x as usize % N) * P;
                host.odp_invalidate_then(p, P, || mprotect(p, P, mm::MprotectFlags::empty()))
                    .unwrap();
                n += 1;
                std::thread::sleep(Duration::from_micros(300));
            }
            n
        })
    };
    let end = Instant::now() + Duration::from_millis(ms);
    let mut it = 0u64;
    while Instant::now() < end {
        let off = (it as usize * 1237) % (rb.len - 2 * P);
        let len = 1 + (it as usize * 977) % (2 * P);
        let d = pattern(len, it as u8);
        local.write(0, &d);
        local.write(2 * P, &vec![0; len]);
        post(
            &a,
            &[
                rdma(
                    2 * it,
                    WrOpcode::Write,
                    local.sge(0, len as u32),
                    rb.addr() + off,
                    mrb.rkey(),
                ),
                rdma(
                    2 * it + 1,
                    WrOpcode::Read,
                    local.sge(2 * P, len as u32),
                    rb.addr() + off,
                    mrb.rkey(),
                ),
            ],
        );
        let wcs = a.cq.poll_wait(2, T).unwrap();
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert_eq!(wcs[1].wr_id, 2 * it + 1);
        assert_eq!(local.to_vec(2 * P, len), d, "iteration {it}");
        it += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let invalidations = inv.join().unwrap();
    let s = a.host.stats();
    assert!(
        invalidations > 10 && it > 5,
        "exercised: {invalidations} invalidations, {it} rounds"
    );
    assert!(s.odp_faults_remote > 0, "{s:?}");
    assert_eq!(s.nonresident_dma + b.host.stats().nonresident_dma, 0);
    drop(mrb);
    // Leave the region accessible for munmap-free drop order (Arc may outlive).
    mprotect(rb.addr(), rb.len, MP_RW);
}

/// Cross-process target (runs only as the child of `remote_faults_across_processes`).
#[test]
fn odp_xproc_child() {
    if std::env::var("RNIC_ODP_CHILD").is_err() {
        return;
    }
    let host = Host::new(HostConfig::default()).unwrap();
    let e = end(&host, &QpInitAttr::default());
    let r = Region::new(4);
    host.frames().track(r.addr(), r.len, false).unwrap();
    let calls = recording_handler(&host);
    let mr = r.odp_mr(&e.pd);
    let info = format!("{} {} {} {}", host.addr().to_hex(), e.qp.qpn(), r.addr(), mr.rkey());
    common::child::serve(&info, |w| match w {
        ["PEER", a, q] => {
            e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                .unwrap();
            Some("READY".to_string())
        }
        ["CHECK", len, seed] => {
            let len: usize = len.parse().unwrap();
            let ok = r.read(0, len) == pattern(len, seed.parse().unwrap());
            let c = calls.lock();
            let nic = c.iter().all(|c| c.2 == "rnic-nic");
            Some(format!("RES {ok} {} {nic} {}", c.len(), host.stats().nonresident_dma))
        }
        _ => None,
    });
    drop(mr);
}

/// A remote fault in another process is raised through the target segment's mailbox,
/// handled by the target's NIC thread, and the WR completes after the NAK timeout.
#[test]
fn remote_faults_across_processes() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "odp_xproc_child", "--nocapture", "--test-threads=1", "-q"])
        .env("RNIC_ODP_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut inp = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = |pfx: &str| loop {
        let mut s = String::new();
        assert!(out.read_line(&mut s).unwrap() > 0, "child exited");
        if s.starts_with(pfx) {
            return s.trim().to_string();
        }
    };
    let info = line("INFO");
    let f: Vec<&str> = info.split_whitespace().collect();
    let (taddr, tqpn, raddr, rkey): (HostAddr, u32, usize, u32) = (
        HostAddr::from_hex(f[1]).unwrap(),
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
    );
    let timeout = Duration::from_millis(10);
    let host = Host::new(cfg(timeout)).unwrap();
    let a = end(&host, &QpInitAttr::default());
    a.qp.connect(all_access(), taddr, tqpn, 7).unwrap();
    writeln!(inp, "PEER {} {}", host.addr().to_hex(), a.qp.qpn()).unwrap();
    line("READY");
    let local = buf(&a.pd, 4 * P, 0);
    // A small WRITE (below ring_max: would use the target's NIC-thread ring) and a
    // large one, both onto non-present target pages.
    for (i, len) in [(1u64, 100usize), (2, 3 * P + 5)] {
        local.write(0, &pattern(len, i as u8));
        let t0 = Instant::now();
        post(&a, &[rdma(i, WrOpcode::Write, local.sge(0, len as u32), raddr, rkey)]);
        let wc = a.cq.poll_wait(1, T).unwrap()[0];
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
        if i == 1 {
            assert!(t0.elapsed() >= timeout, "remote fault costs the NAK timeout");
        }
        writeln!(inp, "CHECK {len} {i}").unwrap();
        let res = line("RES");
        let r: Vec<&str> = res.split_whitespace().collect();
        assert_eq!(r[1], "true", "data landed: {res}");
        assert_ne!(r[2], "0", "target handler ran: {res}");
        assert_eq!(r[3], "true", "handler on the target's NIC thread: {res}");
        assert_eq!(r[4], "0", "no non-resident DMA: {res}");
    }
    let s = host.stats();
    assert!(s.odp_faults_remote >= 2 && s.retransmissions >= 2, "{s:?}");
    drop(inp);
    let _ = child.wait();
}
