//! `Region`: the handle of one registration (unregisters on drop).

use crate::error::{Error, Result};
use crate::space::RegionId;
use crate::Pager;

/// A registered range. Dropping it unregisters it (see [`Pager::register`]).
pub struct Region {
    pager: Pager,
    id: RegionId,
    addr: usize,
    len: usize,
    live: bool,
}

impl Region {
    pub(crate) fn new(pager: Pager, id: RegionId, addr: usize, len: usize) -> Region {
        Region {
            pager,
            id,
            addr,
            len,
            live: true,
        }
    }

    /// Page-aligned start.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The region's identity in the pager.
    pub fn id(&self) -> RegionId {
        self.id
    }
    /// The pager managing it.
    pub fn pager(&self) -> &Pager {
        &self.pager
    }
    /// Start of the region.
    pub fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    /// Start of the region, for writes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
    /// The region's bytes (access may fault pages in); empty once unregistered.
    pub fn as_slice(&self) -> &[u8] {
        if !self.live {
            return &[];
        }
        // SAFETY: the range is mapped while the region is live; moving pages
        // to swap and back preserves their contents.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
    /// Mutable view; empty once unregistered.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if !self.live {
            return &mut [];
        }
        // SAFETY: as above, and `&mut self` makes this the only safe view.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }
    /// Pins `len` bytes at `off` (resident and not evicted until unpinned).
    pub fn pin(&self, off: usize, len: usize) -> Result<()> {
        self.check(off, len)?;
        self.pager.pin(self.addr + off, len)
    }
    /// Releases a pin taken by [`Region::pin`].
    pub fn unpin(&self, off: usize, len: usize) -> Result<()> {
        self.check(off, len)?;
        self.pager.unpin(self.addr + off, len)
    }
    /// Swaps out the whole region; returns pages written.
    pub fn swap_out(&self) -> Result<usize> {
        self.pager.swap_out(self.addr, self.len)
    }
    /// Brings the whole region in; returns pages brought in.
    pub fn prefetch(&self) -> Result<usize> {
        self.pager.prefetch(self.addr, self.len)
    }
    /// Residency of each page.
    pub fn resident(&self) -> Result<Vec<bool>> {
        self.pager.resident(self.addr, self.len)
    }
    /// Number of resident pages.
    pub fn resident_count(&self) -> Result<usize> {
        self.pager.resident_count(self.addr, self.len)
    }
    fn check(&self, off: usize, len: usize) -> Result<()> {
        if !self.live || !off.checked_add(len).is_some_and(|e| e <= self.len) || len == 0 {
            return Err(Error::InvalidRange {
                addr: self.addr.wrapping_add(off),
                len,
                why: "outside the region",
            });
        }
        Ok(())
    }
    /// Unregisters now; a second call returns [`Error::AlreadyUnregistered`].
    pub fn unregister(&mut self) -> Result<()> {
        if !self.live {
            return Err(Error::AlreadyUnregistered(self.addr));
        }
        self.live = false;
        self.pager.unregister(self.id)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.live {
            let _ = self.unregister();
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}
