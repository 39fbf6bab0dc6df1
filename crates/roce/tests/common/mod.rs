//! Test-only helpers shared by the integration tests: a classic pcap writer.

use std::io::{self, Write};

/// LINKTYPE_RAW: each record is one IPv4 or IPv6 packet, no link header (Wireshark and
/// scapy both read it; RoCEv2 needs no Ethernet header to be dissected).
pub const LINKTYPE_RAW: u32 = 101;

/// Writes `packets` as a classic (microsecond, little-endian) pcap file of link type
/// [`LINKTYPE_RAW`], one record per packet, 1 ms apart.
pub fn write_pcap(w: &mut impl Write, packets: &[Vec<u8>]) -> io::Result<()> {
    w.write_all(&0xa1b2_c3d4u32.to_le_bytes())?;
    w.write_all(&2u16.to_le_bytes())?;
    w.write_all(&4u16.to_le_bytes())?;
    w.write_all(&0i32.to_le_bytes())?; // thiszone
    w.write_all(&0u32.to_le_bytes())?; // sigfigs
    w.write_all(&65_535u32.to_le_bytes())?; // snaplen
    w.write_all(&LINKTYPE_RAW.to_le_bytes())?;
    for (i, p) in packets.iter().enumerate() {
        let len = u32::try_from(p.len()).expect("packet fits a pcap record");
        let usec = 1_000 * i as u64;
        w.write_all(&(1_700_000_000 + (usec / 1_000_000) as u32).to_le_bytes())?;
        w.write_all(&((usec % 1_000_000) as u32).to_le_bytes())?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(p)?;
    }
    Ok(())
}
