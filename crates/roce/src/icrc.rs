//! The RoCEv2 Invariant CRC (IBTA vol. 1 Annex A17.3.3, Linux `rxe_icrc.c`, scapy's
//! `contrib/roce.py`): what it covers, which fields it masks, and its byte order.
//!
//! The ICRC is the Ethernet/zlib CRC32 (reflected polynomial `0xedb88320`, initial value
//! and final XOR all ones, as `crc32fast`) over
//!
//! 1. eight bytes of `0xff`, standing in for the masked LRH of native InfiniBand;
//! 2. the IP header with its variant fields set to all ones — IPv4: TOS (byte 1), TTL
//!    (byte 8) and header checksum (bytes 10–11); IPv6: traffic class and flow label
//!    (the low nibble of byte 0 and bytes 1–3; the version nibble is kept) and hop limit
//!    (byte 7). IPv4 options, if any, are covered as they are;
//! 3. the UDP header with its checksum (bytes 6–7) set to all ones;
//! 4. the BTH with byte 4 (FECN, BECN and the six reserved bits) set to all ones;
//! 5. everything after the BTH up to the ICRC: extension headers, payload and pad.
//!
//! The IP and UDP length fields are covered unmasked, and count the ICRC's four bytes.
//! The CRC's value is appended **little-endian** (its least significant byte first):
//! rxe stores `~crc32_le(..)` as a native `u32` on a little-endian host, and scapy packs
//! it with `struct.pack("!I", icrc)[::-1]`. rxe starts `crc32_le` from `0xdebb20e3`, the
//! raw CRC state after `0xffffffff` and the eight `0xff` bytes ([`RXE_SEED`]; a test
//! below proves it is the same as hashing the eight bytes here).

use crate::bth;
use crate::error::{Error, Result};
use crate::ipv4;
use crate::ipv6;
use crate::udp;

/// Length of the ICRC.
pub const LEN: usize = 4;

/// rxe's starting CRC state (`rxe_icrc.c`): the raw (uncomplemented) CRC32 state after
/// the initial `0xffffffff` and the eight `0xff` bytes of the masked LRH.
pub const RXE_SEED: u32 = 0xdebb_20e3;

/// The largest IP header (IPv4 with 40 bytes of options).
const MAX_IP_HEADER: usize = 60;

/// The ICRC of `pkt`: an IP packet from its first byte through its pad, without the
/// ICRC itself (so the packet's last four bytes are excluded by the caller).
/// [`Error::Truncated`] if `pkt` does not hold the IP, UDP and BTH headers,
/// [`Error::BadIpVersion`] / [`Error::BadIhl`] if the IP header length is unknown.
pub fn compute(pkt: &[u8]) -> Result<u32> {
    let Some(&first) = pkt.first() else {
        return Err(Error::Truncated { needed: 1, got: 0 });
    };
    let ip_len = match first >> 4 {
        4 if first & 0x0f >= 5 => usize::from(first & 0x0f) * 4,
        4 => return Err(Error::BadIhl(first & 0x0f)),
        6 => ipv6::LEN,
        v => return Err(Error::BadIpVersion(v)),
    };
    let n = ip_len + udp::LEN + bth::LEN;
    if pkt.len() < n {
        return Err(Error::Truncated {
            needed: n,
            got: pkt.len(),
        });
    }
    let mut hdr = [0u8; MAX_IP_HEADER + udp::LEN + bth::LEN];
    let hdr = &mut hdr[..n];
    hdr.copy_from_slice(&pkt[..n]);
    if first >> 4 == 4 {
        hdr[ipv4::TOS_AT] = 0xff;
        hdr[ipv4::TTL_AT] = 0xff;
        hdr[ipv4::CHECKSUM_AT..ipv4::CHECKSUM_AT + 2].fill(0xff);
    } else {
        hdr[0] |= 0x0f;
        hdr[1..4].fill(0xff);
        hdr[ipv6::HOP_LIMIT_AT] = 0xff;
    }
    let udp_cksum = ip_len + udp::CHECKSUM_AT;
    hdr[udp_cksum..udp_cksum + 2].fill(0xff);
    hdr[ip_len + udp::LEN + 4] = 0xff;

    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    h.update(hdr);
    h.update(&pkt[n..]);
    Ok(h.finalize())
}

