//! What both ends of a RoCEv2 connection use: 24-bit PSN arithmetic, the path (our
//! address and UDP source port, the peer's address, the path MTU), the identity of a
//! peer across the network (the nonce standing for a GID pair), the transport's
//! counters, and packet building through the `roce` crate's representations.

use crate::wire::inject::Injector;
use crate::wire::socket::{route_mtu, TxSocket, ROCE_PORT};
use parking_lot::Mutex;
use roce::aeth::{AethRepr, Syndrome};
use roce::bth::BthRepr;
use roce::exts::ExtHeaders;
use roce::ip::IpRepr;
use roce::ipv4::Ipv4Repr;
use roce::ipv6::Ipv6Repr;
use roce::opcode::{Op, Opcode, Transport};
use roce::udp::UdpRepr;
use std::net::{Ipv6Addr, SocketAddrV6};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// PSNs are 24 bits.
pub const PSN_MASK: u32 = 0x00ff_ffff;

/// `p + n` modulo 2^24.
pub fn psn_add(p: u32, n: u32) -> u32 {
    p.wrapping_add(n) & PSN_MASK
}

/// `p - q` as a signed distance in the 24-bit PSN space (half the space each way).
pub fn psn_diff(p: u32, q: u32) -> i32 {
    ((p.wrapping_sub(q) << 8) as i32) >> 8
}

