//! Tests of target-side admission with the shared fakes.

use std::borrow::Cow;
use std::sync::Arc;

use super::*;
use crate::ctrl::{AtomicRequest, FaultRequest};
use crate::nic::Frame;
use crate::testutil::{FakeIommu, FakeMem};

const BASE: u64 = 0x10_0000;

fn setup(resident: &[bool]) -> (Arc<FakeIommu>, MrShadow<FakeIommu>, Arc<FakeMem>) {
    let io = Arc::new(FakeIommu::default());
    let n = resident.len() as u64;
    let s = MrShadow::new(io.clone(), BASE, n * 4096, 4096, resident).unwrap();
    (io, s, Arc::new(FakeMem::default()))
}

#[test]
fn admission_checks_bounds_rights_and_alignment() {
    let (_io, s, mm) = setup(&[true; 4]);
    let ro = LocalRegion {
        access: Access::REMOTE_READ,
        shadow: &s,
    };
    let none: Option<&LocalRegion<'_, FakeIommu>> = None;
    let e = |r| admit(r, mm.clone(), BASE, 8, Access::REMOTE_READ, false).err();
    assert_eq!(e(none), Some(Status::RemoteAccess), "unknown key");
    assert!(admit(Some(&ro), mm.clone(), BASE, 8, Access::REMOTE_READ, false).is_ok());
    assert_eq!(
        admit(Some(&ro), mm.clone(), BASE, 8, Access::REMOTE_WRITE, false).err(),
        Some(Status::RemoteAccess),
        "missing right"
    );
    assert_eq!(
        admit(
            Some(&ro),
            mm.clone(),
            BASE + 4 * 4096 - 4,
            8,
            Access::REMOTE_READ,
            false
        )
        .err(),
        Some(Status::RemoteAccess),
        "out of bounds"
    );
    assert_eq!(
        admit(
            Some(&ro),
            mm.clone(),
            BASE - 1,
            2,
            Access::REMOTE_READ,
            false
        )
        .err(),
        Some(Status::RemoteAccess)
    );
    assert_eq!(
        admit(
            Some(&ro),
            mm.clone(),
            u64::MAX,
            2,
            Access::REMOTE_READ,
            false
        )
        .err(),
        Some(Status::RemoteAccess)
    );
    let at = LocalRegion {
        access: Access::REMOTE_ATOMIC,
        shadow: &s,
    };
    assert_eq!(
        admit(
            Some(&at),
            mm.clone(),
            BASE + 4,
            8,
            Access::REMOTE_ATOMIC,
            true
        )
        .err(),
        Some(Status::RemoteInvalid),
        "misaligned atomic"
    );
    assert_eq!(
        admit(Some(&at), mm.clone(), BASE, 4, Access::REMOTE_ATOMIC, true).err(),
        Some(Status::RemoteInvalid)
    );
    assert!(admit(
        Some(&at),
        mm.clone(),
        BASE + 8,
        8,
        Access::REMOTE_ATOMIC,
        true
    )
    .is_ok());
    // Nothing stays pinned after all those grants were dropped.
    assert!(mm.pins.lock().unwrap().values().all(|c| *c == 0));
}

#[test]
fn grant_pins_maps_in_and_unpins_on_drop() {
    let (io, s, mm) = setup(&[false, false, true]);
    let rw = LocalRegion {
        access: Access::REMOTE_READ | Access::REMOTE_WRITE,
        shadow: &s,
    };
    let g = admit(
        Some(&rw),
        mm.clone(),
        BASE + 4000,
        200,
        Access::REMOTE_WRITE,
        false,
    )
    .unwrap();
    assert_eq!((g.addr, g.len), (BASE + 4000, 200));
    assert_eq!((mm.pin_count(BASE), mm.pin_count(BASE + 4096)), (1, 1));
    assert_eq!(s.versions().get(0), Some(1));
    assert_eq!(s.versions().get(1), Some(1));
    assert_eq!(io.frame(s.write_range(), 1), Frame::Ram(BASE + 4096));
    assert!(!mm.evict(BASE), "granted page must stay");
    drop(g);
    assert_eq!((mm.pin_count(BASE), mm.pin_count(BASE + 4096)), (0, 0));
    // The mapping stays until the next swap-out.
    assert_eq!(s.versions().get(0), Some(1));
    // Zero-length requests pin nothing.
    let g = admit(Some(&rw), mm.clone(), BASE, 0, Access::REMOTE_READ, false).unwrap();
    assert!(mm.pins.lock().unwrap().values().all(|c| *c == 0));
    drop(g);
}

