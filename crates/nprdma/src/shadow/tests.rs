//! Tests of the MR shadow against a recording fake IOMMU.

use proptest::prelude::*;

use super::*;
use crate::testutil::{Ev, FakeIommu};

const PS: u64 = 4096;

fn setup(addr: u64, len: u64, resident: &[bool]) -> (Arc<FakeIommu>, MrShadow<FakeIommu>) {
    let io = Arc::new(FakeIommu::default());
    let s = MrShadow::new(io.clone(), addr, len, PS, resident).unwrap();
    io.probe.set(s.versions().clone()).unwrap();
    io.take_log();
    (io, s)
}

/// Invariant: version odd ⟺ both views map the real page.
fn consistent(io: &FakeIommu, s: &MrShadow<FakeIommu>) -> Result<(), String> {
    for i in 0..s.versions().len() {
        let v = s.versions().get(i).unwrap();
        let page = (s.addr() & !(PS - 1)) + i as u64 * PS;
        let (r, w) = (
            io.frame(s.read_range(), i as u64),
            io.frame(s.write_range(), i as u64),
        );
        let ok = if v % 2 == 1 {
            r == Frame::Ram(page) && w == Frame::Ram(page)
        } else {
            r == Frame::Signature && w == Frame::BlackHole
        };
        if !ok {
            return Err(format!("page {i}: version {v}, read {r:?}, write {w:?}"));
        }
    }
    Ok(())
}

#[test]
fn registration_maps_from_residency() {
    let (io, s) = setup(0x10_0800, 3 * PS, &[true, false, true, false]);
    assert_eq!(s.versions().len(), 4);
    assert_eq!(
        (0..4)
            .map(|i| s.versions().get(i).unwrap())
            .collect::<Vec<_>>(),
        vec![1, 0, 1, 0]
    );
    consistent(&io, &s).unwrap();
    assert_eq!(s.page_index(0x10_0000), Some(0));
    assert_eq!(s.page_index(0x10_3fff), Some(3));
    assert_eq!(s.page_index(0x10_4000), None);
    assert_eq!(s.page_index(0xfff), None);
    assert!(matches!(
        MrShadow::new(io.clone(), 0x1000, PS, PS, &[true, true]),
        Err(ShadowError::ResidencyLen { got: 2, want: 1 })
    ));
    assert!(matches!(
        MrShadow::new(io, 0x1000, PS, 3000, &[true]),
        Err(ShadowError::BadPageSize(3000))
    ));
}

#[test]
fn swap_out_bumps_version_before_remap_then_flushes() {
    let (io, s) = setup(0x20_0000, 4 * PS, &[true; 4]);
    let n = s.swap_out(&[0x20_1000, 0x20_2000, 0x99_0000]).unwrap();
    assert_eq!(n, 2);
    let log = io.take_log();
    let maps: Vec<_> = log
        .iter()
        .filter_map(|e| match e {
            Ev::Map { frame, version, .. } => Some((*frame, *version)),
            _ => None,
        })
        .collect();
    assert_eq!(maps.len(), 4);
    for (f, v) in &maps {
        assert!(matches!(f, Frame::Signature | Frame::BlackHole));
        assert_eq!(
            v.map(|v| v % 2),
            Some(0),
            "remapped before the version bump"
        );
    }
    let flush_at = log.iter().position(|e| *e == Ev::Flush).expect("flushed");
    let last_map = log
        .iter()
        .rposition(|e| matches!(e, Ev::Map { .. }))
        .unwrap();
    assert!(flush_at > last_map, "flush must follow the remaps");
    assert_eq!(
        log.iter().filter(|e| **e == Ev::Flush).count(),
        1,
        "one flush per batch"
    );
    let res_at = log
        .iter()
        .position(|e| {
            matches!(
                e,
                Ev::Resident {
                    resident: false,
                    ..
                }
            )
        })
        .unwrap();
    assert!(res_at > flush_at);
    consistent(&io, &s).unwrap();
    // Idempotent: already absent → no change, no flush.
    assert_eq!(s.swap_out(&[0x20_1000]).unwrap(), 0);
    assert!(io.take_log().is_empty());
    assert_eq!(s.versions().get(1), Some(2));
}

