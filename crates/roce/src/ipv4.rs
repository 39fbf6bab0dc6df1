//! The IPv4 header of a RoCEv2 packet: a view that honours IHL (options are skipped, not
//! interpreted) and a representation that emits a 20-byte header without options and
//! with its checksum.

use std::net::Ipv4Addr;

use crate::checksum;
use crate::error::{Error, Result};
use crate::field::{get_u16, put_u16};

/// Length of a header without options.
pub const MIN_LEN: usize = 20;

/// Offset of the TOS byte (DSCP and ECN), masked in the ICRC.
pub const TOS_AT: usize = 1;
/// Offset of the TTL, masked in the ICRC.
pub const TTL_AT: usize = 8;
/// Offset of the header checksum, masked in the ICRC.
pub const CHECKSUM_AT: usize = 10;

/// A view of an IPv4 packet (header and payload) at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv4<T> {
    /// The view, without checks.
    pub const fn new_unchecked(buffer: T) -> Ipv4<T> {
        Ipv4 { buffer }
    }

    /// The view, after checking that the version is 4 ([`Error::BadIpVersion`]), IHL is at
    /// least 5 ([`Error::BadIhl`]), the header and the total length fit in `buffer`
    /// ([`Error::Truncated`]) and the total length covers the header
    /// ([`Error::BadIpLength`]). Bytes after the total length are allowed here (the caller
    /// decides).
    pub fn new_checked(buffer: T) -> Result<Ipv4<T>> {
        let b = buffer.as_ref();
        let got = b.len();
        let Some(&first) = b.first() else {
            return Err(Error::Truncated { needed: 1, got });
        };
        if first >> 4 != 4 {
            return Err(Error::BadIpVersion(first >> 4));
        }
        if got < MIN_LEN {
            return Err(Error::Truncated {
                needed: MIN_LEN,
                got,
            });
        }
        let v = Ipv4 { buffer };
        if v.ihl() < 5 {
            return Err(Error::BadIhl(v.ihl()));
        }
        let (hl, tl) = (v.header_len(), usize::from(v.total_len()));
        if got < hl {
            return Err(Error::Truncated { needed: hl, got });
        }
        if tl < hl {
            return Err(Error::BadIpLength {
                declared: tl,
                actual: got,
            });
        }
        if got < tl {
            return Err(Error::Truncated { needed: tl, got });
        }
        Ok(v)
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// IP version (4).
    pub fn version(&self) -> u8 {
        self.b()[0] >> 4
    }

    /// Header length in 32-bit words.
    pub fn ihl(&self) -> u8 {
        self.b()[0] & 0x0f
    }

    /// Header length in bytes.
    pub fn header_len(&self) -> usize {
        usize::from(self.ihl()) * 4
    }

    /// The TOS byte: DSCP (6 bits) and ECN (2 bits).
    pub fn tos(&self) -> u8 {
        self.b()[TOS_AT]
    }

    /// Total length (header and payload).
    pub fn total_len(&self) -> u16 {
        get_u16(self.b(), 2)
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        get_u16(self.b(), 4)
    }

    /// Don't Fragment.
    pub fn dont_frag(&self) -> bool {
        self.b()[6] & 0x40 != 0
    }

    /// More Fragments.
    pub fn more_frags(&self) -> bool {
        self.b()[6] & 0x20 != 0
    }

    /// Fragment offset, in 8-byte units.
    pub fn frag_offset(&self) -> u16 {
        get_u16(self.b(), 6) & 0x1fff
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.b()[TTL_AT]
    }

    /// Protocol.
    pub fn protocol(&self) -> u8 {
        self.b()[9]
    }

    /// Header checksum.
    pub fn checksum(&self) -> u16 {
        get_u16(self.b(), CHECKSUM_AT)
    }

    /// Source address.
    pub fn src(&self) -> Ipv4Addr {
        let b = self.b();
        Ipv4Addr::new(b[12], b[13], b[14], b[15])
    }

    /// Destination address.
    pub fn dst(&self) -> Ipv4Addr {
        let b = self.b();
        Ipv4Addr::new(b[16], b[17], b[18], b[19])
    }

    /// Whether the header checksum (over the whole header, options included) is right.
    pub fn verify_checksum(&self) -> bool {
        checksum::fold(checksum::add(0, &self.b()[..self.header_len()])) == 0xffff
    }

    /// The payload: from the header's end to the total length.
    pub fn payload(&self) -> &[u8] {
        &self.b()[self.header_len()..usize::from(self.total_len())]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4<T> {
    fn m(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets version 4 and the IHL (low four bits of `ihl`).
    pub fn set_version_ihl(&mut self, ihl: u8) {
        self.m()[0] = 0x40 | (ihl & 0x0f);
    }

    /// Sets the TOS byte.
    pub fn set_tos(&mut self, v: u8) {
        self.m()[TOS_AT] = v;
    }

    /// Sets the total length.
    pub fn set_total_len(&mut self, v: u16) {
        put_u16(self.m(), 2, v);
    }

    /// Sets the identification.
    pub fn set_ident(&mut self, v: u16) {
        put_u16(self.m(), 4, v);
    }

    /// Sets the flags and fragment offset: DF as given, MF clear, offset 0.
    pub fn set_dont_frag(&mut self, v: bool) {
        put_u16(self.m(), 6, if v { 0x4000 } else { 0 });
    }

    /// Sets the TTL.
    pub fn set_ttl(&mut self, v: u8) {
        self.m()[TTL_AT] = v;
    }

    /// Sets the protocol.
    pub fn set_protocol(&mut self, v: u8) {
        self.m()[9] = v;
    }

    /// Sets the header checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        put_u16(self.m(), CHECKSUM_AT, v);
    }

    /// Sets the source address.
    pub fn set_src(&mut self, a: Ipv4Addr) {
        self.m()[12..16].copy_from_slice(&a.octets());
    }

    /// Sets the destination address.
    pub fn set_dst(&mut self, a: Ipv4Addr) {
        self.m()[16..20].copy_from_slice(&a.octets());
    }

    /// Computes and writes the header checksum.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let hl = self.header_len();
        let c = checksum::checksum(&self.b()[..hl]);
        self.set_checksum(c);
    }
}

/// A parsed IPv4 header of a RoCEv2 packet (protocol UDP, not fragmented; options, if
/// any, are not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Repr {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// TOS byte (DSCP and ECN; RoCE congestion control marks ECN here).
    pub tos: u8,
    /// Time to live.
    pub ttl: u8,
    /// Identification.
    pub ident: u16,
    /// Don't Fragment (rxe sets it).
    pub dont_frag: bool,
}

