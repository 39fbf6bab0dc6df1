//! End-to-end model of the optimistic one-sided path without a NIC: a toy
//! DMA engine translating every atom through an IOMMU (the [`MrShadow`]'s
//! Read/Write views), a toy pager that swaps pages out (through the
//! shadow's swap-out, then reclaiming and scribbling the frame) and lazily
//! back in (the application touching the page: no IOMMU update), and an
//! initiator that runs READs and WRITEs with the planner's strategies and
//! the checks, falling back to a two-sided path (pin + map-in + CPU copy).
//!
//! The property: whatever the interleaving, an operation the checks accept
//! is byte-exact, and at the end memory equals the model.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nprdma::check::{check_read, check_readback, check_versions, CheckConfig};
use nprdma::nic::{Access, Frame, IommuControl, NicMr};
use nprdma::plan::{choose, AppOp, PlanConfig, Strategy};
use nprdma::shadow::MrShadow;

const PS: u64 = 4096;
const PAGES: u64 = 8;
const BASE: u64 = 0x7000_0000;

#[derive(Debug, thiserror::Error)]
#[error("toy iommu: {0}")]
struct ToyErr(&'static str);

struct ToyMr;
impl NicMr for ToyMr {
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn addr(&self) -> u64 {
        0
    }
    fn len(&self) -> u64 {
        0
    }
}

const F_UNMAPPED: u64 = 0;
const F_SIG: u64 = 1;
const F_HOLE: u64 = 2;
const F_RAM: u64 = 3; // frame = BASE-relative page in the high bits

/// Two ranges (read view, write view) of PAGES entries, lock-free lookups,
/// and a flush that waits for in-flight atoms.
struct ToyIommu {
    views: [Vec<AtomicU64>; 2],
    next: AtomicU32,
    inflight: AtomicU64,
    flushes: AtomicU64,
}

impl ToyIommu {
    fn new() -> Self {
        let v = || (0..PAGES).map(|_| AtomicU64::new(F_UNMAPPED)).collect();
        ToyIommu {
            views: [v(), v()],
            next: AtomicU32::new(0),
            inflight: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        }
    }
}

impl IommuControl for ToyIommu {
    type Error = ToyErr;
    type Range = u32;
    type Mr = ToyMr;
    fn alloc_range(&self, npages: u64) -> Result<u32, ToyErr> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        if id > 1 || npages != PAGES {
            return Err(ToyErr("only two ranges of PAGES pages"));
        }
        Ok(id)
    }
    fn free_range(&self, _: u32) -> Result<(), ToyErr> {
        Ok(())
    }
    fn map(&self, r: &u32, idx: u64, frame: Frame) -> Result<(), ToyErr> {
        let e = match frame {
            Frame::Unmapped => F_UNMAPPED,
            Frame::Signature => F_SIG,
            Frame::BlackHole => F_HOLE,
            Frame::Ram(a) => ((a - BASE) / PS) << 8 | F_RAM,
        };
        self.views[*r as usize]
            .get(idx as usize)
            .ok_or(ToyErr("bad index"))?
            .store(e, Ordering::SeqCst);
        Ok(())
    }
    fn flush(&self) -> Result<(), ToyErr> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        while self.inflight.load(Ordering::SeqCst) != 0 {
            assert!(t.elapsed() < Duration::from_secs(5), "flush hung");
            std::hint::spin_loop();
        }
        Ok(())
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(&self, _: u64, _: u64, _: Access, _: &u32) -> Result<ToyMr, ToyErr> {
        Ok(ToyMr)
    }
    fn set_resident(&self, _: u64, _: u64, _: bool) -> Result<(), ToyErr> {
        Ok(())
    }
}

/// Physical frames, swap copies, and the pager's per-page state.
struct Host {
    phys: Vec<AtomicU8>,
    swap: Vec<Mutex<Vec<u8>>>,
    resident: Vec<AtomicBool>,
    /// Serialises pager transitions and pins of a page.
    page_lock: Vec<Mutex<u32>>, // pin count
    iommu: Arc<ToyIommu>,
    shadow: MrShadow<ToyIommu>,
    cfg: CheckConfig,
    /// Page a stretched DMA atom is using right now (u64::MAX: none): the
    /// swapper goes for it, to hit the in-flight window on purpose.
    hot: AtomicU64,
}

impl Host {
    fn new(init: &[u8]) -> Self {
        let iommu = Arc::new(ToyIommu::new());
        let shadow =
            MrShadow::new(iommu.clone(), BASE, PAGES * PS, PS, &[true; PAGES as usize]).unwrap();
        Host {
            phys: init.iter().map(|b| AtomicU8::new(*b)).collect(),
            swap: (0..PAGES).map(|_| Mutex::new(Vec::new())).collect(),
            resident: (0..PAGES).map(|_| AtomicBool::new(true)).collect(),
            page_lock: (0..PAGES).map(|_| Mutex::new(0)).collect(),
            iommu,
            shadow,
            cfg: CheckConfig::default(),
            hot: AtomicU64::new(u64::MAX),
        }
    }

