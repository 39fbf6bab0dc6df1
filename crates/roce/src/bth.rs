//! The Base Transport Header (IBTA vol. 1 §9.2, 12 bytes): a view over its bytes and its
//! parsed representation.
//!
//! ```text
//!  byte 0: opcode
//!  byte 1: SE(7) M(6) PadCnt(5:4) TVer(3:0)
//!  bytes 2-3: P_Key
//!  byte 4: FECN(7) BECN(6) reserved(5:0)      <- all ones in the ICRC
//!  bytes 5-7: destination QP
//!  byte 8: AckReq(7) reserved(6:0)
//!  bytes 9-11: PSN
//! ```

use crate::error::{Error, Result};
use crate::field::{get_u16, get_u24, put_u16, put_u24};
use crate::opcode::Opcode;

/// Length of the BTH.
pub const LEN: usize = 12;

/// The largest 24-bit value (QPNs and PSNs).
pub const MAX_24: u32 = 0x00ff_ffff;

/// A view of a BTH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Bth<T> {
    /// The view, without checking the length (getters panic on a short buffer).
    pub const fn new_unchecked(buffer: T) -> Bth<T> {
        Bth { buffer }
    }

    /// The view, or [`Error::Truncated`] if `buffer` is shorter than a BTH.
    pub fn new_checked(buffer: T) -> Result<Bth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Bth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The opcode byte.
    pub fn opcode(&self) -> u8 {
        self.b()[0]
    }

    /// Solicited Event.
    pub fn solicited(&self) -> bool {
        self.b()[1] & 0x80 != 0
    }

    /// MigReq.
    pub fn mig_req(&self) -> bool {
        self.b()[1] & 0x40 != 0
    }

    /// Pad count (0..=3): bytes of pad after the payload.
    pub fn pad_count(&self) -> u8 {
        (self.b()[1] >> 4) & 0x3
    }

    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.b()[1] & 0x0f
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        get_u16(self.b(), 2)
    }

    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.b()[4] & 0x80 != 0
    }

    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.b()[4] & 0x40 != 0
    }

    /// Destination QP number (24 bits).
    pub fn dest_qp(&self) -> u32 {
        get_u24(self.b(), 5)
    }

    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.b()[8] & 0x80 != 0
    }

    /// Packet sequence number (24 bits).
    pub fn psn(&self) -> u32 {
        get_u24(self.b(), 9)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    fn m(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    fn set_bit(&mut self, byte: usize, mask: u8, on: bool) {
        let b = &mut self.m()[byte];
        *b = if on { *b | mask } else { *b & !mask };
    }

    /// Sets the opcode byte.
    pub fn set_opcode(&mut self, v: u8) {
        self.m()[0] = v;
    }

    /// Sets Solicited Event.
    pub fn set_solicited(&mut self, v: bool) {
        self.set_bit(1, 0x80, v);
    }

    /// Sets MigReq.
    pub fn set_mig_req(&mut self, v: bool) {
        self.set_bit(1, 0x40, v);
    }

    /// Sets the pad count (low two bits of `v`).
    pub fn set_pad_count(&mut self, v: u8) {
        let b = &mut self.m()[1];
        *b = (*b & !0x30) | ((v & 0x3) << 4);
    }

    /// Sets the transport header version (low four bits of `v`).
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.m()[1];
        *b = (*b & !0x0f) | (v & 0x0f);
    }

    /// Sets the partition key.
    pub fn set_pkey(&mut self, v: u16) {
        put_u16(self.m(), 2, v);
    }

    /// Sets FECN.
    pub fn set_fecn(&mut self, v: bool) {
        self.set_bit(4, 0x80, v);
    }

    /// Sets BECN.
    pub fn set_becn(&mut self, v: bool) {
        self.set_bit(4, 0x40, v);
    }

    /// Sets the destination QP (low 24 bits of `v`).
    pub fn set_dest_qp(&mut self, v: u32) {
        put_u24(self.m(), 5, v);
    }

    /// Sets AckReq.
    pub fn set_ack_req(&mut self, v: bool) {
        self.set_bit(8, 0x80, v);
    }

    /// Sets the PSN (low 24 bits of `v`).
    pub fn set_psn(&mut self, v: u32) {
        put_u24(self.m(), 9, v);
    }
}

/// A parsed BTH. Reserved bits are emitted as zero and ignored on parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// The opcode.
    pub opcode: Opcode,
    /// Solicited Event.
    pub solicited: bool,
    /// MigReq.
    pub mig_req: bool,
    /// Pad count, 0..=3.
    pub pad_count: u8,
    /// Partition key (`0xffff`: the default partition, full member).
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// Destination QP, 24 bits.
    pub dest_qp: u32,
    /// AckReq.
    pub ack_req: bool,
    /// PSN, 24 bits.
    pub psn: u32,
}

