//! NP-RDMA mode's scatter/gather lists: the layer's work requests carry one SGE, the
//! verbs ones up to [`NP_MAX_SGE`]. A QP created with more than one send or receive
//! SGE is *mapped*: each of its WRs reaches the layer under a token `wr_id` (a per-QP
//! sequence number) and a WR with several SGEs goes through a bounce buffer —
//! gathered into it at post time (SEND, WRITE), or scattered out of it when its
//! completion is polled (READ, RECV), before the application sees the completion.
//! Completions of mapped QPs are translated back by [`translate`] (the application's
//! `wr_id`, the scatter). Send completions arrive in post order, so a completion also
//! retires the unsignaled WRs posted before it (their bounce buffers are freed then,
//! as a NIC frees their send-queue slots); as on a NIC, a queue holds at most its
//! depth of WRs not retired by a polled completion (a post beyond is ENOMEM), so
//! an application must signal at least every `max_send_wr` WRs.
//!
//! SGEs are checked against the registered MRs ([`LkeyTable`]: this PD, inside the
//! MR, LOCAL_WRITE where data is written) before the shim touches their memory; a WR
//! with a bad SGE is posted with that SGE alone, so the layer fails it with the
//! status it gives any bad SGE (LOC_PROT_ERR).

use parking_lot::Mutex;
use rnic::{Wc, WcOpcode, WcStatus};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// SGEs per WR this mode advertises (`max_sge`) and accepts: the C layer's limit.
pub const NP_MAX_SGE: u32 = 16;
/// Bounce buffers alive at once in a process (each is a layer MR: NIC MRs and a
/// tracked frame range are reserved for them).
pub const NP_MAX_BOUNCE: u32 = 1024;

/// What the shim knows of a registered MR.
#[derive(Clone, Copy, Debug)]
pub struct MrInfo {
    /// The owning PD (`NpPd` id).
    pub pd: u64,
    pub addr: u64,
    pub len: u64,
    pub local_write: bool,
}

/// The device's registered MRs by lkey.
#[derive(Default)]
pub struct LkeyTable(Mutex<HashMap<u32, MrInfo>>);

impl LkeyTable {
    pub fn insert(&self, lkey: u32, info: MrInfo) {
        self.0.lock().insert(lkey, info);
    }
    pub fn remove(&self, lkey: u32) {
        self.0.lock().remove(&lkey);
    }
    /// The MR of `lkey`, if registered.
    pub fn get(&self, lkey: u32) -> Option<MrInfo> {
        self.0.lock().get(&lkey).copied()
    }
    /// Whether `sge` lies inside an MR of `pd` (with LOCAL_WRITE if `write`).
    pub fn covers(&self, pd: u64, sge: &rnic::Sge, write: bool) -> bool {
        let t = self.0.lock();
        t.get(&sge.lkey).is_some_and(|m| {
            m.pd == pd
                && (!write || m.local_write)
                && sge.addr >= m.addr
                && sge
                    .addr
                    .checked_add(u64::from(sge.length))
                    .is_some_and(|e| e <= m.addr + m.len)
        })
    }
}

/// A bounce buffer: private anonymous memory registered with the layer.
pub struct Bounce<N: np::engine::Backend> {
    // Field order = drop order: the MR before the mapping it covers.
    mr: np::Mr<N>,
    map: vmem::AnonMapping,
    _slot: BounceSlot,
}

/// One of the process's [`NP_MAX_BOUNCE`] bounce buffers.
struct BounceSlot(Arc<std::sync::atomic::AtomicU32>);

impl Drop for BounceSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl<N: np::engine::Backend> Bounce<N> {
    pub fn new(
        pd: &np::Pd<N>,
        used: &Arc<std::sync::atomic::AtomicU32>,
        len: u64,
    ) -> std::result::Result<Bounce<N>, rnic::Error> {
        use std::sync::atomic::Ordering;
        used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < NP_MAX_BOUNCE).then_some(n + 1)
        })
        .map_err(|_| rnic::Error::QueueFull("NP-RDMA scatter/gather bounce buffers"))?;
        let slot = BounceSlot(used.clone());
        let map = vmem::AnonMapping::new(len.max(1) as usize).map_err(rnic::Error::from)?;
        // SAFETY: private anonymous memory that stays mapped until after the MR is
        // dropped (field order of `Bounce`).
        let mr = unsafe {
            pd.reg_mr(map.addr() as u64, len.max(1), np::Access::LOCAL_WRITE)
                .map_err(|e| rnic::Error::Io(format!("bounce buffer: {e}")))?
        };
        Ok(Bounce {
            mr,
            map,
            _slot: slot,
        })
    }
    pub fn sge(&self, len: u32) -> np::Sge {
        self.mr.sge(0, len)
    }
    fn ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }
}

/// One WR of a mapped QP between its post and its completion.
struct Entry<N: np::engine::Backend> {
    token: u64,
    wr_id: u64,
    bounce: Option<Bounce<N>>,
    /// Where the bounce's bytes go at completion (READ / RECV), in order.
    scatter: Vec<(u64, u32)>,
}

