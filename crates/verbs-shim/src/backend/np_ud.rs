//! NP-RDMA mode's UD QPs and address handles, on the software RNIC: a UD QP is a UD
//! QP of the NIC itself (as pinned mode's: GRH, qkeys, `src_qp`, the UD MTU), whose
//! SGEs name NP-RDMA MRs. Datagrams are two-sided and short (≤ the UD MTU), so there
//! is nothing to be optimistic about: as NP-RDMA's SEND/RECV pins temporarily, each
//! WR's pages are pinned in the pager from its post until its completion is polled
//! (a RECV's for writing, a SEND's for reading) and reached by the NIC through a
//! *view* — a standard (passthrough) NIC MR over the application MR, made on first
//! use, with no remote rights, revoked when the application MR is deregistered. The
//! NIC only reaches pages of posted WRs, which are pinned, so pins are bounded by
//! what is posted and no non-resident page is touched.
//!
//! Every NIC WR is signaled (a SEND's pages are unpinned at its own completion); the
//! completions of WRs the application did not signal are dropped unless in error.
//! The NIC's completions come back on the application's CQ ([`UdLinks`]): its poll
//! drains the QP's NIC CQs (one per direction) translating the token wr_ids back;
//! for completion events a thread per NIC CQ waits on that CQ's channel and makes
//! the application CQ's eventfd readable when the application armed it.
//!
//! Deregistration ([`UdShared::revoke`]): the view goes first (the NIC fences its DMA
//! out of it; WRs still posted on it then complete in error, as on a NIC whose MR
//! went), then the pins of those WRs: no byte of the MR is touched afterwards.

use super::np_sgl::LkeyTable;
use super::{Ah, Qp, Result};
use crate::error::ShimError;
use parking_lot::Mutex;
use rnic::{
    Access, PostError, QpAttr, QpAttrMask, QpInitAttr, QpState, RecvWr, SendFlags, SendWr, Wc,
    WcStatus,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// Work requests per queue a UD QP grants in this mode (UCX's ud_verbs posts 4096
/// receives): the NIC's own queue, no engine in between.
pub const NP_UD_MAX_WR: u32 = 4096;

/// What the device's UD QPs share: the NIC PD they live on, the pager that pins
/// their buffers, the application MRs (by lkey) and their NIC views.
pub struct UdShared {
    pd: rnic::Pd,
    pager: vmem::Pager,
    pin: Pinner,
    lkeys: Arc<LkeyTable>,
    /// NIC view of an application MR (and the MR's range), by the application lkey.
    views: Mutex<HashMap<u32, (rnic::Mr, usize, usize)>>,
    /// The UD QPs alive (their pins go when an MR is revoked).
    qps: Mutex<Vec<Weak<Core>>>,
    /// Pages pinned by UD WRs now (for the stats line).
    pinned: AtomicUsize,
    /// The pager's calls when the application unmaps registered memory.
    listener: Mutex<Option<vmem::ListenerId>>,
}

/// The application unmapped registered memory: the views over it go at once (the
/// NIC stops reaching it by address), whatever WRs are posted on them.
struct Unmaps(Weak<UdShared>);

impl vmem::SwapListener for Unmaps {
    fn before_swap_out(&self, _pages: &[usize]) -> bool {
        // Views reach only pinned pages, which are never evicted.
        true
    }
    fn after_unmap(&self, start: usize, end: usize) {
        let Some(sh) = self.0.upgrade() else { return };
        let gone: Vec<_> = {
            let mut v = sh.views.lock();
            let keys: Vec<u32> = v
                .iter()
                .filter(|(_, (_, a, l))| *a < end && start < a + l)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| v.remove(k)).collect()
        };
        // Deregistered in the NIC: returns once no DMA uses them.
        drop(gone);
    }
}

impl Drop for UdShared {
    fn drop(&mut self) {
        if let Some(id) = self.listener.get_mut().take() {
            self.pager.remove_listener(id);
        }
    }
}