impl Ipv4Repr {
    /// Parses a checked view: [`Error::BadIpChecksum`], [`Error::Fragmented`],
    /// [`Error::NotUdp`].
    pub fn parse<T: AsRef<[u8]>>(v: &Ipv4<T>) -> Result<Ipv4Repr> {
        if !v.verify_checksum() {
            return Err(Error::BadIpChecksum);
        }
        if v.more_frags() || v.frag_offset() != 0 {
            return Err(Error::Fragmented);
        }
        if v.protocol() != checksum::PROTO_UDP {
            return Err(Error::NotUdp(v.protocol()));
        }
        Ok(Ipv4Repr {
            src: v.src(),
            dst: v.dst(),
            tos: v.tos(),
            ttl: v.ttl(),
            ident: v.ident(),
            dont_frag: v.dont_frag(),
        })
    }

    /// Writes a 20-byte header (no options, protocol UDP) for `payload_len` bytes of
    /// payload, with its checksum. The buffer must hold [`MIN_LEN`] bytes and the total
    /// must fit 16 bits (the caller checks both).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, v: &mut Ipv4<T>, payload_len: u16) {
        v.set_version_ihl(5);
        v.set_tos(self.tos);
        v.set_total_len(payload_len + MIN_LEN as u16);
        v.set_ident(self.ident);
        v.set_dont_frag(self.dont_frag);
        v.set_ttl(self.ttl);
        v.set_protocol(checksum::PROTO_UDP);
        v.set_src(self.src);
        v.set_dst(self.dst);
        v.fill_checksum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr() -> Ipv4Repr {
        Ipv4Repr {
            src: Ipv4Addr::new(192, 168, 0, 1),
            dst: Ipv4Addr::new(192, 168, 0, 199),
            tos: 0,
            ttl: 64,
            ident: 0,
            dont_frag: true,
        }
    }

