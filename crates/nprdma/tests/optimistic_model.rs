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
    base: u64,
    pages: u64,
    views: [Vec<AtomicU64>; 2],
    next: AtomicU32,
    inflight: AtomicU64,
    flushes: AtomicU64,
}

impl ToyIommu {
    fn new(base: u64, pages: u64) -> Self {
        let v = || (0..pages).map(|_| AtomicU64::new(F_UNMAPPED)).collect();
        ToyIommu {
            base,
            pages,
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
    const ENTRY_BYTES: usize = std::mem::size_of::<AtomicU64>();
    fn alloc_range(&self, npages: u64) -> Result<u32, ToyErr> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        if id > 1 || npages != self.pages {
            return Err(ToyErr("only two ranges of PAGES pages"));
        }
        Ok(id)
    }
    fn free_range(&self, _: u32) -> Result<(), ToyErr> {
        Ok(())
    }
    fn set_mr_rights(&self, _mr: &mut ToyMr, _access: Access, _domain: u32) -> Result<(), ToyErr> {
        Ok(())
    }
    fn map(&self, r: &u32, idx: u64, frame: Frame) -> Result<(), ToyErr> {
        let e = match frame {
            Frame::Unmapped => F_UNMAPPED,
            Frame::Signature => F_SIG,
            Frame::BlackHole => F_HOLE,
            Frame::Ram(a) => ((a - self.base) / PS) << 8 | F_RAM,
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
    unsafe fn reg_mr_iova(
        &self,
        _: u64,
        _: u64,
        _: Access,
        _: &u32,
        _: u32,
    ) -> Result<ToyMr, ToyErr> {
        Ok(ToyMr)
    }
    fn set_resident(&self, _: u64, _: u64, _: bool) -> Result<(), ToyErr> {
        Ok(())
    }
}

/// Physical frames, swap copies, and the pager's per-page state.
struct Host {
    base: u64,
    pages: u64,
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
    fn new(base: u64, init: &[u8]) -> Self {
        let pages = init.len() as u64 / PS;
        let iommu = Arc::new(ToyIommu::new(base, pages));
        let shadow = MrShadow::new(
            iommu.clone(),
            base,
            pages * PS,
            PS,
            &vec![true; pages as usize],
        )
        .unwrap();
        Host {
            base,
            pages,
            phys: init.iter().map(|b| AtomicU8::new(*b)).collect(),
            swap: (0..pages).map(|_| Mutex::new(Vec::new())).collect(),
            resident: (0..pages).map(|_| AtomicBool::new(true)).collect(),
            page_lock: (0..pages).map(|_| Mutex::new(0)).collect(),
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
        self.shadow.swap_out(&[self.base + p as u64 * PS]).unwrap();
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
            let page = ((a - self.base) / PS) as usize;
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
                let off = (x - self.base) as usize;
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
        let first = ((addr - self.base) / PS) as usize;
        let last = ((addr + len.max(1) - 1 - self.base) / PS) as usize;
        (first..=last)
            .map(|i| self.shadow.versions().get(i).unwrap())
            .collect()
    }

    /// Two-sided path: pin, map in, CPU copy, unpin.
    fn two_sided(&self, addr: u64, buf: &mut [u8], write: bool) {
        let first = ((addr - self.base) / PS) as usize;
        let last = ((addr + buf.len() as u64 - 1 - self.base) / PS) as usize;
        for p in first..=last {
            self.pin(p);
        }
        self.shadow.map_in(addr, buf.len() as u64).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            let off = (addr - self.base) as usize + i;
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
    let host = Arc::new(Host::new(BASE, &truth));
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

impl Host {
    /// The application's CPU writes byte `off` (faulting the page in).
    fn write_logical(&self, off: usize, b: u8) {
        let p = off / PS as usize;
        let _g = self.page_lock[p].lock().unwrap();
        self.swap_in_locked(p);
        self.phys[off].store(b, Ordering::SeqCst);
    }

    /// Local fix-up before posting: pages not mapped in the NIC views
    /// (absent, or lazily swapped back in) are pinned, mapped in, unpinned.
    fn local_fixup(&self, addr: u64, len: u64) -> bool {
        let first = ((addr - self.base) / PS) as usize;
        let last = ((addr + len - 1 - self.base) / PS) as usize;
        let mut fixed = false;
        for p in first..=last {
            let page = self.base + p as u64 * PS;
            if !self.shadow.is_mapped(page) {
                self.pin(p);
                self.shadow.map_in(page, PS).unwrap();
                self.unpin(p);
                fixed = true;
            }
        }
        fixed
    }

    fn entry(&self, view: usize, addr: u64) -> u64 {
        self.iommu.views[view][((addr - self.base) / PS) as usize].load(Ordering::SeqCst)
    }

    fn frame_off(&self, ent: u64, addr: u64) -> usize {
        ((ent >> 8) as usize) * PS as usize + ((addr - self.base) % PS) as usize
    }
}

/// A NIC transfer from `src` (through view `sv`) to `dst` (through view
/// `dv`): atoms split at both hosts' aligned grids, each translated on both
/// sides inside both IOMMUs' in-flight sections; some atoms are stretched
/// while the hosts' swappers are pointed at their pages.
#[allow(clippy::too_many_arguments)]
fn dma_copy(src: &Host, sv: usize, sa: u64, dst: &Host, dv: usize, da: u64, len: u64, jitter: u64) {
    let atom = src.cfg.atom() as u64;
    let mut o = 0u64;
    let mut k = 0u64;
    while o < len {
        let e = (((sa + o) / atom + 1) * atom - sa)
            .min(((da + o) / atom + 1) * atom - da)
            .min(len);
        src.iommu.inflight.fetch_add(1, Ordering::SeqCst);
        dst.iommu.inflight.fetch_add(1, Ordering::SeqCst);
        let se = src.entry(sv, sa + o);
        let de = dst.entry(dv, da + o);
        if (jitter + k) % 11 == 0 {
            src.hot.store((sa + o - src.base) / PS, Ordering::SeqCst);
            dst.hot.store((da + o - dst.base) / PS, Ordering::SeqCst);
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(200) {
                std::hint::spin_loop();
            }
            src.hot.store(u64::MAX, Ordering::SeqCst);
            dst.hot.store(u64::MAX, Ordering::SeqCst);
        }
        for x in o..e {
            let b = match se & 0xff {
                F_RAM => src.phys[src.frame_off(se, sa + x)].load(Ordering::SeqCst),
                F_SIG => src.cfg.magic_byte(sa + x),
                F_HOLE => 0,
                _ => panic!("DMA read through an unmapped entry"),
            };
            match de & 0xff {
                F_RAM => dst.phys[dst.frame_off(de, da + x)].store(b, Ordering::SeqCst),
                F_SIG | F_HOLE => {}
                _ => panic!("DMA write through an unmapped entry"),
            }
        }
        dst.iommu.inflight.fetch_sub(1, Ordering::SeqCst);
        src.iommu.inflight.fetch_sub(1, Ordering::SeqCst);
        k += 1;
        o = e;
    }
}

/// The initiator side is not pinned either: its buffer pages are swapped
/// out (and lazily back in) while READs land in them and WRITEs are sent
/// from them. The local pre-check (versions odd, else fix-up) plus the
/// before/after comparison of the local versions must catch every case the
/// remote checks cannot see.
#[test]
fn local_side_swapping_is_caught_by_pre_check_and_local_versions() {
    let iters: u64 = std::env::var("NPRDMA_MODEL_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    const LBASE: u64 = 0x1000_0000;
    let lpages = 4u64;
    let mut rtruth: Vec<u8> = (0..PAGES * PS).map(|i| (i % 253) as u8 & 0x7f).collect();
    let remote = Arc::new(Host::new(BASE, &rtruth));
    let local = Arc::new(Host::new(LBASE, &vec![0x11; (lpages * PS) as usize]));
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (remote, local, stop, swaps) =
            (remote.clone(), local.clone(), stop.clone(), swaps.clone());
        std::thread::spawn(move || {
            let mut s = 5u64;
            while !stop.load(Ordering::SeqCst) {
                for h in [&local, &remote] {
                    let hot = h.hot.load(Ordering::SeqCst);
                    let p = if hot != u64::MAX {
                        hot
                    } else {
                        lcg(&mut s) % h.pages
                    } as usize;
                    if lcg(&mut s) % 4 == 0 {
                        h.touch(p); // lazy swap-in by the application
                    } else if h.swap_out(p) {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::yield_now();
            }
        })
    };

    let cfg = CheckConfig::default();
    let (mut ok, mut fallback, mut fixups) = (0u64, 0u64, 0u64);
    let mut s = 11u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    for it in 0..iters {
        if Instant::now() > deadline {
            break;
        }
        let len = 1 + lcg(&mut s) % (2 * PS);
        let ro = lcg(&mut s) % (PAGES * PS - len);
        let lo = lcg(&mut s) % (lpages * PS - len);
        let (ra, la) = (BASE + ro, LBASE + lo);
        let lrange = lo as usize..(lo + len) as usize;
        let rrange = ro as usize..(ro + len) as usize;
        if local.local_fixup(la, len) {
            fixups += 1;
        }
        if lcg(&mut s) % 2 == 0 {
            // READ remote → local buffer (local Write view).
            let lv1 = local.versions(la, len);
            dma_copy(&remote, 0, ra, &local, 1, la, len, it);
            let lv2 = local.versions(la, len);
            // The application reads its buffer with its CPU.
            let got: Vec<u8> = lrange.clone().map(|i| local.logical(i)).collect();
            let accepted =
                check_versions(&lv1, &lv2).is_ok() && check_read(&got, la, ra, &cfg).is_ok();
            if accepted {
                ok += 1;
                assert_eq!(
                    got,
                    rtruth[rrange.clone()],
                    "accepted a wrong READ (local {la:#x}, remote {ra:#x}, len {len})"
                );
            } else {
                fallback += 1;
                let mut buf = vec![0u8; len as usize];
                remote.two_sided(ra, &mut buf, false);
                for (i, b) in lrange.clone().zip(&buf) {
                    local.write_logical(i, *b);
                }
                assert_eq!(buf, rtruth[rrange.clone()]);
            }
        } else {
            // WRITE local buffer (local Read view) → remote, then read-back.
            let src: Vec<u8> = (0..len).map(|i| ((i * 7 + it) % 113) as u8).collect();
            for (i, b) in lrange.clone().zip(&src) {
                local.write_logical(i, *b);
            }
            local.local_fixup(la, len);
            let lv1 = local.versions(la, len);
            dma_copy(&local, 0, la, &remote, 1, ra, len, it);
            let mut rb = vec![0u8; len as usize];
            remote.dma(0, ra, &mut rb, false, it + 1);
            let lv2 = local.versions(la, len);
            let accepted =
                check_versions(&lv1, &lv2).is_ok() && check_readback(&src, &rb, ra, &cfg).is_ok();
            if accepted {
                ok += 1;
            } else {
                fallback += 1;
                let mut w = src.clone();
                remote.two_sided(ra, &mut w, true);
            }
            rtruth[rrange.clone()].copy_from_slice(&src);
            for i in rrange.clone() {
                assert_eq!(
                    remote.logical(i),
                    rtruth[i],
                    "WRITE lost at remote offset {i} (accepted: {accepted})"
                );
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    swapper.join().unwrap();
    eprintln!(
        "local-side model: accepted {ok}, fell back {fallback}, local fix-ups {fixups}, swap-outs {}",
        swaps.load(Ordering::Relaxed)
    );
    assert!(
        ok > 0 && fallback > 0 && fixups > 0,
        "the run exercised nothing"
    );
}