impl BthRepr {
    /// Parses a BTH: [`Error::UnknownOpcode`] / [`Error::UnsupportedTransport`] for an
    /// opcode this crate does not carry, [`Error::BadTver`] for a TVer other than 0.
    pub fn parse<T: AsRef<[u8]>>(bth: &Bth<T>) -> Result<BthRepr> {
        let opcode = Opcode::from_byte(bth.opcode())?;
        if bth.tver() != 0 {
            return Err(Error::BadTver(bth.tver()));
        }
        Ok(BthRepr {
            opcode,
            solicited: bth.solicited(),
            mig_req: bth.mig_req(),
            pad_count: bth.pad_count(),
            pkey: bth.pkey(),
            fecn: bth.fecn(),
            becn: bth.becn(),
            dest_qp: bth.dest_qp(),
            ack_req: bth.ack_req(),
            psn: bth.psn(),
        })
    }

    /// [`Error::FieldOutOfRange`] if a field does not fit its wire width.
    pub fn check(&self) -> Result<()> {
        if self.pad_count > 3 {
            return Err(Error::FieldOutOfRange("BTH pad count"));
        }
        if self.dest_qp > MAX_24 {
            return Err(Error::FieldOutOfRange("BTH destination QP"));
        }
        if self.psn > MAX_24 {
            return Err(Error::FieldOutOfRange("BTH PSN"));
        }
        Ok(())
    }

    /// Writes every byte of the header (TVer 0, reserved bits 0); fields are truncated to
    /// their widths ([`check`](Self::check) first to refuse instead).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, bth: &mut Bth<T>) {
        bth.m()[..LEN].fill(0);
        bth.set_opcode(self.opcode.byte());
        bth.set_solicited(self.solicited);
        bth.set_mig_req(self.mig_req);
        bth.set_pad_count(self.pad_count);
        bth.set_tver(0);
        bth.set_pkey(self.pkey);
        bth.set_fecn(self.fecn);
        bth.set_becn(self.becn);
        bth.set_dest_qp(self.dest_qp);
        bth.set_ack_req(self.ack_req);
        bth.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opcode::{Op, Transport};

    fn repr() -> BthRepr {
        BthRepr {
            opcode: Opcode::new(Transport::Rc, Op::RdmaWriteFirst).unwrap(),
            solicited: true,
            mig_req: false,
            pad_count: 2,
            pkey: 0xffff,
            fecn: false,
            becn: true,
            dest_qp: 0x12_3456,
            ack_req: true,
            psn: 0xab_cdef,
        }
    }

    #[test]
    fn emits_ibta_layout() {
        let mut buf = [0xaau8; LEN];
        repr().emit(&mut Bth::new_unchecked(&mut buf[..]));
        assert_eq!(
            buf,
            [0x06, 0xa0, 0xff, 0xff, 0x40, 0x12, 0x34, 0x56, 0x80, 0xab, 0xcd, 0xef]
        );
        let got = BthRepr::parse(&Bth::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(got, repr());
    }

    #[test]
    fn refuses_short_bad_tver_and_ranges() {
        assert_eq!(
            Bth::new_checked(&[0u8; 11][..]),
            Err(Error::Truncated {
                needed: 12,
                got: 11
            })
        );
        let mut buf = [0u8; LEN];
        repr().emit(&mut Bth::new_unchecked(&mut buf[..]));
        Bth::new_unchecked(&mut buf[..]).set_tver(1);
        assert_eq!(
            BthRepr::parse(&Bth::new_unchecked(&buf[..])),
            Err(Error::BadTver(1))
        );
        buf[0] = 0x15;
        assert_eq!(
            BthRepr::parse(&Bth::new_unchecked(&buf[..])),
            Err(Error::UnknownOpcode(0x15))
        );
        let mut r = repr();
        r.psn = MAX_24 + 1;
        assert!(r.check().is_err());
        r.psn = MAX_24;
        r.pad_count = 4;
        assert!(r.check().is_err());
        r.pad_count = 3;
        r.dest_qp = 1 << 24;
        assert!(r.check().is_err());
        r.dest_qp = MAX_24;
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn reserved_bits_are_ignored_on_parse() {
        let mut buf = [0u8; LEN];
        repr().emit(&mut Bth::new_unchecked(&mut buf[..]));
        buf[4] |= 0x3f;
        buf[8] |= 0x7f;
        let got = BthRepr::parse(&Bth::new_unchecked(&buf[..])).unwrap();
        assert_eq!(got, repr());
    }
}
