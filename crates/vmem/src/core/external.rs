//! The external notification API for memory the application pages itself.

use super::{page_range, Inner, Segs};
use crate::error::{Error, Result};
use crate::mm::PAGE_SHIFT;
use crate::state::{self, RESIDENT, SWAPPED};
use std::sync::atomic::Ordering::*;

impl Inner {
    fn external_segments(&self, addr: usize, len: usize) -> Result<(usize, usize, Segs)> {
        let (p0, p1) = page_range(addr, len)?;
        let segs = self.segments_for(p0, p1)?;
        if segs.iter().any(|s| !s.arr.external) {
            return Err(Error::InvalidRange {
                addr,
                len,
                why: "not an externally managed region",
            });
        }
        Ok((p0, p1, segs))
    }

    pub fn notify_swapped_out(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1, segs) = self.external_segments(addr, len)?;
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                if state::pins(s.arr.word(p).load(Acquire)) > 0 {
                    return Err(Error::Pinned(p << PAGE_SHIFT));
                }
            }
        }
        let pages: Vec<usize> = (p0..p1).map(|p| p << PAGE_SHIFT).collect();
        self.listeners.before_swap_out(&pages);
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let _ = state::update(s.arr.word(p), |cur| Some(state::with_kind(cur, SWAPPED)));
            }
        }
        Ok(())
    }

    pub fn notify_swapped_in(&self, addr: usize, len: usize) -> Result<()> {
        let (p0, p1, segs) = self.external_segments(addr, len)?;
        for s in &segs {
            for p in s.start.max(p0)..s.end.min(p1) {
                let _ = state::update(s.arr.word(p), |cur| Some(state::with_kind(cur, RESIDENT)));
            }
        }
        let pages: Vec<usize> = (p0..p1).map(|p| p << PAGE_SHIFT).collect();
        self.listeners.after_swap_in(&pages);
        Ok(())
    }
}
