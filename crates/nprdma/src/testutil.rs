//! Test doubles shared by the unit tests: a recording fake IOMMU and an
//! in-memory fake memory manager.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::nic::{Access, Frame, IommuControl, ListenerId, MemoryManager, NicMr, SwapListener};
use crate::shadow::VersionTable;

#[derive(Debug, thiserror::Error)]
#[error("fake iommu: {0}")]
pub(crate) struct FakeErr(pub(crate) &'static str);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FakeRange {
    pub(crate) id: u64,
    pub(crate) npages: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ev {
    Map {
        range: u64,
        idx: u64,
        frame: Frame,
        version: Option<u32>,
    },
    Flush,
    Resident {
        addr: u64,
        resident: bool,
    },
}

pub(crate) struct FakeMr;
impl NicMr for FakeMr {
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn addr(&self) -> u64 {
        0
    }
    fn len(&self) -> u64 {
        0
    }
}

#[derive(Default)]
pub(crate) struct FakeIommu {
    pub(crate) next: AtomicU64,
    pub(crate) frames: Mutex<HashMap<(u64, u64), Frame>>,
    pub(crate) live: Mutex<HashSet<u64>>,
    pub(crate) log: Mutex<Vec<Ev>>,
    pub(crate) probe: OnceLock<Arc<VersionTable>>,
}

impl FakeIommu {
    pub(crate) fn frame(&self, r: &FakeRange, idx: u64) -> Frame {
        *self
            .frames
            .lock()
            .unwrap()
            .get(&(r.id, idx))
            .unwrap_or(&Frame::Unmapped)
    }
    pub(crate) fn take_log(&self) -> Vec<Ev> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

impl IommuControl for FakeIommu {
    type Error = FakeErr;
    type Range = FakeRange;
    type Mr = FakeMr;
    const ENTRY_BYTES: usize = std::mem::size_of::<Frame>();
    fn alloc_range(&self, npages: u64) -> Result<FakeRange, FakeErr> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.live.lock().unwrap().insert(id);
        Ok(FakeRange { id, npages })
    }
    fn free_range(&self, r: FakeRange) -> Result<(), FakeErr> {
        if !self.live.lock().unwrap().remove(&r.id) {
            return Err(FakeErr("double free"));
        }
        Ok(())
    }
    fn map(&self, r: &FakeRange, idx: u64, frame: Frame) -> Result<(), FakeErr> {
        if idx >= r.npages || !self.live.lock().unwrap().contains(&r.id) {
            return Err(FakeErr("bad index"));
        }
        self.frames.lock().unwrap().insert((r.id, idx), frame);
        let version = self.probe.get().and_then(|v| v.get(idx as usize));
        self.log.lock().unwrap().push(Ev::Map {
            range: r.id,
            idx,
            frame,
            version,
        });
        Ok(())
    }
    fn flush(&self) -> Result<(), FakeErr> {
        self.log.lock().unwrap().push(Ev::Flush);
        Ok(())
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        _: u64,
        _: u64,
        _: Access,
        _: &FakeRange,
    ) -> Result<FakeMr, FakeErr> {
        Ok(FakeMr)
    }
    fn set_resident(&self, addr: u64, _len: u64, resident: bool) -> Result<(), FakeErr> {
        self.log
            .lock()
            .unwrap()
            .push(Ev::Resident { addr, resident });
        Ok(())
    }
}

/// Pages 0x1000..0x10000 exist; `pin` fails on page 0xbad000.
#[derive(Default)]
pub(crate) struct FakeMem {
    pub(crate) pins: Mutex<HashMap<u64, u32>>,
    pub(crate) resident: Mutex<HashMap<u64, bool>>,
    pub(crate) listeners: Mutex<Vec<(ListenerId, Arc<dyn SwapListener>)>>,
}

impl FakeMem {
    pub(crate) fn pages(addr: u64, len: u64) -> impl Iterator<Item = u64> {
        let first = addr & !0xfff;
        let end = addr + len;
        (0..)
            .map(move |i| first + i * 0x1000)
            .take_while(move |p| *p < end)
    }
    pub(crate) fn pin_count(&self, p: u64) -> u32 {
        *self.pins.lock().unwrap().get(&p).unwrap_or(&0)
    }
    pub(crate) fn evict(&self, p: u64) -> bool {
        if self.pin_count(p) > 0 {
            return false;
        }
        for (_, l) in self.listeners.lock().unwrap().iter() {
            l.before_swap_out(&[p]);
        }
        self.resident.lock().unwrap().insert(p, false);
        true
    }
}

impl MemoryManager for FakeMem {
    type Error = FakeErr;
    fn page_size(&self) -> usize {
        4096
    }
    fn is_resident(&self, addr: u64) -> bool {
        *self
            .resident
            .lock()
            .unwrap()
            .get(&(addr & !0xfff))
            .unwrap_or(&true)
    }
    fn residency(&self, addr: u64, len: u64, out: &mut Vec<bool>) -> Result<(), FakeErr> {
        out.extend(Self::pages(addr, len).map(|p| self.is_resident(p)));
        Ok(())
    }
    fn pin(&self, addr: u64, len: u64) -> Result<(), FakeErr> {
        if Self::pages(addr, len).any(|p| p == 0xbad000) {
            return Err(FakeErr("cannot pin"));
        }
        let mut pins = self.pins.lock().unwrap();
        for p in Self::pages(addr, len) {
            *pins.entry(p).or_default() += 1;
            self.resident.lock().unwrap().insert(p, true);
        }
        Ok(())
    }
    fn unpin(&self, addr: u64, len: u64) -> Result<(), FakeErr> {
        let mut pins = self.pins.lock().unwrap();
        if Self::pages(addr, len).any(|p| pins.get(&p).copied().unwrap_or(0) == 0) {
            return Err(FakeErr("unpin without pin"));
        }
        for p in Self::pages(addr, len) {
            *pins.get_mut(&p).unwrap() -= 1;
        }
        Ok(())
    }
    fn add_swap_listener(&self, l: Arc<dyn SwapListener>) -> ListenerId {
        let mut ls = self.listeners.lock().unwrap();
        let id = ListenerId(ls.len() as u64 + 1);
        ls.push((id, l));
        id
    }
    fn remove_swap_listener(&self, id: ListenerId) {
        self.listeners.lock().unwrap().retain(|(i, _)| *i != id);
    }
}
