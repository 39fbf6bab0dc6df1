//! Test doubles shared by the unit tests: a recording fake IOMMU, an
//! in-memory fake memory manager, and a fake NIC ([`FakeNic`]) that runs
//! verbs synchronously on an in-memory fabric, checked against the same
//! contract as the software NIC's adapter ([`verbs_contract`]).
#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::ctrl::AtomicKind;
use crate::nic::{
    Access, CompOp, Completion, DeviceCaps, Frame, IommuControl, ListenerId, MemoryManager, Nic,
    NicBuf, NicCq, NicMr, NicQp, PeerAddr, PostError, QpSpec, RecvRequest, SwapListener, WcStatus,
    WorkRequest, WrOp,
};
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
    /// Accessed bits: (range, index) pages DMA reached ([`FakeIommu::touch`]).
    pub(crate) accessed: Mutex<HashSet<(u64, u64)>>,
}

impl FakeIommu {
    /// A DMA reached page `idx` of `r` (sets its accessed bit).
    pub(crate) fn touch(&self, r: &FakeRange, idx: u64) {
        self.accessed.lock().unwrap().insert((r.id, idx));
    }
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
    fn set_mr_rights(
        &self,
        _mr: &mut FakeMr,
        _access: Access,
        _domain: u32,
    ) -> Result<(), FakeErr> {
        Ok(())
    }
    fn test_and_clear_young(&self, r: &FakeRange, idx: u64) -> Result<bool, FakeErr> {
        if idx >= r.npages {
            return Err(FakeErr("bad index"));
        }
        Ok(self.accessed.lock().unwrap().remove(&(r.id, idx)))
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        _: u64,
        _: u64,
        _: Access,
        _: &FakeRange,
        _: u32,
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
        let mut ok = true;
        for (_, l) in self.listeners.lock().unwrap().iter() {
            ok &= l.before_swap_out(&[p]);
        }
        if !ok {
            return false;
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

// ---- The verbs contract NP-RDMA relies on: `nic::contract` ----

pub(crate) use crate::nic::contract::{
    buffers_and_access_contract, iommu_contract, verbs_contract,
};

// ---- A fake NIC: verbs executed synchronously on this CPU ----

/// The fake NIC's errors (post-time refusals).
#[derive(Debug, thiserror::Error)]
#[error("fake nic: {0}")]
pub(crate) struct FakeNicErr(pub(crate) &'static str);

#[derive(Clone, Copy)]
struct FakeRegion {
    addr: u64,
    len: u64,
    access: Access,
    /// Translated through this IOVA range of the fabric (MTT page i → range
    /// page i, counted from `addr`'s page); `None`: identity.
    iova: Option<u64>,
}

/// Page size of the fake NIC's IOMMU.
const FAKE_PS: u64 = 4096;
/// The magic word of the fake NIC's signature page.
pub(crate) const FAKE_MAGIC: u32 = 0x6e70_7264;

impl FakeRegion {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

struct FakeQpRec {
    nic: u8,
    peer: Option<(u8, u32)>,
    access: Access,
    err: bool,
    send_cq: u64,
    recv_cq: u64,
    recvs: VecDeque<(u64, Vec<crate::nic::Sge>)>,
}

#[derive(Default)]
struct Fabric {
    next: u32,
    /// key → (owning NIC, region); one key serves as lkey and rkey.
    mrs: HashMap<u32, (u8, FakeRegion)>,
    qps: HashMap<u32, FakeQpRec>,
    cqs: HashMap<u64, VecDeque<Completion>>,
    /// IOVA ranges: their pages' frames.
    ranges: HashMap<u64, Vec<Frame>>,
    /// Signaled on every completion (the completion channels of all NICs).
    wake: Arc<std::sync::Condvar>,
    /// Serving passes over the (modelled) request rings, `Nic::ring_passes`:
    /// only [`FakeNic::count_ring_pass`] moves it (WRs execute at post time).
    ring_passes: u64,
}

impl Fabric {
    fn id(&mut self) -> u32 {
        self.next += 1;
        self.next
    }
    /// The region behind key `key` of NIC `nic` covering the range with
    /// `need` (`None`: no such right).
    fn region(&self, nic: u8, key: u32, addr: u64, len: u64, need: Access) -> Option<FakeRegion> {
        let (n, r) = self.mrs.get(&key)?;
        (*n == nic && r.covers(addr, len) && r.access.contains(need)).then_some(*r)
    }
    fn complete(&mut self, cq: u64, c: Completion) {
        self.cqs.entry(cq).or_default().push_back(c);
        self.wake.notify_all();
    }
    /// Calls `f(chunk_addr, chunk_len, frame)` for the page-bounded chunks
    /// of `[addr, addr+len)` of region `r` (validated): the process address
    /// the DMA reaches (`Ram`), or the special frame. False if a page is
    /// unmapped (nothing was called for it or after it).
    fn walk(
        &self,
        r: &FakeRegion,
        addr: u64,
        len: u64,
        mut f: impl FnMut(u64, u64, Frame),
    ) -> bool {
        let Some(range) = r.iova else {
            f(addr, len, Frame::Ram(addr));
            return true;
        };
        let frames = &self.ranges[&range];
        let mut at = addr;
        let end = addr + len;
        while at < end {
            let n = (FAKE_PS - at % FAKE_PS).min(end - at);
            let page = (at / FAKE_PS - r.addr / FAKE_PS) as usize;
            match frames.get(page).copied().unwrap_or(Frame::Unmapped) {
                Frame::Unmapped => return false,
                Frame::Ram(p) => f(p + at % FAKE_PS, n, Frame::Ram(p)),
                other => f(at, n, other),
            }
            at += n;
        }
        true
    }
    /// The DMA read of `[addr, addr+len)` through region `r`.
    fn dma_read(&self, r: &FakeRegion, addr: u64, len: u64) -> Option<Vec<u8>> {
        let mut d = Vec::with_capacity(len as usize);
        let mut mapped = true;
        let walked = self.walk(r, addr, len, |a, n, fr| match fr {
            Frame::Ram(_) => match crate::mem::read(a, n as usize) {
                Ok(v) => d.extend(v),
                Err(_) => mapped = false,
            },
            Frame::Signature => {
                let m = FAKE_MAGIC.to_le_bytes();
                d.extend((a..a + n).map(|x| m[(x % 4) as usize]));
            }
            _ => d.extend(std::iter::repeat_n(0, n as usize)),
        });
        (walked && mapped).then_some(d)
    }
    /// The DMA write of `data` to `addr` through region `r`.
    fn dma_write(&self, r: &FakeRegion, addr: u64, data: &[u8]) -> bool {
        let mut off = 0usize;
        let mut mapped = true;
        let walked = self.walk(r, addr, data.len() as u64, |a, n, fr| {
            if let Frame::Ram(_) = fr {
                mapped &= crate::mem::write(a, &data[off..off + n as usize]).is_ok();
            }
            off += n as usize;
        });
        walked && mapped
    }
}

/// One PD of a fake NIC on a shared in-memory fabric ([`FakeNic::pair`]):
/// WRs execute at post time, on the posting thread, against this process's
/// memory, with the verbs' checks (keys, bounds, rights, RECVs) and
/// completions. Without IOMMU control (user-space mode), or with it
/// ([`FakeNic::pair_with_iommu`]: MRs over IOVA ranges whose pages name
/// process memory or the signature / black-hole page, what the engine runs
/// on).
pub(crate) struct FakeNic {
    id: u8,
    fabric: Arc<Mutex<Fabric>>,
    iommu: Option<Arc<FakeNicIommu>>,
}

impl FakeNic {
    /// Two NICs on one fabric, without IOMMU control.
    pub(crate) fn pair() -> (FakeNic, FakeNic) {
        Self::pair_of(false)
    }
    /// Two NICs on one fabric, with IOMMU control.
    pub(crate) fn pair_with_iommu() -> (FakeNic, FakeNic) {
        Self::pair_of(true)
    }
    /// Two NICs on one fabric, the first with IOMMU control, the second
    /// without (kernel-module mode facing user-space mode).
    pub(crate) fn pair_mixed() -> (FakeNic, FakeNic) {
        let (a, _) = Self::pair_of(true);
        let (_, mut b) = Self::pair_of(false);
        b.fabric = a.fabric.clone();
        (a, b)
    }
    fn pair_of(iommu: bool) -> (FakeNic, FakeNic) {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        let nic = |id| FakeNic {
            id,
            fabric: fabric.clone(),
            iommu: iommu.then(|| {
                Arc::new(FakeNicIommu {
                    id,
                    fabric: fabric.clone(),
                })
            }),
        };
        (nic(1), nic(2))
    }
    /// Count a serving pass over the request rings, as a CQ poll that served
    /// peers' requests does on the software NIC.
    pub(crate) fn count_ring_pass(&self) {
        self.fabric.lock().expect("fabric").ring_passes += 1;
    }
}

/// The IOMMU control of a [`FakeNic`]: ranges of frames in the fabric,
/// consulted page by page by every DMA through an IOVA MR. A DMA runs under
/// the fabric's lock, so a remap is never concurrent with one and `flush`
/// has nothing to wait for.
pub(crate) struct FakeNicIommu {
    id: u8,
    fabric: Arc<Mutex<Fabric>>,
}

impl IommuControl for FakeNicIommu {
    type Error = FakeNicErr;
    type Range = FakeRange;
    type Mr = FakeNicMr;
    const ENTRY_BYTES: usize = 8;
    fn alloc_range(&self, npages: u64) -> Result<FakeRange, FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let id = u64::from(f.id());
        f.ranges.insert(id, vec![Frame::Unmapped; npages as usize]);
        Ok(FakeRange { id, npages })
    }
    fn free_range(&self, r: FakeRange) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        f.ranges
            .remove(&r.id)
            .map(drop)
            .ok_or(FakeNicErr("no such range"))
    }
    fn map(&self, r: &FakeRange, idx: u64, frame: Frame) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let p = f
            .ranges
            .get_mut(&r.id)
            .and_then(|v| v.get_mut(idx as usize))
            .ok_or(FakeNicErr("bad IOVA page"))?;
        *p = frame;
        Ok(())
    }
    fn flush(&self) -> Result<(), FakeNicErr> {
        Ok(())
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        r: &FakeRange,
        _domain: u32,
    ) -> Result<FakeNicMr, FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let pages = (addr + len).div_ceil(FAKE_PS) - addr / FAKE_PS;
        if len == 0 || !f.ranges.contains_key(&r.id) || pages > r.npages {
            return Err(FakeNicErr("bad IOVA registration"));
        }
        let key = f.id();
        let region = FakeRegion {
            addr,
            len,
            access,
            iova: Some(r.id),
        };
        f.mrs.insert(key, (self.id, region));
        Ok(FakeNicMr {
            key,
            region,
            fabric: self.fabric.clone(),
        })
    }
    fn set_mr_rights(
        &self,
        mr: &mut FakeNicMr,
        access: Access,
        _domain: u32,
    ) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let e = f.mrs.get_mut(&mr.key).ok_or(FakeNicErr("no such MR"))?;
        e.1.access = access;
        mr.region.access = access;
        Ok(())
    }
    fn set_resident(&self, _addr: u64, _len: u64, _resident: bool) -> Result<(), FakeNicErr> {
        Ok(())
    }
}