/// The nonce standing for the peer at `remote` as seen from our address `local`
/// (both GIDs): the `peer_nonce` of a QP connected across the network, and the
/// `src_nonce` its requests carry into our rings (computed from each packet's
/// addresses, so a packet from elsewhere does not match). Top bit set: never a
/// host's own nonce pattern collision in practice (those are random 64-bit).
pub fn wire_nonce(local: &[u8; 16], remote: &[u8; 16]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in local.iter().chain(remote.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h | 1 << 63
}

/// The path of a connection.
pub struct Path {
    /// Our send socket (bound to the QP's source GID and UDP port).
    pub sock: TxSocket,
    /// The peer (its GID's address, port 4791).
    pub remote: SocketAddrV6,
    /// Path MTU in bytes (256..=4096).
    pub mtu: usize,
    /// The test-only fault injector, if `NPRDMA_WIRE_FAULTS` is set.
    pub inject: Option<Arc<Mutex<Injector>>>,
}

impl Path {
    /// Open the send socket of a QP: source `local` GID, UDP source port derived from
    /// the QP number (rxe's flow entropy range 0xc000..), peer `remote` GID.
    pub fn open(
        local: Ipv6Addr,
        remote: Ipv6Addr,
        qpn: u32,
        mtu: u32,
        inject: Option<Arc<Mutex<Injector>>>,
    ) -> std::io::Result<Path> {
        let sport = 0xc000 | (qpn.wrapping_mul(0x9e37_79b9) >> 18) as u16 & 0x3fff;
        let sock = TxSocket::bind(SocketAddrV6::new(local, sport, 0, 0))?;
        let remote = SocketAddrV6::new(remote, ROCE_PORT, 0, 0);
        let mut mtu = (mtu as usize).clamp(256, 4096);
        if let Some(link) = route_mtu(&sock.local, &remote) {
            // The IB MTU the link carries whole (no IP fragments: the DF bit is set):
            // IP, UDP, BTH, the largest extension headers (RETH + ImmDt) and the ICRC.
            let room = link.saturating_sub(ip_repr(&local, remote.ip()).header_len() + 8 + 12 + 20 + 4);
            while mtu > 256 && mtu > room {
                mtu /= 2;
            }
        }
        Ok(Path {
            sock,
            remote,
            mtu,
            inject,
        })
    }

    /// The IP header this path's packets carry (IPv4 for IPv4-mapped addresses,
    /// identification 0 and don't-fragment as the kernel sends them).
    pub fn ip(&self) -> IpRepr {
        ip_repr(self.sock.local.ip(), self.remote.ip())
    }

    /// Send `pkts` (UDP payloads) to the peer, through the fault injector if one is on.
    pub fn send(&self, pkts: Vec<Vec<u8>>) {
        let pkts = match &self.inject {
            Some(i) => i.lock().apply(pkts),
            None => pkts,
        };
        let v: Vec<&[u8]> = pkts.iter().map(|p| p.as_slice()).collect();
        self.sock.send(&self.remote, &v);
    }
}

/// The IP representation between `src` and `dst` (as GIDs).
pub fn ip_repr(src: &Ipv6Addr, dst: &Ipv6Addr) -> IpRepr {
    match (src.to_ipv4_mapped(), dst.to_ipv4_mapped()) {
        (Some(s), Some(d)) => IpRepr::V4(Ipv4Repr {
            src: s,
            dst: d,
            tos: 0,
            ttl: 64,
            ident: 0,
            dont_frag: true,
        }),
        _ => IpRepr::V6(Ipv6Repr {
            src: *src,
            dst: *dst,
            traffic_class: 0,
            flow_label: 0,
            hop_limit: 64,
        }),
    }
}

/// The RC opcode `op`.
pub fn rc(op: Op) -> Opcode {
    Opcode::new(Transport::Rc, op).expect("every RC op has an opcode")
}

/// Whether `op` is one of the RC READ response opcodes.
pub fn is_read_response(op: Opcode) -> bool {
    [
        Op::RdmaReadResponseFirst,
        Op::RdmaReadResponseMiddle,
        Op::RdmaReadResponseLast,
        Op::RdmaReadResponseOnly,
    ]
    .iter()
    .any(|&o| rc(o) == op)
}

/// A BTH for `dest_qp` at `psn`.
pub fn bth(opcode: Opcode, dest_qp: u32, psn: u32, ack_req: bool, solicited: bool, payload_len: usize) -> BthRepr {
    BthRepr {
        opcode,
        solicited,
        mig_req: true,
        pad_count: roce::packet::pad_for(payload_len),
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qp: dest_qp & PSN_MASK,
        ack_req,
        psn: psn & PSN_MASK,
    }
}

/// Build one packet and return its UDP payload (BTH through ICRC).
pub fn build(path: &Path, bth: BthRepr, exts: ExtHeaders, payload: &[u8]) -> Vec<u8> {
    let repr = roce::packet::Repr {
        ip: path.ip(),
        udp: UdpRepr {
            src_port: path.sock.local.port(),
        },
        bth,
        exts,
        payload_len: payload.len(),
    };
    let mut buf = vec![0u8; roce::packet::buffer_len(&repr)];
    match roce::packet::emit(&repr, payload, &mut buf) {
        Ok(_) => buf.split_off(roce::packet::rebuilt_len(&repr.ip)),
        Err(e) => {
            // Every field is built in range above; a refusal is a bug, not the peer's.
            tracing::error!("RoCE packet refused by emit: {e}");
            Vec::new()
        }
    }
}

/// An ACKNOWLEDGE carrying `syndrome` for `psn`.
pub fn ack(path: &Path, dest_qp: u32, psn: u32, syndrome: Syndrome, msn: u32) -> Vec<u8> {
    build(
        path,
        bth(rc(Op::Acknowledge), dest_qp, psn, false, false, 0),
        ExtHeaders::Aeth(AethRepr {
            syndrome,
            msn: msn & PSN_MASK,
        }),
        &[],
    )
}

/// The transport's counters (one set per host).
#[derive(Default)]
pub struct Counters {
    pub tx_packets: AtomicU64,
    pub rx_packets: AtomicU64,
    pub retransmissions: AtomicU64,
    pub timeouts: AtomicU64,
    pub naks_sent: AtomicU64,
    pub naks_received: AtomicU64,
    pub duplicates: AtomicU64,
    /// Dropped: failed the ICRC or the packet checks.
    pub bad_packets: AtomicU64,
    /// Dropped: for a QP that is not connected across the network, or from another address.
    pub stray_packets: AtomicU64,
    /// Dropped: out of sequence (after the one NAK).
    pub out_of_sequence: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_wraps() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_diff(0, PSN_MASK), 1);
        assert_eq!(psn_diff(PSN_MASK, 0), -1);
        assert_eq!(psn_diff(5, 3), 2);
        assert_eq!(psn_diff(3, 5), -2);
    }

    #[test]
    fn nonce_depends_on_both_ends() {
        let a = [1u8; 16];
        let b = [2u8; 16];
        assert_ne!(wire_nonce(&a, &b), wire_nonce(&b, &a));
        assert_eq!(wire_nonce(&a, &b), wire_nonce(&a, &b));
        assert!(wire_nonce(&a, &b) >> 63 == 1);
    }
}
