//! Tests of the interface helpers with an in-memory fake memory manager.

use std::collections::HashMap;
use std::sync::Mutex;

use super::*;

#[derive(Debug, thiserror::Error)]
#[error("fake: {0}")]
struct FakeErr(&'static str);

/// Pages 0x1000..0x10000 exist; `pin` fails on page 0xbad000.
#[derive(Default)]
struct FakeMem {
    pins: Mutex<HashMap<u64, u32>>,
    resident: Mutex<HashMap<u64, bool>>,
    listeners: Mutex<Vec<(ListenerId, Arc<dyn SwapListener>)>>,
}

impl FakeMem {
    fn pages(addr: u64, len: u64) -> impl Iterator<Item = u64> {
        let first = addr & !0xfff;
        let end = addr + len;
        (0..)
            .map(move |i| first + i * 0x1000)
            .take_while(move |p| *p < end)
    }
    fn pin_count(&self, p: u64) -> u32 {
        *self.pins.lock().unwrap().get(&p).unwrap_or(&0)
    }
    fn evict(&self, p: u64) -> bool {
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

#[test]
fn pinned_guard_unpins_on_drop_and_release() {
    let mm = Arc::new(FakeMem::default());
    {
        let g = Pinned::new(mm.clone(), 0x1ff0, 0x20).unwrap();
        assert_eq!(g.range(), (0x1ff0, 0x20));
        assert_eq!((mm.pin_count(0x1000), mm.pin_count(0x2000)), (1, 1));
        assert!(!mm.evict(0x2000), "pinned page must not be evicted");
        let g2 = Pinned::new(mm.clone(), 0x2000, 1).unwrap();
        assert_eq!(mm.pin_count(0x2000), 2);
        g2.release().unwrap();
        assert_eq!(mm.pin_count(0x2000), 1);
        drop(g);
    }
    assert_eq!((mm.pin_count(0x1000), mm.pin_count(0x2000)), (0, 0));
    assert!(mm.evict(0x2000));
    assert!(!mm.is_resident(0x2abc));
    // Pinning brings it back.
    let g = Pinned::new(mm.clone(), 0x2000, 4096).unwrap();
    assert!(mm.is_resident(0x2000));
    drop(g);
}

#[test]
fn failed_pin_leaves_nothing_pinned() {
    let mm = Arc::new(FakeMem::default());
    assert!(Pinned::new(mm.clone(), 0xbac000, 0x3000).is_err());
    assert_eq!(mm.pin_count(0xbac000), 0);
    assert!(mm.pins.lock().unwrap().values().all(|c| *c == 0));
    // Double unpin through the trait is reported, not a panic.
    assert!(mm.unpin(0x1000, 1).is_err());
}

struct Recorder(Mutex<Vec<u64>>);
impl SwapListener for Recorder {
    fn before_swap_out(&self, pages: &[u64]) {
        self.0.lock().unwrap().extend_from_slice(pages);
    }
}

#[test]
fn listeners_hear_swap_outs_until_removed() {
    let mm = FakeMem::default();
    let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
    let id = mm.add_swap_listener(rec.clone());
    assert!(mm.evict(0x5000));
    mm.remove_swap_listener(id);
    assert!(mm.evict(0x6000));
    assert_eq!(*rec.0.lock().unwrap(), vec![0x5000]);
    let mut v = Vec::new();
    mm.residency(0x4000, 0x3000, &mut v).unwrap();
    assert_eq!(v, vec![true, false, false]);
}

#[test]
fn access_flags_compose() {
    let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
    assert!(a.contains(Access::REMOTE_READ));
    assert!(!a.contains(Access::REMOTE_WRITE));
    assert_eq!(a.0, 5);
    assert!(Completion::default().is_ok());
}
