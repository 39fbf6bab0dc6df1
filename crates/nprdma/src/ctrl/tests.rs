//! Unit and property tests of the control wire format.

use std::borrow::Cow;

use proptest::prelude::*;

use super::*;

fn cfg() -> CtrlConfig {
    CtrlConfig::default()
}

fn roundtrip(r: &Repr<'_>) -> Vec<u8> {
    let mut buf = vec![0xAAu8; r.buffer_len() + 7];
    let n = r.emit(&mut buf, &cfg()).expect("emit");
    assert_eq!(n, r.buffer_len());
    assert_eq!(n % SLOT, 0);
    buf.truncate(n);
    let back = Repr::parse_bytes(&buf, &cfg()).expect("parse");
    assert_eq!(&back, r);
    buf
}

fn km(i: u32) -> KeyMapping {
    KeyMapping {
        app_rkey: i,
        write_rkey: i + 1000,
        version_rkey: i + 2000,
        page_count: 3,
        region_va: 0x7f00_0000_1000 + i as u64 * 0x10000,
        region_len: 3 * 4096,
        version_va: 0x5000 + i as u64 * 12,
    }
}

#[test]
fn single_slot_messages_roundtrip_with_expected_layout() {
    let f = Repr::Fault(FaultRequest {
        req_id: 0x01020304,
        kind: FaultKind::Write,
        local_addr: 0x1111_2222_3333_4444,
        local_key: 0xabcd,
        remote_addr: 0x5555_6666_7777_8888,
        rkey: 0x77,
        len: 4096,
        inline_ok: true,
        retry_mode: false,
        want_lease: false,
    });
    let b = roundtrip(&f);
    assert_eq!(b.len(), SLOT);
    assert_eq!(b[0], VERSION);
    assert_eq!(b[1], Opcode::FaultRequest as u8);
    assert_eq!(b[2], 1);
    assert_eq!(b[3], flags::INLINE_OK);
    assert_eq!(b[7], FaultKind::Write as u8);
    assert_eq!(&b[8..12], &0x01020304u32.to_le_bytes());
    assert_eq!(&b[32..40], &0x5555_6666_7777_8888u64.to_le_bytes());
    assert_eq!(message_len(&b).unwrap(), SLOT);

    roundtrip(&Repr::Completion {
        req_id: 9,
        status: Status::Retry,
        byte_len: 77,
    });
    roundtrip(&Repr::Atomic(AtomicRequest {
        req_id: 1,
        kind: AtomicKind::CmpSwap,
        remote_addr: 0x1000,
        rkey: 5,
        compare_add: 1,
        swap: u64::MAX,
    }));
    roundtrip(&Repr::AtomicResp {
        req_id: 1,
        status: Status::Ok,
        original: 42,
    });
    roundtrip(&Repr::KeyQuery {
        req_id: 3,
        rkey: None,
    });
    roundtrip(&Repr::KeyQuery {
        req_id: 3,
        rkey: Some(0),
    });
    roundtrip(&Repr::ReceiverReady {
        req_id: 4,
        status: Status::Ok,
    });
    roundtrip(&Repr::Release { req_id: 4 });
    let b = roundtrip(&Repr::Lease {
        req_id: 5,
        rkey: 0x77,
        key: 0x1234_5678,
        addr: 0x7f00_0000_1000,
        len: 1 << 20,
        write: true,
        ms: 100,
        seq: 3,
    });
    assert_eq!(b.len(), SLOT);
    roundtrip(&Repr::LeaseRelease {
        key: 0x1234_5678,
        seq: 3,
    });
    roundtrip(&Repr::SendRendezvous {
        req_id: 8,
        addr: 0x1234,
        len: 1 << 20,
        key: 0x99,
        imm: Some(0),
        solicited: true,
        rnr_retry: 7,
    });
    roundtrip(&Repr::WriteImmNotify {
        req_id: 8,
        addr: 0x1234,
        len: 100,
        rkey: 0x99,
        imm: 0xfeed,
        solicited: false,
        rnr_retry: 7,
    });
}

