//! The BTH opcode table (IBTA vol. 1 §9.2, Linux `rxe_opcode.c`): transport classes and
//! operations, and for each valid pair the extension headers that follow the BTH, whether
//! it carries payload, request or response, and its place in a message.

use crate::error::{Error, Result};

/// The transport classes this crate carries (the opcode's top three bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// Reliable Connected, class `0x00`.
    Rc,
    /// Unreliable Connected, class `0x20`.
    Uc,
    /// Unreliable Datagram, class `0x60`.
    Ud,
}

impl Transport {
    /// All classes, in opcode order.
    pub const ALL: [Transport; 3] = [Transport::Rc, Transport::Uc, Transport::Ud];

    /// The class bits (`0x00`, `0x20`, `0x60`).
    pub const fn bits(self) -> u8 {
        match self {
            Transport::Rc => 0x00,
            Transport::Uc => 0x20,
            Transport::Ud => 0x60,
        }
    }
}

/// The operation (the opcode's low five bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(missing_docs)] // Each variant is the IBTA operation of its name.
pub enum Op {
    SendFirst,
    SendMiddle,
    SendLast,
    SendLastWithImmediate,
    SendOnly,
    SendOnlyWithImmediate,
    RdmaWriteFirst,
    RdmaWriteMiddle,
    RdmaWriteLast,
    RdmaWriteLastWithImmediate,
    RdmaWriteOnly,
    RdmaWriteOnlyWithImmediate,
    RdmaReadRequest,
    RdmaReadResponseFirst,
    RdmaReadResponseMiddle,
    RdmaReadResponseLast,
    RdmaReadResponseOnly,
    Acknowledge,
    AtomicAcknowledge,
    CompareSwap,
    FetchAdd,
    SendLastWithInvalidate,
    SendOnlyWithInvalidate,
}

impl Op {
    /// All operations, in code order.
    pub const ALL: [Op; 23] = [
        Op::SendFirst,
        Op::SendMiddle,
        Op::SendLast,
        Op::SendLastWithImmediate,
        Op::SendOnly,
        Op::SendOnlyWithImmediate,
        Op::RdmaWriteFirst,
        Op::RdmaWriteMiddle,
        Op::RdmaWriteLast,
        Op::RdmaWriteLastWithImmediate,
        Op::RdmaWriteOnly,
        Op::RdmaWriteOnlyWithImmediate,
        Op::RdmaReadRequest,
        Op::RdmaReadResponseFirst,
        Op::RdmaReadResponseMiddle,
        Op::RdmaReadResponseLast,
        Op::RdmaReadResponseOnly,
        Op::Acknowledge,
        Op::AtomicAcknowledge,
        Op::CompareSwap,
        Op::FetchAdd,
        Op::SendLastWithInvalidate,
        Op::SendOnlyWithInvalidate,
    ];

    /// The operation code (the opcode's low five bits).
    pub const fn code(self) -> u8 {
        match self {
            Op::SendFirst => 0x00,
            Op::SendMiddle => 0x01,
            Op::SendLast => 0x02,
            Op::SendLastWithImmediate => 0x03,
            Op::SendOnly => 0x04,
            Op::SendOnlyWithImmediate => 0x05,
            Op::RdmaWriteFirst => 0x06,
            Op::RdmaWriteMiddle => 0x07,
            Op::RdmaWriteLast => 0x08,
            Op::RdmaWriteLastWithImmediate => 0x09,
            Op::RdmaWriteOnly => 0x0a,
            Op::RdmaWriteOnlyWithImmediate => 0x0b,
            Op::RdmaReadRequest => 0x0c,
            Op::RdmaReadResponseFirst => 0x0d,
            Op::RdmaReadResponseMiddle => 0x0e,
            Op::RdmaReadResponseLast => 0x0f,
            Op::RdmaReadResponseOnly => 0x10,
            Op::Acknowledge => 0x11,
            Op::AtomicAcknowledge => 0x12,
            Op::CompareSwap => 0x13,
            Op::FetchAdd => 0x14,
            Op::SendLastWithInvalidate => 0x16,
            Op::SendOnlyWithInvalidate => 0x17,
        }
    }