#[test]
fn failed_pin_answers_no_resources() {
    // The fake refuses to pin page 0xbad000.
    let io = Arc::new(FakeIommu::default());
    let s = MrShadow::new(io, 0xbac000, 3 * 4096, 4096, &[true; 3]).unwrap();
    let mm = Arc::new(FakeMem::default());
    let r = LocalRegion {
        access: Access::REMOTE_READ,
        shadow: &s,
    };
    assert_eq!(
        admit(
            Some(&r),
            mm.clone(),
            0xbac000,
            3 * 4096,
            Access::REMOTE_READ,
            false
        )
        .err(),
        Some(Status::NoResources)
    );
    assert!(mm.pins.lock().unwrap().values().all(|c| *c == 0));
}

#[test]
fn required_rights_per_message() {
    let f = |kind| {
        Repr::Fault(FaultRequest {
            req_id: 0,
            kind,
            local_addr: 0,
            local_key: 0,
            remote_addr: 0,
            rkey: 0,
            len: 0,
            inline_ok: false,
            retry_mode: false,
            want_lease: false,
        })
    };
    assert_eq!(
        required_access(&f(FaultKind::Read)),
        Some(Access::REMOTE_READ)
    );
    assert_eq!(
        required_access(&f(FaultKind::Write)),
        Some(Access::REMOTE_WRITE)
    );
    let w = Repr::WriteInline {
        req_id: 0,
        remote_addr: 0,
        rkey: 0,
        want_lease: false,
        data: Cow::Borrowed(&[]),
    };
    assert_eq!(required_access(&w), Some(Access::REMOTE_WRITE));
    let a = Repr::Atomic(AtomicRequest {
        req_id: 0,
        kind: AtomicKind::FetchAdd,
        remote_addr: 0,
        rkey: 0,
        compare_add: 1,
        swap: 0,
    });
    assert_eq!(required_access(&a), Some(Access::REMOTE_ATOMIC));
    assert_eq!(required_access(&Repr::Release { req_id: 0 }), None);
}

#[test]
fn atomics_execute_once_and_concurrently_correct() {
    let w = AtomicU64::new(5);
    assert_eq!(apply_atomic(AtomicKind::CmpSwap, 4, 9, &w), 5);
    assert_eq!(w.load(Ordering::SeqCst), 5, "failed compare must not swap");
    assert_eq!(apply_atomic(AtomicKind::CmpSwap, 5, 9, &w), 5);
    assert_eq!(w.load(Ordering::SeqCst), 9);
    assert_eq!(apply_atomic(AtomicKind::FetchAdd, u64::MAX, 0, &w), 9);
    assert_eq!(w.load(Ordering::SeqCst), 8, "wrapping add");
    let w = Arc::new(AtomicU64::new(0));
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let w = w.clone();
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    apply_atomic(AtomicKind::FetchAdd, 1, 0, &w);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(w.load(Ordering::SeqCst), 20_000);
}

#[test]
fn statuses_map_to_ibv_numbers() {
    assert_eq!(wc_status(Status::Ok), 0);
    assert_eq!(wc_status(Status::RemoteAccess), 10);
    assert_eq!(wc_status(Status::RnrNoRecv), 13);
    assert_eq!(wc_status(Status::Flushed), 5);
}
