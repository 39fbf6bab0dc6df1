//! IOMMU tests: IOVA MRs over RAM / signature / black-hole / unmapped frames, frame
//! residency, torn transfers only at atom boundaries under concurrent remapping, and
//! flush really waiting for in-flight DMA.

mod common;
use common::*;
use rnic::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

const PAGE: usize = 4096;

/// Page-aligned heap memory.
struct PageBuf {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: plain heap memory, accessed through raw pointers only.
unsafe impl Send for PageBuf {}
// SAFETY: as above.
unsafe impl Sync for PageBuf {}
impl PageBuf {
    fn new(pages: usize) -> PageBuf {
        let l = std::alloc::Layout::from_size_align(pages * PAGE, PAGE).unwrap();
        // SAFETY: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(l) };
        assert!(!ptr.is_null());
        PageBuf { ptr, len: pages * PAGE }
    }
    fn page(&self, i: usize) -> usize {
        self.ptr as usize + i * PAGE
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: bounds checked.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.add(off), data.len()) }
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0; len];
        // SAFETY: bounds checked.
        unsafe { std::ptr::copy(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }
}
impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.len, PAGE).unwrap()) }
    }
}

fn magic_bytes(len: usize, magic: u32) -> Vec<u8> {
    let b = magic.to_le_bytes();
    (0..len).map(|i| b[i % 4]).collect()
}

