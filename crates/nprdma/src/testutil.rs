//! Test doubles shared by the unit tests: a recording fake IOMMU, an
//! in-memory fake memory manager, and a fake NIC ([`FakeNic`]) that runs
//! verbs synchronously on an in-memory fabric, checked against the same
//! contract as the software NIC's adapter ([`verbs_contract`]).
#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::nic::{
    Access, CompOp, Completion, DeviceCaps, Frame, IommuControl, ListenerId, MemoryManager, Nic,
    NicCq, NicMr, NicQp, PeerAddr, PostError, QpSpec, RecvRequest, Sge, SwapListener, WcStatus,
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

// ---- The verbs contract NP-RDMA relies on ----

/// Wait for one completion on `cq` (panics after 5 s).
fn one<C: NicCq>(cq: &C) -> Completion {
    let t0 = Instant::now();
    let mut c = [Completion::default(); 1];
    while t0.elapsed() < Duration::from_secs(5) {
        if cq.poll(&mut c).expect("poll") == 1 {
            return c[0];
        }
        std::thread::yield_now();
    }
    panic!("no completion within 5 s");
}

fn wr(wr_id: u64, op: WrOp, sg: &[Sge], raddr: u64, rkey: u32) -> WorkRequest<'_> {
    WorkRequest {
        wr_id,
        op,
        sg_list: sg,
        remote_addr: raddr,
        rkey,
        signaled: true,
        fence: false,
        inline: false,
    }
}