    #[test]
    fn emits_the_known_header() {
        // Same header as checksum.rs's known example (total length 0x73): checksum b861.
        let mut b = [0u8; 0x73];
        repr().emit(&mut Ipv4::new_unchecked(&mut b[..]), 0x73 - 20);
        assert_eq!(
            &b[..20],
            &[
                0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
                0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7
            ]
        );
        let v = Ipv4::new_checked(&b[..]).unwrap();
        assert_eq!(Ipv4Repr::parse(&v), Ok(repr()));
        assert_eq!(v.payload().len(), 0x73 - 20);
    }

    #[test]
    fn honours_ihl() {
        // IHL 6: one word of options (NOPs), covered by the checksum.
        let mut b = [0u8; 32];
        repr().emit(&mut Ipv4::new_unchecked(&mut b[..]), 12);
        let mut v = Ipv4::new_unchecked(&mut b[..]);
        v.set_version_ihl(6);
        v.set_total_len(32);
        b[20..24].fill(1);
        Ipv4::new_unchecked(&mut b[..]).fill_checksum();
        let v = Ipv4::new_checked(&b[..]).unwrap();
        assert_eq!(v.header_len(), 24);
        assert_eq!(v.payload().len(), 8);
        assert_eq!(Ipv4Repr::parse(&v), Ok(repr()));
        // An option byte changed: the checksum covers it.
        b[21] = 2;
        assert_eq!(
            Ipv4Repr::parse(&Ipv4::new_checked(&b[..]).unwrap()),
            Err(Error::BadIpChecksum)
        );
    }

    #[test]
    fn refuses_bad_headers() {
        let mut b = [0u8; 40];
        repr().emit(&mut Ipv4::new_unchecked(&mut b[..]), 20);
        assert!(Ipv4::new_checked(&b[..]).is_ok());
        assert_eq!(
            Ipv4::new_checked(&b[..39]),
            Err(Error::Truncated {
                needed: 40,
                got: 39
            })
        );
        assert_eq!(
            Ipv4::new_checked(&b[..19]),
            Err(Error::Truncated {
                needed: 20,
                got: 19
            })
        );
        assert_eq!(
            Ipv4::new_checked(&[][..]),
            Err(Error::Truncated { needed: 1, got: 0 })
        );
        let mut c = b;
        c[0] = 0x65;
        assert_eq!(Ipv4::new_checked(&c[..]), Err(Error::BadIpVersion(6)));
        c[0] = 0x44;
        assert_eq!(Ipv4::new_checked(&c[..]), Err(Error::BadIhl(4)));
        c[0] = 0x4f;
        assert_eq!(
            Ipv4::new_checked(&c[..]),
            Err(Error::Truncated {
                needed: 60,
                got: 40
            })
        );
        let mut c = b;
        Ipv4::new_unchecked(&mut c[..]).set_total_len(19);
        assert_eq!(
            Ipv4::new_checked(&c[..]),
            Err(Error::BadIpLength {
                declared: 19,
                actual: 40
            })
        );
        let mut c = b;
        c[9] = 6;
        Ipv4::new_unchecked(&mut c[..]).fill_checksum();
        assert_eq!(
            Ipv4Repr::parse(&Ipv4::new_checked(&c[..]).unwrap()),
            Err(Error::NotUdp(6))
        );
        let mut c = b;
        c[6] |= 0x20;
        Ipv4::new_unchecked(&mut c[..]).fill_checksum();
        assert_eq!(
            Ipv4Repr::parse(&Ipv4::new_checked(&c[..]).unwrap()),
            Err(Error::Fragmented)
        );
        let mut c = b;
        c[TTL_AT] -= 1;
        assert_eq!(
            Ipv4Repr::parse(&Ipv4::new_checked(&c[..]).unwrap()),
            Err(Error::BadIpChecksum)
        );
    }
}
