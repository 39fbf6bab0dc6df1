//! Tests of the interface helpers with an in-memory fake memory manager.

use std::sync::Mutex;

use super::*;
use crate::testutil::FakeMem;

#[test]
fn pinned_guard_unpins_on_drop_and_release() {
    let mm = Arc::new(FakeMem::default());
    {
        let g = Pinned::new(mm.clone(), 0x1ff0, 0x20).unwrap();
        assert_eq!(g.range(), (0x1ff0, 0x20));
        assert_eq!((mm.pin_count(0x1000), mm.pin_count(0x2000)), (1, 1));
        assert!(!mm.evict(0x2000), "pinned page must not be evicted");
        let g2 = Pinned::new(mm.clone(), 0x2000, 1).unwrap();
        assert_eq!(mm.pin_count(0x2000), 2);
        g2.release().unwrap();
        assert_eq!(mm.pin_count(0x2000), 1);
        drop(g);
    }
    assert_eq!((mm.pin_count(0x1000), mm.pin_count(0x2000)), (0, 0));
    assert!(mm.evict(0x2000));
    assert!(!mm.is_resident(0x2abc));
    // Pinning brings it back.
    let g = Pinned::new(mm.clone(), 0x2000, 4096).unwrap();
    assert!(mm.is_resident(0x2000));
    drop(g);
}

#[test]
fn failed_pin_leaves_nothing_pinned() {
    let mm = Arc::new(FakeMem::default());
    assert!(Pinned::new(mm.clone(), 0xbac000, 0x3000).is_err());
    assert_eq!(mm.pin_count(0xbac000), 0);
    assert!(mm.pins.lock().unwrap().values().all(|c| *c == 0));
    // Double unpin through the trait is reported, not a panic.
    assert!(mm.unpin(0x1000, 1).is_err());
}

struct Recorder(Mutex<Vec<u64>>);
impl SwapListener for Recorder {
    fn before_swap_out(&self, pages: &[u64]) -> bool {
        self.0.lock().unwrap().extend_from_slice(pages);
        true
    }
}

#[test]
fn listeners_hear_swap_outs_until_removed() {
    let mm = FakeMem::default();
    let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
    let id = mm.add_swap_listener(rec.clone());
    assert!(mm.evict(0x5000));
    mm.remove_swap_listener(id);
    assert!(mm.evict(0x6000));
    assert_eq!(*rec.0.lock().unwrap(), vec![0x5000]);
    let mut v = Vec::new();
    mm.residency(0x4000, 0x3000, &mut v).unwrap();
    assert_eq!(v, vec![true, false, false]);
}

#[test]
fn access_flags_compose() {
    let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
    assert!(a.contains(Access::REMOTE_READ));
    assert!(!a.contains(Access::REMOTE_WRITE));
    assert_eq!(a.0, 5);
    assert!(Completion::default().is_ok());
}

#[test]
fn wc_status_numbers_are_ibv_wc_status() {
    for code in 0..22 {
        assert_eq!(WcStatus::from_code(code).code(), code);
    }
    assert_eq!(WcStatus::LocProtErr.code(), 4);
    assert_eq!(WcStatus::WrFlushErr.code(), Completion::WR_FLUSH_ERR);
    assert_eq!(WcStatus::from_code(22), WcStatus::GeneralErr);
    assert_eq!(WcStatus::from_code(u32::MAX), WcStatus::GeneralErr);
}

#[test]
fn the_fake_nic_keeps_the_verbs_contract() {
    let (a, b) = crate::testutil::FakeNic::pair();
    assert!(!a.caps().iommu && a.iommu().is_none());
    assert_ne!(a.addr(), b.addr());
    crate::testutil::verbs_contract(&a, &b);
    crate::testutil::buffers_and_access_contract(&a, &b);
    let (a, b) = crate::testutil::FakeNic::pair_with_iommu();
    assert!(a.caps().iommu && a.iommu().is_some());
    crate::testutil::iommu_contract(&a, &b);
}
