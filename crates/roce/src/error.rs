//! The crate's error type: one variant for each way a packet is refused on parse or emit.

use thiserror::Error;

/// Why a packet (or a header) could not be parsed, or a [`Repr`](crate::packet::Repr)
/// could not be emitted.
///
/// Parse errors are listed in the order `packet::parse` checks them (a [`Error::Truncated`]
/// can come from each header in turn); the emit-only ones come last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Error {
    /// The buffer ends before a header (or the length a header declares) does.
    #[error("buffer truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the header (or declared length) needs.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// The IP version nibble is neither 4 nor 6.
    #[error("IP version {0} (only 4 and 6 carry RoCEv2)")]
    BadIpVersion(u8),
    /// The IPv4 header length (IHL) is below 5 words.
    #[error("IPv4 IHL {0} is below 5")]
    BadIhl(u8),
    /// The IP total (IPv4) or payload (IPv6) length disagrees with the header or buffer.
    #[error("IP length {declared} does not match the {actual} bytes present")]
    BadIpLength {
        /// Length the IP header declares (whole packet for IPv4 and IPv6 alike).
        declared: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The IPv4 header checksum is wrong.
    #[error("IPv4 header checksum mismatch")]
    BadIpChecksum,
    /// The IPv4 packet is a fragment (MF set or a nonzero offset): RoCEv2 is never
    /// fragmented.
    #[error("IPv4 fragment")]
    Fragmented,
    /// The IP protocol (IPv4) or next header (IPv6, no extension headers allowed) is not UDP.
    #[error("IP protocol / next header {0} is not UDP (17)")]
    NotUdp(u8),
    /// The UDP length field disagrees with the IP payload length.
    #[error("UDP length {udp} does not match the IP payload length {ip}")]
    UdpLengthMismatch {
        /// The UDP header's length field.
        udp: usize,
        /// The IP payload length.
        ip: usize,
    },
    /// The UDP destination port is not RoCEv2's 4791.
    #[error("UDP destination port {0} is not 4791")]
    WrongPort(u16),
    /// A nonzero UDP checksum is wrong.
    #[error("UDP checksum mismatch")]
    BadUdpChecksum,
    /// The ICRC at the end of the packet is not the one its bytes give.
    #[error("ICRC mismatch: packet has {found:#010x}, bytes give {computed:#010x}")]
    BadIcrc {
        /// The ICRC carried (its 4 wire bytes read little-endian).
        found: u32,
        /// The ICRC computed.
        computed: u32,
    },
    /// The BTH opcode is not defined for its transport class.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The BTH opcode's transport class is one this crate does not carry (RD, CNP, XRC).
    #[error("unsupported transport class of opcode {0:#04x} (RD, CNP or XRC)")]
    UnsupportedTransport(u8),
    /// The BTH transport header version is not 0.
    #[error("BTH TVer {0} is not 0")]
    BadTver(u8),
    /// The packet ends before the extension headers its opcode requires.
    #[error("opcode {opcode:#04x} needs {needed} bytes of extension headers, {got} present")]
    HeadersMissing {
        /// The BTH opcode.
        opcode: u8,
        /// Bytes of extension headers the opcode needs.
        needed: usize,
        /// Bytes present between the BTH and the ICRC.
        got: usize,
    },
    /// The AETH syndrome is a reserved value.
    #[error("reserved AETH syndrome {0:#04x}")]
    BadSyndrome(u8),
    /// The BTH pad count is larger than the bytes left for payload and pad.
    #[error("pad count {pad} with only {room} bytes of payload room")]
    PadWithoutRoom {
        /// The BTH pad count.
        pad: u8,
        /// Bytes between the extension headers and the ICRC.
        room: usize,
    },
    /// The opcode carries no payload, but the packet (or emit call) has payload or pad.
    #[error("opcode {opcode:#04x} carries no payload, {len} bytes present")]
    UnexpectedPayload {
        /// The BTH opcode.
        opcode: u8,
        /// Bytes of payload and pad present.
        len: usize,
    },
    /// The payload is larger than the largest path MTU (4096 bytes).
    #[error("payload of {0} bytes exceeds 4096")]
    PayloadTooLong(usize),
    /// Emit: the extension headers given do not match the opcode's.
    #[error("extension headers do not match opcode {0:#04x}")]
    HeadersMismatch(u8),
    /// Emit: the payload given is not the length the representation says.
    #[error("payload of {given} bytes, representation says {repr}")]
    PayloadLenMismatch {
        /// `Repr::payload_len`.
        repr: usize,
        /// The payload's length.
        given: usize,
    },
    /// Emit: a field's value does not fit its wire width.
    #[error("field {0} out of range")]
    FieldOutOfRange(&'static str),
    /// Emit: the output buffer is too small.
    #[error("output buffer of {got} bytes, {needed} needed")]
    BufferTooSmall {
        /// Bytes the packet needs.
        needed: usize,
        /// Bytes the buffer has.
        got: usize,
    },
}

/// The crate's result type.
pub type Result<T> = core::result::Result<T, Error>;