#[test]
fn inline_data_spans_continuation_slots() {
    let data: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
    let r = Repr::WriteInline {
        req_id: 1,
        remote_addr: 0x4000,
        rkey: 2,
        want_lease: false,
        data: Cow::Borrowed(&data),
    };
    // 24-byte fixed part + 1024 bytes of data = 1048 → 17 slots.
    assert_eq!(r.nslots(), 17);
    let b = roundtrip(&r);
    assert_eq!(message_len(&b[..SLOT]).unwrap(), 17 * SLOT);
    let p = Packet::new_checked(&b[..]).unwrap();
    assert_eq!(p.payload(), &data[..]);
    // A message that needs exactly one slot of content stays one slot.
    let r = Repr::SendInline {
        req_id: 1,
        imm: None,
        solicited: false,
        rnr_retry: 7,
        data: Cow::Owned(vec![1; SLOT - layout::SEND_INLINE_DATA]),
    };
    assert_eq!(r.nslots(), 1);
    roundtrip(&r);
}

#[test]
fn key_sync_packs_several_entries() {
    let max = cfg().max_key_entries();
    assert!(max >= 20, "{max}");
    let entries: Vec<_> = (0..max as u32).map(km).collect();
    let r = Repr::KeySync {
        req_id: 5,
        more: true,
        entries: Cow::Owned(entries.clone()),
    };
    let b = roundtrip(&r);
    let p = Packet::new_checked(&b[..]).unwrap();
    assert_eq!(p.len_field() as usize, max);
    assert!(p.key_entry(max).is_none());
    assert_eq!(
        &p.key_entry(1).unwrap()[0..4],
        &entries[1].app_rkey.to_le_bytes()
    );
    let too_many = Repr::KeySync {
        req_id: 5,
        more: false,
        entries: Cow::Owned((0..max as u32 + 1).map(km).collect()),
    };
    let mut buf = vec![0; 64 * 255];
    assert!(matches!(
        too_many.emit(&mut buf, &cfg()),
        Err(CtrlError::TooManyEntries { .. })
    ));
}

#[test]
fn malformed_input_yields_typed_errors() {
    let good = roundtrip(&Repr::Completion {
        req_id: 1,
        status: Status::Ok,
        byte_len: 4,
    });
    // Short buffer.
    assert!(matches!(
        Repr::parse_bytes(&good[..20], &cfg()),
        Err(CtrlError::Truncated { .. })
    ));
    assert!(matches!(message_len(&[]), Err(CtrlError::Truncated { .. })));
    // Bad version / opcode / status / flags / slot count.
    let mut b = good.clone();
    b[0] = 9;
    assert_eq!(Repr::parse_bytes(&b, &cfg()), Err(CtrlError::BadVersion(9)));
    let mut b = good.clone();
    b[1] = 0;
    assert_eq!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::UnknownOpcode(0))
    );
    let mut b = good.clone();
    b[1] = 200;
    assert_eq!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::UnknownOpcode(200))
    );
    let mut b = good.clone();
    b[6] = 99;
    assert_eq!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::UnknownStatus(99))
    );
    let mut b = good.clone();
    b[3] = 0x80;
    assert!(matches!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::BadField { field: "flags", .. })
    ));
    let mut b = good.clone();
    b[2] = 2;
    assert!(matches!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::BadSlotCount { nslots: 2, need: 1 })
    ));
    // Truncated multi-slot message: header says 17 slots, only 3 present.
    let data = vec![3u8; 1024];
    let r = Repr::WriteInline {
        req_id: 1,
        remote_addr: 0,
        rkey: 0,
        want_lease: false,
        data: Cow::Borrowed(&data),
    };
    let mut big = vec![0; r.buffer_len()];
    r.emit(&mut big, &cfg()).unwrap();
    assert!(matches!(
        Repr::parse_bytes(&big[..3 * SLOT], &cfg()),
        Err(CtrlError::Truncated { .. })
    ));
    // Inline length above the configured maximum (but within the slots).
    let small = CtrlConfig::with_max_inline(512).unwrap();
    assert!(matches!(
        Repr::parse_bytes(&big, &small),
        Err(CtrlError::InlineTooLong {
            len: 1024,
            max: 512
        })
    ));
    assert!(matches!(
        r.emit(&mut big, &small),
        Err(CtrlError::InlineTooLong { .. })
    ));
    // A length field that claims more data than the slots hold.
    let mut b = big.clone();
    b[4..6].copy_from_slice(&2000u16.to_le_bytes());
    assert!(matches!(
        Repr::parse_bytes(&b, &cfg()),
        Err(CtrlError::BadSlotCount { .. })
    ));
    // READ asking for more than can come back inline.
    let ri = Repr::ReadInline {
        req_id: 1,
        remote_addr: 0,
        rkey: 0,
        want_lease: false,
        len: 4096,
    };
    assert!(matches!(
        ri.emit(&mut big, &cfg()),
        Err(CtrlError::InlineTooLong { .. })
    ));
    // Output buffer too small.
    assert!(matches!(
        r.emit(&mut [0u8; 64], &cfg()),
        Err(CtrlError::BufferTooSmall { .. })
    ));
    // Unknown fault kind.
    let mut f = vec![0; SLOT];
    Repr::Fault(FaultRequest {
        req_id: 1,
        kind: FaultKind::Read,
        local_addr: 0,
        local_key: 0,
        remote_addr: 0,
        rkey: 0,
        len: 1,
        inline_ok: false,
        retry_mode: true,
        want_lease: false,
    })
    .emit(&mut f, &cfg())
    .unwrap();
    f[7] = 3;
    assert!(matches!(
        Repr::parse_bytes(&f, &cfg()),
        Err(CtrlError::BadField {
            field: "fault kind",
            value: 3
        })
    ));
    // Configuration beyond the slot limit is refused.
    assert!(CtrlConfig::with_max_inline(64 * 255).is_err());
}

