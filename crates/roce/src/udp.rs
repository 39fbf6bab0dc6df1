//! The UDP header of a RoCEv2 packet (destination port 4791): a view, its length check
//! against the IP payload, and its checksum (0 over IPv4 as rxe sends, computed over
//! IPv6; a nonzero one is verified on parse).

use crate::checksum;
use crate::error::{Error, Result};
use crate::field::{get_u16, put_u16};
use crate::ip::IpRepr;

/// Length of the UDP header.
pub const LEN: usize = 8;

/// RoCEv2's UDP destination port (IANA).
pub const ROCE_PORT: u16 = 4791;

/// Offset of the checksum, masked in the ICRC.
pub const CHECKSUM_AT: usize = 6;

/// A view of a UDP datagram (header and payload) at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Udp<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Udp<T> {
    /// The view, without checks.
    pub const fn new_unchecked(buffer: T) -> Udp<T> {
        Udp { buffer }
    }

    /// The view, or [`Error::Truncated`] if `buffer` is shorter than the header.
    pub fn new_checked(buffer: T) -> Result<Udp<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Udp { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 0)
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 2)
    }

    /// Length (header and payload).
    pub fn len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 4)
    }

    /// Whether the length field is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checksum (0: none).
    pub fn checksum(&self) -> u16 {
        get_u16(self.buffer.as_ref(), CHECKSUM_AT)
    }

    /// Whether the checksum over the whole buffer (the datagram) and `ip`'s pseudo-header
    /// is right; a zero checksum (none sent) is right.
    pub fn verify_checksum(&self, ip: &IpRepr) -> bool {
        let b = self.buffer.as_ref();
        self.checksum() == 0 || checksum::fold(checksum::add(ip.pseudo_sum(b.len()), b)) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Udp<T> {
    /// Sets the source port.
    pub fn set_src_port(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), 0, v);
    }

    /// Sets the destination port.
    pub fn set_dst_port(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), 2, v);
    }

    /// Sets the length.
    pub fn set_len(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), 4, v);
    }

    /// Sets the checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), CHECKSUM_AT, v);
    }

    /// Computes the checksum over the whole buffer (the datagram, payload written) and
    /// `ip`'s pseudo-header, and writes it (a computed 0 is sent as `0xffff`).
    pub fn fill_checksum(&mut self, ip: &IpRepr) {
        self.set_checksum(0);
        let b = self.buffer.as_ref();
        let c = !checksum::fold(checksum::add(ip.pseudo_sum(b.len()), b));
        self.set_checksum(if c == 0 { 0xffff } else { c });
    }
}

/// A parsed RoCEv2 UDP header (the destination port is always [`ROCE_PORT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpRepr {
    /// Source port (free; rxe hashes the QP numbers into it for ECMP).
    pub src_port: u16,
}

impl UdpRepr {
    /// Parses the datagram that is the whole view (the IP payload under `ip`):
    /// [`Error::UdpLengthMismatch`], [`Error::WrongPort`], [`Error::BadUdpChecksum`].
    pub fn parse<T: AsRef<[u8]>>(u: &Udp<T>, ip: &IpRepr) -> Result<UdpRepr> {
        let ip_len = u.buffer.as_ref().len();
        if usize::from(u.len()) != ip_len {
            return Err(Error::UdpLengthMismatch {
                udp: usize::from(u.len()),
                ip: ip_len,
            });
        }
        if u.dst_port() != ROCE_PORT {
            return Err(Error::WrongPort(u.dst_port()));
        }
        if !u.verify_checksum(ip) {
            return Err(Error::BadUdpChecksum);
        }
        Ok(UdpRepr {
            src_port: u.src_port(),
        })
    }

    /// Writes the header for a datagram of `len` bytes with a zero checksum (fill it with
    /// [`Udp::fill_checksum`] once the payload is written, for IPv6). The buffer must hold
    /// [`LEN`] bytes and `len` fit 16 bits (the caller checks both).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, u: &mut Udp<T>, len: u16) {
        u.set_src_port(self.src_port);
        u.set_dst_port(ROCE_PORT);
        u.set_len(len);
        u.set_checksum(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipv4::Ipv4Repr;
    use crate::ipv6::Ipv6Repr;
    use std::net::Ipv4Addr;

    fn v4() -> IpRepr {
        IpRepr::V4(Ipv4Repr {
            src: Ipv4Addr::new(192, 0, 2, 1),
            dst: Ipv4Addr::new(192, 0, 2, 2),
            tos: 0,
            ttl: 64,
            ident: 0,
            dont_frag: true,
        })
    }

    fn v6() -> IpRepr {
        IpRepr::V6(Ipv6Repr {
            src: "2001:db8::1".parse().unwrap(),
            dst: "2001:db8::2".parse().unwrap(),
            traffic_class: 0,
            flow_label: 0,
            hop_limit: 64,
        })
    }

    fn datagram(ip: &IpRepr, fill: bool) -> Vec<u8> {
        let mut b = vec![0u8; LEN + 5];
        b[LEN..].copy_from_slice(b"hello");
        UdpRepr { src_port: 0xc000 }.emit(&mut Udp::new_unchecked(&mut b[..]), 13);
        if fill {
            Udp::new_unchecked(&mut b[..]).fill_checksum(ip);
        }
        b
    }

    #[test]
    fn layout_and_checksums() {
        let b = datagram(&v4(), false);
        assert_eq!(&b[..8], &[0xc0, 0x00, 0x12, 0xb7, 0, 13, 0, 0]);
        let u = Udp::new_checked(&b[..]).unwrap();
        assert_eq!(UdpRepr::parse(&u, &v4()), Ok(UdpRepr { src_port: 0xc000 }));
        for ip in [v4(), v6()] {
            let mut b = datagram(&ip, true);
            assert_ne!(Udp::new_unchecked(&b[..]).checksum(), 0);
            assert_eq!(
                UdpRepr::parse(&Udp::new_checked(&b[..]).unwrap(), &ip),
                Ok(UdpRepr { src_port: 0xc000 })
            );
            b[LEN] ^= 1;
            assert_eq!(
                UdpRepr::parse(&Udp::new_checked(&b[..]).unwrap(), &ip),
                Err(Error::BadUdpChecksum)
            );
        }
    }

    #[test]
    fn checksum_matches_an_independent_sum() {
        // IPv4 pseudo-header + header + "hello", summed by hand as 16-bit words.
        let b = datagram(&v4(), true);
        let words: u32 = [0xc000, 0x0201, 0xc000, 0x0202, 17, 13].iter().sum::<u32>()
            + 0xc000
            + 4791
            + 13
            + 0x6865
            + 0x6c6c
            + 0x6f00;
        let folded = (words & 0xffff) + (words >> 16);
        let want = !(folded as u16);
        assert_eq!(Udp::new_unchecked(&b[..]).checksum(), want);
    }

    #[test]
    fn refuses_length_and_port() {
        let mut b = datagram(&v4(), false);
        assert_eq!(
            UdpRepr::parse(&Udp::new_checked(&b[..12]).unwrap(), &v4()),
            Err(Error::UdpLengthMismatch { udp: 13, ip: 12 })
        );
        Udp::new_unchecked(&mut b[..]).set_dst_port(4792);
        assert_eq!(
            UdpRepr::parse(&Udp::new_checked(&b[..]).unwrap(), &v4()),
            Err(Error::WrongPort(4792))
        );
        assert_eq!(
            Udp::new_checked(&b[..7]),
            Err(Error::Truncated { needed: 8, got: 7 })
        );
    }
}
