//! The ACK Extended Transport Header (4 bytes: syndrome, MSN) of ACKs, atomic ACKs and
//! RDMA READ responses, and the syndrome's decoding (IBTA vol. 1 §9.7.5.1, `rxe_hdr.h`).
//!
//! Syndrome byte: bit 7 reserved (0); bits 6:5 the type — `00` ACK (low five bits: credit
//! count), `01` RNR NAK (timer), `10` reserved, `11` NAK (code).

use crate::error::{Error, Result};
use crate::field::{get_u24, put_u24};

/// Length of the AETH.
pub const LEN: usize = 4;

/// A view of an AETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aeth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Aeth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> Aeth<T> {
        Aeth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Aeth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Aeth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The raw syndrome byte.
    pub fn syndrome(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        get_u24(self.buffer.as_ref(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Aeth<T> {
    /// Sets the raw syndrome byte.
    pub fn set_syndrome(&mut self, v: u8) {
        self.buffer.as_mut()[0] = v;
    }

    /// Sets the MSN (low 24 bits of `v`).
    pub fn set_msn(&mut self, v: u32) {
        put_u24(self.buffer.as_mut(), 1, v);
    }
}

/// A NAK's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NakCode {
    /// PSN sequence error (0).
    PsnSequenceError,
    /// Invalid request (1).
    InvalidRequest,
    /// Remote access error (2).
    RemoteAccessError,
    /// Remote operational error (3).
    RemoteOperationalError,
    /// Invalid RD request (4).
    InvalidRdRequest,
}

impl NakCode {
    /// All codes, in value order.
    pub const ALL: [NakCode; 5] = [
        NakCode::PsnSequenceError,
        NakCode::InvalidRequest,
        NakCode::RemoteAccessError,
        NakCode::RemoteOperationalError,
        NakCode::InvalidRdRequest,
    ];

    /// The code's value (the syndrome's low five bits).
    pub const fn value(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
        }
    }
}

/// A decoded AETH syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syndrome {
    /// ACK with an end-to-end credit count (5 bits; `0x1f`: credits not limited).
    Ack {
        /// The credit count.
        credit: u8,
    },
    /// Receiver not ready, retry after the timer's time (5-bit code, IBTA table 45).
    RnrNak {
        /// The timer code.
        timer: u8,
    },
    /// NAK.
    Nak(NakCode),
}

impl Syndrome {
    /// Decodes the syndrome byte: [`Error::BadSyndrome`] for bit 7 set, the reserved type
    /// `10`, or a reserved NAK code (5..=31).
    pub fn from_byte(b: u8) -> Result<Syndrome> {
        let low = b & 0x1f;
        match b & 0xe0 {
            0x00 => Ok(Syndrome::Ack { credit: low }),
            0x20 => Ok(Syndrome::RnrNak { timer: low }),
            0x60 => NakCode::ALL
                .into_iter()
                .find(|c| c.value() == low)
                .map(Syndrome::Nak)
                .ok_or(Error::BadSyndrome(b)),
            _ => Err(Error::BadSyndrome(b)),
        }
    }

    /// The syndrome byte (credit and timer truncated to five bits).
    pub const fn byte(self) -> u8 {
        match self {
            Syndrome::Ack { credit } => credit & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            Syndrome::Nak(code) => 0x60 | code.value(),
        }
    }

    /// [`Error::FieldOutOfRange`] if the credit count or timer exceeds five bits.
    pub fn check(self) -> Result<()> {
        match self {
            Syndrome::Ack { credit } if credit > 0x1f => Err(Error::FieldOutOfRange("AETH credit")),
            Syndrome::RnrNak { timer } if timer > 0x1f => Err(Error::FieldOutOfRange("AETH timer")),
            _ => Ok(()),
        }
    }
}

/// A parsed AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AethRepr {
    /// The syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number, 24 bits.
    pub msn: u32,
}

impl AethRepr {
    /// Reads the header ([`Error::BadSyndrome`] for a reserved syndrome).
    pub fn parse<T: AsRef<[u8]>>(h: &Aeth<T>) -> Result<AethRepr> {
        Ok(AethRepr {
            syndrome: Syndrome::from_byte(h.syndrome())?,
            msn: h.msn(),
        })
    }

    /// [`Error::FieldOutOfRange`] if a field does not fit its width.
    pub fn check(&self) -> Result<()> {
        self.syndrome.check()?;
        if self.msn > 0x00ff_ffff {
            return Err(Error::FieldOutOfRange("AETH MSN"));
        }
        Ok(())
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Aeth<T>) {
        h.set_syndrome(self.syndrome.byte());
        h.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syndromes_as_rxe_defines_them() {
        // rxe_hdr.h: AETH_ACK_UNLIMITED 0x1f, AETH_RNR_NAK 0x20, AETH_NAK_PSN_SEQ_ERROR 0x60,
        // AETH_NAK_INVALID_REQ 0x61, AETH_NAK_REM_ACC_ERR 0x62, AETH_NAK_REM_OP_ERR 0x63,
        // AETH_NAK_INV_RD_REQ 0x64.
        assert_eq!(Syndrome::from_byte(0x1f), Ok(Syndrome::Ack { credit: 31 }));
        assert_eq!(
            Syndrome::from_byte(0x2e),
            Ok(Syndrome::RnrNak { timer: 14 })
        );
        let naks = [0x60, 0x61, 0x62, 0x63, 0x64];
        for (b, c) in naks.into_iter().zip(NakCode::ALL) {
            assert_eq!(Syndrome::from_byte(b), Ok(Syndrome::Nak(c)));
            assert_eq!(Syndrome::Nak(c).byte(), b);
        }
        for b in [0x40, 0x5f, 0x65, 0x7f, 0x80, 0xff] {
            assert_eq!(Syndrome::from_byte(b), Err(Error::BadSyndrome(b)));
        }
        // Every valid byte round-trips.
        for b in 0..=255u8 {
            if let Ok(s) = Syndrome::from_byte(b) {
                assert_eq!(s.byte(), b);
            }
        }
    }

    #[test]
    fn layout_and_ranges() {
        let r = AethRepr {
            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
            msn: 0x01_0203,
        };
        let mut b = [0u8; LEN];
        r.emit(&mut Aeth::new_unchecked(&mut b[..]));
        assert_eq!(b, [0x62, 1, 2, 3]);
        assert_eq!(AethRepr::parse(&Aeth::new_checked(&b[..]).unwrap()), Ok(r));
        assert!(Aeth::new_checked(&b[..3]).is_err());
        let bad = AethRepr {
            syndrome: Syndrome::Ack { credit: 32 },
            msn: 0,
        };
        assert!(bad.check().is_err());
        let bad = AethRepr {
            syndrome: Syndrome::RnrNak { timer: 31 },
            msn: 1 << 24,
        };
        assert!(bad.check().is_err());
    }
}
