//! The Internet checksum (RFC 1071): the ones'-complement sum the IPv4 header and UDP
//! checksums use, and the IPv4/IPv6 pseudo-headers of the UDP checksum.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// Adds `data` (big-endian 16-bit words, an odd last byte padded with zero) to the
/// unfolded ones'-complement sum `acc`.
pub fn add(acc: u64, data: &[u8]) -> u64 {
    let mut acc = acc;
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        acc += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// `acc` folded to 16 bits (end-around carry), not complemented.
pub fn fold(acc: u64) -> u16 {
    let mut s = acc;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The checksum field value for `data` (whose checksum field is zero): the complement of
/// the folded sum. Verifying: the folded sum over data *with* its checksum is `0xffff`.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(add(0, data))
}

/// The unfolded sum of the IPv4 pseudo-header of a UDP datagram of `udp_len` bytes.
pub fn pseudo_v4(src: Ipv4Addr, dst: Ipv4Addr, udp_len: u16) -> u64 {
    let acc = add(0, &src.octets());
    let acc = add(acc, &dst.octets());
    acc + u64::from(PROTO_UDP) + u64::from(udp_len)
}

/// The unfolded sum of the IPv6 pseudo-header (RFC 8200 §8.1) of a UDP datagram of
/// `udp_len` bytes.
pub fn pseudo_v6(src: Ipv6Addr, dst: Ipv6Addr, udp_len: u32) -> u64 {
    let acc = add(0, &src.octets());
    let acc = add(acc, &dst.octets());
    acc + u64::from(udp_len >> 16) + u64::from(udp_len & 0xffff) + u64::from(PROTO_UDP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3: the words 0001 f203 f4f5 f6f7 sum to ddf2 (folded).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(add(0, &data)), 0xddf2);
        assert_eq!(checksum(&data), !0xddf2);
    }

    #[test]
    fn known_ipv4_header() {
        // A well-known example header (Wikipedia "IPv4 header checksum"): checksum b861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&h), 0xb861);
        h[10] = 0xb8;
        h[11] = 0x61;
        assert_eq!(fold(add(0, &h)), 0xffff);
    }

    #[test]
    fn odd_length_pads_with_zero() {
        assert_eq!(fold(add(0, &[0x12, 0x34, 0x56])), 0x1234 + 0x5600);
    }
}