    /// Pager eviction: listener (version, remap, flush), write to swap,
    /// reclaim (scribble the frame).
    fn swap_out(&self, p: usize) -> bool {
        let pins = self.page_lock[p].lock().unwrap();
        if *pins > 0 || !self.resident[p].load(Ordering::SeqCst) {
            return false;
        }
        self.shadow.swap_out(&[BASE + p as u64 * PS]).unwrap();
        let off = p * PS as usize;
        let copy: Vec<u8> = (0..PS as usize)
            .map(|i| self.phys[off + i].load(Ordering::SeqCst))
            .collect();
        *self.swap[p].lock().unwrap() = copy;
        for i in 0..PS as usize {
            self.phys[off + i].store(0xCC, Ordering::SeqCst);
        }
        self.resident[p].store(false, Ordering::SeqCst);
        drop(pins);
        true
    }

    /// Swap-in by the pager (an application touch, or a pin); no IOMMU
    /// update: swap-in is lazy.
    fn swap_in_locked(&self, p: usize) {
        if self.resident[p].load(Ordering::SeqCst) {
            return;
        }
        let off = p * PS as usize;
        let copy = self.swap[p].lock().unwrap();
        for (i, b) in copy.iter().enumerate() {
            self.phys[off + i].store(*b, Ordering::SeqCst);
        }
        self.resident[p].store(true, Ordering::SeqCst);
    }

    fn touch(&self, p: usize) {
        let _g = self.page_lock[p].lock().unwrap();
        self.swap_in_locked(p);
    }

    fn pin(&self, p: usize) {
        let mut g = self.page_lock[p].lock().unwrap();
        self.swap_in_locked(p);
        *g += 1;
    }

    fn unpin(&self, p: usize) {
        *self.page_lock[p].lock().unwrap() -= 1;
    }

    /// Logical content of byte `a` (resident frame or swap copy).
    fn logical(&self, off: usize) -> u8 {
        let p = off / PS as usize;
        let _g = self.page_lock[p].lock().unwrap();
        if self.resident[p].load(Ordering::SeqCst) {
            self.phys[off].load(Ordering::SeqCst)
        } else {
            self.swap[p].lock().unwrap()[off % PS as usize]
        }
    }

    /// DMA through view `v` (0 read, 1 write), atom by atom (address-aligned
    /// atoms), copying out of or into `buf`.
    fn dma(&self, v: usize, addr: u64, buf: &mut [u8], write: bool, jitter: u64) {
        let atom = self.cfg.atom() as u64;
        let mut a = addr;
        let end = addr + buf.len() as u64;
        let mut k = 0u64;
        while a < end {
            let e = ((a / atom) + 1) * atom;
            let e = e.min(end);
            self.iommu.inflight.fetch_add(1, Ordering::SeqCst);
            let page = ((a - BASE) / PS) as usize;
            let ent = self.iommu.views[v][page].load(Ordering::SeqCst);
            if (jitter + k) % 29 == 0 || (e == end && jitter % 3 == 0) {
                // Stretch some atoms between translation and copy so that
                // swap-outs land while they are in flight (flush must wait).
                self.hot.store(page as u64, Ordering::SeqCst);
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(300) {
                    std::hint::spin_loop();
                }
                self.hot.store(u64::MAX, Ordering::SeqCst);
            }
            for x in a..e {
                let i = (x - addr) as usize;
                let off = (x - BASE) as usize;
                match (ent & 0xff, write) {
                    (F_RAM, false) => {
                        buf[i] = self.phys[((ent >> 8) as usize) * PS as usize + off % PS as usize]
                            .load(Ordering::SeqCst)
                    }
                    (F_RAM, true) => self.phys
                        [((ent >> 8) as usize) * PS as usize + off % PS as usize]
                        .store(buf[i], Ordering::SeqCst),
                    (F_SIG, false) => buf[i] = self.cfg.magic_byte(x),
                    (F_HOLE, false) => buf[i] = 0,
                    (F_SIG | F_HOLE, true) => {}
                    _ => panic!("DMA through an unmapped entry"),
                }
            }
            self.iommu.inflight.fetch_sub(1, Ordering::SeqCst);
            k += 1;
            if (jitter + k) % 7 == 0 {
                std::thread::yield_now();
            }
            a = e;
        }
    }

    fn versions(&self, addr: u64, len: u64) -> Vec<u32> {
        let first = ((addr - BASE) / PS) as usize;
        let last = ((addr + len.max(1) - 1 - BASE) / PS) as usize;
        (first..=last)
            .map(|i| self.shadow.versions().get(i).unwrap())
            .collect()
    }

