//! The extension headers after the BTH as one typed value whose shape matches the opcode
//! (`opcode::OpInfo::headers`): parsed for an opcode, checked against one, emitted.

use crate::aeth::{self, Aeth, AethRepr};
use crate::atomic_ack_eth::{AtomicAckEth, AtomicAckEthRepr};
use crate::atomic_eth::{AtomicEth, AtomicEthRepr};
use crate::deth::{self, Deth, DethRepr};
use crate::error::{Error, Result};
use crate::ieth::{Ieth, IethRepr};
use crate::immdt::{ImmDt, ImmDtRepr};
use crate::opcode::{Ext, Opcode};
use crate::reth::{self, Reth, RethRepr};

/// The extension headers of one packet, in wire order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtHeaders {
    /// None (SEND FIRST/MIDDLE/LAST/ONLY, RDMA WRITE MIDDLE/LAST, READ RESPONSE MIDDLE).
    None,
    /// ImmDt (SEND_LAST/ONLY_WITH_IMMEDIATE, RDMA_WRITE_LAST_WITH_IMMEDIATE).
    ImmDt(ImmDtRepr),
    /// IETH (SEND_LAST/ONLY_WITH_INVALIDATE).
    Ieth(IethRepr),
    /// RETH (RDMA WRITE FIRST/ONLY, RDMA READ REQUEST).
    Reth(RethRepr),
    /// RETH then ImmDt (RDMA_WRITE_ONLY_WITH_IMMEDIATE).
    RethImmDt(RethRepr, ImmDtRepr),
    /// AETH (ACKNOWLEDGE, READ RESPONSE FIRST/LAST/ONLY).
    Aeth(AethRepr),
    /// AETH then AtomicAckETH (ATOMIC_ACKNOWLEDGE).
    AethAtomicAck(AethRepr, AtomicAckEthRepr),
    /// AtomicETH (COMPARE_SWAP, FETCH_ADD).
    AtomicEth(AtomicEthRepr),
    /// DETH (UD SEND_ONLY).
    Deth(DethRepr),
    /// DETH then ImmDt (UD SEND_ONLY_WITH_IMMEDIATE).
    DethImmDt(DethRepr, ImmDtRepr),
}

