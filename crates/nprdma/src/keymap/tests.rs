//! Tests of key mapping and first-use sync.

use proptest::prelude::*;

use super::*;
use crate::ctrl::{Packet, SLOT};

fn m(rkey: u32, va: u64, len: u64) -> KeyMapping {
    let (_, pages) = page_span(va, len, 4096).unwrap();
    KeyMapping {
        app_rkey: rkey,
        write_rkey: rkey | 0x100_0000,
        version_rkey: 77,
        page_count: pages as u32,
        region_va: va,
        region_len: len,
        version_va: 0x9000_0000 + rkey as u64 * 0x1000,
    }
}

#[test]
fn lookup_translates_and_checks_bounds() {
    let mut t = KeyTable::new(4096).unwrap();
    // Region starts mid-page: 0x10_0800 .. 0x10_3800 covers 4 pages.
    t.insert(m(5, 0x10_0800, 0x3000)).unwrap();
    let tr = t.lookup(5, 0x10_1ff0, 0x20).unwrap();
    assert_eq!(tr.write_rkey, 5 | 0x100_0000);
    assert_eq!(tr.first_page, 1);
    assert_eq!(tr.page_count, 2);
    assert_eq!(tr.version_addr, 0x9000_0000 + 5 * 0x1000 + 4);
    assert_eq!(tr.version_len, 8);
    // Whole region, exact ends.
    let tr = t.lookup(5, 0x10_0800, 0x3000).unwrap();
    assert_eq!((tr.first_page, tr.page_count), (0, 4));
    // Zero-length at the end is fine; one byte past is not.
    assert_eq!(t.lookup(5, 0x10_3800, 0).unwrap().page_count, 0);
    assert!(matches!(
        t.lookup(5, 0x10_3800, 1),
        Err(KeyMapError::OutOfBounds { .. })
    ));
    assert!(matches!(
        t.lookup(5, 0x10_07ff, 2),
        Err(KeyMapError::OutOfBounds { .. })
    ));
    assert!(matches!(
        t.lookup(5, u64::MAX, 2),
        Err(KeyMapError::OutOfBounds { .. })
    ));
    assert_eq!(t.lookup(6, 0x10_0800, 1), Err(KeyMapError::UnknownKey(6)));
}

#[test]
fn inconsistent_mappings_are_rejected() {
    let mut t = KeyTable::new(4096).unwrap();
    let mut bad = m(1, 0x1000, 0x2000);
    bad.page_count = 3;
    assert!(matches!(t.insert(bad), Err(KeyMapError::BadMapping { .. })));
    let mut wrap = m(1, u64::MAX - 10, 5);
    wrap.region_len = 100;
    assert!(matches!(
        t.insert(wrap),
        Err(KeyMapError::BadMapping { .. })
    ));
    let mut vwrap = m(1, 0x1000, 0x2000);
    vwrap.version_va = u64::MAX - 4;
    assert!(matches!(
        t.insert(vwrap),
        Err(KeyMapError::BadMapping { .. })
    ));
    assert!(t.is_empty());
    assert_eq!(
        KeyTable::new(3000).unwrap_err(),
        KeyMapError::BadPageSize(3000)
    );
}

#[test]
fn sync_over_the_wire_and_revoke() {
    let cfg = CtrlConfig::default();
    let mut local = KeyTable::new(4096).unwrap();
    let n = cfg.max_key_entries() * 2 + 3;
    for i in 0..n as u32 {
        local
            .insert(m(i + 1, 0x100_0000 + i as u64 * 0x10000, 0x8000))
            .unwrap();
    }
    let msgs = local.sync_messages(42, &cfg);
    assert_eq!(msgs.len(), 3);

    let mut peer = PeerKeys::new(4096).unwrap();
    assert!(peer.needs_sync());
    peer.begin_sync(42);
    for (i, msg) in msgs.iter().enumerate() {
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.emit(&mut buf, &cfg).unwrap();
        assert_eq!(buf.len() % SLOT, 0);
        let parsed = Repr::parse(&Packet::new_checked(&buf[..]).unwrap(), &cfg).unwrap();
        assert!(peer.needs_sync(), "synced before message {i}");
        peer.apply(&parsed).unwrap();
    }
    assert_eq!(peer.state(), SyncState::Synced);
    assert_eq!(peer.table().len(), n);
    for i in 0..n as u32 {
        assert_eq!(peer.table().get(i + 1), local.get(i + 1));
    }
    peer.apply(&Repr::KeyRevoke { req_id: 0, rkey: 1 }).unwrap();
    assert_eq!(
        peer.lookup(1, 0x100_0000, 1),
        Err(KeyMapError::UnknownKey(1))
    );
    assert_eq!(
        peer.apply(&Repr::Release { req_id: 1 }),
        Err(KeyMapError::NotKeyMessage)
    );
}

#[test]
fn sync_of_empty_table_and_stale_reply() {
    let cfg = CtrlConfig::default();
    let msgs = KeyTable::new(4096).unwrap().sync_messages(7, &cfg);
    assert_eq!(msgs.len(), 1);
    let mut peer = PeerKeys::new(4096).unwrap();
    peer.begin_sync(8);
    // A reply to another query does not complete this one.
    peer.apply(&msgs[0]).unwrap();
    assert_eq!(peer.state(), SyncState::Pending { req_id: 8 });
    peer.begin_sync(7);
    peer.apply(&msgs[0]).unwrap();
    assert_eq!(peer.state(), SyncState::Synced);
}

#[test]
fn a_bad_entry_rejects_the_whole_message() {
    let mut peer = PeerKeys::new(4096).unwrap();
    let good = m(1, 0x1000, 0x1000);
    let mut bad = m(2, 0x1000, 0x1000);
    bad.page_count = 0;
    let msg = Repr::KeySync {
        req_id: 0,
        more: false,
        entries: Cow::Owned(vec![good, bad]),
    };
    assert!(peer.apply(&msg).is_err());
    assert!(peer.table().is_empty());
}

proptest! {
    #[test]
    fn lookup_accepts_exactly_the_accesses_inside(
        va in 0u64..(1 << 40), rlen in 0u64..100_000, addr_off in -5000i64..110_000, len in 0u64..20_000
    ) {
        let mut t = KeyTable::new(4096).unwrap();
        t.insert(m(9, va, rlen)).unwrap();
        let addr = (va as i64 + addr_off).max(0) as u64;
        let inside = addr >= va && addr + len <= va + rlen;
        match t.lookup(9, addr, len) {
            Ok(tr) => {
                prop_assert!(inside);
                // The version words lie within the region's version table.
                let vt = t.get(9).unwrap();
                prop_assert!(tr.version_addr >= vt.version_va);
                prop_assert!(tr.version_addr + tr.version_len <= vt.version_va + 4 * vt.page_count as u64);
                prop_assert_eq!(tr.page_count, page_span(addr, len, 4096).unwrap().1);
            }
            Err(e) => {
                prop_assert!(!inside);
                prop_assert!(matches!(e, KeyMapError::OutOfBounds { .. }), "{e}");
            }
        }
    }
}
