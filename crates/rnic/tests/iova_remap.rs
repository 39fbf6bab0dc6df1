//! Remapping IOVA pages during multi-page transfers whose frames are contiguous (so the
//! DMA engine translates each page once and coalesces the run into one memmove / one
//! iovec): a READ still tears only at atom boundaries (page boundaries, or where an
//! epoch section ends), and `flush()` returns only after every DMA section that could
//! have used the old frame — the remapper poisons the old frame right after `flush()`,
//! so a READ that saw poison would prove a copy ran outside the section that translated
//! it. In-process and cross-process (the test binary re-executes itself as the target,
//! env `RNIC_IOVA_REMAP_CHILD`). Long form: `RNIC_LONG=1`.

mod common;
use common::child::{serve, Child};
use common::*;
use rnic::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const PAGES: usize = 64;
const POISON: u8 = 0xff;

/// Byte `off` of page `page` of frame set `set`: distinct per set, page and 64 B piece,
/// never `POISON`.
fn frame_byte(set: usize, page: usize, off: usize) -> u8 {
    ((set * 97 + page * 13 + off / 64 * 7 + off) % 251) as u8
}

/// The whole content of frame set `set`.
fn set_content(set: usize) -> Vec<u8> {
    (0..PAGES * PAGE).map(|i| frame_byte(set, i / PAGE, i % PAGE)).collect()
}

/// Page-aligned heap memory of `PAGES` pages (one contiguous frame run).
struct PageBuf(*mut u8);
// SAFETY: plain heap memory, accessed through raw pointers only.
unsafe impl Send for PageBuf {}
// SAFETY: as above.
unsafe impl Sync for PageBuf {}
fn layout() -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(PAGES * PAGE, PAGE).unwrap()
}
impl PageBuf {
    fn new() -> PageBuf {
        // SAFETY: non-zero size layout.
        let p = unsafe { std::alloc::alloc_zeroed(layout()) };
        assert!(!p.is_null());
        PageBuf(p)
    }
    fn page(&self, i: usize) -> usize {
        assert!(i < PAGES);
        self.0 as usize + i * PAGE
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= PAGES * PAGE);
        // SAFETY: bounds checked.
        unsafe { std::ptr::copy(data.as_ptr(), self.0.add(off), data.len()) }
    }
}
impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout.
        unsafe { std::alloc::dealloc(self.0, layout()) }
    }
}

/// The target side: an IOVA MR over `PAGES` IOVA pages, each mapped to the same page
/// of one of two frame sets (each set contiguous), and a thread moving single pages
/// between the sets: write the new frame, map, `flush()`, poison the old frame.
struct Target {
    host: Host,
    sets: Arc<[PageBuf; 2]>,
    range: IovaRange,
    _va: PageBuf,
    mr: Option<Mr>,
    stop: Arc<AtomicBool>,
    remaps: Arc<AtomicU64>,
    /// Remaps whose new entry is stored (counted before their flush).
    maps: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Target {
    fn new(host: &Host, pd: &Pd) -> Target {
        let sets = Arc::new([PageBuf::new(), PageBuf::new()]);
        sets[0].write(0, &set_content(0));
        sets[1].write(0, &vec![POISON; PAGES * PAGE]);
        let io = host.iommu();
        let range = io.alloc_range(PAGES as u64).unwrap();
        let f: Vec<Frame> = (0..PAGES).map(|p| Frame::Ram(sets[0].page(p))).collect();
        // SAFETY: the frame sets outlive every DMA: `Drop` stops the remapper,
        // deregisters the MR and frees (unmaps + flushes) the range first.
        unsafe { io.map_range(&range, 0, &f).unwrap() };
        let va = PageBuf::new();
        // SAFETY: `va` only provides the MR's addresses; the frames are valid as above.
        let mr = unsafe { pd.reg_mr_iova(va.page(0), PAGES * PAGE, all_access(), &range).unwrap() };
        Target {
            host: host.clone(),
            sets,
            range,
            _va: va,
            mr: Some(mr),
            stop: Arc::new(AtomicBool::new(false)),
            remaps: Arc::new(AtomicU64::new(0)),
            maps: Arc::new(AtomicU64::new(0)),
            thread: None,
        }
    }

    fn va(&self) -> u64 {
        self.mr.as_ref().unwrap().addr() as u64
    }

    fn rkey(&self) -> u32 {
        self.mr.as_ref().unwrap().rkey()
    }

    /// Start the remapper and wait (bounded) until it has done some remaps.
    fn start(&mut self) {
        let (stop, remaps, maps, sets, host, base) = (
            self.stop.clone(),
            self.remaps.clone(),
            self.maps.clone(),
            self.sets.clone(),
            self.host.clone(),
            self.range.base,
        );
        self.thread = Some(std::thread::spawn(move || {
            let fresh = [set_content(0), set_content(1)];
            let mut cur = [0usize; PAGES];
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            while !stop.load(Ordering::Relaxed) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let p = (x >> 33) as usize % PAGES;
                let (old, new) = (cur[p], 1 - cur[p]);
                // The new frame is mapped nowhere (its last mapping was flushed before
                // it was poisoned): no DMA can see it half written.
                sets[new].write(p * PAGE, &fresh[new][p * PAGE..(p + 1) * PAGE]);
                // SAFETY: the frame sets outlive all DMA (see `new`).
                unsafe {
                    host.iommu()
                        .map(base + p as u64, Frame::Ram(sets[new].page(p)))
                        .unwrap()
                };
                maps.fetch_add(1, Ordering::Relaxed);
                host.iommu().flush().unwrap();
                sets[old].write(p * PAGE, &[POISON; PAGE]);
                cur[p] = new;
                remaps.fetch_add(1, Ordering::Relaxed);
            }
        }));
        let t = Instant::now();
        while self.remaps.load(Ordering::Relaxed) < 50 {
            assert!(t.elapsed() < Duration::from_secs(20), "remapper never ran");
            std::thread::yield_now();
        }
    }

