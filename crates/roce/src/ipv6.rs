//! The IPv6 header of a RoCEv2 packet: the fixed 40-byte header, next header UDP (no
//! extension headers), as a view and a representation.

use std::net::Ipv6Addr;

use crate::checksum;
use crate::error::{Error, Result};
use crate::field::{get_u16, get_u32, put_u16, put_u32};

/// Length of the fixed header.
pub const LEN: usize = 40;

/// Offset of the hop limit, masked in the ICRC (with traffic class and flow label, bytes
/// 0..4 but the version nibble).
pub const HOP_LIMIT_AT: usize = 7;

/// The largest flow label (20 bits).
pub const MAX_FLOW_LABEL: u32 = 0x000f_ffff;

/// A view of an IPv6 packet at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv6<T> {
    /// The view, without checks.
    pub const fn new_unchecked(buffer: T) -> Ipv6<T> {
        Ipv6 { buffer }
    }

    /// The view, after checking the version is 6 ([`Error::BadIpVersion`]) and the header
    /// and payload length fit in `buffer` ([`Error::Truncated`]). Bytes after the payload
    /// are allowed here (the caller decides).
    pub fn new_checked(buffer: T) -> Result<Ipv6<T>> {
        let b = buffer.as_ref();
        let got = b.len();
        let Some(&first) = b.first() else {
            return Err(Error::Truncated { needed: 1, got });
        };
        if first >> 4 != 6 {
            return Err(Error::BadIpVersion(first >> 4));
        }
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        let v = Ipv6 { buffer };
        let total = v.total_len();
        if got < total {
            return Err(Error::Truncated { needed: total, got });
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

    /// IP version (6).
    pub fn version(&self) -> u8 {
        self.b()[0] >> 4
    }

    /// Traffic class (DSCP and ECN).
    pub fn traffic_class(&self) -> u8 {
        ((get_u16(self.b(), 0) >> 4) & 0xff) as u8
    }

    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        get_u32(self.b(), 0) & MAX_FLOW_LABEL
    }

    /// Payload length.
    pub fn payload_len(&self) -> u16 {
        get_u16(self.b(), 4)
    }

    /// Header and payload length.
    pub fn total_len(&self) -> usize {
        LEN + usize::from(self.payload_len())
    }

    /// Next header.
    pub fn next_header(&self) -> u8 {
        self.b()[6]
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.b()[HOP_LIMIT_AT]
    }

    /// Source address.
    pub fn src(&self) -> Ipv6Addr {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.b()[8..24]);
        Ipv6Addr::from(a)
    }

    /// Destination address.
    pub fn dst(&self) -> Ipv6Addr {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.b()[24..40]);
        Ipv6Addr::from(a)
    }

    /// The payload (payload length bytes after the header).
    pub fn payload(&self) -> &[u8] {
        &self.b()[LEN..self.total_len()]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6<T> {
    fn m(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets version 6, the traffic class and the flow label (low 20 bits).
    pub fn set_version_class_flow(&mut self, class: u8, flow: u32) {
        let w = (6 << 28) | (u32::from(class) << 20) | (flow & MAX_FLOW_LABEL);
        put_u32(self.m(), 0, w);
    }

    /// Sets the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        put_u16(self.m(), 4, v);
    }

    /// Sets the next header.
    pub fn set_next_header(&mut self, v: u8) {
        self.m()[6] = v;
    }

    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.m()[HOP_LIMIT_AT] = v;
    }

    /// Sets the source address.
    pub fn set_src(&mut self, a: Ipv6Addr) {
        self.m()[8..24].copy_from_slice(&a.octets());
    }

    /// Sets the destination address.
    pub fn set_dst(&mut self, a: Ipv6Addr) {
        self.m()[24..40].copy_from_slice(&a.octets());
    }
}

/// A parsed IPv6 header of a RoCEv2 packet (next header UDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Repr {
    /// Source address.
    pub src: Ipv6Addr,
    /// Destination address.
    pub dst: Ipv6Addr,
    /// Traffic class (DSCP and ECN).
    pub traffic_class: u8,
    /// Flow label, 20 bits.
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
}

impl Ipv6Repr {
    /// Parses a checked view: [`Error::NotUdp`] if the next header is not UDP (extension
    /// headers are not accepted).
    pub fn parse<T: AsRef<[u8]>>(v: &Ipv6<T>) -> Result<Ipv6Repr> {
        if v.next_header() != checksum::PROTO_UDP {
            return Err(Error::NotUdp(v.next_header()));
        }
        Ok(Ipv6Repr {
            src: v.src(),
            dst: v.dst(),
            traffic_class: v.traffic_class(),
            flow_label: v.flow_label(),
            hop_limit: v.hop_limit(),
        })
    }

    /// [`Error::FieldOutOfRange`] if the flow label exceeds 20 bits.
    pub fn check(&self) -> Result<()> {
        if self.flow_label > MAX_FLOW_LABEL {
            return Err(Error::FieldOutOfRange("IPv6 flow label"));
        }
        Ok(())
    }

    /// Writes the header for `payload_len` bytes of payload (the buffer must hold
    /// [`LEN`] bytes).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, v: &mut Ipv6<T>, payload_len: u16) {
        v.set_version_class_flow(self.traffic_class, self.flow_label);
        v.set_payload_len(payload_len);
        v.set_next_header(checksum::PROTO_UDP);
        v.set_hop_limit(self.hop_limit);
        v.set_src(self.src);
        v.set_dst(self.dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr() -> Ipv6Repr {
        Ipv6Repr {
            src: "fe80::1".parse().unwrap(),
            dst: "2001:db8::2".parse().unwrap(),
            traffic_class: 0xab,
            flow_label: 0xc_def0,
            hop_limit: 64,
        }
    }

    #[test]
    fn layout_and_round_trip() {
        let mut b = [0u8; LEN + 8];
        repr().emit(&mut Ipv6::new_unchecked(&mut b[..]), 8);
        assert_eq!(&b[..8], &[0x6a, 0xbc, 0xde, 0xf0, 0, 8, 17, 64]);
        assert_eq!(&b[8..10], &[0xfe, 0x80]);
        assert_eq!(b[23], 1);
        assert_eq!(&b[24..26], &[0x20, 0x01]);
        let v = Ipv6::new_checked(&b[..]).unwrap();
        assert_eq!(Ipv6Repr::parse(&v), Ok(repr()));
        assert_eq!(v.payload().len(), 8);
    }

    #[test]
    fn refuses_bad_headers() {
        let mut b = [0u8; LEN + 8];
        repr().emit(&mut Ipv6::new_unchecked(&mut b[..]), 8);
        assert_eq!(
            Ipv6::new_checked(&b[..LEN + 7]),
            Err(Error::Truncated {
                needed: 48,
                got: 47
            })
        );
        assert_eq!(
            Ipv6::new_checked(&b[..39]),
            Err(Error::Truncated {
                needed: 40,
                got: 39
            })
        );
        let mut c = b;
        c[0] = 0x4a;
        assert_eq!(Ipv6::new_checked(&c[..]), Err(Error::BadIpVersion(4)));
        let mut c = b;
        c[6] = 0; // hop-by-hop options
        assert_eq!(
            Ipv6Repr::parse(&Ipv6::new_checked(&c[..]).unwrap()),
            Err(Error::NotUdp(0))
        );
        let mut r = repr();
        r.flow_label = MAX_FLOW_LABEL + 1;
        assert!(r.check().is_err());
    }
}
