//! The RDMA Extended Transport Header (16 bytes: virtual address, R_Key, DMA length) of
//! RDMA WRITE FIRST/ONLY and RDMA READ requests.

use crate::error::{Error, Result};
use crate::field::{get_u32, get_u64, put_u32, put_u64};

/// Length of the RETH.
pub const LEN: usize = 16;

/// A view of a RETH at the start of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Reth<T> {
    /// The view, without checking the length.
    pub const fn new_unchecked(buffer: T) -> Reth<T> {
        Reth { buffer }
    }

    /// The view, or [`Error::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Reth<T>> {
        let got = buffer.as_ref().len();
        if got < LEN {
            return Err(Error::Truncated { needed: LEN, got });
        }
        Ok(Reth { buffer })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Virtual address.
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 0)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 8)
    }

    /// DMA length (of the whole message).
    pub fn dma_len(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 12)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Reth<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 0, v);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 8, v);
    }

    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 12, v);
    }
}

/// A parsed RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RethRepr {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length.
    pub dma_len: u32,
}

impl RethRepr {
    /// Reads the header.
    pub fn parse<T: AsRef<[u8]>>(h: &Reth<T>) -> RethRepr {
        RethRepr {
            va: h.va(),
            rkey: h.rkey(),
            dma_len: h.dma_len(),
        }
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Reth<T>) {
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_round_trip() {
        let r = RethRepr {
            va: 0x0011_2233_4455_6677,
            rkey: 0x8899_aabb,
            dma_len: 0x0000_1000,
        };
        let mut b = [0u8; LEN];
        r.emit(&mut Reth::new_unchecked(&mut b[..]));
        assert_eq!(
            b,
            [0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0, 0, 0x10, 0]
        );
        assert_eq!(RethRepr::parse(&Reth::new_checked(&b[..]).unwrap()), r);
        assert!(Reth::new_checked(&b[..15]).is_err());
    }
}
