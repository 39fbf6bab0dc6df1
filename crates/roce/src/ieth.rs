//! The Invalidate Extended Transport Header (4 bytes: the R_Key to invalidate) of
//! SEND_LAST/ONLY_WITH_INVALIDATE.

use crate::error::{Error, Result};
use crate::field::{get_u32, put_u32};

/// Length of the IETH.
pub const LEN: usize = 4;

/// A view of an IETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ieth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ieth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> Ieth<T> {
        Ieth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Ieth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Ieth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ieth<T> {
    /// Sets the R_Key.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// A parsed IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &Ieth<T>) -> IethRepr {
        IethRepr { rkey: h.rkey() }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Ieth<T>) {
        h.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = IethRepr { rkey: 0x0102_0304 };
        let mut b = [0u8; LEN];
        r.emit(&mut Ieth::new_unchecked(&mut b[..]));
        assert_eq!(b, [1, 2, 3, 4]);
        assert_eq!(IethRepr::parse(&Ieth::new_checked(&b[..]).unwrap()), r);
        assert!(Ieth::new_checked(&b[..3]).is_err());
    }
}