/// How UD WRs pin application memory: the NP-RDMA engine's pin of part of an MR
/// (by lkey, address, length, for writing), which also keeps the pages resident
/// for the NIC and mapped in the MR's NIC views, and counts them among the
/// engine's pins; the pin is released when the returned value drops.
pub type Pinner = Box<
    dyn Fn(u32, u64, u64, bool) -> std::result::Result<Box<dyn Send + Sync>, np::Error>
        + Send
        + Sync,
>;

/// A pin of one SGE's pages, released on drop.
struct Pin {
    lkey: u32,
    pages: usize,
    sh: Arc<UdShared>,
    _held: Box<dyn Send + Sync>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.sh.pinned.fetch_sub(self.pages, Ordering::Relaxed);
    }
}

fn pages(addr: usize, len: usize) -> usize {
    let p = vmem::PAGE_SIZE;
    (addr + len).div_ceil(p) - addr / p
}

impl UdShared {
    pub fn new(
        host: &rnic::Host,
        pager: &vmem::Pager,
        pin: Pinner,
        lkeys: Arc<LkeyTable>,
    ) -> Result<Arc<Self>> {
        let ctx = host.open_context()?;
        let sh = Arc::new(UdShared {
            pd: ctx.alloc_pd()?,
            pager: pager.clone(),
            pin,
            lkeys,
            views: Mutex::new(HashMap::new()),
            qps: Mutex::new(Vec::new()),
            pinned: AtomicUsize::new(0),
            listener: Mutex::new(None),
        });
        let id = pager.add_listener(Arc::new(Unmaps(Arc::downgrade(&sh))));
        *sh.listener.lock() = Some(id);
        Ok(sh)
    }

    /// Pages UD WRs hold pinned now.
    pub fn pinned_pages(&self) -> usize {
        self.pinned.load(Ordering::Relaxed)
    }

    /// An address handle for the device whose GID is `gid`.
    pub fn create_ah(&self, gid: [u8; 16]) -> Result<Box<dyn Ah>> {
        let dest = rnic::HostAddr::from_bytes(&gid);
        let ah = self.pd.create_ah(dest).map_err(|e| {
            ShimError::InvalidArgument(format!("no device has GID {}: {e}", dest.to_hex()))
        })?;
        Ok(Box::new(NpAh(ah)))
    }

    /// Application MR `lkey` is going (deregistered, or re-registered): its view
    /// first, then the pins UD WRs hold in it. Call after the lkey left the table.
    pub fn revoke(&self, lkey: u32) {
        let view = self.views.lock().remove(&lkey);
        // Deregistered in the NIC: returns once no DMA uses it.
        drop(view);
        let qps: Vec<Arc<Core>> = {
            let mut q = self.qps.lock();
            q.retain(|w| w.strong_count() > 0);
            q.iter().filter_map(Weak::upgrade).collect()
        };
        for c in qps {
            let mut st = c.st.lock();
            let st = &mut *st;
            for e in st.sends.values_mut().chain(st.recvs.values_mut()) {
                e.pins.retain(|p| p.lkey != lkey);
            }
        }
    }

    /// `sg` (application SGEs of PD `pd_id`) as NIC SGEs into `out`, pinning their
    /// pages into `pins` (for writing if `write`). An SGE outside the PD's MRs, or
    /// whose pages cannot be pinned, gets lkey 0 (no NIC MR has it): the NIC fails the
    /// WR as it fails any bad SGE (LOC_PROT_ERR).
    fn translate(
        self: &Arc<Self>,
        pd_id: u64,
        sg: &[rnic::Sge],
        write: bool,
        out: &mut Vec<rnic::Sge>,
        pins: &mut Vec<Pin>,
    ) {
        // Keys under the views' lock: a revoke either precedes the lkey check (which
        // then fails) or removes the view made here — and then drops the pins taken
        // below, once the caller (holding the QP's lock) is done.
        let keys: Vec<Option<u32>> = {
            let mut views = self.views.lock();
            sg.iter()
                .map(|s| self.view_key(&mut views, pd_id, s, write))
                .collect()
        };
        // Pinned outside it: a pin may wait for the pager's fault thread, which
        // takes it in `Unmaps::after_unmap`.
        for (s, key) in sg.iter().zip(keys) {
            let key = match key {
                Some(k) if s.length > 0 => {
                    let (addr, len) = (s.addr as usize, s.length as usize);
                    match (self.pin)(s.lkey, s.addr, u64::from(s.length), write) {
                        Ok(held) => {
                            let n = pages(addr, len);
                            self.pinned.fetch_add(n, Ordering::Relaxed);
                            pins.push(Pin {
                                lkey: s.lkey,
                                pages: n,
                                sh: self.clone(),
                                _held: held,
                            });
                            k
                        }
                        Err(e) => {
                            tracing::debug!(addr, len, "UD pin failed: {e}");
                            0
                        }
                    }
                }
                Some(k) => k,
                None => 0,
            };
            out.push(rnic::Sge { lkey: key, ..*s });
        }
    }