/// A registered region of a [`FakeNic`]; deregistered on drop.
pub(crate) struct FakeNicMr {
    key: u32,
    region: FakeRegion,
    fabric: Arc<Mutex<Fabric>>,
}

impl NicMr for FakeNicMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn addr(&self) -> u64 {
        self.region.addr
    }
    fn len(&self) -> u64 {
        self.region.len
    }
}

impl Drop for FakeNicMr {
    fn drop(&mut self) {
        self.fabric.lock().expect("fabric").mrs.remove(&self.key);
    }
}

/// An owned registered buffer of a [`FakeNic`] (heap memory; the
/// registration drops first).
pub(crate) struct FakeBuf {
    mr: FakeNicMr,
    mem: Box<[std::cell::UnsafeCell<u8>]>,
}

// SAFETY: the bytes are only reached through raw-pointer copies (the fake
// NIC's DMA and `read`), like a NIC-written buffer.
#[allow(unsafe_code)]
unsafe impl Sync for FakeBuf {}

impl NicMr for FakeBuf {
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    fn addr(&self) -> u64 {
        self.mr.addr()
    }
    fn len(&self) -> u64 {
        self.mr.len()
    }
}

impl NicBuf for FakeBuf {
    fn read(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.mem.len(), "read out of bounds");
        crate::mem::read_into(self.addr() + off as u64, out)
            .expect("the fake's own buffer is mapped");
    }
}

