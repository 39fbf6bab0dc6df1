//! How residency reaches the NIC and back: pages the pager brings in after
//! registration are mapped into the NIC's views in the same pass (eager
//! map-in, with a pager that notifies swap-ins), and pages peers keep
//! reaching by DMA are spared by the pager's CLOCK (the IOMMU's accessed
//! bits answer its `test_and_clear_young`).

mod common;
use common::*;
use nprdma::Config;

const PG: usize = 4096;

fn side_eager(eager: bool) -> Side {
    side_paged(
        rnic::HostConfig::default(),
        vmem::PagerConfig {
            eager_swap_in_notify: eager,
            ..pager_cfg()
        },
        Config::default(),
    )
}

/// Two-sided rounds the target served for the initiator's READs of all of
/// `r` after its CPU wrote `data` into it (first touches after
/// registration), then after a swap-out and the CPU reading it back in;
/// checks the data each time.
fn reads_after_cpu_touch(eager: bool) -> (u64, u64) {
    let a = side();
    let b = side_eager(eager);
    let (qa, _qb) = connect(&a, &b, 16);
    let n = 4 * PG;
    let l = Buf::with(&a, n, Some(&vec![1; n]));
    let mut r = Buf::new(&b, n);
    let data = pattern(7, n);
    r.bytes_mut().copy_from_slice(&data);
    // The fault thread maps a page in just after waking the faulting thread.
    let mapped = |r: &Buf| (0..4).all(|p| r.mr.is_mapped(r.addr() + (p * PG) as u64));
    let settle = |r: &Buf| {
        let t = std::time::Instant::now();
        while eager && !mapped(r) && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::yield_now();
        }
    };
    settle(&r);
    assert_eq!(mapped(&r), eager);
    let read_all = |id| {
        qa.post_send(&[rd(id, &l, 0, &r, 0, n as u32)]).unwrap();
        assert!(wait1(&a.cq).is_ok());
        assert_eq!(l.bytes(), &data[..]);
    };
    read_all(1);
    let first = b.ctx.stats().served;
    r.swap_out();
    assert!(!mapped(&r));
    assert_eq!(r.bytes(), &data[..], "the CPU faults the pages back in");
    settle(&r);
    read_all(2);
    let second = b.ctx.stats().served - first;
    assert_eq!(b.host.stats().nonresident_dma, 0);
    (first, second)
}

#[test]
fn pages_the_cpu_brings_in_are_read_one_sided_with_eager_map_in() {
    assert_eq!(reads_after_cpu_touch(true), (0, 0));
    let (first, second) = reads_after_cpu_touch(false);
    assert!(
        first > 0 && second > 0,
        "without eager swap-in notices the first READs go two-sided ({first}, {second})"
    );
}

/// The target's pager evicts down to half its pages: those the initiator
/// keeps reading stay, the idle ones go, though CLOCK's hand meets the hot
/// ones first.
#[test]
fn pages_peers_keep_reading_survive_reclaim() {
    let a = side();
    let b = side_paged(
        rnic::HostConfig::default(),
        vmem::PagerConfig {
            background_evictor: false,
            ..pager_cfg()
        },
        Config::default(),
    );
    let (qa, _qb) = connect(&a, &b, 16);
    let n = 8 * PG;
    let l = Buf::with(&a, PG, Some(&[1; PG]));
    let r = Buf::with(&b, n, Some(&pattern(3, n)));
    for (id, p) in (0..4).enumerate() {
        qa.post_send(&[rd(id as u64, &l, 0, &r, (p * PG) as u64, PG as u32)])
            .unwrap();
        assert!(wait1(&a.cq).is_ok());
    }
    let resident = b.pager.stats().resident_pages;
    b.pager.set_budget(Some(resident - 4));
    b.pager.enforce_budget();
    let kept: Vec<bool> = (0..8)
        .map(|p| b.pager.is_resident(r.addr() as usize + p * PG))
        .collect();
    assert_eq!(kept, [true, true, true, true, false, false, false, false]);
    assert!(b.pager.stats().young_spared >= 4);
    assert_eq!(r.bytes(), &pattern(3, n)[..]);
    assert_eq!(b.host.stats().nonresident_dma, 0);
}