    /// The NIC lkey of `s`'s view, made now if needed; `None`: `s` is not inside an
    /// MR of the PD (with LOCAL_WRITE if `write`).
    fn view_key(
        &self,
        views: &mut HashMap<u32, (rnic::Mr, usize, usize)>,
        pd_id: u64,
        s: &rnic::Sge,
        write: bool,
    ) -> Option<u32> {
        if !self.lkeys.covers(pd_id, s, write) {
            return None;
        }
        if let Some(v) = views.get(&s.lkey) {
            return Some(v.0.lkey());
        }
        let info = self.lkeys.get(s.lkey)?;
        let acc = if info.local_write {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        // SAFETY: the range of a registered application MR, mapped while registered;
        // the view is dropped (`revoke`) before the MR is deregistered, and the NIC
        // reaches only the pages of posted WRs, pinned until their completion.
        let v = unsafe { self.pd.reg_mr(info.addr as usize, info.len as usize, acc) };
        match v {
            Ok(v) => {
                let k = v.lkey();
                views.insert(s.lkey, (v, info.addr as usize, info.len as usize));
                Some(k)
            }
            Err(e) => {
                tracing::warn!("UD view of MR {:#x}: {e}", s.lkey);
                None
            }
        }
    }
}

/// An address handle: the NIC's.
struct NpAh(rnic::Ah);

impl Ah for NpAh {
    fn dest(&self) -> rnic::HostAddr {
        self.0.dest()
    }
}

/// One WR between its post and its completion.
struct Entry {
    wr_id: u64,
    /// The application asked for its completion (sends; receives always).
    signaled: bool,
    pins: Vec<Pin>,
}

#[derive(Default)]
struct State {
    next: u64,
    sends: HashMap<u64, Entry>,
    recvs: HashMap<u64, Entry>,
}

/// The WRs of one UD QP in flight.
#[derive(Default)]
struct Core {
    st: Mutex<State>,
}

/// What an application CQ knows of the UD QPs completing into it.
#[derive(Default)]
pub struct UdLinks {
    n: AtomicUsize,
    list: Mutex<Vec<Weak<Link>>>,
    /// The application armed the CQ (`ibv_req_notify_cq`) and no UD event fired
    /// yet: [`DISARMED`], [`SOLICITED`] or [`ANY`].
    armed: Arc<AtomicU8>,
    /// Completions taken out of the NIC CQs but not polled yet ([`UdLinks::drain`]).
    staged: Mutex<std::collections::VecDeque<Wc>>,
}

const DISARMED: u8 = 0;
const SOLICITED: u8 = 1;
const ANY: u8 = 2;

impl UdLinks {
    /// Drain the NIC CQs of the UD QPs completing here into `out`; how many.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        if self.n.load(Ordering::Acquire) == 0 || out.is_empty() {
            return Ok(0);
        }
        let mut got = 0;
        {
            let mut q = self.staged.lock();
            while got < out.len() {
                let Some(w) = q.pop_front() else { break };
                out[got] = w;
                got += 1;
            }
        }
        let links: Vec<Arc<Link>> = {
            let mut l = self.list.lock();
            l.retain(|w| w.strong_count() > 0);
            // (Kept nonzero while completions of QPs gone since are staged.)
            let staged = !self.staged.lock().is_empty();
            self.n
                .store(l.len().max(usize::from(staged)), Ordering::Release);
            l.iter().filter_map(Weak::upgrade).collect()
        };
        for l in links {
            if got == out.len() {
                break;
            }
            got += l.poll(&mut out[got..])?;
            if got == out.len() {
                break;
            }
        }
        Ok(got)
    }

    /// Arm the UD QPs' NIC CQs for the application CQ's next event.
    /// Take every completion of the UD QPs out of their NIC CQs (kept for the next
    /// polls): how many wait now (`ibv_resize_cq` counts them).
    pub fn drain(&self) -> Result<usize> {
        if self.n.load(Ordering::Acquire) == 0 {
            return Ok(0);
        }
        // (The list's lock before the staged queue's, never inside it: see `poll`.)
        let links: Vec<Arc<Link>> = self.list.lock().iter().filter_map(Weak::upgrade).collect();
        let mut q = self.staged.lock();
        let mut buf = [Wc::default(); CHUNK];
        for l in links {
            loop {
                let n = l.poll(&mut buf)?;
                q.extend(&buf[..n]);
                if n < CHUNK {
                    break;
                }
            }
        }
        Ok(q.len())
    }

    /// A CQ armed before its UD QPs exist arms them as they are made ([`UdLinks::add`]).
    pub fn arm(&self, solicited_only: bool) -> Result<()> {
        // Under the list's lock: a link added meanwhile is armed by `add`.
        let l = self.list.lock();
        let want = if solicited_only { SOLICITED } else { ANY };
        // Arming for any completion is not narrowed by a solicited-only request.
        let now = self.armed.fetch_max(want, Ordering::AcqRel).max(want);
        for x in l.iter().filter_map(Weak::upgrade) {
            x.cq.req_notify(now == SOLICITED)?;
        }
        Ok(())
    }

    /// The application took the CQ's event: no UD event until it arms it again.
    pub fn disarm(&self) {
        self.armed.store(DISARMED, Ordering::Release);
    }

    fn add(&self, l: &Arc<Link>) -> Result<()> {
        let mut v = self.list.lock();
        match self.armed.load(Ordering::Acquire) {
            DISARMED => {}
            a => l.cq.req_notify(a == SOLICITED)?,
        }
        v.push(Arc::downgrade(l));
        self.n.store(v.len(), Ordering::Release);
        Ok(())
    }
}