/// The verbs contract NP-RDMA relies on, for any [`Nic`]: one-sided
/// WRITE/READ/atomic, SEND with immediate (gathered and inline) into
/// posted RECVs, remote access errors as completions, flush on ERR.
pub(crate) fn verbs_contract<N: Nic>(a: &N, b: &N) {
    let spec = QpSpec {
        qpn: None,
        max_send_wr: 16,
        max_recv_wr: 16,
        max_sge: 2,
        max_inline: 64,
    };
    let (ca, cb) = (
        a.create_cq(64).expect("cq a"),
        b.create_cq(64).expect("cq b"),
    );
    let qa = a.create_qp(&spec, &ca, &ca).expect("qp a");
    let qb = b.create_qp(&spec, &cb, &cb).expect("qp b");
    let rights = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    qa.connect(b.addr(), qb.qpn(), rights).expect("connect a");
    qb.connect(a.addr(), qa.qpn(), rights).expect("connect b");
    let mut la = vec![0u8; 4096];
    let mut lb = vec![0u8; 4096];
    let acc = Access::LOCAL_WRITE | rights;
    // SAFETY: both vectors outlive their MRs (dropped at the end of
    // this function, MRs first: declared later).
    #[allow(unsafe_code)]
    let (ma, mb) = unsafe {
        (
            a.reg_mr(la.as_mut_ptr() as u64, 4096, acc).expect("mr a"),
            b.reg_mr(lb.as_mut_ptr() as u64, 4096, acc).expect("mr b"),
        )
    };
    let sge = |m: &N::Mr, off: u64, len: u32| Sge {
        addr: m.addr() + off,
        length: len,
        lkey: m.lkey(),
    };
    for (i, x) in la.iter_mut().enumerate().take(64) {
        *x = i as u8 + 1;
    }
    // WRITE a[0..64] → b[100..164].
    let s = [sge(&ma, 0, 64)];
    qa.post_send(&[wr(1, WrOp::Write, &s, mb.addr() + 100, mb.rkey())])
        .expect("post write");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status, c.op), (1, 0, CompOp::Write));
    assert_eq!(&lb[100..164], &la[..64]);
    // READ b[100..164] → a[1000..1064], gathered into two SGEs.
    let s = [sge(&ma, 1000, 32), sge(&ma, 2000, 32)];
    qa.post_send(&[wr(2, WrOp::Read, &s, mb.addr() + 100, mb.rkey())])
        .expect("post read");
    let c = one(&ca);
    assert_eq!(
        (c.wr_id, c.status, c.op, c.byte_len),
        (2, 0, CompOp::Read, 64)
    );
    assert_eq!(&la[1000..1032], &la[..32]);
    assert_eq!(&la[2000..2032], &la[32..64]);
    // FETCH_ADD on b[512] (8-aligned in the MR).
    lb[512..520].copy_from_slice(&5u64.to_le_bytes());
    let s = [sge(&ma, 3000, 8)];
    qa.post_send(&[wr(
        3,
        WrOp::FetchAdd { add: 2 },
        &s,
        mb.addr() + 512,
        mb.rkey(),
    )])
    .expect("post atomic");
    let c = one(&ca);
    assert_eq!((c.wr_id, c.status, c.op), (3, 0, CompOp::FetchAdd));
    assert_eq!(la[3000..3008], 5u64.to_le_bytes());
    assert_eq!(lb[512..520], 7u64.to_le_bytes());
    // SEND with immediate into a posted RECV, then an inline SEND.
    let r = [sge(&mb, 1024, 128)];
    let r2 = [sge(&mb, 2048, 128)];
    qb.post_recv(&[
        RecvRequest {
            wr_id: 40,
            sg_list: &r,
        },
        RecvRequest {
            wr_id: 41,
            sg_list: &r2,
        },
    ])
    .expect("post recv");
    let s = [sge(&ma, 0, 16)];
    // Inline: no lkey, the bytes are copied at post time.
    let data = [Sge {
        addr: la.as_ptr() as u64 + 16,
        length: 8,
        lkey: 0,
    }];
    let inline = WorkRequest {
        inline: true,
        ..wr(5, WrOp::Send, &data, 0, 0)
    };
    qa.post_send(&[wr(4, WrOp::SendImm(99), &s, 0, 0), inline])
        .expect("post sends");
    let (c1, c2) = (one(&ca), one(&ca));
    assert_eq!((c1.wr_id, c1.status, c2.wr_id, c2.status), (4, 0, 5, 0));
    let r1 = one(&cb);
    assert_eq!(
        (r1.wr_id, r1.status, r1.op, r1.byte_len, r1.imm),
        (40, 0, CompOp::RecvWithImm, 16, Some(99))
    );
    let r2 = one(&cb);
    assert_eq!(
        (r2.wr_id, r2.status, r2.op, r2.byte_len),
        (41, 0, CompOp::Recv, 8)
    );
    assert_eq!(&lb[1024..1040], &la[..16]);
    assert_eq!(&lb[2048..2056], &la[16..24]);
    // In ERR, posted RECVs flush (a second pair: ERR is for good).
    let qa2 = a.create_qp(&spec, &ca, &ca).expect("qp a2");
    let qb2 = b.create_qp(&spec, &cb, &cb).expect("qp b2");
    qa2.connect(b.addr(), qb2.qpn(), rights)
        .expect("connect a2");
    qb2.connect(a.addr(), qa2.qpn(), rights)
        .expect("connect b2");
    qb2.post_recv(&[RecvRequest {
        wr_id: 42,
        sg_list: &r,
    }])
    .expect("post recv");
    qb2.set_error().expect("to ERR");
    let c = one(&cb);
    assert_eq!((c.wr_id, c.status), (42, Completion::WR_FLUSH_ERR));
    // A bad rkey fails at the responder: an error completion.
    let s = [sge(&ma, 0, 8)];
    qa.post_send(&[wr(6, WrOp::Write, &s, mb.addr(), mb.rkey() ^ 0x4000)])
        .expect("post bad write");
    let c = one(&ca);
    assert_eq!(c.wr_id, 6);
    assert_eq!(WcStatus::from_code(c.status), WcStatus::RemAccessErr);
    drop((ma, mb));
}

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
}

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
    }
}

/// One PD of a fake NIC on a shared in-memory fabric ([`FakeNic::pair`]):
/// WRs execute at post time, on the posting thread, against this process's
/// memory, with the verbs' checks (keys, bounds, rights, RECVs) and
/// completions. No IOMMU control (user-space mode).
pub(crate) struct FakeNic {
    id: u8,
    fabric: Arc<Mutex<Fabric>>,
}