#[test]
fn map_in_remaps_before_bumping_version() {
    let (io, s) = setup(0x30_0000, 4 * PS, &[false; 4]);
    assert_eq!(s.map_in(0x30_1ff0, 0x20).unwrap(), 2);
    for e in io.take_log() {
        if let Ev::Map { frame, version, .. } = e {
            assert!(matches!(frame, Frame::Ram(_)));
            assert_eq!(
                version.map(|v| v % 2),
                Some(0),
                "version bumped before the remap"
            );
        }
    }
    assert_eq!(s.versions().get(1), Some(1));
    assert_eq!(s.versions().get(2), Some(1));
    assert_eq!(s.versions().get(0), Some(0));
    consistent(&io, &s).unwrap();
    assert_eq!(s.map_in(0x30_1000, 1).unwrap(), 0);
    // The local pre-check over the versions.
    use crate::check::{precheck_local, Suspect};
    assert!(s.is_mapped(0x30_1000) && !s.is_mapped(0x30_0fff) && !s.is_mapped(0x40_0000));
    assert_eq!(
        precheck_local(0x30_1000, 0x2000, 4096, |p| s.is_mapped(p)),
        Ok(())
    );
    assert_eq!(
        precheck_local(0x30_1000, 0x2001, 4096, |p| s.is_mapped(p)),
        Err(Suspect::NotResident {
            page_addr: 0x30_3000
        })
    );
    assert!(matches!(
        s.map_in(0x30_3000, 0x2000),
        Err(ShadowError::OutOfRange { .. })
    ));
    assert!(matches!(
        s.map_in(u64::MAX, 2),
        Err(ShadowError::OutOfRange { .. })
    ));
}

/// The pager's `clear_young` question: a page DMA reached through either
/// view is young once, then not until reached again; pages outside the
/// region are left as they are.
#[test]
fn young_pages_come_from_either_views_accessed_bits() {
    let (io, s) = setup(0x50_0000, 4 * PS, &[true; 4]);
    io.touch(s.read_range(), 1);
    io.touch(s.write_range(), 2);
    io.touch(s.read_range(), 3);
    io.touch(s.write_range(), 3);
    let l: &dyn SwapListener = &s;
    let pages: Vec<u64> = (0..5).map(|i| 0x50_0000 + i * PS).collect();
    let mut young = [false, false, false, false, true];
    l.test_and_clear_young(&pages, &mut young);
    assert_eq!(young, [false, true, true, true, true], "ORed in");
    let mut young = [false; 5];
    l.test_and_clear_young(&pages, &mut young);
    assert_eq!(young, [false; 5], "asking cleared both views' bits");
}

/// The eager swap-in notice maps the pages in at once (resident for the NIC
/// model, real frame, then odd version), and does nothing for an MR part of
/// whose memory was unmapped.
#[test]
fn eager_swap_in_notice_maps_pages_in() {
    let (io, s) = setup(0x60_0000, 3 * PS, &[true; 3]);
    let l: &dyn SwapListener = &s;
    l.before_swap_out(&[0x60_0000, 0x60_1000, 0x60_2000]);
    io.take_log();
    l.after_swap_in(&[0x60_1000, 0x60_2000, 0x70_0000]);
    let log = io.take_log();
    assert_eq!(
        log.first(),
        Some(&Ev::Resident {
            addr: 0x60_1000,
            resident: true
        }),
        "resident for the NIC model before the NIC may reach it"
    );
    for e in &log {
        if let Ev::Map { frame, version, .. } = e {
            assert!(matches!(frame, Frame::Ram(_)));
            assert_eq!(version.map(|v| v % 2), Some(0), "remap before the bump");
        }
    }
    assert_eq!(
        (0..3).map(|i| s.versions().get(i)).collect::<Vec<_>>(),
        [Some(2), Some(3), Some(3)]
    );
    consistent(&io, &s).unwrap();
    l.after_unmap(0x60_0000, 0x60_1000);
    l.after_swap_in(&[0x60_0000]);
    assert_eq!(s.versions().get(0), Some(2), "not after an unmap");
}

#[test]
fn listener_and_drop_release_ranges() {
    let io;
    {
        let (io2, s) = setup(0x40_0000, PS, &[true]);
        io = io2;
        let l: &dyn SwapListener = &s;
        l.before_swap_out(&[0x40_0000]);
        assert_eq!(s.versions().get(0), Some(2));
        let mut snap = [0u32; 1];
        assert!(s.versions().snapshot(0, &mut snap));
        assert_eq!(snap, [2]);
        assert!(!s.versions().snapshot(1, &mut snap));
        assert!(!s.versions().snapshot(usize::MAX, &mut snap));
        assert_eq!(s.versions().byte_len(), 4);
    }
    assert!(io.live.lock().unwrap().is_empty(), "IOVA ranges leaked");
}

