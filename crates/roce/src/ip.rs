//! The IP layer of a RoCEv2 packet, either version: which header a buffer starts with,
//! its exact length, and the UDP pseudo-header sum.

use std::ops::Range;

use crate::checksum;
use crate::error::{Error, Result};
use crate::ipv4::{self, Ipv4, Ipv4Repr};
use crate::ipv6::{self, Ipv6, Ipv6Repr};

/// The IP header of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpRepr {
    /// IPv4 (emitted without options).
    V4(Ipv4Repr),
    /// IPv6 (no extension headers).
    V6(Ipv6Repr),
}

impl IpRepr {
    /// Length of the header [`emit`](Self::emit) writes.
    pub fn header_len(&self) -> usize {
        match self {
            IpRepr::V4(_) => ipv4::MIN_LEN,
            IpRepr::V6(_) => ipv6::LEN,
        }
    }

    /// [`Error::FieldOutOfRange`] if a field does not fit its width.
    pub fn check(&self) -> Result<()> {
        match self {
            IpRepr::V4(_) => Ok(()),
            IpRepr::V6(r) => r.check(),
        }
    }

    /// Parses the IP packet that is all of `buf`, and gives the range of its payload.
    /// Besides the errors of [`Ipv4::new_checked`], [`Ipv4Repr::parse`],
    /// [`Ipv6::new_checked`] and [`Ipv6Repr::parse`]: [`Error::BadIpLength`] if `buf` is
    /// longer than the IP length says.
    pub fn parse(buf: &[u8]) -> Result<(IpRepr, Range<usize>)> {
        let Some(&first) = buf.first() else {
            return Err(Error::Truncated { needed: 1, got: 0 });
        };
        let (repr, hl, total) = match first >> 4 {
            4 => {
                let v = Ipv4::new_checked(buf)?;
                let r = Ipv4Repr::parse(&v)?;
                (IpRepr::V4(r), v.header_len(), usize::from(v.total_len()))
            }
            6 => {
                let v = Ipv6::new_checked(buf)?;
                let r = Ipv6Repr::parse(&v)?;
                (IpRepr::V6(r), ipv6::LEN, v.total_len())
            }
            other => return Err(Error::BadIpVersion(other)),
        };
        if buf.len() != total {
            return Err(Error::BadIpLength {
                declared: total,
                actual: buf.len(),
            });
        }
        Ok((repr, hl..total))
    }

    /// Writes the header at the start of `buf` for `payload_len` bytes of payload:
    /// [`Error::BufferTooSmall`] if `buf` cannot hold the header,
    /// [`Error::FieldOutOfRange`] if the length does not fit the IP length field.
    pub fn emit(&self, buf: &mut [u8], payload_len: usize) -> Result<()> {
        let needed = self.header_len();
        if buf.len() < needed {
            return Err(Error::BufferTooSmall {
                needed,
                got: buf.len(),
            });
        }
        // The IP length field: IPv4's total length counts the header, IPv6's payload
        // length does not.
        let field = match self {
            IpRepr::V4(_) => payload_len + ipv4::MIN_LEN,
            IpRepr::V6(_) => payload_len,
        };
        if u16::try_from(field).is_err() {
            return Err(Error::FieldOutOfRange("IP length"));
        }
        let payload_len = payload_len as u16;
        match self {
            IpRepr::V4(r) => r.emit(&mut Ipv4::new_unchecked(buf), payload_len),
            IpRepr::V6(r) => r.emit(&mut Ipv6::new_unchecked(buf), payload_len),
        }
        Ok(())
    }

    /// The unfolded sum of the UDP pseudo-header for a datagram of `udp_len` bytes.
    pub fn pseudo_sum(&self, udp_len: usize) -> u64 {
        match self {
            IpRepr::V4(r) => checksum::pseudo_v4(r.src, r.dst, udp_len as u16),
            IpRepr::V6(r) => checksum::pseudo_v6(r.src, r.dst, udp_len as u32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn v4() -> IpRepr {
        IpRepr::V4(Ipv4Repr {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            tos: 2,
            ttl: 64,
            ident: 7,
            dont_frag: true,
        })
    }

    fn v6() -> IpRepr {
        IpRepr::V6(Ipv6Repr {
            src: "::ffff:10.0.0.1".parse().unwrap(),
            dst: "::ffff:10.0.0.2".parse().unwrap(),
            traffic_class: 0,
            flow_label: 1,
            hop_limit: 255,
        })
    }

    #[test]
    fn both_versions_round_trip_with_exact_length() {
        for ip in [v4(), v6()] {
            let hl = ip.header_len();
            let mut b = vec![0u8; hl + 10];
            ip.emit(&mut b, 10).unwrap();
            assert_eq!(IpRepr::parse(&b), Ok((ip, hl..hl + 10)));
            b.push(0);
            assert_eq!(
                IpRepr::parse(&b),
                Err(Error::BadIpLength {
                    declared: hl + 10,
                    actual: hl + 11
                })
            );
            b.truncate(hl + 9);
            assert_eq!(
                IpRepr::parse(&b),
                Err(Error::Truncated {
                    needed: hl + 10,
                    got: hl + 9
                })
            );
            assert!(matches!(
                ip.emit(&mut b[..hl - 1], 0),
                Err(Error::BufferTooSmall { .. })
            ));
            assert_eq!(
                ip.emit(&mut b, 70_000),
                Err(Error::FieldOutOfRange("IP length"))
            );
        }
        assert_eq!(IpRepr::parse(&[0x50; 40]), Err(Error::BadIpVersion(5)));
        assert_eq!(
            IpRepr::parse(&[]),
            Err(Error::Truncated { needed: 1, got: 0 })
        );
    }
}
