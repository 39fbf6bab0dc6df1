//! A whole RoCEv2 packet — IP, UDP, BTH, extension headers, payload, pad, ICRC — as one
//! representation: [`parse`] with every check, [`emit`] with checksums, pad and ICRC,
//! and [`buffer_len`].
//!
//! [`parse`] checks, in this order: the IP header and length (the buffer is exactly one
//! IP packet), UDP length, port and checksum, room for a BTH and an ICRC, the ICRC, then
//! the BTH (opcode, TVer), the extension headers the opcode needs, the pad, and the
//! payload (none on an opcode that carries none; at most [`MAX_PAYLOAD`] bytes). Fields
//! are interpreted only once the ICRC has vouched for them. The pad's contents are not
//! checked (rxe does not either); [`emit`] writes zeros.

use std::ops::Range;

use crate::bth::{self, Bth, BthRepr};
use crate::error::{Error, Result};
use crate::exts::ExtHeaders;
use crate::icrc;
use crate::ip::IpRepr;
use crate::udp::{self, Udp, UdpRepr};

/// The largest payload of one packet: the largest IBTA path MTU.
pub const MAX_PAYLOAD: usize = 4096;

/// A parsed RoCEv2 packet (everything but the payload bytes themselves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// IP version, addresses, TOS/traffic class, TTL/hop limit.
    pub ip: IpRepr,
    /// UDP source port (the destination is always 4791).
    pub udp: UdpRepr,
    /// The BTH; `bth.pad_count` pad bytes follow the payload.
    pub bth: BthRepr,
    /// The extension headers; their shape must be the opcode's.
    pub exts: ExtHeaders,
    /// Payload bytes (pad excluded).
    pub payload_len: usize,
}

impl Repr {
    /// Whether [`emit`] would accept this representation (with a payload of
    /// `payload_len` bytes): fields fit their widths ([`Error::FieldOutOfRange`]), the
    /// extension headers are the opcode's ([`Error::HeadersMismatch`]), the payload is at
    /// most [`MAX_PAYLOAD`] ([`Error::PayloadTooLong`]) and absent, pad included, on an
    /// opcode without one ([`Error::UnexpectedPayload`]).
    pub fn check(&self) -> Result<()> {
        self.ip.check()?;
        self.bth.check()?;
        self.exts.check(self.bth.opcode)?;
        if self.payload_len > MAX_PAYLOAD {
            return Err(Error::PayloadTooLong(self.payload_len));
        }
        let carried = self.payload_len + usize::from(self.bth.pad_count);
        if !self.bth.opcode.info().payload && carried > 0 {
            return Err(Error::UnexpectedPayload {
                opcode: self.bth.opcode.byte(),
                len: carried,
            });
        }
        Ok(())
    }
}

/// The pad count that makes `payload_len` bytes a multiple of four (IBTA §9.2: payload
/// and pad together are whole 4-byte words).
pub const fn pad_for(payload_len: usize) -> u8 {
    ((4 - payload_len % 4) % 4) as u8
}

/// The length of the packet [`emit`] writes for `repr`: IP and UDP headers, BTH,
/// extension headers, payload, pad and ICRC.
pub fn buffer_len(repr: &Repr) -> usize {
    repr.ip.header_len()
        + udp::LEN
        + bth::LEN
        + repr.exts.len()
        + repr.payload_len
        + usize::from(repr.bth.pad_count & 3)
        + icrc::LEN
}

/// Parses `buf`, exactly one IP packet carrying RoCEv2, into its representation and the
/// range of its payload in `buf`. Never panics; see the module doc for the checks.
pub fn parse(buf: &[u8]) -> Result<(Repr, Range<usize>)> {
    let (ip, ip_payload) = IpRepr::parse(buf)?;
    let udp_start = ip_payload.start;
    let udp_view = Udp::new_checked(&buf[ip_payload])?;
    let udp = UdpRepr::parse(&udp_view, &ip)?;

    transport(buf, ip, udp, udp_start + udp::LEN)
}