impl ExtHeaders {
    /// The headers, in wire order.
    pub fn layout(&self) -> &'static [Ext] {
        match self {
            ExtHeaders::None => &[],
            ExtHeaders::ImmDt(_) => &[Ext::ImmDt],
            ExtHeaders::Ieth(_) => &[Ext::Ieth],
            ExtHeaders::Reth(_) => &[Ext::Reth],
            ExtHeaders::RethImmDt(..) => &[Ext::Reth, Ext::ImmDt],
            ExtHeaders::Aeth(_) => &[Ext::Aeth],
            ExtHeaders::AethAtomicAck(..) => &[Ext::Aeth, Ext::AtomicAckEth],
            ExtHeaders::AtomicEth(_) => &[Ext::AtomicEth],
            ExtHeaders::Deth(_) => &[Ext::Deth],
            ExtHeaders::DethImmDt(..) => &[Ext::Deth, Ext::ImmDt],
        }
    }

    /// Their total length in bytes.
    pub fn len(&self) -> usize {
        self.layout().iter().map(|e| e.size()).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.layout().is_empty()
    }

    /// Parses the headers `opcode` requires from the start of `buf` (the bytes after the
    /// BTH, up to the ICRC): [`Error::HeadersMissing`] if `buf` is shorter than they are,
    /// [`Error::BadSyndrome`] for a reserved AETH syndrome.
    pub fn parse(opcode: Opcode, buf: &[u8]) -> Result<ExtHeaders> {
        let info = opcode.info();
        let needed = info.headers_len();
        if buf.len() < needed {
            return Err(Error::HeadersMissing {
                opcode: opcode.byte(),
                needed,
                got: buf.len(),
            });
        }
        let imm_at = |at: usize| -> Result<ImmDtRepr> {
            Ok(ImmDtRepr::parse(&ImmDt::new_checked(&buf[at..])?))
        };
        let aeth = || -> Result<AethRepr> { AethRepr::parse(&Aeth::new_checked(buf)?) };
        Ok(match info.headers {
            [] => ExtHeaders::None,
            [Ext::ImmDt] => ExtHeaders::ImmDt(imm_at(0)?),
            [Ext::Ieth] => ExtHeaders::Ieth(IethRepr::parse(&Ieth::new_checked(buf)?)),
            [Ext::Reth] => ExtHeaders::Reth(RethRepr::parse(&Reth::new_checked(buf)?)),
            [Ext::Reth, Ext::ImmDt] => ExtHeaders::RethImmDt(
                RethRepr::parse(&Reth::new_checked(buf)?),
                imm_at(reth::LEN)?,
            ),
            [Ext::Aeth] => ExtHeaders::Aeth(aeth()?),
            [Ext::Aeth, Ext::AtomicAckEth] => ExtHeaders::AethAtomicAck(
                aeth()?,
                AtomicAckEthRepr::parse(&AtomicAckEth::new_checked(&buf[aeth::LEN..])?),
            ),
            [Ext::AtomicEth] => {
                ExtHeaders::AtomicEth(AtomicEthRepr::parse(&AtomicEth::new_checked(buf)?))
            }
            [Ext::Deth] => ExtHeaders::Deth(DethRepr::parse(&Deth::new_checked(buf)?)),
            [Ext::Deth, Ext::ImmDt] => ExtHeaders::DethImmDt(
                DethRepr::parse(&Deth::new_checked(buf)?),
                imm_at(deth::LEN)?,
            ),
            // The opcode table has no other shape.
            _ => return Err(Error::HeadersMismatch(opcode.byte())),
        })
    }

    /// [`Error::HeadersMismatch`] unless these are the headers `opcode` requires;
    /// [`Error::FieldOutOfRange`] if a field does not fit its wire width.
    pub fn check(&self, opcode: Opcode) -> Result<()> {
        if self.layout() != opcode.info().headers {
            return Err(Error::HeadersMismatch(opcode.byte()));
        }
        match self {
            ExtHeaders::Aeth(a) | ExtHeaders::AethAtomicAck(a, _) => a.check(),
            ExtHeaders::Deth(d) | ExtHeaders::DethImmDt(d, _) => d.check(),
            _ => Ok(()),
        }
    }

    /// Writes the headers at the start of `buf`: [`Error::BufferTooSmall`] if it is
    /// shorter than [`len`](Self::len).
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let needed = self.len();
        if buf.len() < needed {
            return Err(Error::BufferTooSmall {
                needed,
                got: buf.len(),
            });
        }
        match self {
            ExtHeaders::None => {}
            ExtHeaders::ImmDt(i) => i.emit(&mut ImmDt::new_checked(buf)?),
            ExtHeaders::Ieth(i) => i.emit(&mut Ieth::new_checked(buf)?),
            ExtHeaders::Reth(r) => r.emit(&mut Reth::new_checked(buf)?),
            ExtHeaders::RethImmDt(r, i) => {
                r.emit(&mut Reth::new_checked(&mut buf[..])?);
                i.emit(&mut ImmDt::new_checked(&mut buf[reth::LEN..])?);
            }
            ExtHeaders::Aeth(a) => a.emit(&mut Aeth::new_checked(buf)?),
            ExtHeaders::AethAtomicAck(a, k) => {
                a.emit(&mut Aeth::new_checked(&mut buf[..])?);
                k.emit(&mut AtomicAckEth::new_checked(&mut buf[aeth::LEN..])?);
            }
            ExtHeaders::AtomicEth(a) => a.emit(&mut AtomicEth::new_checked(buf)?),
            ExtHeaders::Deth(d) => d.emit(&mut Deth::new_checked(buf)?),
            ExtHeaders::DethImmDt(d, i) => {
                d.emit(&mut Deth::new_checked(&mut buf[..])?);
                i.emit(&mut ImmDt::new_checked(&mut buf[deth::LEN..])?);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aeth::Syndrome;
    use crate::opcode::{Op, Transport};

    /// A value of the shape `opcode` requires.
    fn sample(opcode: Opcode) -> ExtHeaders {
        let reth = RethRepr {
            va: 0x7f00_0000_1000,
            rkey: 0x1234,
            dma_len: 8192,
        };
        let imm = ImmDtRepr { imm: 0xcafe_f00d };
        let aeth = AethRepr {
            syndrome: Syndrome::Ack { credit: 0x1f },
            msn: 77,
        };
        let deth = DethRepr {
            qkey: 0x1111_0000,
            src_qp: 0x42,
        };
        match opcode.info().headers {
            [] => ExtHeaders::None,
            [Ext::ImmDt] => ExtHeaders::ImmDt(imm),
            [Ext::Ieth] => ExtHeaders::Ieth(IethRepr { rkey: 9 }),
            [Ext::Reth] => ExtHeaders::Reth(reth),
            [Ext::Reth, Ext::ImmDt] => ExtHeaders::RethImmDt(reth, imm),
            [Ext::Aeth] => ExtHeaders::Aeth(aeth),
            [Ext::Aeth, Ext::AtomicAckEth] => {
                ExtHeaders::AethAtomicAck(aeth, AtomicAckEthRepr { orig: 5 })
            }
            [Ext::AtomicEth] => ExtHeaders::AtomicEth(AtomicEthRepr {
                va: 0x1000,
                rkey: 3,
                swap_add: 4,
                compare: 5,
            }),
            [Ext::Deth] => ExtHeaders::Deth(deth),
            [Ext::Deth, Ext::ImmDt] => ExtHeaders::DethImmDt(deth, imm),
            other => panic!("unexpected layout {other:?}"),
        }
    }

    #[test]
    fn every_opcode_round_trips_and_checks() {
        for op in Opcode::all() {
            let e = sample(op);
            assert_eq!(e.len(), op.info().headers_len());
            assert_eq!(e.check(op), Ok(()));
            let mut buf = vec![0u8; e.len() + 3];
            e.emit(&mut buf).unwrap();
            assert_eq!(ExtHeaders::parse(op, &buf), Ok(e), "{op:?}");
            if !e.is_empty() {
                assert_eq!(
                    ExtHeaders::parse(op, &buf[..e.len() - 1]),
                    Err(Error::HeadersMissing {
                        opcode: op.byte(),
                        needed: e.len(),
                        got: e.len() - 1
                    })
                );
                assert!(matches!(
                    e.emit(&mut buf[..e.len() - 1]),
                    Err(Error::BufferTooSmall { .. })
                ));
            }
        }
    }

    #[test]
    fn mismatch_is_refused() {
        let ack = Opcode::new(Transport::Rc, Op::Acknowledge).unwrap();
        let send = Opcode::new(Transport::Rc, Op::SendOnly).unwrap();
        assert_eq!(
            sample(send).check(ack),
            Err(Error::HeadersMismatch(ack.byte()))
        );
        assert_eq!(
            sample(ack).check(send),
            Err(Error::HeadersMismatch(send.byte()))
        );
        let ud = Opcode::new(Transport::Ud, Op::SendOnly).unwrap();
        let rc_imm = Opcode::new(Transport::Rc, Op::SendOnlyWithImmediate).unwrap();
        assert!(sample(ud).check(rc_imm).is_err());
    }

    #[test]
    fn reserved_syndrome_is_refused() {
        let ack = Opcode::new(Transport::Rc, Op::Acknowledge).unwrap();
        assert_eq!(
            ExtHeaders::parse(ack, &[0x40, 0, 0, 1]),
            Err(Error::BadSyndrome(0x40))
        );
    }
}