/// A CQ of a [`FakeNic`].
pub(crate) struct FakeCq {
    id: u64,
    fabric: Arc<Mutex<Fabric>>,
}

impl NicCq for FakeCq {
    type Error = FakeNicErr;
    fn poll(&self, out: &mut [Completion]) -> Result<usize, FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.cqs.entry(self.id).or_default();
        let n = out.len().min(q.len());
        for o in out.iter_mut().take(n) {
            *o = q.pop_front().expect("counted");
        }
        Ok(n)
    }
    fn arm(&self, _solicited_only: bool) -> Result<(), FakeNicErr> {
        Ok(())
    }
    fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

/// An RC QP of a [`FakeNic`].
pub(crate) struct FakeQp {
    qpn: u32,
    fabric: Arc<Mutex<Fabric>>,
}

/// Scatter `data` over the SGEs `sges` of NIC `nic` (validated: their
/// regions exist); false if a page is unmapped.
fn scatter(f: &Fabric, nic: u8, sges: &[crate::nic::Sge], data: &[u8]) -> bool {
    let mut off = 0;
    for s in sges {
        let n = (s.length as usize).min(data.len() - off);
        let Some(r) = f.region(nic, s.lkey, s.addr, n as u64, Access(0)) else {
            return false;
        };
        if !f.dma_write(&r, s.addr, &data[off..off + n]) {
            return false;
        }
        off += n;
    }
    true
}

