//! The requester: executes one send WR of a QP against its connected peer, either
//! directly (the initiator performs the target NIC's DMA through the target's shared
//! tables: in-process memcpy or process_vm_*), or through the target QP's request ring
//! served by the target's NIC thread (small READ/WRITE and atomics across processes).

use crate::dma::{self, check_key, AtomicOp, DmaErr, Fault, MrView, Port, Side, Span, MR_PASSTHROUGH};
use crate::host::HostInner;
use crate::odp;
use crate::peer::Peer;
use crate::qp::{EState, Entry, QpInner, Sq};
use crate::responder::{self, Delivery, Message};
use crate::scratch::{scratch_slot, Scratch};
use crate::segment::{self, QpRec};
use crate::verbs::*;
use std::sync::atomic::Ordering;

pub(crate) enum Outcome {
    Done(WcStatus, u32),
    Rnr(u32),
    /// ODP model: the responder NAKed a remote page fault (retransmit after the timeout).
    OdpNak,
    /// ODP model: a local page was invalidated during the copy; the fault was served,
    /// execute the WR again.
    OdpRetry,
}

/// ODP model, local fault: hand every non-present page of the local ODP spans to the
/// host in one NIC->host interrupt and stall until it was served.
fn odp_local(me: &HostInner, spans: &[Span], write: bool) -> Result<(), WcStatus> {
    let miss = odp::missing(&me.seg, spans, write);
    if miss.is_empty() {
        return Ok(());
    }
    me.seg.stats().odp_faults_local.fetch_add(1, Ordering::Relaxed);
    if odp::fault_local(me, miss, me.cfg.transport_timeout) {
        Ok(())
    } else {
        Err(WcStatus::LocProtErr)
    }
}

/// ODP model, remote fault: if the target's ODP span has non-present pages, the
/// responder raises them on its host and NAKs.
fn odp_remote(tseg: &crate::segment::Segment, me: &HostInner, spans: &[Span], write: bool) -> bool {
    let miss = odp::missing(tseg, spans, write);
    if miss.is_empty() {
        return false;
    }
    me.seg.stats().odp_faults_remote.fetch_add(1, Ordering::Relaxed);
    odp::fault_remote(tseg, miss);
    true
}

pub(crate) enum Issue {
    Issued,
    Failed(WcStatus),
    Full,
}

const MAX_MSG: u64 = 1 << 31;

fn passthrough(addr: u64, len: u64) -> Span {
    Span {
        mr: MrView {
            kind: MR_PASSTHROUGH,
            va: addr,
            len,
            iova_base: 0,
            iova_slot: 0,
            odp: false,
        },
        addr,
        len,
    }
}

scratch_slot!(SPANS: Span);

/// Validate the local side of a WR (lkeys against this host's MR table).
fn local_spans(q: &QpInner, e: &Entry, need: Access) -> Result<Scratch<Span>, WcStatus> {
    let mut v = Scratch::take(&SPANS);
    if e.flags.contains(SendFlags::INLINE) {
        v.push(passthrough(e.inline.as_ptr() as u64, e.inline.len() as u64));
        return Ok(v);
    }
    let seg = &q.host.inner().seg;
    for s in e.sges.iter() {
        if s.length == 0 {
            continue;
        }
        match check_key(seg, s.lkey, q.pd.id(), s.addr, s.length as u64, need) {
            Ok(mr) => v.push(Span {
                mr,
                addr: s.addr,
                len: s.length as u64,
            }),
            Err(_) => return Err(WcStatus::LocProtErr),
        }
    }
    Ok(v)
}

fn local_need(op: &WrOpcode) -> Access {
    if matches!(op, WrOpcode::Read) || op.is_atomic() {
        Access::LOCAL_WRITE
    } else {
        Access::empty()
    }
}