/// The soundness argument of the version protocol, exercised with threads:
/// a reader that sees the same odd version before and after looking at the
/// frame must have seen the real frame.
#[test]
fn versioned_reader_never_trusts_a_special_frame() {
    let (io, s) = setup(0x50_0000, PS, &[true]);
    let s = Arc::new(s);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flipper = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            for i in 0..20_000u32 {
                s.swap_out(&[0x50_0000]).unwrap();
                s.map_in(0x50_0000, 1).unwrap();
                if i % 16 == 0 {
                    // Leave stable windows so the reader also trusts some
                    // samples, even on a loaded machine.
                    let t = std::time::Instant::now();
                    while t.elapsed() < std::time::Duration::from_micros(20) {
                        std::hint::spin_loop();
                    }
                }
            }
            stop.store(true, Ordering::SeqCst);
        })
    };
    let mut trusted = 0u64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
        let v1 = s.versions().get(0).unwrap();
        let f = io.frame(s.write_range(), 0);
        let v2 = s.versions().get(0).unwrap();
        if v1 == v2 && v1 % 2 == 1 {
            assert_eq!(
                f,
                Frame::Ram(0x50_0000),
                "trusted a special frame at version {v1}"
            );
            trusted += 1;
        }
        io.take_log();
    }
    flipper.join().unwrap();
    assert!(trusted > 0);
}

proptest! {
    #[test]
    fn random_transitions_keep_views_and_versions_consistent(
        resident in prop::collection::vec(any::<bool>(), 1..12),
        steps in prop::collection::vec((any::<bool>(), any::<u64>(), 0u64..3), 1..40)
    ) {
        let n = resident.len() as u64;
        let (io, s) = setup(0x60_0000, n * PS, &resident);
        let mut last: Vec<u32> = (0..n as usize).map(|i| s.versions().get(i).unwrap()).collect();
        for (out, pick, span) in steps {
            let first = 0x60_0000 + (pick % n) * PS;
            if out {
                let pages: Vec<u64> = (0..=span).map(|k| first + k * PS).collect();
                let changed = s.swap_out(&pages).unwrap();
                let flushes = io.take_log().iter().filter(|e| **e == Ev::Flush).count();
                prop_assert_eq!(flushes, (changed > 0) as usize);
            } else {
                let len = ((span + 1) * PS).min(0x60_0000 + n * PS - first);
                s.map_in(first, len).unwrap();
                io.take_log();
            }
            consistent(&io, &s).map_err(TestCaseError::fail)?;
            for (i, l) in last.iter_mut().enumerate() {
                let v = s.versions().get(i).unwrap();
                prop_assert!(v >= *l, "version went backwards");
                *l = v;
            }
        }
    }
}

#[test]
fn per_page_state_is_two_ptes_and_a_version() {
    // The paper's budget: a 4-byte PTE in each view's IOMMU mapping and a
    // 4-byte version, computed from the element types.
    assert_eq!(rnic::Iommu::ENTRY_BYTES, 4);
    assert_eq!(VERSION_BYTES, 4);
    assert_eq!(
        STATE_BYTES_PER_PAGE,
        2 * rnic::Iommu::ENTRY_BYTES + VERSION_BYTES
    );
    const { assert!(STATE_BYTES_PER_PAGE <= 12) };
    // The table registered as the Version MR is exactly one word per page.
    let t = VersionTable::new([true, false, true]);
    assert_eq!(t.byte_len(), 3 * VERSION_BYTES as u64);
}

#[test]
fn pins_are_kept_per_pinned_range_not_per_page() {
    let (io, s) = setup(0x40_0000, 8 * PS, &[false; 8]);
    assert_eq!(s.pinned_pages(), 0);
    s.pinned_map_in(0x40_0000 + PS, 2 * PS).unwrap();
    s.pinned_map_in(0x40_0000 + 2 * PS, PS).unwrap();
    assert_eq!(s.pinned_pages(), 2, "pages 1 and 2");
    // A swap-out announcement for a pinned page remaps the views (version
    // even) but leaves the page resident for the NIC model.
    assert_eq!(s.swap_out(&[0x40_0000 + 2 * PS]).unwrap(), 1);
    assert!(!s.is_mapped(0x40_0000 + 2 * PS));
    assert!(!io.take_log().iter().any(
        |e| matches!(e, Ev::Resident { addr, resident: false, .. } if *addr == 0x40_0000 + 2 * PS)
    ));
    s.unpinned(0x40_0000 + 5 * PS, PS);
    assert_eq!(
        s.pinned_pages(),
        2,
        "undoing a pin nobody made changes nothing"
    );
    s.unpinned(0x40_0000 + PS, 2 * PS);
    assert_eq!(s.pinned_pages(), 1, "page 2 is still pinned once");
    s.unpinned(0x40_0000 + 2 * PS, PS);
    assert_eq!(s.pinned_pages(), 0);
    consistent(&io, &s).unwrap();
}