#[test]
fn iova_mr_over_special_frames() {
    for cfg in [HostConfig::default(), ring_cfg()] {
        let (a, b) = pair_cfg(cfg);
        let va = PageBuf::new(4);
        let ram = PageBuf::new(1);
        ram.write(0, &pattern(PAGE, 1));
        let io = b.host.iommu();
        let range = io.alloc_range(4).unwrap();
        // SAFETY: `ram` outlives every DMA below (the hosts are dropped first? no: we
        // unmap + flush before it drops, see end of test).
        unsafe {
            io.map_range(
                &range,
                0,
                &[
                    Frame::Ram(ram.page(0)),
                    Frame::Signature,
                    Frame::BlackHole,
                    Frame::Unmapped,
                ],
            )
            .unwrap();
        }
        // SAFETY: va is only used for addressing; frames are valid as above.
        let mr = unsafe { b.pd.reg_mr_iova(va.page(0), 4 * PAGE, all_access(), &range).unwrap() };
        let local = buf(&a.pd, 3 * PAGE, 0xcc);
        let sge = [local.sge(0, (3 * PAGE) as u32)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Read, &sge).remote(va.page(0) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(local.to_vec(0, PAGE), pattern(PAGE, 1), "RAM frame");
        assert_eq!(
            local.to_vec(PAGE, PAGE),
            magic_bytes(PAGE, 0xdeadbeef),
            "signature frame"
        );
        assert_eq!(local.to_vec(2 * PAGE, PAGE), vec![0; PAGE], "black-hole reads as zeros");
        // unaligned read crossing RAM -> signature
        let sge = [local.sge(0, 100)];
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Read, &sge).remote(va.page(1) as u64 - 50, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let mut exp = pattern(PAGE, 1)[PAGE - 50..].to_vec();
        exp.extend(magic_bytes(PAGE, 0xdeadbeef)[..50].iter());
        assert_eq!(local.to_vec(0, 100), exp);
        // writes to signature and black-hole frames are dropped
        local.fill(0x11);
        let sge = [local.sge(0, (2 * PAGE) as u32)];
        a.qp.post_send(&[SendWr::new(3, WrOpcode::Write, &sge).remote(va.page(1) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let sge = [local.sge(0, (3 * PAGE) as u32)];
        a.qp.post_send(&[SendWr::new(4, WrOpcode::Read, &sge).remote(va.page(0) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(
            local.to_vec(PAGE, PAGE),
            magic_bytes(PAGE, 0xdeadbeef),
            "signature never changes"
        );
        assert_eq!(local.to_vec(2 * PAGE, PAGE), vec![0; PAGE]);
        assert_eq!(
            va.read(0, 4 * PAGE),
            vec![0; 4 * PAGE],
            "the VA itself is never touched"
        );
        // an unmapped IOVA page fails the WR
        let sge = [local.sge(0, 8)];
        a.qp.post_send(&[SendWr::new(5, WrOpcode::Read, &sge).remote(va.page(3) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::RemAccessErr);
        drop(mr);
        io.free_range(range).unwrap();
    }
}

/// The IOMMU's accessed bit: DMA through an entry to a RAM frame sets it,
/// `test_and_clear_young` reads and clears it, a remap starts it clear, and
/// special frames never set it.
#[test]
fn dma_sets_the_accessed_bit_of_the_pages_it_touches() {
    for cfg in [HostConfig::default(), ring_cfg()] {
        let (a, b) = pair_cfg(cfg);
        let va = PageBuf::new(4);
        let ram = PageBuf::new(3);
        let io = b.host.iommu();
        let range = io.alloc_range(4).unwrap();
        // SAFETY: `ram` outlives every DMA below (the range is freed, hence
        // unmapped and flushed, before it drops).
        unsafe {
            io.map_range(
                &range,
                0,
                &[
                    Frame::Ram(ram.page(0)),
                    Frame::Ram(ram.page(1)),
                    Frame::Ram(ram.page(2)),
                    Frame::Signature,
                ],
            )
            .unwrap();
        }
        // SAFETY: va is only used for addressing; frames are valid as above.
        let mr = unsafe { b.pd.reg_mr_iova(va.page(0), 4 * PAGE, all_access(), &range).unwrap() };
        let young = |i| io.test_and_clear_young(&range, i).unwrap();
        assert!((0..4).all(|i| !young(i)), "nothing accessed yet");
        let local = buf(&a.pd, PAGE, 0xcc);
        let op = |id, opc, page: usize, len: usize| {
            let sge = [local.sge(0, len as u32)];
            a.qp.post_send(&[SendWr::new(id, opc, &sge).remote(va.page(page) as u64, mr.rkey())])
                .unwrap();
            assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        };
        op(1, WrOpcode::Read, 1, 64);
        op(2, WrOpcode::Write, 2, PAGE);
        op(3, WrOpcode::Read, 3, 64);
        assert_eq!((0..4).map(young).collect::<Vec<_>>(), [false, true, true, false]);
        assert!((0..4).all(|i| !young(i)), "asking clears the bit");
        op(4, WrOpcode::Read, 0, 8);
        // SAFETY: as above.
        unsafe { io.map_at(&range, 0, Frame::Ram(ram.page(0))).unwrap() };
        assert!(!young(0), "a new entry starts not accessed");
        assert!(io.test_and_clear_young(&range, 4).is_err());
        drop(mr);
        io.free_range(range).unwrap();
    }
}

#[test]
fn nonresident_frames_are_never_touched() {
    for cfg in [HostConfig::default(), ring_cfg()] {
        let (a, b) = pair_cfg(cfg);
        let t = PageBuf::new(4);
        t.write(0, &pattern(4 * PAGE, 2));
        // SAFETY: t outlives the MR (dropped at the end of the loop body after mr).
        let mr = unsafe { b.pd.reg_mr(t.page(0), 4 * PAGE, all_access()).unwrap() };
        b.host.frames().track(t.page(0), 4 * PAGE, true).unwrap();
        b.host.frames().set_resident(t.page(2), PAGE, false);
        b.host.iommu().flush().unwrap();
        assert!(!b.host.frames().is_resident(t.page(2) + 5));
        assert!(b.host.frames().is_resident(t.page(1)));
        let local = buf(&a.pd, 4 * PAGE, 0);
        let sge = [local.sge(0, PAGE as u32)];
        a.qp.post_send(&[SendWr::new(1, WrOpcode::Read, &sge).remote(t.page(1) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        assert_eq!(b.host.stats().nonresident_dma, 0);
        local.fill(9);
        let sge = [local.sge(0, 16)];
        a.qp.post_send(&[SendWr::new(2, WrOpcode::Write, &sge).remote(t.page(2) as u64 + 8, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::RemAccessErr);
        assert_eq!(b.host.stats().nonresident_dma, 1, "the access was refused and counted");
        assert_eq!(
            t.read(2 * PAGE, PAGE),
            pattern(4 * PAGE, 2)[2 * PAGE..3 * PAGE].to_vec(),
            "not touched"
        );
        b.host.frames().untrack(t.page(0)).unwrap();
        drop(mr);
    }
    // local side: READ into a non-resident local page -> LOC_PROT_ERR
    let (a, b) = pair();
    let l = PageBuf::new(2);
    // SAFETY: l outlives the MR.
    let lmr = unsafe { a.pd.reg_mr(l.page(0), 2 * PAGE, all_access()).unwrap() };
    a.host.frames().track(l.page(0), 2 * PAGE, false).unwrap();
    let r = buf(&b.pd, PAGE, 3);
    let sge = [lmr.sge(0, 64)];
    a.qp.post_send(&[SendWr::new(1, WrOpcode::Read, &sge).remote(r.addr() as u64, r.rkey())])
        .unwrap();
    assert_eq!(wait1(&a.cq).status, WcStatus::LocProtErr);
    assert_eq!(a.host.stats().nonresident_dma, 1);
    assert_eq!(l.read(0, 64), vec![0; 64]);
    drop(lmr);
}

/// Frame-set contents: byte at (set, page, off) — distinct per set, page and atom.
fn frame_byte(set: usize, page: usize, off: usize) -> u8 {
    ((set * 97 + page * 13 + off / 256 * 7 + off) % 251) as u8
}

/// Wait (bounded) until a background thread got going, so a loaded machine cannot
/// make the stress tests vacuous.
fn wait_until(f: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "background thread never ran"
        );
        std::thread::yield_now();
    }
}

fn stress_iters() -> usize {
    if std::env::var("RNIC_LONG").is_ok() {
        20_000
    } else {
        400
    }
}

#[test]
fn torn_transfers_only_at_atom_boundaries() {
    for cfg in [
        HostConfig::default(),
        HostConfig {
            max_tlp: 128,
            ..HostConfig::default()
        },
    ] {
        let tlp = cfg.max_tlp;
        let (a, b) = pair_cfg(cfg);
        let pages = 16;
        let va = PageBuf::new(pages);
        let sets = [PageBuf::new(pages), PageBuf::new(pages)];
        for (s, fs) in sets.iter().enumerate() {
            for p in 0..pages {
                let v: Vec<u8> = (0..PAGE).map(|o| frame_byte(s, p, o)).collect();
                fs.write(p * PAGE, &v);
            }
        }
        let io = b.host.iommu();
        let range = io.alloc_range(pages as u64).unwrap();
        let frames0: Vec<Frame> = (0..pages).map(|p| Frame::Ram(sets[0].page(p))).collect();
        // SAFETY: the frame sets outlive all DMA (unmapped + flushed before drop).
        unsafe { io.map_range(&range, 0, &frames0).unwrap() };
        // SAFETY: va is only used for addressing.
        let mr = unsafe {
            b.pd.reg_mr_iova(va.page(0), pages * PAGE, all_access(), &range)
                .unwrap()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let remaps = Arc::new(AtomicU64::new(0));
        let remapper = {
            let (stop, remaps, host) = (stop.clone(), remaps.clone(), b.host.clone());
            let addrs: Vec<[usize; 2]> = (0..pages).map(|p| [sets[0].page(p), sets[1].page(p)]).collect();
            std::thread::spawn(move || {
                let mut x = 12345u64;
                while !stop.load(Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let p = (x >> 33) as usize % pages;
                    let s = (x >> 20) as usize % 2;
                    // SAFETY: frames stay valid (see above).
                    unsafe {
                        host.iommu()
                            .map(range.base + p as u64, Frame::Ram(addrs[p][s]))
                            .unwrap()
                    };
                    remaps.fetch_add(1, Ordering::Relaxed);
                    if x % 8 == 0 {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let local = buf(&a.pd, pages * PAGE, 0);
        let mut torn = 0;
        wait_until(|| remaps.load(Ordering::Relaxed) > 100);
        for it in 0..stress_iters() {
            let off = (it * 4 * tlp) % PAGE; // atom-aligned start, varying
            let len = pages * PAGE - off;
            let sge = [local.sge(0, len as u32)];
            a.qp.post_send(&[
                SendWr::new(it as u64, WrOpcode::Read, &sge).remote(va.page(0) as u64 + off as u64, mr.rkey())
            ])
            .unwrap();
            assert_eq!(wait1(&a.cq).status, WcStatus::Success);
            let got = local.to_vec(0, len);
            let mut sets_seen = [false; 2];
            for (ai, atom) in got.chunks(tlp).enumerate() {
                let vo = off + ai * tlp;
                let (p, o) = (vo / PAGE, vo % PAGE);
                let which: Vec<usize> = (0..2)
                    .filter(|&s| {
                        atom.iter()
                            .enumerate()
                            .all(|(k, &byte)| byte == frame_byte(s, p, o + k))
                    })
                    .collect();
                assert!(!which.is_empty(), "atom {ai} of read {it} mixes frames inside an atom");
                sets_seen[which[0]] = true;
            }
            if sets_seen[0] && sets_seen[1] {
                torn += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        remapper.join().unwrap();
        eprintln!(
            "tlp {tlp}: {torn} torn transfers (mixing old and new frames at atom boundaries), {} remaps",
            remaps.load(Ordering::Relaxed)
        );
        assert!(remaps.load(Ordering::Relaxed) > 0);
        drop(mr);
        io.free_range(range).unwrap();
    }
}

#[test]
fn flush_waits_for_in_flight_dma() {
    // Two frame sets; the one not mapped is poisoned only after map + flush. If flush
    // returned while a DMA still used the old frames, a READ would see poison.
    let (a, b) = pair_cfg(HostConfig {
        dma_section: 64 * 1024,
        ..HostConfig::default()
    });
    let pages = 64;
    let va = PageBuf::new(pages);
    let sets = Arc::new([PageBuf::new(pages), PageBuf::new(pages)]);
    let clean = vec![0x5au8; pages * PAGE];
    sets[0].write(0, &clean);
    let io = b.host.iommu();
    let range = io.alloc_range(pages as u64).unwrap();
    let map_set = |s: usize| {
        let f: Vec<Frame> = (0..pages).map(|p| Frame::Ram(sets[s].page(p))).collect();
        // SAFETY: frame sets outlive all DMA (joined + unmapped + flushed first).
        unsafe { b.host.iommu().map_range(&range, 0, &f).unwrap() };
    };
    map_set(0);
    // SAFETY: va only addresses.
    let mr = unsafe {
        b.pd.reg_mr_iova(va.page(0), pages * PAGE, all_access(), &range)
            .unwrap()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flusher = {
        let (stop, sets, host) = (stop.clone(), sets.clone(), b.host.clone());
        let clean = clean.clone();
        std::thread::spawn(move || {
            let mut cur = 0;
            let mut flips = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let next = 1 - cur;
                sets[next].write(0, &clean);
                let f: Vec<Frame> = (0..pages).map(|p| Frame::Ram(sets[next].page(p))).collect();
                // SAFETY: as above.
                unsafe { host.iommu().map_range(&range, 0, &f).unwrap() };
                host.iommu().flush().unwrap();
                sets[cur].write(0, &vec![0xffu8; pages * PAGE]); // poison the old set
                cur = next;
                flips += 1;
            }
            flips
        })
    };
    let local = buf(&a.pd, pages * PAGE, 0);
    wait_until(|| b.host.stats().flushes > 2);
    for it in 0..stress_iters() / 4 {
        let sge = [local.sge(0, (pages * PAGE) as u32)];
        a.qp.post_send(&[SendWr::new(it as u64, WrOpcode::Read, &sge).remote(va.page(0) as u64, mr.rkey())])
            .unwrap();
        assert_eq!(wait1(&a.cq).status, WcStatus::Success);
        let got = local.to_vec(0, pages * PAGE);
        assert!(
            got.iter().all(|&x| x == 0x5a),
            "read {it} saw a frame poisoned after flush returned"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let flips = flusher.join().unwrap();
    eprintln!("{flips} remap+flush cycles");
    assert!(flips > 0);
    assert!(b.host.stats().flushes >= flips);
    drop(mr);
    io.free_range(range).unwrap();
}