impl FakeNic {
    /// Two NICs on one fabric.
    pub(crate) fn pair() -> (FakeNic, FakeNic) {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        (
            FakeNic {
                id: 1,
                fabric: fabric.clone(),
            },
            FakeNic { id: 2, fabric },
        )
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

/// Scatter `data` over `sges` (already validated).
fn scatter(sges: &[crate::nic::Sge], data: &[u8]) {
    let mut off = 0;
    for s in sges {
        let n = (s.length as usize).min(data.len() - off);
        crate::mem::write(s.addr, &data[off..off + n]);
        off += n;
    }
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
        let gather = || {
            let mut d = Vec::new();
            for s in w.sg_list {
                d.extend(crate::mem::read(s.addr, s.length as usize));
            }
            d
        };
        let Some(peer) = f.qps.get(&pq).filter(|p| p.nic == pn && !p.err) else {
            return (WcStatus::RetryExcErr, 0);
        };
        let (peer_access, peer_recv_cq) = (peer.access, peer.recv_cq);
        let remote = |need: Access| {
            peer_access
                .contains(need)
                .then(|| f.region(pn, w.rkey, w.remote_addr, len, need))
                .flatten()
        };
        match w.op {
            WrOp::Write | WrOp::WriteImm(_) => {
                if remote(Access::REMOTE_WRITE).is_none() {
                    return (WcStatus::RemAccessErr, 0);
                }
                crate::mem::write(w.remote_addr, &gather());
                (WcStatus::Success, len as u32)
            }
            WrOp::Read => {
                if remote(Access::REMOTE_READ).is_none() {
                    return (WcStatus::RemAccessErr, 0);
                }
                scatter(w.sg_list, &crate::mem::read(w.remote_addr, len as usize));
                (WcStatus::Success, len as u32)
            }
            WrOp::CmpSwap { .. } | WrOp::FetchAdd { .. } => {
                if len != 8 || remote(Access::REMOTE_ATOMIC).is_none() {
                    return (WcStatus::RemAccessErr, 0);
                }
                let Some(word) = crate::mem::atomic_at(w.remote_addr) else {
                    return (WcStatus::RemInvReqErr, 0);
                };
                let old = match w.op {
                    WrOp::CmpSwap { compare, swap } => word
                        .compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst)
                        .unwrap_or_else(|v| v),
                    WrOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
                    _ => unreachable!("atomic opcodes only"),
                };
                scatter(w.sg_list, &old.to_le_bytes());
                (WcStatus::Success, 8)
            }
            WrOp::Send | WrOp::SendImm(_) => {
                let data = gather();
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
                    op: if imm.is_some() {
                        CompOp::RecvWithImm
                    } else {
                        CompOp::Recv
                    },
                    byte_len: data.len() as u32,
                    imm,
                    qp_num: pq,
                };
                let fits = data.len() as u64 <= room
                    && rsges.iter().all(|s| {
                        f.region(pn, s.lkey, s.addr, u64::from(s.length), Access::LOCAL_WRITE)
                            .is_some()
                    });
                if !fits {
                    c.status = WcStatus::LocLenErr.code();
                    c.byte_len = 0;
                    f.complete(peer_recv_cq, c);
                    return (WcStatus::RemInvReqErr, 0);
                }
                scatter(&rsges, &data);
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
    type Iommu = FakeIommuCap;
    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            max_tlp: 64,
            magic: 0,
            page_size: 4096,
            max_qp_wr: 1024,
            max_sge: 16,
            max_inline: 256,
            iommu: false,
        }
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<FakeNicMr, FakeNicErr> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(FakeNicErr("bad range"));
        }
        let mut f = self.fabric.lock().expect("fabric");
        let key = f.id();
        let region = FakeRegion { addr, len, access };
        f.mrs.insert(key, (self.id, region));
        Ok(FakeNicMr {
            key,
            region,
            fabric: self.fabric.clone(),
        })
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
    fn iommu(&self) -> Option<&FakeIommuCap> {
        None
    }
}

/// The fake NIC's (absent) IOMMU capability: [`FakeIommu`] with the fake
/// NIC's error type.
pub(crate) type FakeIommuCap = NoIommu;

/// No IOMMU control (a [`FakeNic`] runs in user-space mode).
pub(crate) struct NoIommu;

impl IommuControl for NoIommu {
    type Error = FakeNicErr;
    type Range = ();
    type Mr = FakeMr;
    const ENTRY_BYTES: usize = 0;
    fn alloc_range(&self, _npages: u64) -> Result<(), FakeNicErr> {
        Err(FakeNicErr("no IOMMU"))
    }
    fn free_range(&self, _range: ()) -> Result<(), FakeNicErr> {
        Err(FakeNicErr("no IOMMU"))
    }
    fn map(&self, _range: &(), _index: u64, _frame: Frame) -> Result<(), FakeNicErr> {
        Err(FakeNicErr("no IOMMU"))
    }
    fn flush(&self) -> Result<(), FakeNicErr> {
        Ok(())
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        _addr: u64,
        _len: u64,
        _access: Access,
        _range: &(),
    ) -> Result<FakeMr, FakeNicErr> {
        Err(FakeNicErr("no IOMMU"))
    }
    fn set_resident(&self, _addr: u64, _len: u64, _resident: bool) -> Result<(), FakeNicErr> {
        Ok(())
    }
}