/// Parses a datagram received through a UDP socket (the kernel checked and removed its
/// IP and UDP headers): `buf` holds headers the receiver rebuilt from what the socket
/// reported — `ip` (addresses; IPv4 with identification 0 and don't-fragment, as an
/// unconnected Linux socket sends with `IP_PMTUDISC_DO`) and the UDP source port —
/// written by [`rebuild_headers`], then the datagram. The ICRC is checked over them,
/// then the BTH onward as [`parse`] does. The returned range indexes `buf`.
pub fn parse_rebuilt(buf: &[u8], ip: IpRepr, udp: UdpRepr) -> Result<(Repr, Range<usize>)> {
    transport(buf, ip, udp, ip.header_len() + udp::LEN)
}

/// Write the IP and UDP headers of a `datagram_len`-byte UDP payload (BTH through
/// ICRC) at the start of `buf` (which must hold [`rebuilt_len`] bytes): the headers the
/// ICRC covers. Checksums are left zero (the ICRC masks them).
pub fn rebuild_headers(
    buf: &mut [u8],
    ip: &IpRepr,
    udp: &UdpRepr,
    datagram_len: usize,
) -> Result<()> {
    let ip_len = ip.header_len();
    let n = ip_len + udp::LEN;
    if buf.len() < n {
        return Err(Error::BufferTooSmall {
            needed: n,
            got: buf.len(),
        });
    }
    ip.emit(&mut buf[..ip_len], udp::LEN + datagram_len)?;
    udp.emit(
        &mut Udp::new_unchecked(&mut buf[ip_len..n]),
        (udp::LEN + datagram_len) as u16,
    );
    Ok(())
}

/// Bytes of the IP and UDP headers [`rebuild_headers`] writes for `ip`.
pub fn rebuilt_len(ip: &IpRepr) -> usize {
    ip.header_len() + udp::LEN
}

/// The transport part of [`parse`]: the ICRC over the whole of `buf`, then the BTH
/// at `bth_start`, the extension headers, pad and payload.
fn transport(
    buf: &[u8],
    ip: IpRepr,
    udp: UdpRepr,
    bth_start: usize,
) -> Result<(Repr, Range<usize>)> {
    let needed = bth_start + bth::LEN + icrc::LEN;
    if buf.len() < needed {
        return Err(Error::Truncated {
            needed,
            got: buf.len(),
        });
    }
    let end = buf.len() - icrc::LEN;
    let computed = icrc::compute(&buf[..end])?;
    let found = icrc::from_wire([buf[end], buf[end + 1], buf[end + 2], buf[end + 3]]);
    if found != computed {
        return Err(Error::BadIcrc { found, computed });
    }

    let bth = BthRepr::parse(&Bth::new_checked(&buf[bth_start..end])?)?;
    let after_bth = &buf[bth_start + bth::LEN..end];
    let exts = ExtHeaders::parse(bth.opcode, after_bth)?;
    let room = after_bth.len() - exts.len();
    if usize::from(bth.pad_count) > room {
        return Err(Error::PadWithoutRoom {
            pad: bth.pad_count,
            room,
        });
    }
    if !bth.opcode.info().payload && room > 0 {
        return Err(Error::UnexpectedPayload {
            opcode: bth.opcode.byte(),
            len: room,
        });
    }
    let payload_len = room - usize::from(bth.pad_count);
    if payload_len > MAX_PAYLOAD {
        return Err(Error::PayloadTooLong(payload_len));
    }
    let start = bth_start + bth::LEN + exts.len();
    let repr = Repr {
        ip,
        udp,
        bth,
        exts,
        payload_len,
    };
    Ok((repr, start..start + payload_len))
}