/// One direction of a UD QP: its NIC CQ, and where its completions go.
struct Link {
    cq: rnic::Cq,
    core: Arc<Core>,
    recv: bool,
}

/// Completions converted per NIC CQ poll.
const CHUNK: usize = 32;

impl Link {
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        let mut st = self.core.st.lock();
        let mut got = 0;
        let mut buf = [Wc::default(); CHUNK];
        while got < out.len() {
            let k = (out.len() - got).min(CHUNK);
            let m = self.cq.poll(&mut buf[..k])?;
            for w in &buf[..m] {
                let q = if self.recv {
                    &mut st.recvs
                } else {
                    &mut st.sends
                };
                // A WR of a QP reset since: no completion (as its WRs went).
                let Some(e) = q.remove(&w.wr_id) else {
                    continue;
                };
                // The NIC is done with the WR's pages: unpinned here.
                drop(e.pins);
                if !e.signaled && w.status == WcStatus::Success {
                    continue;
                }
                out[got] = Wc {
                    wr_id: e.wr_id,
                    ..*w
                };
                got += 1;
            }
            if m < k {
                break;
            }
        }
        Ok(got)
    }
}

/// Waits for the events of one NIC CQ and passes them on to the application CQ.
struct Forwarder {
    wake: Box<dyn Fn() + Send + Sync>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Forwarder {
    fn start(chan: rnic::CompChannel, armed: Arc<AtomicU8>, signal: Signal) -> Result<Self> {
        let wake = Box::new(chan.waker());
        let thread = std::thread::Builder::new()
            .name("nprdma-ud-ev".into())
            .spawn(move || {
                while let Ok(Some(_)) = chan.get_event_or_wake(None) {
                    if armed.swap(DISARMED, Ordering::AcqRel) != DISARMED {
                        signal();
                    }
                }
            })
            .map_err(|e| ShimError::Nic(rnic::Error::Io(format!("UD event thread: {e}"))))?;
        Ok(Forwarder {
            wake,
            thread: Some(thread),
        })
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        (self.wake)();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Makes an application CQ's eventfd readable (it keeps the CQ's fd open).
pub type Signal = Arc<dyn Fn() + Send + Sync>;

/// An application CQ as a UD QP sees it.
pub struct AppCq<'a> {
    /// Its completion event (used when `events`).
    pub signal: Signal,
    pub links: &'a Arc<UdLinks>,
    pub events: bool,
    pub depth: u32,
}

/// A UD QP of NP-RDMA mode.
pub struct UdQp {
    // Field order = drop order: the NIC QP first (no DMA after), then the event
    // threads, then the WRs' pins (`core`, also held by the links).
    qp: rnic::Qp,
    _fwd: Vec<Forwarder>,
    _links: [Arc<Link>; 2],
    core: Arc<Core>,
    sh: Arc<UdShared>,
    pd_id: u64,
    sq_sig_all: bool,
    _quota: Box<dyn Send + Sync>,
}

/// Create a UD QP on `sh`'s NIC PD for application PD `pd_id`.
pub fn create_qp(
    sh: &Arc<UdShared>,
    pd_id: u64,
    send: AppCq<'_>,
    recv: AppCq<'_>,
    attr: &QpInitAttr,
    quota: Box<dyn Send + Sync>,
) -> Result<Box<dyn Qp>> {
    if attr.max_send_wr > NP_UD_MAX_WR || attr.max_recv_wr > NP_UD_MAX_WR {
        return Err(ShimError::InvalidArgument(format!(
            "UD QP of {} send / {} recv WRs (at most {NP_UD_MAX_WR})",
            attr.max_send_wr, attr.max_recv_wr
        )));
    }
    let core = Arc::new(Core::default());
    let mut fwd = Vec::new();
    let mut mk = |a: &AppCq<'_>, wrs: u32, recv: bool| -> Result<Arc<Link>> {
        let chan = if a.events {
            Some(sh.pd.host().open_context()?.create_comp_channel()?)
        } else {
            None
        };
        let ctx = sh.pd.host().open_context()?;
        let depth = a.depth.max(wrs).clamp(1, ctx.query_device().max_cqe);
        let cq = ctx.create_cq(depth, chan.as_ref())?;
        if let Some(ch) = chan {
            fwd.push(Forwarder::start(
                ch,
                a.links.armed.clone(),
                a.signal.clone(),
            )?);
        }
        Ok(Arc::new(Link {
            cq,
            core: core.clone(),
            recv,
        }))
    };
    let sl = mk(&send, attr.max_send_wr, false)?;
    let rl = mk(&recv, attr.max_recv_wr, true)?;
    let qp = sh
        .pd
        .create_qp_of(rnic::QpType::Ud, &sl.cq, &rl.cq, None, attr)?;
    send.links.add(&sl)?;
    recv.links.add(&rl)?;
    sh.qps.lock().push(Arc::downgrade(&core));
    Ok(Box::new(UdQp {
        qp,
        _fwd: fwd,
        _links: [sl, rl],
        core,
        sh: sh.clone(),
        pd_id,
        sq_sig_all: attr.sq_sig_all,
        _quota: quota,
    }))
}