    /// Two-sided path: pin, map in, CPU copy, unpin.
    fn two_sided(&self, addr: u64, buf: &mut [u8], write: bool) {
        let first = ((addr - BASE) / PS) as usize;
        let last = ((addr + buf.len() as u64 - 1 - BASE) / PS) as usize;
        for p in first..=last {
            self.pin(p);
        }
        self.shadow.map_in(addr, buf.len() as u64).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            let off = (addr - BASE) as usize + i;
            if write {
                self.phys[off].store(*b, Ordering::SeqCst);
            } else {
                *b = self.phys[off].load(Ordering::SeqCst);
            }
        }
        for p in first..=last {
            self.unpin(p);
        }
    }
}

fn lcg(s: &mut u64) -> u64 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *s >> 33
}

#[test]
fn accepted_operations_are_byte_exact_under_concurrent_swapping() {
    let iters: u64 = std::env::var("NPRDMA_MODEL_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let mut truth: Vec<u8> = (0..PAGES * PS).map(|i| (i % 251) as u8 & 0x7f).collect();
    let host = Arc::new(Host::new(&truth));
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (host, stop, swaps) = (host.clone(), stop.clone(), swaps.clone());
        std::thread::spawn(move || {
            let mut s = 99u64;
            while !stop.load(Ordering::SeqCst) {
                let hot = host.hot.load(Ordering::SeqCst);
                if hot != u64::MAX {
                    if host.swap_out(hot as usize) {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                let p = (lcg(&mut s) % PAGES) as usize;
                match lcg(&mut s) % 3 {
                    0 | 1 => {
                        if host.swap_out(p) {
                            swaps.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => host.touch(p), // lazy swap-in
                }
                std::thread::yield_now();
            }
        })
    };

    let plan_cfg = PlanConfig {
        write_version_threshold: 2048,
        read_version_threshold: Some(6000),
        ..PlanConfig::default()
    };
    let (mut ok, mut fallback) = (0u64, 0u64);
    let mut s = 7u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    for it in 0..iters {
        if Instant::now() > deadline {
            break;
        }
        let len = 1 + lcg(&mut s) % 9000;
        let off = lcg(&mut s) % (PAGES * PS - len);
        let addr = BASE + off;
        let local_addr = 0x10_0000 + lcg(&mut s) % 4096;
        let is_write = lcg(&mut s) % 2 == 0;
        let range = off as usize..(off + len) as usize;
        if is_write {
            let src: Vec<u8> = (0..len).map(|i| ((i + it) % 127) as u8).collect();
            let accepted = match choose(AppOp::Write, len, true, &plan_cfg) {
                Strategy::WriteReadback { .. } => {
                    let mut w = src.clone();
                    host.dma(1, addr, &mut w, true, it);
                    let mut rb = vec![0u8; len as usize];
                    host.dma(0, addr, &mut rb, false, it + 3);
                    check_readback(&src, &rb, addr, &host.cfg).is_ok()
                }
                Strategy::WriteVersioned => {
                    let v1 = host.versions(addr, len);
                    let mut w = src.clone();
                    host.dma(1, addr, &mut w, true, it);
                    let v2 = host.versions(addr, len);
                    check_versions(&v1, &v2).is_ok()
                }
                other => panic!("unexpected strategy {other:?}"),
            };
            if accepted {
                ok += 1;
            } else {
                fallback += 1;
                let mut w = src.clone();
                host.two_sided(addr, &mut w, true);
            }
            truth[range.clone()].copy_from_slice(&src);
            for i in range.clone() {
                assert_eq!(
                    host.logical(i),
                    truth[i],
                    "write lost at offset {i} (accepted: {accepted})"
                );
            }
        } else {
            let mut buf = vec![0u8; len as usize];
            let accepted = match choose(AppOp::Read, len, true, &plan_cfg) {
                Strategy::ReadMagic => {
                    host.dma(0, addr, &mut buf, false, it);
                    check_read(&buf, local_addr, addr, &host.cfg).is_ok()
                }
                Strategy::ReadVersioned => {
                    let v1 = host.versions(addr, len);
                    host.dma(0, addr, &mut buf, false, it);
                    let v2 = host.versions(addr, len);
                    check_versions(&v1, &v2).is_ok()
                }
                other => panic!("unexpected strategy {other:?}"),
            };
            if accepted {
                ok += 1;
                assert_eq!(
                    &buf[..],
                    &truth[range.clone()],
                    "accepted a wrong READ at {addr:#x}+{len}"
                );
            } else {
                fallback += 1;
                host.two_sided(addr, &mut buf, false);
                assert_eq!(&buf[..], &truth[range.clone()], "two-sided READ wrong");
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    swapper.join().unwrap();
    for (i, t) in truth.iter().enumerate() {
        assert_eq!(host.logical(i), *t, "final memory differs at {i}");
    }
    eprintln!(
        "ops accepted {ok}, fell back {fallback}, swap-outs {}, flushes {}",
        swaps.load(Ordering::Relaxed),
        host.iommu.flushes.load(Ordering::Relaxed)
    );
    assert!(
        ok > 0 && fallback > 0 && swaps.load(Ordering::Relaxed) > 0,
        "the run exercised nothing"
    );
}