/// Whether `rkey` names a live ON_DEMAND MR of the target.
fn remote_odp(seg: &crate::segment::Segment, rkey: u32) -> bool {
    dma::key_index(rkey).and_then(|i| seg.mr(i)).is_some_and(|r| {
        r.key.load(Ordering::Acquire) == rkey
            && Access::from_bits_truncate(r.access.load(Ordering::Relaxed)).contains(Access::ON_DEMAND)
    })
}

/// Whether this WR goes through the target NIC thread's request ring.
pub(crate) fn uses_ring(q: &QpInner, sq: &Sq, e: &Entry) -> bool {
    let Some(peer) = sq.peer.as_ref() else { return false };
    let far = peer.port != Port::Local || q.host.inner().cfg.inproc_ring;
    if !far {
        return false;
    }
    match e.op {
        // ODP model: READ/WRITE to target ODP memory go direct (the initiator's DMA
        // engine detects the page fault and NAKs it).
        // A target inside the peer's DMA pool is one memcpy for the initiator: direct.
        WrOpcode::Read | WrOpcode::Write => {
            e.len() <= peer.seg.p.ring_rw_max as u64
                && !remote_odp(&peer.seg, e.rkey)
                && (peer.port == Port::Local || peer.seg.pool_local(e.raddr, e.len().max(1)).is_none())
        }
        WrOpcode::CmpSwap { .. } | WrOpcode::FetchAdd { .. } => true,
        _ => false,
    }
}

fn target<'a>(q: &QpInner, sq: &mut Sq, peer: &'a Peer) -> Option<(u32, &'a QpRec)> {
    if sq.tq.is_none() {
        sq.tq = peer.seg.find_qp(sq.attr.dest_qp_num);
    }
    let tq = sq.tq?;
    let h = q.host.inner();
    let r = responder::target_qp(&peer.seg, tq, sq.attr.dest_qp_num, h.addr.nonce, q.qpn)?;
    Some((tq, r))
}

/// Put a WR into the target's request ring.
pub(crate) fn issue_ring(q: &QpInner, sq: &mut Sq, i: usize, now: u64) -> Issue {
    let e = &sq.entries[i];
    let len = e.len();
    let (op, cmp, swp) = match e.op {
        WrOpcode::Read => (segment::RING_READ, 0, 0),
        WrOpcode::Write => (segment::RING_WRITE, 0, 0),
        WrOpcode::CmpSwap { compare, swap } => (segment::RING_CAS, compare, swap),
        WrOpcode::FetchAdd { add } => (segment::RING_FADD, add, 0),
        _ => return Issue::Failed(WcStatus::LocQpOpErr),
    };
    let spans = match local_spans(q, e, local_need(&e.op)) {
        Ok(s) => s,
        Err(s) => return Issue::Failed(s),
    };
    if e.op.is_atomic() && len != 8 {
        return Issue::Failed(WcStatus::LocLenErr);
    }
    let Some(peer) = sq.peer.clone() else {
        return Issue::Failed(WcStatus::RetryExcErr);
    };
    if sq.tq.is_none() {
        sq.tq = peer.seg.find_qp(sq.attr.dest_qp_num);
    }
    let Some(tq) = sq.tq else {
        return Issue::Failed(WcStatus::RetryExcErr);
    };
    let slot = sq.ring_prod;
    let (h, data) = peer.seg.slot(tq, slot);
    if h.state.load(Ordering::Acquire) != segment::SLOT_FREE {
        return Issue::Full;
    }
    let me = q.host.inner();
    h.op.store(op, Ordering::Relaxed);
    h.len.store(len as u32, Ordering::Relaxed);
    h.raddr.store(e.raddr, Ordering::Relaxed);
    h.rkey.store(e.rkey, Ordering::Relaxed);
    h.src_qpn.store(q.qpn, Ordering::Relaxed);
    h.src_nonce.store(me.addr.nonce, Ordering::Relaxed);
    h.cmp.store(cmp, Ordering::Relaxed);
    h.swp.store(swp, Ordering::Relaxed);
    let mut atoms = 0;
    // Payloads of up to 8 bytes travel in the slot header (`cmp`), saving a cache line.
    let mut small = [0u8; 8];
    let dst_ptr = if len <= 8 { small.as_mut_ptr() } else { data };
    if op == segment::RING_WRITE && len > 0 {
        let src = Side {
            seg: &me.seg,
            port: Port::Local,
            spans: &spans,
        };
        let dst_span = [passthrough(dst_ptr as u64, len)];
        let dst = Side {
            seg: &me.seg,
            port: Port::Local,
            spans: &dst_span,
        };
        match dma::copy(&src, &dst, len, me.cfg.dma_section) {
            Ok(a) => atoms = a,
            Err(_) => return Issue::Failed(WcStatus::LocProtErr),
        }
    }
    if op == segment::RING_WRITE && len <= 8 {
        h.cmp.store(u64::from_le_bytes(small), Ordering::Relaxed);
    }
    h.state.store(segment::SLOT_REQ, Ordering::Release);
    peer.seg.ring_doorbell(tq);
    sq.ring_prod += 1;
    let e = &mut sq.entries[i];
    e.atoms = atoms;
    e.st = EState::Issued { slot, since: now };
    Issue::Issued
}