    /// Stop the remapper; returns how many remaps (each with a flush) it did.
    fn stop(&mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.remaps.load(Ordering::Relaxed)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop();
        drop(self.mr.take());
        self.host.iommu().free_range(self.range).unwrap();
    }
}

fn iters() -> usize {
    if std::env::var("RNIC_LONG").is_ok() {
        20_000
    } else {
        300
    }
}

/// Check the data of a READ of `got.len()` bytes at MR offset `off`: no poison, and
/// every `tlp` atom entirely from one frame set. Returns whether both sets were seen.
fn check(exp: &[Vec<u8>; 2], off: usize, got: &[u8], tlp: usize, what: &str) -> bool {
    assert!(
        !got.contains(&POISON),
        "{what}: saw a frame poisoned after flush() returned"
    );
    let mut seen = [false; 2];
    for (ai, atom) in got.chunks(tlp).enumerate() {
        let vo = off + ai * tlp;
        let s = (0..2)
            .find(|&s| atom == &exp[s][vo..vo + atom.len()])
            .unwrap_or_else(|| panic!("{what}: atom {ai} mixes frames inside an atom"));
        seen[s] = true;
    }
    seen[0] && seen[1]
}

/// Offsets of the READs: atom-aligned, varying, so epoch sections start mid-page too.
fn read_off(it: usize, tlp: usize) -> usize {
    (it * 5 * tlp) % (4 * PAGE)
}

