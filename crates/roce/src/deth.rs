//! The Datagram Extended Transport Header (8 bytes: Q_Key, reserved byte, source QP) of UD
//! SENDs.

use crate::error::{Error, Result};
use crate::field::{get_u24, get_u32, put_u24, put_u32};

/// Length of the DETH.
pub const LEN: usize = 8;

/// A view of a DETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Deth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> Deth<T> {
        Deth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Deth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Deth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Queue key.
    pub fn qkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }

    /// Source QP number (24 bits).
    pub fn src_qp(&self) -> u32 {
        get_u24(self.buffer.as_ref(), 5)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Deth<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v);
    }

    /// Sets the source QP (low 24 bits of `v`) and clears the reserved byte.
    pub fn set_src_qp(&mut self, v: u32) {
        self.buffer.as_mut()[4] = 0;
        put_u24(self.buffer.as_mut(), 5, v);
    }
}

/// A parsed DETH (the reserved byte is emitted as zero and ignored on parse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DethRepr {
    /// Queue key.
    pub qkey: u32,
    /// Source QP, 24 bits.
    pub src_qp: u32,
}

impl DethRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &Deth<T>) -> DethRepr {
        DethRepr {
            qkey: h.qkey(),
            src_qp: h.src_qp(),
        }
    }

    /// [`Error::FieldOutOfRange`] if the source QP exceeds 24 bits.
    pub fn check(&self) -> Result<()> {
        if self.src_qp > 0x00ff_ffff {
            return Err(Error::FieldOutOfRange("DETH source QP"));
        }
        Ok(())
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Deth<T>) {
        h.set_qkey(self.qkey);
        h.set_src_qp(self.src_qp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = DethRepr {
            qkey: 0x1122_3344,
            src_qp: 0xab_cdef,
        };
        let mut b = [0xffu8; LEN];
        r.emit(&mut Deth::new_unchecked(&mut b[..]));
        assert_eq!(b, [0x11, 0x22, 0x33, 0x44, 0, 0xab, 0xcd, 0xef]);
        assert_eq!(DethRepr::parse(&Deth::new_checked(&b[..]).unwrap()), r);
        assert!(Deth::new_checked(&b[..7]).is_err());
        assert!(DethRepr {
            qkey: 0,
            src_qp: 1 << 24
        }
        .check()
        .is_err());
    }
}