    fn from_code(code: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.code() == code)
    }
}

/// An extension header that may follow the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ext {
    /// RDMA Extended Transport Header, 16 bytes.
    Reth,
    /// ACK Extended Transport Header, 4 bytes.
    Aeth,
    /// Atomic Extended Transport Header, 28 bytes.
    AtomicEth,
    /// Atomic ACK Extended Transport Header, 8 bytes.
    AtomicAckEth,
    /// Immediate data, 4 bytes.
    ImmDt,
    /// Datagram Extended Transport Header, 8 bytes.
    Deth,
    /// Invalidate Extended Transport Header (an R_Key), 4 bytes.
    Ieth,
}

impl Ext {
    /// The header's length in bytes.
    pub const fn size(self) -> usize {
        match self {
            Ext::Reth => 16,
            Ext::Aeth => 4,
            Ext::AtomicEth => 28,
            Ext::AtomicAckEth => 8,
            Ext::ImmDt => 4,
            Ext::Deth => 8,
            Ext::Ieth => 4,
        }
    }
}

/// Whether a packet is sent by the requester or by the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Requester to responder (SEND, WRITE, READ request, atomics).
    Request,
    /// Responder to requester (READ responses, ACK, atomic ACK).
    Response,
}

/// A packet's place in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// The first packet of several.
    First,
    /// Neither first nor last.
    Middle,
    /// The last packet of several.
    Last,
    /// The message's only packet.
    Only,
}

/// What an opcode implies about its packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpInfo {
    /// The extension headers after the BTH, in wire order.
    pub headers: &'static [Ext],
    /// Whether the packet carries payload.
    pub payload: bool,
    /// Request or response.
    pub direction: Direction,
    /// Its place in the message.
    pub position: Position,
}

impl OpInfo {
    /// Total length of the extension headers.
    pub fn headers_len(&self) -> usize {
        self.headers.iter().map(|h| h.size()).sum()
    }
}

/// A valid (transport class, operation) pair: the BTH opcode byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode {
    transport: Transport,
    op: Op,
}

/// Whether `op` is defined for `transport` (UC: SEND and RDMA WRITE without invalidate;
/// UD: SEND_ONLY with or without immediate; RC: all).
const fn valid(transport: Transport, op: Op) -> bool {
    match transport {
        Transport::Rc => true,
        Transport::Uc => op.code() <= Op::RdmaWriteOnlyWithImmediate.code(),
        Transport::Ud => matches!(op, Op::SendOnly | Op::SendOnlyWithImmediate),
    }
}

impl Opcode {
    /// The opcode of `op` on `transport`, if defined.
    pub fn new(transport: Transport, op: Op) -> Option<Opcode> {
        valid(transport, op).then_some(Opcode { transport, op })
    }

    /// Every valid opcode, in byte order.
    pub fn all() -> impl Iterator<Item = Opcode> {
        Transport::ALL
            .into_iter()
            .flat_map(|t| Op::ALL.into_iter().filter_map(move |op| Opcode::new(t, op)))
    }

    /// Decodes a BTH opcode byte: [`Error::UnsupportedTransport`] for RD (`0x40`), CNP
    /// (`0x80`) and XRC (`0xa0`) classes, [`Error::UnknownOpcode`] for the rest that are
    /// not defined (including the manufacturer-specific `0xc0..=0xff`).
    pub fn from_byte(b: u8) -> Result<Opcode> {
        let transport = match b & 0xe0 {
            0x00 => Transport::Rc,
            0x20 => Transport::Uc,
            0x60 => Transport::Ud,
            0x40 | 0x80 | 0xa0 => return Err(Error::UnsupportedTransport(b)),
            _ => return Err(Error::UnknownOpcode(b)),
        };
        Op::from_code(b & 0x1f)
            .and_then(|op| Opcode::new(transport, op))
            .ok_or(Error::UnknownOpcode(b))
    }