#[test]
fn remap_during_coalesced_transfer_in_process() {
    for cfg in [
        HostConfig::default(),
        HostConfig {
            max_tlp: 128,
            dma_section: 16 * 1024,
            ..HostConfig::default()
        },
    ] {
        let tlp = cfg.max_tlp;
        let (a, b) = pair_cfg(cfg);
        let mut t = Target::new(&b.host, &b.pd);
        let exp = [set_content(0), set_content(1)];
        let local = buf(&a.pd, PAGES * PAGE, 0);
        t.start();
        let (mut mixed, mut overlapped) = (0, 0);
        // At least `iters()` READs, and more (bounded) until some ran while the
        // remapper remapped: on a loaded 2-core machine the two threads may rarely
        // run at the same time.
        let t0 = Instant::now();
        let mut it = 0;
        while it < iters() || (overlapped < 10 && t0.elapsed() < Duration::from_secs(20)) {
            it += 1;
            let off = read_off(it, tlp);
            let len = PAGES * PAGE - off;
            let sge = [local.sge(0, len as u32)];
            let r0 = t.maps.load(Ordering::Relaxed);
            a.qp.post_send(&[SendWr::new(it as u64, WrOpcode::Read, &sge).remote(t.va() + off as u64, t.rkey())])
                .unwrap();
            assert_eq!(wait1(&a.cq).status, WcStatus::Success);
            overlapped += (t.maps.load(Ordering::Relaxed) != r0) as usize;
            mixed += check(&exp, off, &local.to_vec(0, len), tlp, &format!("read {it}")) as usize;
        }
        let remaps = t.stop();
        eprintln!(
            "tlp {tlp}: {it} reads, {overlapped} overlapped a remap, {mixed} saw both frame sets, {remaps} remaps"
        );
        assert!(
            overlapped > 0,
            "no READ ran while a page was remapped: the test proved nothing"
        );
        assert!(b.host.stats().flushes >= remaps);
        assert_eq!(b.host.stats().nonresident_dma, 0);
    }
}

/// The target in its own process. Does nothing unless run as the child.
#[test]
fn iova_remap_child() {
    if std::env::var("RNIC_IOVA_REMAP_CHILD").is_err() {
        return;
    }
    let host = Host::new(HostConfig::default()).unwrap();
    let e = end(&host, &QpInitAttr::default());
    let mut t = Target::new(&host, &e.pd);
    let info = format!("{} {} {} {}", host.addr().to_hex(), e.qp.qpn(), t.va(), t.rkey());
    serve(&info, |w| match w {
        ["PEER", a, q] => {
            e.qp.connect(all_access(), HostAddr::from_hex(a).unwrap(), q.parse().unwrap(), 7)
                .unwrap();
            Some("READY".to_string())
        }
        ["START"] => {
            t.start();
            Some("STARTED".to_string())
        }
        ["STOP"] => {
            let remaps = t.stop();
            Some(format!("STOPPED {remaps} {}", host.stats().flushes))
        }
        ["EXIT"] => None,
        _ => Some("?".into()),
    });
}

#[test]
fn remap_during_coalesced_transfer_cross_process() {
    let mut ch = Child::spawn(
        "iova_remap_child",
        "RNIC_IOVA_REMAP_CHILD",
        "1",
        &["INFO", "READY", "STARTED", "STOPPED"],
    );
    let info = ch.line();
    let f: Vec<&str> = info.split_whitespace().collect();
    let raddr = HostAddr::from_hex(f[1]).unwrap();
    let rqpn: u32 = f[2].parse().unwrap();
    let (va, rkey): (u64, u32) = (f[3].parse().unwrap(), f[4].parse().unwrap());
    let host = Host::new(HostConfig::default()).unwrap();
    let e = end(&host, &QpInitAttr::default());
    e.qp.connect(all_access(), raddr, rqpn, 7).unwrap();
    assert_eq!(
        ch.cmd(&format!("PEER {} {}", host.addr().to_hex(), e.qp.qpn())),
        "READY"
    );
    let tlp = HostConfig::default().max_tlp;
    let exp = [set_content(0), set_content(1)];
    let local = buf(&e.pd, PAGES * PAGE, 0);
    assert_eq!(ch.cmd("START"), "STARTED");
    let mut mixed = 0;
    for it in 0..iters() {
        // Offset 0 reads all 256 KiB (shared with the target's NIC thread when it helps).
        let off = read_off(it, tlp);
        let len = PAGES * PAGE - off;
        let sge = [local.sge(0, len as u32)];
        e.qp.post_send(&[SendWr::new(it as u64, WrOpcode::Read, &sge).remote(va + off as u64, rkey)])
            .unwrap();
        assert_eq!(wait1(&e.cq).status, WcStatus::Success);
        mixed += check(&exp, off, &local.to_vec(0, len), tlp, &format!("read {it}")) as usize;
    }
    let st = ch.cmd("STOP");
    let w: Vec<u64> = st.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect();
    eprintln!(
        "cross-process: {mixed} reads saw both frame sets, {} remap+flush cycles",
        w[0]
    );
    assert!(w[0] >= 50 && w[1] >= w[0], "remaps {} flushes {}", w[0], w[1]);
}