/// The ICRC's four wire bytes (little-endian).
pub fn to_wire(icrc: u32) -> [u8; LEN] {
    icrc.to_le_bytes()
}

/// The ICRC carried by the four wire bytes `b`.
pub fn from_wire(b: [u8; LEN]) -> u32 {
    u32::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-at-a-time CRC32 register update of `crc32_le` (no complement in or out),
    /// written from the polynomial: an independent check of `crc32fast`'s convention.
    fn crc32_le(mut crc: u32, data: &[u8]) -> u32 {
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xedb8_8320
                } else {
                    crc >> 1
                };
            }
        }
        crc
    }

    #[test]
    fn rxe_seed_is_eight_ff_bytes() {
        assert_eq!(crc32_le(0xffff_ffff, &[0xff; 8]), RXE_SEED);
        // And crc32fast continuing from it is rxe's `~crc32_le(seed, rest)`.
        let rest = b"any bytes at all";
        let mut h = crc32fast::Hasher::new_with_initial(!RXE_SEED);
        h.update(rest);
        assert_eq!(h.finalize(), !crc32_le(RXE_SEED, rest));
    }

    /// A hand-built IPv4 RoCEv2 RC SEND_ONLY: IP 20, UDP 8, BTH 12, payload 4.
    fn v4_packet() -> Vec<u8> {
        let p = vec![
            0x45, 0x02, 0x00, 0x30, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 10, 0, 0, 1,
            10, 0, 0, 2, // IPv4
            0xc0, 0x00, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, // UDP
            0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x00, 0x05, // BTH
            1, 2, 3, 4, // payload
        ];
        assert_eq!(p.len(), 0x30 - 4);
        p
    }

    #[test]
    fn masks_exactly_the_variant_fields() {
        let p = v4_packet();
        let base = compute(&p).unwrap();
        // The same CRC by hand: masked copy, through the bitwise CRC.
        let mut m = p.clone();
        m[1] = 0xff;
        m[8] = 0xff;
        m[10] = 0xff;
        m[11] = 0xff;
        m[26] = 0xff;
        m[27] = 0xff;
        m[32] = 0xff;
        let mut all = vec![0xffu8; 8];
        all.extend_from_slice(&m);
        assert_eq!(base, !crc32_le(!0, &all));
        // Every masked byte may change; every other byte changes the ICRC.
        let masked = [1usize, 8, 10, 11, 26, 27, 32];
        for i in 0..p.len() {
            let mut q = p.clone();
            q[i] ^= 0x01;
            // (Byte 0's flip makes IHL 4: an error, which is a change too.)
            let changed = compute(&q) != Ok(base);
            assert_eq!(changed, !masked.contains(&i), "byte {i}");
        }
    }

    #[test]
    fn ipv6_masks_class_flow_and_hop_limit() {
        let mut p = vec![0u8; 40 + 8 + 12];
        p[0] = 0x60;
        p[5] = 20; // payload length (no ICRC here: not checked by compute)
        p[6] = 17;
        p[7] = 64;
        let base = compute(&p).unwrap();
        let masked = [0usize, 1, 2, 3, 7, 46, 47, 52];
        for i in 0..p.len() {
            for bit in 0..8 {
                if i == 0 && bit >= 4 {
                    continue; // the version nibble decides the layout itself
                }
                let mut q = p.clone();
                q[i] ^= 1 << bit;
                let changed = compute(&q).unwrap() != base;
                assert_eq!(changed, !masked.contains(&i), "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn wire_order_is_little_endian() {
        assert_eq!(to_wire(0x1122_3344), [0x44, 0x33, 0x22, 0x11]);
        assert_eq!(from_wire([0x44, 0x33, 0x22, 0x11]), 0x1122_3344);
    }

    #[test]
    fn refuses_what_it_cannot_place() {
        let p = v4_packet();
        assert_eq!(
            compute(&p[..39]),
            Err(Error::Truncated {
                needed: 40,
                got: 39
            })
        );
        let mut q = p.clone();
        q[0] = 0x44;
        assert_eq!(compute(&q), Err(Error::BadIhl(4)));
        q[0] = 0x75;
        assert_eq!(compute(&q), Err(Error::BadIpVersion(7)));
        assert_eq!(compute(&[]), Err(Error::Truncated { needed: 1, got: 0 }));
    }
}