    /// The opcode byte.
    pub const fn byte(self) -> u8 {
        self.transport.bits() | self.op.code()
    }

    /// The transport class.
    pub const fn transport(self) -> Transport {
        self.transport
    }

    /// The operation.
    pub const fn op(self) -> Op {
        self.op
    }

    /// Headers, payload, direction and position of this opcode.
    pub const fn info(self) -> OpInfo {
        use Direction::{Request as Req, Response as Resp};
        use Ext::*;
        use Position::*;
        let (headers, payload, direction, position): (&'static [Ext], bool, Direction, Position) =
            match (self.transport, self.op) {
                (Transport::Ud, Op::SendOnly) => (&[Deth], true, Req, Only),
                (Transport::Ud, Op::SendOnlyWithImmediate) => (&[Deth, ImmDt], true, Req, Only),
                (_, Op::SendFirst) => (&[], true, Req, First),
                (_, Op::SendMiddle) => (&[], true, Req, Middle),
                (_, Op::SendLast) => (&[], true, Req, Last),
                (_, Op::SendLastWithImmediate) => (&[ImmDt], true, Req, Last),
                (_, Op::SendOnly) => (&[], true, Req, Only),
                (_, Op::SendOnlyWithImmediate) => (&[ImmDt], true, Req, Only),
                (_, Op::RdmaWriteFirst) => (&[Reth], true, Req, First),
                (_, Op::RdmaWriteMiddle) => (&[], true, Req, Middle),
                (_, Op::RdmaWriteLast) => (&[], true, Req, Last),
                (_, Op::RdmaWriteLastWithImmediate) => (&[ImmDt], true, Req, Last),
                (_, Op::RdmaWriteOnly) => (&[Reth], true, Req, Only),
                (_, Op::RdmaWriteOnlyWithImmediate) => (&[Reth, ImmDt], true, Req, Only),
                (_, Op::RdmaReadRequest) => (&[Reth], false, Req, Only),
                (_, Op::RdmaReadResponseFirst) => (&[Aeth], true, Resp, First),
                (_, Op::RdmaReadResponseMiddle) => (&[], true, Resp, Middle),
                (_, Op::RdmaReadResponseLast) => (&[Aeth], true, Resp, Last),
                (_, Op::RdmaReadResponseOnly) => (&[Aeth], true, Resp, Only),
                (_, Op::Acknowledge) => (&[Aeth], false, Resp, Only),
                (_, Op::AtomicAcknowledge) => (&[Aeth, AtomicAckEth], false, Resp, Only),
                (_, Op::CompareSwap) => (&[AtomicEth], false, Req, Only),
                (_, Op::FetchAdd) => (&[AtomicEth], false, Req, Only),
                (_, Op::SendLastWithInvalidate) => (&[Ieth], true, Req, Last),
                (_, Op::SendOnlyWithInvalidate) => (&[Ieth], true, Req, Only),
            };
        OpInfo {
            headers,
            payload,
            direction,
            position,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rxe_opcode.c's table, transcribed independently of `info` as
    /// (opcode, header bytes after the BTH, payload, request, start, end).
    const RXE: &[(u8, usize, bool, bool, bool, bool)] = &[
        (0x00, 0, true, true, true, false),
        (0x01, 0, true, true, false, false),
        (0x02, 0, true, true, false, true),
        (0x03, 4, true, true, false, true),
        (0x04, 0, true, true, true, true),
        (0x05, 4, true, true, true, true),
        (0x06, 16, true, true, true, false),
        (0x07, 0, true, true, false, false),
        (0x08, 0, true, true, false, true),
        (0x09, 4, true, true, false, true),
        (0x0a, 16, true, true, true, true),
        (0x0b, 20, true, true, true, true),
        (0x0c, 16, false, true, true, true),
        (0x0d, 4, true, false, true, false),
        (0x0e, 0, true, false, false, false),
        (0x0f, 4, true, false, false, true),
        (0x10, 4, true, false, true, true),
        (0x11, 4, false, false, true, true),
        (0x12, 12, false, false, true, true),
        (0x13, 28, false, true, true, true),
        (0x14, 28, false, true, true, true),
        (0x16, 4, true, true, false, true),
        (0x17, 4, true, true, true, true),
        (0x20, 0, true, true, true, false),
        (0x21, 0, true, true, false, false),
        (0x22, 0, true, true, false, true),
        (0x23, 4, true, true, false, true),
        (0x24, 0, true, true, true, true),
        (0x25, 4, true, true, true, true),
        (0x26, 16, true, true, true, false),
        (0x27, 0, true, true, false, false),
        (0x28, 0, true, true, false, true),
        (0x29, 4, true, true, false, true),
        (0x2a, 16, true, true, true, true),
        (0x2b, 20, true, true, true, true),
        (0x64, 8, true, true, true, true),
        (0x65, 12, true, true, true, true),
    ];

    #[test]
    fn table_matches_rxe() {
        let ours: Vec<Opcode> = Opcode::all().collect();
        assert_eq!(ours.len(), RXE.len());
        for (op, &(byte, hlen, payload, req, start, end)) in ours.iter().zip(RXE) {
            assert_eq!(op.byte(), byte);
            let i = op.info();
            assert_eq!(i.headers_len(), hlen, "{op:?}");
            assert_eq!(i.payload, payload, "{op:?}");
            assert_eq!(i.direction == Direction::Request, req, "{op:?}");
            let (s, e) = match i.position {
                Position::First => (true, false),
                Position::Middle => (false, false),
                Position::Last => (false, true),
                Position::Only => (true, true),
            };
            assert_eq!((s, e), (start, end), "{op:?}");
            assert_eq!(Opcode::from_byte(byte), Ok(*op));
        }
    }

    #[test]
    fn every_other_byte_is_refused() {
        for b in 0..=255u8 {
            let r = Opcode::from_byte(b);
            if RXE.iter().any(|e| e.0 == b) {
                assert!(r.is_ok(), "{b:#x}");
                continue;
            }
            let want = match b & 0xe0 {
                0x40 | 0x80 | 0xa0 => Error::UnsupportedTransport(b),
                _ => Error::UnknownOpcode(b),
            };
            assert_eq!(r, Err(want), "{b:#x}");
        }
        // CNP is 0x81 and RD's SEND_ONLY 0x44: both recognised as unsupported.
        assert_eq!(
            Opcode::from_byte(0x81),
            Err(Error::UnsupportedTransport(0x81))
        );
        assert_eq!(
            Opcode::from_byte(0x44),
            Err(Error::UnsupportedTransport(0x44))
        );
    }

    #[test]
    fn header_order_follows_rxe_offsets() {
        let woi = Opcode::new(Transport::Rc, Op::RdmaWriteOnlyWithImmediate).unwrap();
        assert_eq!(woi.info().headers, &[Ext::Reth, Ext::ImmDt]);
        let aack = Opcode::new(Transport::Rc, Op::AtomicAcknowledge).unwrap();
        assert_eq!(aack.info().headers, &[Ext::Aeth, Ext::AtomicAckEth]);
        let udi = Opcode::new(Transport::Ud, Op::SendOnlyWithImmediate).unwrap();
        assert_eq!(udi.info().headers, &[Ext::Deth, Ext::ImmDt]);
        assert!(Opcode::new(Transport::Uc, Op::RdmaReadRequest).is_none());
        assert!(Opcode::new(Transport::Uc, Op::SendOnlyWithInvalidate).is_none());
        assert!(Opcode::new(Transport::Ud, Op::SendFirst).is_none());
    }
}