/// The token tables of one mapped QP.
pub struct Sgl<N: np::engine::Backend> {
    next: u64,
    sends: VecDeque<Entry<N>>,
    recvs: VecDeque<Entry<N>>,
}

impl<N: np::engine::Backend> Default for Sgl<N> {
    fn default() -> Self {
        Sgl {
            next: 0,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
        }
    }
}

/// How a WR of a mapped QP reaches the layer.
pub struct Mapped {
    /// The `wr_id` the layer sees.
    pub token: u64,
    /// The single SGE to post (None: no data).
    pub sge: Option<np::Sge>,
}

impl<N: np::engine::Backend> Sgl<N> {
    /// Record a WR (before posting it: its completion may be polled at once) and say
    /// how to post it. `depth`: WRs the queue may hold; `sg`: the verbs SGEs (already
    /// checked against the QP's cap); `into_local`: data is written into them (READ,
    /// RECV).
    #[allow(clippy::too_many_arguments)]
    pub fn map(
        &mut self,
        recv: bool,
        depth: u32,
        wr_id: u64,
        sg: &[rnic::Sge],
        into_local: bool,
        pd_id: u64,
        pd: &np::Pd<N>,
        lkeys: &LkeyTable,
        bounces: &Arc<std::sync::atomic::AtomicU32>,
    ) -> std::result::Result<Mapped, rnic::Error> {
        let held = if recv { &self.recvs } else { &self.sends };
        if held.len() >= depth as usize {
            return Err(rnic::Error::QueueFull(if recv {
                "receive queue"
            } else {
                "send queue (signal a WR and poll its completion)"
            }));
        }
        self.next += 1;
        let token = self.next;
        let one = |s: &rnic::Sge| np::Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        };
        let mut e = Entry {
            token,
            wr_id,
            bounce: None,
            scatter: Vec::new(),
        };
        let sge = match sg {
            [] => None,
            [s] => Some(one(s)),
            _ => match sg.iter().find(|s| !lkeys.covers(pd_id, s, into_local)) {
                // The layer fails it as it fails any bad SGE.
                Some(bad) => Some(one(bad)),
                None => {
                    let total: u64 = sg.iter().map(|s| u64::from(s.length)).sum();
                    let total = u32::try_from(total)
                        .map_err(|_| rnic::Error::InvalidArgument("SGE list longer than 4 GiB"))?;
                    let b = Bounce::new(pd, bounces, u64::from(total))?;
                    if into_local {
                        e.scatter = sg.iter().map(|s| (s.addr, s.length)).collect();
                    } else {
                        let mut off = 0usize;
                        for s in sg {
                            // SAFETY: `s` lies inside a registered MR of this PD
                            // (checked above), mapped while registered; the bounce
                            // has `total` bytes and is not in flight yet.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    s.addr as *const u8,
                                    b.ptr().add(off),
                                    s.length as usize,
                                )
                            };
                            off += s.length as usize;
                        }
                    }
                    let sge = b.sge(total);
                    e.bounce = Some(b);
                    Some(sge)
                }
            },
        };
        if recv {
            self.recvs.push_back(e);
        } else {
            self.sends.push_back(e);
        }
        Ok(Mapped { token, sge })
    }

    /// Forget the WR just recorded by [`Sgl::map`] (its post failed).
    pub fn unmap_last(&mut self, recv: bool) {
        if recv {
            self.recvs.pop_back();
        } else {
            self.sends.pop_back();
        }
    }
}

/// The mapped QPs of a device by QP number (shared with its CQs).
pub type Registry<N> = Arc<Mutex<HashMap<u32, Arc<Mutex<Sgl<N>>>>>>;

/// Give `wc` (a completion of a mapped QP) back its application `wr_id`, scattering
/// a successful READ's / RECV's bounce into the WR's SGEs first.
pub fn translate<N: np::engine::Backend>(reg: &Registry<N>, wc: &mut Wc) {
    let Some(sgl) = reg.lock().get(&wc.qp_num).cloned() else {
        return;
    };
    let mut s = sgl.lock();
    let recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
    let q = if recv { &mut s.recvs } else { &mut s.sends };
    let Some(i) = q.iter().position(|e| e.token == wc.wr_id) else {
        return;
    };
    // Entries before it were retired without a completion of their own.
    q.drain(..i);
    let e = q.pop_front().expect("i is in range");
    wc.wr_id = e.wr_id;
    if let (Some(b), true) = (&e.bounce, wc.status == WcStatus::Success) {
        let mut left = if recv {
            wc.byte_len as usize
        } else {
            usize::MAX
        };
        let mut off = 0usize;
        for &(addr, len) in &e.scatter {
            let n = (len as usize).min(left);
            // SAFETY: the SGE was checked at post time to lie inside a registered MR
            // of the QP's PD with LOCAL_WRITE (the application keeps it registered
            // until the WR completes, as with any NIC); the bounce holds at least the
            // SGEs' total, and its WR is complete (no DMA into it any more).
            unsafe { std::ptr::copy_nonoverlapping(b.ptr().add(off), addr as *mut u8, n) };
            off += n;
            left -= n;
            if left == 0 {
                break;
            }
        }
    }
}