impl UdQp {
    fn post_send_one(&self, w: &SendWr) -> std::result::Result<(), rnic::Error> {
        let mut st = self.core.st.lock();
        let mut sg = Vec::new();
        let mut pins = Vec::new();
        if !w.flags.contains(SendFlags::INLINE) {
            self.sh
                .translate(self.pd_id, w.sg_list, false, &mut sg, &mut pins);
        }
        st.next += 1;
        let token = st.next;
        let signaled = self.sq_sig_all || w.flags.contains(SendFlags::SIGNALED);
        st.sends.insert(
            token,
            Entry {
                wr_id: w.wr_id,
                signaled,
                pins,
            },
        );
        let nic = SendWr {
            wr_id: token,
            sg_list: &sg,
            flags: w.flags | SendFlags::SIGNALED,
            ..*w
        };
        let r = self.qp.post_send(&[nic]).map_err(|e| e.err);
        if r.is_err() {
            st.sends.remove(&token);
        }
        r
    }

    fn post_recv_one(&self, w: &RecvWr) -> std::result::Result<(), rnic::Error> {
        let mut st = self.core.st.lock();
        let mut sg = Vec::new();
        let mut pins = Vec::new();
        self.sh
            .translate(self.pd_id, w.sg_list, true, &mut sg, &mut pins);
        st.next += 1;
        let token = st.next;
        st.recvs.insert(
            token,
            Entry {
                wr_id: w.wr_id,
                signaled: true,
                pins,
            },
        );
        let nic = RecvWr {
            wr_id: token,
            sg_list: &sg,
        };
        let r = self.qp.post_recv(&[nic]).map_err(|e| e.err);
        if r.is_err() {
            st.recvs.remove(&token);
        }
        r
    }
}

