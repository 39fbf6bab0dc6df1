//! Property tests of `packet::parse` and `packet::emit`: parse never panics (on random
//! bytes and on damaged real packets); emit then parse gives back the representation and
//! payload; one flipped bit outside the ICRC-masked fields is always refused; so is every
//! truncation and extension.

use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;
use proptest::sample::Index;
use roce::aeth::{AethRepr, NakCode, Syndrome};
use roce::atomic_ack_eth::AtomicAckEthRepr;
use roce::atomic_eth::AtomicEthRepr;
use roce::bth::{BthRepr, MAX_24};
use roce::deth::DethRepr;
use roce::exts::ExtHeaders;
use roce::ieth::IethRepr;
use roce::immdt::ImmDtRepr;
use roce::ip::IpRepr;
use roce::ipv4::Ipv4Repr;
use roce::ipv6::{Ipv6Repr, MAX_FLOW_LABEL};
use roce::opcode::{Ext, Opcode};
use roce::packet::{self, Repr, MAX_PAYLOAD};
use roce::reth::RethRepr;
use roce::udp::UdpRepr;

fn ip() -> impl Strategy<Value = IpRepr> {
    let v4 = (
        any::<[u8; 4]>(),
        any::<[u8; 4]>(),
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
        any::<bool>(),
    )
        .prop_map(|(s, d, tos, ttl, ident, dont_frag)| {
            IpRepr::V4(Ipv4Repr {
                src: Ipv4Addr::from(s),
                dst: Ipv4Addr::from(d),
                tos,
                ttl,
                ident,
                dont_frag,
            })
        });
    let v6 = (
        any::<[u8; 16]>(),
        any::<[u8; 16]>(),
        any::<u8>(),
        0..=MAX_FLOW_LABEL,
        any::<u8>(),
    )
        .prop_map(|(s, d, traffic_class, flow_label, hop_limit)| {
            IpRepr::V6(Ipv6Repr {
                src: Ipv6Addr::from(s),
                dst: Ipv6Addr::from(d),
                traffic_class,
                flow_label,
                hop_limit,
            })
        });
    prop_oneof![v4, v6]
}

fn syndrome() -> impl Strategy<Value = Syndrome> {
    prop_oneof![
        (0u8..=0x1f).prop_map(|credit| Syndrome::Ack { credit }),
        (0u8..=0x1f).prop_map(|timer| Syndrome::RnrNak { timer }),
        (0usize..5).prop_map(|i| Syndrome::Nak(NakCode::ALL[i])),
    ]
}

/// One arbitrary value of every extension header; [`exts_for`] picks the opcode's.
#[derive(Debug, Clone)]
struct Pool {
    reth: RethRepr,
    aeth: AethRepr,
    atomic: AtomicEthRepr,
    atomic_ack: AtomicAckEthRepr,
    imm: ImmDtRepr,
    deth: DethRepr,
    ieth: IethRepr,
}

fn pool() -> impl Strategy<Value = Pool> {
    (
        (any::<u64>(), any::<u32>(), any::<u32>()),
        (syndrome(), 0..=MAX_24),
        (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()),
        any::<u64>(),
        any::<u32>(),
        (any::<u32>(), 0..=MAX_24),
        any::<u32>(),
    )
        .prop_map(|(r, a, at, orig, imm, d, ieth)| Pool {
            reth: RethRepr {
                va: r.0,
                rkey: r.1,
                dma_len: r.2,
            },
            aeth: AethRepr {
                syndrome: a.0,
                msn: a.1,
            },
            atomic: AtomicEthRepr {
                va: at.0,
                rkey: at.1,
                swap_add: at.2,
                compare: at.3,
            },
            atomic_ack: AtomicAckEthRepr { orig },
            imm: ImmDtRepr { imm },
            deth: DethRepr {
                qkey: d.0,
                src_qp: d.1,
            },
            ieth: IethRepr { rkey: ieth },
        })
}

fn exts_for(op: Opcode, p: &Pool) -> ExtHeaders {
    match op.info().headers {
        [] => ExtHeaders::None,
        [Ext::ImmDt] => ExtHeaders::ImmDt(p.imm),
        [Ext::Ieth] => ExtHeaders::Ieth(p.ieth),
        [Ext::Reth] => ExtHeaders::Reth(p.reth),
        [Ext::Reth, Ext::ImmDt] => ExtHeaders::RethImmDt(p.reth, p.imm),
        [Ext::Aeth] => ExtHeaders::Aeth(p.aeth),
        [Ext::Aeth, Ext::AtomicAckEth] => ExtHeaders::AethAtomicAck(p.aeth, p.atomic_ack),
        [Ext::AtomicEth] => ExtHeaders::AtomicEth(p.atomic),
        [Ext::Deth] => ExtHeaders::Deth(p.deth),
        [Ext::Deth, Ext::ImmDt] => ExtHeaders::DethImmDt(p.deth, p.imm),
        other => panic!("opcode {op:?} has an unknown layout {other:?}"),
    }
}