impl FakeQp {
    /// Execute one WR; its completion status.
    fn execute(&self, f: &mut Fabric, me: u8, w: &WorkRequest<'_>) -> (WcStatus, u32) {
        let q = &f.qps[&self.qpn];
        if q.err {
            return (WcStatus::WrFlushErr, 0);
        }
        let Some((pn, pq)) = q.peer else {
            return (WcStatus::RetryExcErr, 0);
        };
        let len: u64 = w.sg_list.iter().map(|s| u64::from(s.length)).sum();
        let local_write = matches!(
            w.op,
            WrOp::Read | WrOp::CmpSwap { .. } | WrOp::FetchAdd { .. }
        );
        let need = if local_write {
            Access::LOCAL_WRITE
        } else {
            Access(0)
        };
        if !w.inline
            && w.sg_list.iter().any(|s| {
                f.region(me, s.lkey, s.addr, u64::from(s.length), need)
                    .is_none()
            })
        {
            return (WcStatus::LocProtErr, 0);
        }
        let gather = |f: &Fabric| {
            let mut d = Vec::new();
            for s in w.sg_list {
                if w.inline {
                    d.extend(crate::mem::read(s.addr, s.length as usize).ok()?);
                    continue;
                }
                let r = f.region(me, s.lkey, s.addr, u64::from(s.length), Access(0))?;
                d.extend(f.dma_read(&r, s.addr, u64::from(s.length))?);
            }
            Some(d)
        };
        let Some(peer) = f.qps.get(&pq).filter(|p| p.nic == pn && !p.err) else {
            return (WcStatus::RetryExcErr, 0);
        };
        let (peer_access, peer_recv_cq) = (peer.access, peer.recv_cq);
        // The QP's flags filter remote requests, except to `ANY_QP` MRs.
        let remote = |need: Access| {
            f.region(pn, w.rkey, w.remote_addr, len, need)
                .filter(|r| peer_access.contains(need) || r.access.contains(Access::ANY_QP))
        };
        match w.op {
            WrOp::Write | WrOp::WriteImm(_) => {
                let Some(r) = remote(Access::REMOTE_WRITE) else {
                    return (WcStatus::RemAccessErr, 0);
                };
                let Some(d) = gather(f) else {
                    return (WcStatus::LocProtErr, 0);
                };
                if !f.dma_write(&r, w.remote_addr, &d) {
                    return (WcStatus::RemAccessErr, 0);
                }
                (WcStatus::Success, len as u32)
            }
            WrOp::Read => {
                let Some(r) = remote(Access::REMOTE_READ) else {
                    return (WcStatus::RemAccessErr, 0);
                };
                let Some(d) = f.dma_read(&r, w.remote_addr, len) else {
                    return (WcStatus::RemAccessErr, 0);
                };
                if !scatter(f, me, w.sg_list, &d) {
                    return (WcStatus::LocProtErr, 0);
                }
                (WcStatus::Success, len as u32)
            }
            WrOp::CmpSwap { .. } | WrOp::FetchAdd { .. } => {
                let Some(r) = remote(Access::REMOTE_ATOMIC).filter(|_| len == 8) else {
                    return (WcStatus::RemAccessErr, 0);
                };
                let mut at = None;
                f.walk(&r, w.remote_addr, 8, |a, _, fr| {
                    if let Frame::Ram(_) = fr {
                        at = Some(a);
                    }
                });
                let (kind, compare_add, swap) = match w.op {
                    WrOp::CmpSwap { compare, swap } => (AtomicKind::CmpSwap, compare, swap),
                    WrOp::FetchAdd { add } => (AtomicKind::FetchAdd, add, 0),
                    _ => unreachable!("atomic opcodes only"),
                };
                let old = match at.and_then(|a| crate::mem::atomic(a, kind, compare_add, swap)) {
                    Some(Ok(v)) => v,
                    Some(Err(_)) => return (WcStatus::RemAccessErr, 0),
                    None => return (WcStatus::RemInvReqErr, 0),
                };
                if !scatter(f, me, w.sg_list, &old.to_le_bytes()) {
                    return (WcStatus::LocProtErr, 0);
                }
                (WcStatus::Success, 8)
            }
            WrOp::Send | WrOp::SendImm(_) => {
                let Some(data) = gather(f) else {
                    return (WcStatus::LocProtErr, 0);
                };
                let peer = f.qps.get_mut(&pq).expect("looked up");
                let Some((rid, rsges)) = peer.recvs.pop_front() else {
                    return (WcStatus::RnrRetryExcErr, 0);
                };
                let room: u64 = rsges.iter().map(|s| u64::from(s.length)).sum();
                let imm = match w.op {
                    WrOp::SendImm(i) => Some(i),
                    _ => None,
                };
                let mut c = Completion {
                    wr_id: rid,
                    status: 0,
                    op: CompOp::Recv,
                    byte_len: data.len() as u32,
                    imm,
                    qp_num: pq,
                };
                let fits = data.len() as u64 <= room
                    && rsges.iter().all(|s| {
                        f.region(pn, s.lkey, s.addr, u64::from(s.length), Access::LOCAL_WRITE)
                            .is_some()
                    });
                if !fits || !scatter(f, pn, &rsges, &data) {
                    c.status = WcStatus::LocLenErr.code();
                    c.byte_len = 0;
                    f.complete(peer_recv_cq, c);
                    return (WcStatus::RemInvReqErr, 0);
                }
                f.complete(peer_recv_cq, c);
                (WcStatus::Success, data.len() as u32)
            }
        }
    }
}

