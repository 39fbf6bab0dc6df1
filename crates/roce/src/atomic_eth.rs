//! The Atomic Extended Transport Header (28 bytes: virtual address, R_Key, swap or add
//! data, compare data) of COMPARE_SWAP and FETCH_ADD.

use crate::error::{Error, Result};
use crate::field::{get_u32, get_u64, put_u32, put_u64};

/// Length of the AtomicETH.
pub const LEN: usize = 28;

/// A view of an AtomicETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicEth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AtomicEth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> AtomicEth<T> {
        AtomicEth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<AtomicEth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(AtomicEth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Virtual address (8-byte aligned on a valid request).
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 0)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 8)
    }

    /// Swap data (COMPARE_SWAP) or add data (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 12)
    }

    /// Compare data (COMPARE_SWAP; unused by FETCH_ADD).
    pub fn compare(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 20)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEth<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 0, v);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 8, v);
    }

    /// Sets the swap or add data.
    pub fn set_swap_add(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 12, v);
    }

    /// Sets the compare data.
    pub fn set_compare(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 20, v);
    }
}

/// A parsed AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEthRepr {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap or add data.
    pub swap_add: u64,
    /// Compare data.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicEth<T>) -> AtomicEthRepr {
        AtomicEthRepr {
            va: h.va(),
            rkey: h.rkey(),
            swap_add: h.swap_add(),
            compare: h.compare(),
        }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicEth<T>) {
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_swap_add(self.swap_add);
        h.set_compare(self.compare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = AtomicEthRepr {
            va: 0x1000,
            rkey: 0x0a0b_0c0d,
            swap_add: 0x1111_2222_3333_4444,
            compare: 0x5555_6666_7777_8888,
        };
        let mut b = [0u8; LEN];
        r.emit(&mut AtomicEth::new_unchecked(&mut b[..]));
        assert_eq!(&b[6..8], &[0x10, 0]);
        assert_eq!(&b[8..12], &[0x0a, 0x0b, 0x0c, 0x0d]);
        assert_eq!(&b[12..14], &[0x11, 0x11]);
        assert_eq!(&b[26..28], &[0x88, 0x88]);
        assert_eq!(
            AtomicEthRepr::parse(&AtomicEth::new_checked(&b[..]).unwrap()),
            r
        );
        assert!(AtomicEth::new_checked(&b[..27]).is_err());
    }
}