/// A valid representation and its payload.
fn packet() -> impl Strategy<Value = (Repr, Vec<u8>)> {
    let ops: Vec<Opcode> = Opcode::all().collect();
    let bth_bits = (
        any::<[bool; 5]>(),
        any::<u16>(),
        0..=MAX_24,
        0..=MAX_24,
        0u8..=3,
    );
    let payload = prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..=64),
        1 => proptest::collection::vec(any::<u8>(), 0..=MAX_PAYLOAD),
    ];
    (
        ip(),
        any::<u16>(),
        proptest::sample::select(ops),
        bth_bits,
        pool(),
        payload,
    )
        .prop_map(
            |(ip, src_port, opcode, (flags, pkey, dest_qp, psn, pad), pool, payload)| {
                let carries = opcode.info().payload;
                let payload = if carries { payload } else { Vec::new() };
                let repr = Repr {
                    ip,
                    udp: UdpRepr { src_port },
                    bth: BthRepr {
                        opcode,
                        solicited: flags[0],
                        mig_req: flags[1],
                        pad_count: if carries { pad } else { 0 },
                        pkey,
                        fecn: flags[2],
                        becn: flags[3],
                        dest_qp,
                        ack_req: flags[4],
                        psn,
                    },
                    exts: exts_for(opcode, &pool),
                    payload_len: payload.len(),
                };
                (repr, payload)
            },
        )
}

fn emitted(repr: &Repr, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; packet::buffer_len(repr)];
    let n = packet::emit(repr, payload, &mut buf).expect("a valid repr emits");
    assert_eq!(n, buf.len());
    buf
}

/// Whether byte `i`, bit `bit` of `pkt` is one the ICRC masks (so a flip of it may go
/// unseen): IPv4 TOS, TTL, header checksum; IPv6 traffic class, flow label, hop limit;
/// the UDP checksum; BTH byte 4.
fn masked(pkt: &[u8], i: usize, bit: u8) -> bool {
    let v4 = pkt[0] >> 4 == 4;
    let ip_len = if v4 { 20 } else { 40 };
    let ip_masked = if v4 {
        matches!(i, 1 | 8 | 10 | 11)
    } else {
        (i == 0 && bit < 4) || matches!(i, 1..=3 | 7)
    };
    ip_masked || i == ip_len + 6 || i == ip_len + 7 || i == ip_len + 8 + 4
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = packet::parse(&bytes);
        // With a plausible IPv4 or IPv6 start, to get past the first check more often.
        let mut b = bytes.clone();
        if let Some(first) = b.first_mut() {
            *first = 0x45;
        }
        let _ = packet::parse(&b);
        if let Some(first) = b.first_mut() {
            *first = 0x60;
        }
        let _ = packet::parse(&b);
    }

    #[test]
    fn damaged_packets_never_panic(
        (repr, payload) in packet(),
        edits in proptest::collection::vec((any::<Index>(), any::<u8>()), 1..8),
        cut in any::<Index>(),
    ) {
        let mut b = emitted(&repr, &payload);
        for (at, v) in &edits {
            let i = at.index(b.len());
            b[i] = *v;
        }
        let _ = packet::parse(&b);
        let _ = packet::parse(&b[..cut.index(b.len() + 1)]);
    }

    #[test]
    fn emit_then_parse_round_trips((repr, payload) in packet()) {
        let b = emitted(&repr, &payload);
        let (got, range) = packet::parse(&b).expect("an emitted packet parses");
        prop_assert_eq!(got, repr);
        prop_assert_eq!(&b[range], &payload[..]);
    }

    #[test]
    fn one_bit_flip_outside_the_masks_is_refused((repr, payload) in packet(), pick in any::<Index>()) {
        let b = emitted(&repr, &payload);
        let bits: Vec<(usize, u8)> = if b.len() <= 300 {
            (0..b.len()).flat_map(|i| (0..8).map(move |bit| (i, bit))).collect()
        } else {
            let k = pick.index(b.len() * 8);
            vec![(k / 8, (k % 8) as u8)]
        };
        for (i, bit) in bits {
            let mut c = b.clone();
            c[i] ^= 1 << bit;
            let r = packet::parse(&c);
            if !masked(&b, i, bit) {
                prop_assert!(r.is_err(), "flip of byte {} bit {} accepted: {:?}", i, bit, r);
            }
        }
    }

    #[test]
    fn every_truncation_and_extension_is_refused((repr, payload) in packet(), extra in any::<u8>()) {
        let b = emitted(&repr, &payload);
        for k in 0..b.len() {
            prop_assert!(packet::parse(&b[..k]).is_err(), "truncated to {} bytes accepted", k);
        }
        let mut longer = b.clone();
        longer.push(extra);
        prop_assert!(packet::parse(&longer).is_err());
    }
}