fn advance_ring(sq: &mut Sq, tq: u32) {
    let Some(peer) = sq.peer.as_ref() else { return };
    while sq.ring_cons < sq.ring_prod
        && peer.seg.slot(tq, sq.ring_cons).0.state.load(Ordering::Acquire) == segment::SLOT_FREE
    {
        sq.ring_cons += 1;
    }
}

/// Check the response of the front WR (ring slot `slot`); None while in flight.
pub(crate) fn finish_ring(q: &QpInner, sq: &mut Sq, slot: u64, since: u64, now: u64) -> Option<(WcStatus, u32)> {
    let peer = sq.peer.clone()?;
    let tq = sq.tq?;
    let me = q.host.inner();
    let (h, data) = peer.seg.slot(tq, slot);
    if h.state.load(Ordering::Acquire) != segment::SLOT_DONE {
        if now.saturating_sub(since) > me.cfg.transport_timeout.as_nanos() as u64 {
            sq.zombies.push((slot, now));
            return Some((WcStatus::RetryExcErr, 0));
        }
        return None;
    }
    let mut status = WcStatus::from_u32(h.status.load(Ordering::Relaxed));
    let e = &sq.entries[0];
    let len = e.len();
    if status.is_ok() && (matches!(e.op, WrOpcode::Read) || e.op.is_atomic()) {
        match local_spans(q, e, Access::LOCAL_WRITE) {
            Err(s) => status = s,
            Ok(spans) => {
                let result = h.result.load(Ordering::Relaxed).to_le_bytes();
                let src_span = if e.op.is_atomic() || len <= 8 {
                    [passthrough(result.as_ptr() as u64, 8)]
                } else {
                    [passthrough(data as u64, len)]
                };
                let src = Side {
                    seg: &me.seg,
                    port: Port::Local,
                    spans: &src_span,
                };
                let dst = Side {
                    seg: &me.seg,
                    port: Port::Local,
                    spans: &spans,
                };
                match dma::copy(&src, &dst, len, me.cfg.dma_section) {
                    Ok(a) => sq.entries[0].atoms += a,
                    Err(_) => status = WcStatus::LocProtErr,
                }
            }
        }
    }
    h.state.store(segment::SLOT_FREE, Ordering::Release);
    advance_ring(sq, tq);
    let byte_len = if sq.entries[0].op.is_atomic() { 8 } else { len as u32 };
    Some((status, byte_len))
}