impl Qp for UdQp {
    fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
    fn cap(&self) -> QpInitAttr {
        self.qp.cap()
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.qp.modify(attr, mask)?;
        if mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Reset {
            // Its WRs went without completions: their pins too.
            let mut st = self.core.st.lock();
            st.sends.clear();
            st.recvs.clear();
        }
        Ok(())
    }
    fn query(&self) -> QpAttr {
        self.qp.query()
    }
    fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        super::post_each(wrs, |w| self.post_send_one(w))
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        super::post_each(wrs, |w| self.post_recv_one(w))
    }
}

#[cfg(test)]
mod tests {
    use super::super::np::{NpDevice, Soft};
    use super::super::{Cq, Device, Pd, Qp};
    use rnic::{
        Access, QpAttr, QpAttrMask, QpInitAttr, QpState, RecvWr, SendFlags, SendWr, Wc, WcStatus,
        WrOpcode,
    };

    const QKEY: u32 = 0x1234;

    fn stat(dev: &dyn Device, key: &str) -> u64 {
        let s = dev.stats();
        s.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {s}"))
    }

    fn ud_qp(pd: &dyn Pd, cq: &dyn Cq, wrs: u32) -> Box<dyn Qp> {
        let init = QpInitAttr {
            qpn: None,
            max_send_wr: wrs,
            max_recv_wr: wrs,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let q = pd
            .create_qp_of(rnic::QpType::Ud, cq, cq, None, &init)
            .unwrap();
        use QpAttrMask as M;
        let a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey: QKEY,
            ..Default::default()
        };
        q.modify(&a, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY)
            .unwrap();
        let a = QpAttr {
            qp_state: QpState::Rtr,
            ..Default::default()
        };
        q.modify(&a, M::STATE).unwrap();
        let a = QpAttr {
            qp_state: QpState::Rts,
            ..Default::default()
        };
        q.modify(&a, M::STATE | M::SQ_PSN).unwrap();
        q
    }

