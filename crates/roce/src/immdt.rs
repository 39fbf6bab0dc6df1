//! The Immediate Data header (4 bytes) of the `*_WITH_IMMEDIATE` opcodes.

use crate::error::{Error, Result};
use crate::field::{get_u32, put_u32};

/// Length of the ImmDt header.
pub const LEN: usize = 4;

/// A view of an ImmDt header at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmDt<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ImmDt<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> ImmDt<T> {
        ImmDt { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<ImmDt<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(ImmDt { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The immediate data, read big-endian (verbs' `imm_data` is these four bytes as a
    /// `__be32`).
    pub fn imm(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDt<T> {
    /// Sets the immediate data.
    pub fn set_imm(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// A parsed ImmDt header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImmDtRepr {
    /// The immediate data (big-endian on the wire).
    pub imm: u32,
}

impl ImmDtRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &ImmDt<T>) -> ImmDtRepr {
        ImmDtRepr { imm: h.imm() }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut ImmDt<T>) {
        h.set_imm(self.imm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = ImmDtRepr { imm: 0xdead_beef };
        let mut b = [0u8; LEN];
        r.emit(&mut ImmDt::new_unchecked(&mut b[..]));
        assert_eq!(b, [0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(ImmDtRepr::parse(&ImmDt::new_checked(&b[..]).unwrap()), r);
        assert!(ImmDt::new_checked(&b[..3]).is_err());
    }
}
