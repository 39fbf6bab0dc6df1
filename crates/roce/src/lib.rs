//! # roce — the RoCEv2 wire format
//!
//! The bytes of RoCEv2 (IBTA vol. 1 and its Annex A17): the BTH opcode table, the base
//! and extension transport headers, the IPv4/IPv6 and UDP framing RoCEv2 rides in, and
//! the ICRC, with [Linux rxe](https://github.com/torvalds/linux/tree/master/drivers/infiniband/sw/rxe)
//! (`rxe_opcode.c`, `rxe_hdr.h`, `rxe_icrc.c`) as the reference. It is the foundation of
//! the software RNIC's RoCEv2 transport (issue 35). Wireshark's dissector (`tshark`) and
//! scapy's `contrib.roce` ICRC check the bytes independently (`tests/tools.rs`).
//!
//! Header views follow smoltcp's style: `View<T: AsRef<[u8]>>` with `new_checked`,
//! getters, and setters when `T: AsMut<[u8]>`; a `…Repr` with `parse(&view)` and
//! `emit(&self, &mut view)`. All fields are big-endian except the ICRC (little-endian,
//! see [`icrc`]). No `unsafe`; parsing never panics on any input (fuzzed).
//!
//! ## API in one screen
//! ```text
//! packet::parse(&[u8]) -> Result<(packet::Repr, Range<usize> /* payload */)>
//! packet::emit(&Repr, payload: &[u8], buf: &mut [u8]) -> Result<usize>   // checksums, pad, ICRC
//! packet::buffer_len(&Repr) -> usize      packet::pad_for(len) -> u8     packet::MAX_PAYLOAD (4096)
//! packet::Repr { ip: IpRepr, udp: UdpRepr { src_port }, bth: BthRepr, exts: ExtHeaders, payload_len }
//!   Repr::check() -> Result<()>          // what emit refuses, before writing anything
//! ip::IpRepr::{V4(Ipv4Repr { src, dst, tos, ttl, ident, dont_frag }),
//!              V6(Ipv6Repr { src, dst, traffic_class, flow_label, hop_limit })}
//! bth::BthRepr { opcode, solicited, mig_req, pad_count, pkey, fecn, becn, dest_qp, ack_req, psn }
//! opcode::Opcode::{new(Transport, Op) -> Option, from_byte(u8) -> Result, all(), byte(), info()}
//!   OpInfo { headers: &[Ext], payload, direction: Request|Response, position: First|Middle|Last|Only }
//! exts::ExtHeaders::{None, ImmDt, Ieth, Reth, RethImmDt, Aeth, AethAtomicAck, AtomicEth, Deth, DethImmDt}
//!   RethRepr { va, rkey, dma_len }   AethRepr { syndrome: Syndrome, msn }   DethRepr { qkey, src_qp }
//!   Syndrome::{Ack { credit }, RnrNak { timer }, Nak(NakCode)}   ImmDtRepr { imm }   IethRepr { rkey }
//!   AtomicEthRepr { va, rkey, swap_add, compare }   AtomicAckEthRepr { orig }
//! packet::parse_rebuilt(&[u8], IpRepr, UdpRepr)   packet::rebuild_headers(buf, &IpRepr, &UdpRepr, len)
//! icrc::compute(packet_without_icrc) -> Result<u32>   icrc::to_wire(u32) -> [u8; 4]
//! views: Ipv4, Ipv6, Udp, Bth, Reth, Aeth, AtomicEth, AtomicAckEth, ImmDt, Deth, Ieth
//! error::Error — one variant per refusal (Truncated, BadIpVersion, BadIhl, BadIpLength,
//!   BadIpChecksum, Fragmented, NotUdp, UdpLengthMismatch, WrongPort, BadUdpChecksum, BadIcrc,
//!   UnknownOpcode, UnsupportedTransport, BadTver, HeadersMissing, BadSyndrome, PadWithoutRoom,
//!   PayloadTooLong, UnexpectedPayload; emit: HeadersMismatch, PayloadLenMismatch,
//!   FieldOutOfRange, BufferTooSmall)
//! ```
//!
//! Carried: RC, UC and UD (RD, CNP and XRC opcodes are recognised and refused as
//! unsupported). IPv4 is emitted without options (parse honours IHL) and with a zero UDP
//! checksum, as rxe sends; IPv6 without extension headers and with a UDP checksum. No
//! Ethernet: the transport will send UDP datagrams through sockets, and the IP header
//! is here because the ICRC covers it.
//!
//! ## The transport
//!
//! PSNs, ACK/NAK, retransmission, segmentation and UDP I/O live in `rnic`'s RoCEv2
//! transport (`crates/rnic/src/wire/`), which builds packets with [`packet::emit`] and
//! checks received datagrams with [`packet::parse_rebuilt`] (the IP and UDP headers
//! rebuilt from what the socket reports, [`packet::rebuild_headers`]).
//!
//! ## Files, bottom first (`tests/layers.rs` checks each imports only files below it)
//! `error`, `field` (big-endian access), `checksum` (RFC 1071), `opcode`, `bth`, the
//! extension headers (`reth`, `aeth`, `atomic_eth`, `atomic_ack_eth`, `deth`, `immdt`,
//! `ieth`), `exts`, `ipv4`, `ipv6`, `ip`, `udp`, `icrc`, `packet`.

#![forbid(unsafe_code)]

pub mod aeth;
pub mod atomic_ack_eth;
pub mod atomic_eth;
pub mod bth;
pub mod checksum;
pub mod deth;
pub mod error;
pub mod exts;
pub mod field;
pub mod icrc;
pub mod ieth;
pub mod immdt;
pub mod ip;
pub mod ipv4;
pub mod ipv6;
pub mod opcode;
pub mod packet;
pub mod reth;
pub mod udp;

pub use error::{Error, Result};
pub use packet::{buffer_len, emit, parse, Repr};