    fn wait(cq: &dyn Cq, n: usize) -> Vec<Wc> {
        let mut v = Vec::new();
        let mut out = [Wc::default(); 16];
        let t0 = std::time::Instant::now();
        while v.len() < n {
            let k = cq.poll(&mut out).unwrap();
            v.extend_from_slice(&out[..k]);
            assert!(t0.elapsed().as_secs() < 10, "{} of {n}: {v:?}", v.len());
        }
        assert_eq!(v.len(), n, "more than {n}: {v:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(cq.poll(&mut out).unwrap(), 0, "more than {n}");
        v
    }

    /// UD on NP-RDMA memory: receives into never-touched pages hold their pages
    /// pinned while posted (and only then), the datagram lands byte-exact after its
    /// 40-byte GRH, a 2-SGE send gathers, an unsignaled send's success is silent, a
    /// bad lkey completes LOC_PROT_ERR; deregistering an MR with receives posted
    /// releases their pins and no byte of it is written afterwards, each posted
    /// receive completing once (none successfully); no DMA meets a non-resident page.
    #[test]
    fn ud_pins_while_posted_and_dereg_revokes() {
        const LEN: usize = 256 * 1024;
        let dev = NpDevice::<Soft>::new().unwrap();
        assert!(dev.address_handles());
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64, false).unwrap();
        let mem = vmem::AnonMapping::new(LEN).unwrap();
        let base = mem.addr() as u64;
        let acc = Access::LOCAL_WRITE;
        // SAFETY: the mapping outlives the MRs (dropped first).
        let mr = unsafe { pd.reg_mr(mem.addr(), LEN / 2, acc).unwrap() };
        // SAFETY: as above.
        let mr2 = unsafe { pd.reg_mr(mem.addr() + LEN / 2, LEN / 2, acc).unwrap() };
        let (a, b) = (ud_qp(&*pd, &*cq, 16), ud_qp(&*pd, &*cq, 16));
        let ah = pd.create_ah(dev.gid()).unwrap();
        let to = |q: &dyn Qp| rnic::UdDest {
            dest: ah.dest(),
            remote_qpn: q.qpn(),
            remote_qkey: QKEY,
        };
        let at = |off: u64| (base + off) as *mut u8;
        // 4 receives of 2 pages each into never-touched memory of mr.
        for i in 0..4u64 {
            let sg = [rnic::Sge {
                addr: base + 8192 * (i + 1),
                length: 8192,
                lkey: mr.lkey(),
            }];
            b.post_recv(&[RecvWr {
                wr_id: 10 + i,
                sg_list: &sg,
            }])
            .unwrap();
        }
        assert_eq!(stat(&dev, "ud_pinned_pages"), 8);
        // SAFETY: inside the mapping (page 0, not posted).
        unsafe { std::slice::from_raw_parts_mut(at(0), 4096).fill(0x5a) };
        for i in 0..100 {
            // SAFETY: as above.
            unsafe { *at(i) = i as u8 };
        }
        let sg = [
            rnic::Sge {
                addr: base,
                length: 60,
                lkey: mr.lkey(),
            },
            rnic::Sge {
                addr: base + 60,
                length: 40,
                lkey: mr.lkey(),
            },
        ];
        let mut w = SendWr::new(1, WrOpcode::Send, &sg);
        w.ud = Some(to(&*b));
        // Unsignaled: its success is not reported; the next (signaled) one is.
        w.flags = SendFlags::empty();
        a.post_send(&[w]).unwrap();
        w.wr_id = 2;
        w.flags = SendFlags::SIGNALED;
        a.post_send(&[w]).unwrap();
        let mut got = wait(&*cq, 3);
        got.sort_by_key(|w| w.wr_id);
        let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, [2, 10, 11]);
        assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
        assert_eq!((got[1].byte_len, got[1].src_qp), (140, a.qpn()));
        for r in 0..2u64 {
            let off = 8192 * (r + 1) + 40;
            // SAFETY: inside the mapping; the receive completed.
            let data = unsafe { std::slice::from_raw_parts(at(off), 100) };
            assert_eq!(data, (0..100u8).collect::<Vec<_>>().as_slice());
        }
        assert_eq!(stat(&dev, "ud_pinned_pages"), 4, "2 receives left");
        // A bad lkey: LOC_PROT_ERR (the QP moves to ERR), nothing pinned for it.
        let bad = [rnic::Sge {
            addr: base,
            length: 8,
            lkey: mr.lkey() ^ 0x40,
        }];
        let mut w = SendWr::new(3, WrOpcode::Send, &bad);
        w.ud = Some(to(&*b));
        a.post_send(&[w]).unwrap();
        let got = wait(&*cq, 1);
        assert_eq!((got[0].wr_id, got[0].status), (3, WcStatus::LocProtErr));
        // Receives into mr2, then mr2 is deregistered: its pins go with it.
        let off2 = (LEN / 2) as u64;
        let q3 = ud_qp(&*pd, &*cq, 16);
        for i in 0..3u64 {
            let sg = [rnic::Sge {
                addr: base + off2 + 4096 * i,
                length: 4096,
                lkey: mr2.lkey(),
            }];
            q3.post_recv(&[RecvWr {
                wr_id: 20 + i,
                sg_list: &sg,
            }])
            .unwrap();
        }
        assert_eq!(stat(&dev, "ud_pinned_pages"), 4 + 3);
        drop(mr2);
        assert_eq!(stat(&dev, "ud_pinned_pages"), 4);
        let sg = [rnic::Sge {
            addr: base,
            length: 100,
            lkey: mr.lkey(),
        }];
        let mut w = SendWr::new(4, WrOpcode::Send, &sg);
        w.ud = Some(to(&*q3));
        b.post_send(&[w]).unwrap();
        // The datagram fails q3's first receive (LOC_PROT_ERR: its MR is gone), the
        // QP moves to ERR and the other two flush.
        let mut all = wait(&*cq, 4);
        assert_eq!(q3.query().qp_state, QpState::Err);
        all.sort_by_key(|w| w.wr_id);
        assert_eq!(all[0].wr_id, 4);
        let recvs: Vec<_> = all[1..].iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(all[0].status, WcStatus::Success, "{all:?}");
        assert_eq!(recvs.len(), 3, "{all:?}");
        assert_eq!(recvs[0], (20, WcStatus::LocProtErr));
        assert!(recvs.iter().all(|r| r.1 != WcStatus::Success), "{recvs:?}");
        // SAFETY: inside the mapping.
        let untouched = unsafe { std::slice::from_raw_parts(at(off2), 3 * 4096) };
        assert!(untouched.iter().all(|&x| x == 0), "written after dereg");
        drop((a, b, q3));
        assert_eq!(stat(&dev, "ud_pinned_pages"), 0, "destroy releases");
        assert_eq!(stat(&dev, "nonresident_dma"), 0);
        drop((ah, mr));
    }

    /// The application unmaps registered memory with a UD receive posted on it: the
    /// NIC stops reaching it (the datagram fails the receive with LOC_PROT_ERR,
    /// nothing is written at the address), and the process goes on.
    #[test]
    fn ud_unmap_with_receive_posted() {
        const LEN: usize = 64 * 1024;
        let dev = NpDevice::<Soft>::new().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16, false).unwrap();
        let mem = vmem::AnonMapping::new(LEN).unwrap();
        let src = vmem::AnonMapping::new(4096).unwrap();
        let base = mem.addr() as u64;
        // SAFETY: the MR is dropped before `mem` (it outlives it; its tail is
        // unmapped below, which the pager follows).
        let mr = unsafe { pd.reg_mr(mem.addr(), LEN, Access::LOCAL_WRITE).unwrap() };
        // SAFETY: as above.
        let smr = unsafe { pd.reg_mr(src.addr(), 4096, Access::LOCAL_WRITE).unwrap() };
        let (a, b) = (ud_qp(&*pd, &*cq, 4), ud_qp(&*pd, &*cq, 4));
        let ah = pd.create_ah(dev.gid()).unwrap();
        let tail = base + (LEN / 2) as u64;
        let sg = [rnic::Sge {
            addr: tail,
            length: 4096,
            lkey: mr.lkey(),
        }];
        b.post_recv(&[RecvWr {
            wr_id: 7,
            sg_list: &sg,
        }])
        .unwrap();
        // SAFETY: the second half of our own mapping; nothing else uses it.
        let r = unsafe { libc::munmap(tail as *mut libc::c_void, LEN / 2) };
        assert_eq!(r, 0);
        // The pager's fault thread handles the unmap event.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let ss = [rnic::Sge {
            addr: src.addr() as u64,
            length: 64,
            lkey: smr.lkey(),
        }];
        let mut w = SendWr::new(1, WrOpcode::Send, &ss);
        w.ud = Some(rnic::UdDest {
            dest: ah.dest(),
            remote_qpn: b.qpn(),
            remote_qkey: QKEY,
        });
        a.post_send(&[w]).unwrap();
        let mut got = wait(&*cq, 2);
        got.sort_by_key(|w| w.wr_id);
        assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::Success));
        assert_eq!((got[1].wr_id, got[1].status), (7, WcStatus::LocProtErr));
        assert_eq!(stat(&dev, "nonresident_dma"), 0);
        drop((a, b, ah, smr, mr));
        assert_eq!(stat(&dev, "ud_pinned_pages"), 0);
    }
}