impl NicQp for FakeQp {
    type Error = FakeNicErr;
    fn qpn(&self) -> u32 {
        self.qpn
    }
    fn connect(&self, peer: PeerAddr, peer_qpn: u32, access: Access) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.qps.get_mut(&self.qpn).ok_or(FakeNicErr("no such QP"))?;
        q.peer = Some((peer.0[0], peer_qpn));
        q.access = access;
        Ok(())
    }
    fn set_access(&self, access: Access) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.qps.get_mut(&self.qpn).ok_or(FakeNicErr("no such QP"))?;
        q.access = access;
        Ok(())
    }
    fn reset(&self) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.qps.get_mut(&self.qpn).ok_or(FakeNicErr("no such QP"))?;
        q.err = false;
        q.peer = None;
        q.recvs.clear();
        Ok(())
    }
    fn post_send(&self, wrs: &[WorkRequest<'_>]) -> Result<(), PostError<FakeNicErr>> {
        let mut f = self.fabric.lock().expect("fabric");
        let (me, cq) = {
            let q = &f.qps[&self.qpn];
            (q.nic, q.send_cq)
        };
        for w in wrs {
            let (status, byte_len) = self.execute(&mut f, me, w);
            if status != WcStatus::Success {
                // RC: the QP fails; the WRs behind complete flushed.
                f.qps.get_mut(&self.qpn).expect("exists").err = true;
            }
            if w.signaled || status != WcStatus::Success {
                let op = match w.op {
                    WrOp::Write | WrOp::WriteImm(_) => CompOp::Write,
                    WrOp::Read => CompOp::Read,
                    WrOp::Send | WrOp::SendImm(_) => CompOp::Send,
                    WrOp::CmpSwap { .. } => CompOp::CmpSwap,
                    WrOp::FetchAdd { .. } => CompOp::FetchAdd,
                };
                let c = Completion {
                    wr_id: w.wr_id,
                    status: status.code(),
                    op,
                    byte_len,
                    imm: None,
                    qp_num: self.qpn,
                };
                f.complete(cq, c);
            }
        }
        Ok(())
    }
    fn post_recv(&self, wrs: &[RecvRequest<'_>]) -> Result<(), PostError<FakeNicErr>> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.qps.get_mut(&self.qpn).expect("exists");
        let (err, cq) = (q.err, q.recv_cq);
        for w in wrs {
            if err {
                let c = Completion {
                    wr_id: w.wr_id,
                    status: Completion::WR_FLUSH_ERR,
                    op: CompOp::Recv,
                    ..Completion::default()
                };
                f.complete(cq, c);
            } else {
                let q = f.qps.get_mut(&self.qpn).expect("exists");
                q.recvs.push_back((w.wr_id, w.sg_list.to_vec()));
            }
        }
        Ok(())
    }
    fn set_error(&self) -> Result<(), FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let q = f.qps.get_mut(&self.qpn).expect("exists");
        q.err = true;
        let cq = q.recv_cq;
        let flushed: Vec<u64> = q.recvs.drain(..).map(|(id, _)| id).collect();
        for wr_id in flushed {
            let c = Completion {
                wr_id,
                status: Completion::WR_FLUSH_ERR,
                op: CompOp::Recv,
                qp_num: self.qpn,
                ..Completion::default()
            };
            f.complete(cq, c);
        }
        Ok(())
    }
}