/// Free ring slots of flushed WRs once their responses arrived (or timed out).
pub(crate) fn reap_zombies(q: &QpInner, sq: &mut Sq, now: u64) {
    if sq.zombies.is_empty() {
        return;
    }
    let (Some(peer), Some(tq)) = (sq.peer.clone(), sq.tq) else {
        sq.zombies.clear();
        return;
    };
    let timeout = q.host.inner().cfg.transport_timeout.as_nanos() as u64;
    sq.zombies.retain(|&(slot, since)| {
        let h = peer.seg.slot(tq, slot).0;
        if h.state.load(Ordering::Acquire) == segment::SLOT_DONE || now.saturating_sub(since) > timeout {
            h.state.store(segment::SLOT_FREE, Ordering::Release);
            false
        } else {
            true
        }
    });
    advance_ring(sq, tq);
}

fn dma_status(err: DmaErr, local_is_src: bool) -> (WcStatus, bool) {
    // (status, remote side at fault)
    match (err, local_is_src) {
        (DmaErr::Src(_), true) | (DmaErr::Dst(_), false) => (WcStatus::LocProtErr, false),
        _ => (WcStatus::RemAccessErr, true),
    }
}

/// Execute a WR directly against the target (initiator-side DMA).
pub(crate) fn exec_direct(q: &QpInner, sq: &mut Sq, i: usize) -> Outcome {
    let me: &HostInner = q.host.inner();
    let Some(peer) = sq.peer.clone() else {
        return Outcome::Done(WcStatus::RetryExcErr, 0);
    };
    let Some((tq, r)) = target(q, sq, &peer) else {
        return Outcome::Done(WcStatus::RetryExcErr, 0);
    };
    let Sq {
        entries,
        ring_prod,
        ring_cons,
        ..
    } = sq;
    let e = &mut entries[i];
    let spans = match local_spans(q, e, local_need(&e.op)) {
        Ok(s) => s,
        Err(s) => return Outcome::Done(s, 0),
    };
    if let Err(s) = odp_local(me, &spans, local_need(&e.op) == Access::LOCAL_WRITE) {
        return Outcome::Done(s, 0);
    }
    let len = e.len();
    if len > MAX_MSG {
        return Outcome::Done(WcStatus::LocLenErr, 0);
    }
    let section = me.cfg.dma_section;
    let local = Side {
        seg: &me.seg,
        port: Port::Local,
        spans: &spans,
    };
    let tseg = &*peer.seg;
    let remote_err = |s: WcStatus| {
        responder::qp_error(tseg, &peer, tq);
        Outcome::Done(s, 0)
    };
    match e.op {
        WrOpcode::Write | WrOpcode::Read => {
            let read = e.op == WrOpcode::Read;
            let need = if read {
                Access::REMOTE_READ
            } else {
                Access::REMOTE_WRITE
            };
            let mr = match responder::remote_check(tseg, r, e.rkey, e.raddr, len, need) {
                Ok(m) => m,
                Err(s) => return remote_err(s),
            };
            let tspan = [Span { mr, addr: e.raddr, len }];
            if mr.odp && odp_remote(tseg, me, &tspan, !read) {
                return Outcome::OdpNak;
            }
            let remote = Side {
                seg: tseg,
                port: peer.port,
                spans: &tspan,
            };
            // Large cross-process transfers are split with the target's NIC thread
            // (through a free request-ring slot: the ring is empty when a direct op runs).
            let help = (me.cfg.dma_help
                && crate::sys::now_ns() >= me.help_backoff.load(Ordering::Relaxed)
                && peer.port != Port::Local
                && len as usize >= dma::HELP_MIN
                && *ring_prod == *ring_cons)
                .then(|| dma::Help {
                    seg: tseg,
                    qp: tq,
                    next_slot: std::cell::Cell::new(*ring_prod),
                    src_nonce: me.addr.nonce,
                    src_qpn: q.qpn,
                    timeout_ns: me.cfg.transport_timeout.as_nanos() as u64,
                    backoff_until: &me.help_backoff,
                });
            let res = if read {
                dma::copy_with_help(&remote, &local, len, section, help.as_ref())
            } else {
                dma::copy_with_help(&local, &remote, len, section, help.as_ref())
            };
            if let Some(h) = &help {
                // Jobs the helper took used ring slots (FREE again, unless timed out).
                *ring_prod = h.next_slot.get();
                *ring_cons = *ring_prod;
            }
            match res {
                Ok(a) => {
                    e.atoms = a;
                    Outcome::Done(WcStatus::Success, len as u32)
                }
                Err(DmaErr::Src(Fault::NotPresent(_)) | DmaErr::Dst(Fault::NotPresent(_))) => {
                    // Invalidated after the scan: a local page is served here, a remote
                    // one is NAKed (the partial transfer is redone).
                    if let Err(s) = odp_local(me, &spans, read) {
                        return Outcome::Done(s, 0);
                    }
                    if odp_remote(tseg, me, &tspan, !read) {
                        return Outcome::OdpNak;
                    }
                    Outcome::OdpRetry
                }
                Err(DmaErr::Io) if !tseg.alive() => {
                    // The target process is gone: as a vanished peer on a real
                    // fabric, the transport retries run out.
                    Outcome::Done(WcStatus::RetryExcErr, 0)
                }
                Err(err) => {
                    let (s, remote_fault) = dma_status(err, !read);
                    if remote_fault {
                        remote_err(s)
                    } else {
                        Outcome::Done(s, 0)
                    }
                }
            }
        }
        WrOpcode::Send | WrOpcode::SendImm(_) | WrOpcode::WriteImm(_) => {
            let m = Message {
                src: local,
                len,
                imm: e.op.imm(),
                write_to: matches!(e.op, WrOpcode::WriteImm(_)).then_some((e.rkey, e.raddr)),
                src_qpn: q.qpn,
                solicited: e.flags.contains(SendFlags::SOLICITED),
                section,
            };
            match responder::deliver(&peer, tq, r, &m) {
                Delivery::Done(s) => Outcome::Done(s, if s.is_ok() { len as u32 } else { 0 }),
                Delivery::Rnr(t) => Outcome::Rnr(t),
            }
        }
        WrOpcode::CmpSwap { .. } | WrOpcode::FetchAdd { .. } => {
            if len != 8 {
                return Outcome::Done(WcStatus::LocLenErr, 0);
            }
            if peer.port != Port::Local {
                // Never routed here (uses_ring), but stay correct if it were.
                return Outcome::Done(WcStatus::LocQpOpErr, 0);
            }
            let op = match e.op {
                WrOpcode::CmpSwap { compare, swap } => AtomicOp::CmpSwap { compare, swap },
                WrOpcode::FetchAdd { add } => AtomicOp::FetchAdd { add },
                _ => unreachable!("atomic opcode"),
            };
            if let Ok(mr) = responder::remote_check(tseg, r, e.rkey, e.raddr, 8, Access::REMOTE_ATOMIC) {
                let tspan = [Span {
                    mr,
                    addr: e.raddr,
                    len: 8,
                }];
                if mr.odp && odp_remote(tseg, me, &tspan, true) {
                    return Outcome::OdpNak;
                }
            }
            let (s, v) = responder::atomic_here(tseg, r, e.rkey, e.raddr, op);
            if !s.is_ok() {
                return remote_err(s);
            }
            let bytes = v.to_le_bytes();
            let src_span = [passthrough(bytes.as_ptr() as u64, 8)];
            let src = Side {
                seg: &me.seg,
                port: Port::Local,
                spans: &src_span,
            };
            match dma::copy(&src, &local, 8, section) {
                Ok(a) => {
                    e.atoms = a;
                    Outcome::Done(WcStatus::Success, 8)
                }
                Err(_) => Outcome::Done(WcStatus::LocProtErr, 0),
            }
        }
    }
}