/// Writes the packet of `repr` carrying `payload` at the start of `buf`, with the IPv4
/// header checksum, the UDP checksum (0 over IPv4, computed over IPv6), zero pad and the
/// ICRC, and returns its length ([`buffer_len`]). Refuses, never panics:
/// [`Repr::check`]'s errors, [`Error::PayloadLenMismatch`] if `payload` is not
/// `repr.payload_len` bytes, [`Error::BufferTooSmall`].
pub fn emit(repr: &Repr, payload: &[u8], buf: &mut [u8]) -> Result<usize> {
    repr.check()?;
    if payload.len() != repr.payload_len {
        return Err(Error::PayloadLenMismatch {
            repr: repr.payload_len,
            given: payload.len(),
        });
    }
    let n = buffer_len(repr);
    if buf.len() < n {
        return Err(Error::BufferTooSmall {
            needed: n,
            got: buf.len(),
        });
    }
    let buf = &mut buf[..n];
    let ip_len = repr.ip.header_len();
    repr.ip.emit(buf, n - ip_len)?;
    let udp_len = n - ip_len;
    repr.udp.emit(
        &mut Udp::new_unchecked(&mut buf[ip_len..]),
        udp_len as u16, // < n, which the IP length check above bounded to 16 bits
    );
    let bth_start = ip_len + udp::LEN;
    repr.bth.emit(&mut Bth::new_checked(&mut buf[bth_start..])?);
    let ext_start = bth_start + bth::LEN;
    repr.exts.emit(&mut buf[ext_start..])?;
    let pay_start = ext_start + repr.exts.len();
    let pad_start = pay_start + payload.len();
    buf[pay_start..pad_start].copy_from_slice(payload);
    let end = n - icrc::LEN;
    buf[pad_start..end].fill(0);
    let crc = icrc::compute(&buf[..end])?;
    buf[end..].copy_from_slice(&icrc::to_wire(crc));
    if let IpRepr::V6(_) = repr.ip {
        Udp::new_unchecked(&mut buf[ip_len..]).fill_checksum(&repr.ip);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aeth::{AethRepr, NakCode, Syndrome};
    use crate::deth::DethRepr;
    use crate::immdt::ImmDtRepr;
    use crate::ipv4::{Ipv4, Ipv4Repr};
    use crate::ipv6::Ipv6Repr;
    use crate::opcode::{Op, Opcode, Transport};
    use crate::reth::RethRepr;
    use std::net::Ipv4Addr;

    fn v4() -> IpRepr {
        IpRepr::V4(Ipv4Repr {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            tos: 0,
            ttl: 64,
            ident: 0x1234,
            dont_frag: true,
        })
    }

    fn v6() -> IpRepr {
        IpRepr::V6(Ipv6Repr {
            src: "fd00::1".parse().unwrap(),
            dst: "fd00::2".parse().unwrap(),
            traffic_class: 0x02,
            flow_label: 0x1_2345,
            hop_limit: 64,
        })
    }

    fn bth(t: Transport, op: Op, pad: u8) -> BthRepr {
        BthRepr {
            opcode: Opcode::new(t, op).unwrap(),
            solicited: false,
            mig_req: true,
            pad_count: pad,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: 0x11,
            ack_req: true,
            psn: 0x00ab_cdef,
        }
    }

    fn write_only(ip: IpRepr, payload_len: usize) -> Repr {
        Repr {
            ip,
            udp: UdpRepr { src_port: 0xc123 },
            bth: bth(Transport::Rc, Op::RdmaWriteOnly, pad_for(payload_len)),
            exts: ExtHeaders::Reth(RethRepr {
                va: 0x7f12_3456_7000,
                rkey: 0x0102_0304,
                dma_len: payload_len as u32,
            }),
            payload_len,
        }
    }

    fn ack(ip: IpRepr) -> Repr {
        Repr {
            ip,
            udp: UdpRepr { src_port: 0xc123 },
            bth: bth(Transport::Rc, Op::Acknowledge, 0),
            exts: ExtHeaders::Aeth(AethRepr {
                syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
                msn: 3,
            }),
            payload_len: 0,
        }
    }

    fn bytes(r: &Repr, payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; buffer_len(r)];
        assert_eq!(emit(r, payload, &mut b), Ok(b.len()));
        b
    }

    /// Recomputes the IPv4 header checksum, the UDP checksum (over IPv6) and the ICRC of
    /// a tampered packet, so only the tampering is wrong.
    fn reseal(b: &mut [u8]) {
        let ip_len = if b[0] >> 4 == 4 {
            let hl = usize::from(b[0] & 0xf) * 4;
            Ipv4::new_unchecked(&mut b[..]).fill_checksum();
            hl
        } else {
            40
        };
        let end = b.len() - 4;
        let crc = icrc::compute(&b[..end]).unwrap();
        b[end..].copy_from_slice(&icrc::to_wire(crc));
        if b[0] >> 4 == 6 {
            let (ip, _) = IpRepr::parse(b).unwrap();
            Udp::new_unchecked(&mut b[ip_len..]).fill_checksum(&ip);
        }
    }

    #[test]
    fn emit_then_parse_both_versions() {
        for ip in [v4(), v6()] {
            let payload: Vec<u8> = (0..13u8).collect();
            let r = write_only(ip, payload.len());
            let b = bytes(&r, &payload);
            assert_eq!(
                b.len(),
                r.ip.header_len() + 8 + 12 + 16 + 13 + 3 + 4,
                "headers, payload, pad, ICRC"
            );
            let (got, range) = parse(&b).unwrap();
            assert_eq!(got, r);
            assert_eq!(&b[range.clone()], &payload[..]);
            assert_eq!(&b[range.end..range.end + 3], &[0, 0, 0], "zero pad");
            // UDP checksum: none over IPv4, present over IPv6.
            let udp_ck = u16::from_be_bytes([b[r.ip.header_len() + 6], b[r.ip.header_len() + 7]]);
            assert_eq!(udp_ck == 0, matches!(ip, IpRepr::V4(_)));
        }
    }

    #[test]
    fn every_error_variant_of_parse() {
        let payload = [7u8; 8];
        let good = bytes(&write_only(v4(), 8), &payload);
        let ip_len = 20;
        let bth_at = ip_len + 8;
        let check = |b: &[u8], want: Error| {
            assert_eq!(parse(b).map(|_| ()), Err(want));
        };

        check(
            &good[..good.len() - 1],
            Error::Truncated {
                needed: good.len(),
                got: good.len() - 1,
            },
        );
        let mut b = good.clone();
        b[0] = 0x55;
        check(&b, Error::BadIpVersion(5));
        let mut b = good.clone();
        b[0] = 0x43;
        check(&b, Error::BadIhl(3));
        let mut b = good.clone();
        b.push(0);
        check(
            &b,
            Error::BadIpLength {
                declared: good.len(),
                actual: good.len() + 1,
            },
        );
        let mut b = good.clone();
        b[9] = 6;
        reseal(&mut b);
        check(&b, Error::NotUdp(6));
        let mut b = good.clone();
        b[ip_len + 5] -= 1;
        reseal(&mut b);
        check(
            &b,
            Error::UdpLengthMismatch {
                udp: good.len() - 21,
                ip: good.len() - 20,
            },
        );
        let mut b = good.clone();
        b[ip_len + 3] = 0xb8;
        reseal(&mut b);
        check(&b, Error::WrongPort(4792));
        let mut b = good.clone();
        b[12] ^= 1;
        check(&b, Error::BadIpChecksum);
        let mut b = good.clone();
        b[ip_len + 7] = 1; // a nonzero, wrong UDP checksum
        check(&b, Error::BadUdpChecksum);
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 0x80;
        let Err(Error::BadIcrc { found, computed }) = parse(&b) else {
            panic!("ICRC flip not caught");
        };
        assert_eq!(found ^ computed, 0x8000_0000);
        let mut b = good.clone();
        b[bth_at] = 0x15;
        reseal(&mut b);
        check(&b, Error::UnknownOpcode(0x15));
        let mut b = good.clone();
        b[bth_at] = 0x44;
        reseal(&mut b);
        check(&b, Error::UnsupportedTransport(0x44));
        let mut b = good.clone();
        b[bth_at + 1] |= 1;
        reseal(&mut b);
        check(&b, Error::BadTver(1));

        // An ATOMIC_ACKNOWLEDGE opcode on the write's bytes: 12 header bytes needed, the
        // write has RETH + payload = 24 bytes, so retag a short ACK instead.
        let short = bytes(&ack(v4()), &[]);
        let mut b = short.clone();
        b[bth_at] = 0x12; // ATOMIC_ACKNOWLEDGE: AETH + AtomicAckETH
        reseal(&mut b);
        check(
            &b,
            Error::HeadersMissing {
                opcode: 0x12,
                needed: 12,
                got: 4,
            },
        );
        let mut b = short.clone();
        b[bth_at + 1] |= 0x10; // pad 1, no room
        reseal(&mut b);
        check(&b, Error::PadWithoutRoom { pad: 1, room: 0 });
        // A READ request (RETH, no payload) on the write's bytes: 8 + 0 pad bytes extra.
        let mut b = good.clone();
        b[bth_at] = 0x0c;
        reseal(&mut b);
        check(
            &b,
            Error::UnexpectedPayload {
                opcode: 0x0c,
                len: 8,
            },
        );
        // 4097 bytes of payload.
        let big = vec![1u8; MAX_PAYLOAD];
        let mut b = bytes(&write_only(v4(), MAX_PAYLOAD), &big);
        assert_eq!(
            parse(&b).map(|(r, p)| (r.payload_len, p.len())),
            Ok((4096, 4096))
        );
        // Widen the packet by hand: one more payload byte and its pad (3), lengths fixed.
        let at = b.len() - 4;
        b.splice(at..at, [1u8, 0, 0, 0]);
        let n = b.len() as u16;
        b[2..4].copy_from_slice(&n.to_be_bytes());
        b[ip_len + 4..ip_len + 6].copy_from_slice(&(n - 20).to_be_bytes());
        b[bth_at + 1] |= 0x30;
        reseal(&mut b);
        check(&b, Error::PayloadTooLong(MAX_PAYLOAD + 1));
    }

    #[test]
    fn emit_refuses_without_panicking() {
        let r = write_only(v6(), 10);
        let payload = [0u8; 10];
        let n = buffer_len(&r);
        let mut buf = vec![0u8; n];
        for short in 0..n {
            assert_eq!(
                emit(&r, &payload, &mut buf[..short]),
                Err(Error::BufferTooSmall {
                    needed: n,
                    got: short
                })
            );
        }
        assert_eq!(
            emit(&r, &payload[..9], &mut buf),
            Err(Error::PayloadLenMismatch { repr: 10, given: 9 })
        );
        let mut bad = r;
        bad.payload_len = MAX_PAYLOAD + 1;
        let big = vec![0u8; MAX_PAYLOAD + 1];
        assert_eq!(
            emit(&bad, &big, &mut vec![0u8; 5000]),
            Err(Error::PayloadTooLong(MAX_PAYLOAD + 1))
        );
        let mut bad = ack(v4());
        bad.bth.pad_count = 1;
        assert_eq!(
            emit(&bad, &[], &mut buf),
            Err(Error::UnexpectedPayload {
                opcode: 0x11,
                len: 1
            })
        );
        let mut bad = ack(v4());
        bad.exts = ExtHeaders::ImmDt(ImmDtRepr { imm: 1 });
        assert_eq!(emit(&bad, &[], &mut buf), Err(Error::HeadersMismatch(0x11)));
        let mut bad = ack(v4());
        bad.bth.psn = 1 << 24;
        assert!(matches!(
            emit(&bad, &[], &mut buf),
            Err(Error::FieldOutOfRange(_))
        ));
        let mut bad = r;
        bad.exts = ExtHeaders::Deth(DethRepr { qkey: 0, src_qp: 0 });
        assert_eq!(
            emit(&bad, &payload, &mut buf),
            Err(Error::HeadersMismatch(0x0a))
        );
    }

    #[test]
    fn pad_for_rounds_to_words() {
        let pads: Vec<u8> = (0..9).map(pad_for).collect();
        assert_eq!(pads, [0, 3, 2, 1, 0, 3, 2, 1, 0]);
    }
}