impl Nic for FakeNic {
    type Error = FakeNicErr;
    type Mr = FakeNicMr;
    type Cq = FakeCq;
    type Qp = FakeQp;
    type Buf = FakeBuf;
    type Iommu = FakeNicIommu;
    type Stats = ();
    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            max_tlp: 256,
            magic: FAKE_MAGIC,
            page_size: 4096,
            max_qp_wr: 1024,
            max_sge: 16,
            max_inline: 256,
            iommu: self.iommu.is_some(),
            max_cqe: 1 << 16,
        }
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<FakeNicMr, FakeNicErr> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(FakeNicErr("bad range"));
        }
        let mut f = self.fabric.lock().expect("fabric");
        let key = f.id();
        let region = FakeRegion {
            addr,
            len,
            access,
            iova: None,
        };
        f.mrs.insert(key, (self.id, region));
        Ok(FakeNicMr {
            key,
            region,
            fabric: self.fabric.clone(),
        })
    }
    fn alloc_buf(&self, len: usize, access: Access) -> Result<FakeBuf, FakeNicErr> {
        let mem: Box<[std::cell::UnsafeCell<u8>]> = (0..len.max(1))
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect();
        #[allow(unsafe_code)]
        // SAFETY: the memory is owned by the buffer, which drops the
        // registration (its first field) before the memory.
        let mr = unsafe { self.reg_mr(mem.as_ptr() as u64, len as u64, access)? };
        Ok(FakeBuf { mr, mem })
    }
    fn create_cq(&self, _depth: u32) -> Result<FakeCq, FakeNicErr> {
        let id = u64::from(self.fabric.lock().expect("fabric").id());
        Ok(FakeCq {
            id,
            fabric: self.fabric.clone(),
        })
    }
    fn create_qp(
        &self,
        spec: &QpSpec,
        send_cq: &FakeCq,
        recv_cq: &FakeCq,
    ) -> Result<FakeQp, FakeNicErr> {
        let mut f = self.fabric.lock().expect("fabric");
        let qpn = match spec.qpn {
            Some(n) if f.qps.contains_key(&n) => return Err(FakeNicErr("QPN in use")),
            Some(n) => n,
            None => f.id(),
        };
        f.qps.insert(
            qpn,
            FakeQpRec {
                nic: self.id,
                peer: None,
                access: Access(0),
                err: false,
                send_cq: send_cq.id,
                recv_cq: recv_cq.id,
                recvs: VecDeque::new(),
            },
        );
        Ok(FakeQp {
            qpn,
            fabric: self.fabric.clone(),
        })
    }
    fn addr(&self) -> PeerAddr {
        PeerAddr([self.id; 16])
    }
    fn iommu(&self) -> Option<Arc<FakeNicIommu>> {
        self.iommu.clone()
    }
    fn wait_event(&self, timeout: Duration) -> Result<bool, FakeNicErr> {
        // Any completion on the fabric counts as an event (the caller
        // polls its CQs anyway).
        let f = self.fabric.lock().expect("fabric");
        let wake = f.wake.clone();
        let (_f, t) = wake.wait_timeout(f, timeout).expect("fabric");
        Ok(!t.timed_out())
    }
    fn stats(&self) {}
    fn ring_passes(&self) -> u64 {
        self.fabric.lock().expect("fabric").ring_passes
    }
}

impl crate::engine::Backend for FakeNic {
    fn error(e: FakeNicErr) -> crate::engine::Error {
        crate::engine::Error::Other(e.to_string())
    }
}