#[test]
fn pad_spans_any_number_of_slots() {
    let r = Repr::Pad { slots: 5 };
    let b = roundtrip(&r);
    assert_eq!(b.len(), 5 * SLOT);
    assert!(Repr::Pad { slots: 0 }.emit(&mut [0; 64], &cfg()).is_err());
}

fn arb_status() -> impl Strategy<Value = Status> {
    (0u8..8).prop_map(|s| Status::try_from(s).unwrap())
}

fn arb_key() -> impl Strategy<Value = KeyMapping> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(a, w, v, n, va, len, vva)| KeyMapping {
            app_rkey: a,
            write_rkey: w,
            version_rkey: v,
            page_count: n,
            region_va: va,
            region_len: len,
            version_va: vva,
        })
}

fn arb_data() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=DEFAULT_MAX_INLINE)
}

fn arb_repr() -> impl Strategy<Value = Repr<'static>> {
    let max_entries = CtrlConfig::default().max_key_entries();
    prop_oneof![
        (any::<u32>(), any::<Option<u32>>())
            .prop_map(|(req_id, rkey)| Repr::KeyQuery { req_id, rkey }),
        (
            any::<u32>(),
            any::<bool>(),
            prop::collection::vec(arb_key(), 0..=max_entries)
        )
            .prop_map(|(req_id, more, e)| Repr::KeySync {
                req_id,
                more,
                entries: Cow::Owned(e)
            }),
        (any::<u32>(), any::<u32>()).prop_map(|(req_id, rkey)| Repr::KeyRevoke { req_id, rkey }),
        (
            any::<u32>(),
            any::<bool>(),
            (
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<u32>(),
                any::<u32>()
            ),
            any::<bool>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(
                |(req_id, rd, (la, lk, ra, rk, len), inline_ok, retry_mode, want_lease)| {
                    Repr::Fault(FaultRequest {
                        req_id,
                        kind: if rd {
                            FaultKind::Read
                        } else {
                            FaultKind::Write
                        },
                        local_addr: la,
                        local_key: lk,
                        remote_addr: ra,
                        rkey: rk,
                        len,
                        inline_ok,
                        retry_mode,
                        want_lease,
                    })
                }
            ),
        (any::<u32>(), any::<u64>(), any::<u32>(), arb_data()).prop_map(
            |(req_id, remote_addr, rkey, d)| Repr::WriteInline {
                req_id,
                remote_addr,
                rkey,
                want_lease: rkey % 2 == 1,
                data: Cow::Owned(d)
            }
        ),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            0..=DEFAULT_MAX_INLINE as u32
        )
            .prop_map(|(req_id, remote_addr, rkey, len)| Repr::ReadInline {
                req_id,
                remote_addr,
                rkey,
                want_lease: req_id % 2 == 1,
                len
            }),
        (any::<u32>(), arb_status(), arb_data()).prop_map(|(req_id, status, d)| {
            let data = if status == Status::Ok { d } else { Vec::new() };
            Repr::ReadInlineResp {
                req_id,
                status,
                data: Cow::Owned(data),
            }
        }),
        (any::<u32>(), arb_status(), any::<u32>()).prop_map(|(req_id, status, byte_len)| {
            Repr::Completion {
                req_id,
                status,
                byte_len,
            }
        }),
        (any::<u32>(), arb_status())
            .prop_map(|(req_id, status)| Repr::ReceiverReady { req_id, status }),
        any::<u32>().prop_map(|req_id| Repr::Release { req_id }),
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            any::<u32>()
        )
            .prop_map(|(req_id, rkey, key, addr, len, write, ms)| Repr::Lease {
                req_id,
                rkey,
                key,
                addr,
                len,
                write,
                ms,
                seq: req_id ^ key,
            }),
        (any::<u32>(), any::<u32>()).prop_map(|(key, seq)| Repr::LeaseRelease { key, seq }),
        (
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(
                |(req_id, cas, remote_addr, rkey, compare_add, swap)| Repr::Atomic(AtomicRequest {
                    req_id,
                    kind: if cas {
                        AtomicKind::CmpSwap
                    } else {
                        AtomicKind::FetchAdd
                    },
                    remote_addr,
                    rkey,
                    compare_add,
                    swap: if cas { swap } else { 0 },
                })
            ),
        (any::<u32>(), arb_status(), any::<u64>()).prop_map(|(req_id, status, original)| {
            Repr::AtomicResp {
                req_id,
                status,
                original,
            }
        }),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<Option<u32>>(),
            (any::<bool>(), 0u8..8)
        )
            .prop_map(|(req_id, addr, len, key, imm, (solicited, rnr_retry))| {
                Repr::SendRendezvous {
                    req_id,
                    addr,
                    len,
                    key,
                    imm,
                    solicited,
                    rnr_retry,
                }
            }),
        (
            any::<u32>(),
            any::<Option<u32>>(),
            (any::<bool>(), 0u8..8),
            arb_data()
        )
            .prop_map(
                |(req_id, imm, (solicited, rnr_retry), d)| Repr::SendInline {
                    req_id,
                    imm,
                    solicited,
                    rnr_retry,
                    data: Cow::Owned(d)
                }
            ),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            (any::<bool>(), 0u8..8)
        )
            .prop_map(|(req_id, addr, len, rkey, imm, (solicited, rnr_retry))| {
                Repr::WriteImmNotify {
                    req_id,
                    addr,
                    len,
                    rkey,
                    imm,
                    solicited,
                    rnr_retry,
                }
            }),
        (1u8..=255).prop_map(|slots| Repr::Pad { slots }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = message_len(&bytes);
        if let Ok(r) = Repr::parse_bytes(&bytes, &cfg()) {
            // Whatever parses re-encodes to something that parses identically.
            let mut buf = vec![0; r.buffer_len()];
            r.emit(&mut buf, &cfg()).unwrap();
            prop_assert_eq!(Repr::parse_bytes(&buf, &cfg()).unwrap(), r);
        }
    }

    #[test]
    fn plausible_headers_never_panic(
        op in 0u8..20, nslots in any::<u8>(), fl in any::<u8>(), len in any::<u16>(),
        status in 0u8..10, kind in 0u8..4, tail in prop::collection::vec(any::<u8>(), 0..1200)
    ) {
        // Valid version byte so the fuzzing reaches the per-opcode decoding.
        let mut b = vec![VERSION, op, nslots, fl];
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&[status, kind]);
        b.extend_from_slice(&tail);
        let _ = Repr::parse_bytes(&b, &cfg());
        let _ = Repr::parse_bytes(&b, &CtrlConfig::with_max_inline(100).unwrap());
    }

    #[test]
    fn repr_roundtrips(r in arb_repr()) {
        let mut buf = vec![0x5Au8; r.buffer_len()];
        prop_assert_eq!(r.emit(&mut buf, &cfg()).unwrap(), buf.len());
        prop_assert_eq!(message_len(&buf[..SLOT]).unwrap(), buf.len());
        let back = Repr::parse_bytes(&buf, &cfg()).unwrap();
        prop_assert_eq!(back.into_owned(), r);
    }

    #[test]
    fn corrupted_messages_never_panic(r in arb_repr(), pos in any::<usize>(), val in any::<u8>()) {
        let mut buf = vec![0; r.buffer_len()];
        r.emit(&mut buf, &cfg()).unwrap();
        let i = pos % buf.len();
        buf[i] = val;
        let _ = Repr::parse_bytes(&buf, &cfg());
        let _ = Repr::parse_bytes(&buf[..i], &cfg());
    }
}
