//! The Atomic ACK Extended Transport Header (8 bytes: the original remote data) of
//! ATOMIC_ACKNOWLEDGE, after its AETH.

use crate::error::{Error, Result};
use crate::field::{get_u64, put_u64};

/// Length of the AtomicAckETH.
pub const LEN: usize = 8;

/// A view of an AtomicAckETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicAckEth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AtomicAckEth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> AtomicAckEth<T> {
        AtomicAckEth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<AtomicAckEth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(AtomicAckEth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The remote data before the atomic operation.
    pub fn orig(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEth<T> {
    /// Sets the original remote data.
    pub fn set_orig(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 0, v);
    }
}

/// A parsed AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicAckEthRepr {
    /// The original remote data.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicAckEth<T>) -> AtomicAckEthRepr {
        AtomicAckEthRepr { orig: h.orig() }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicAckEth<T>) {
        h.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = AtomicAckEthRepr {
            orig: 0x0102_0304_0506_0708,
        };
        let mut b = [0u8; LEN];
        r.emit(&mut AtomicAckEth::new_unchecked(&mut b[..]));
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            AtomicAckEthRepr::parse(&AtomicAckEth::new_checked(&b[..]).unwrap()),
            r
        );
        assert!(AtomicAckEth::new_checked(&b[..7]).is_err());
    }
}
