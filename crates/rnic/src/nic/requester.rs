//! The requester: executes one send WR of a QP against its connected peer, either
//! directly (the initiator performs the target NIC's DMA through the target's shared
//! tables: in-process memcpy or process_vm_*), or through the target QP's request ring
//! served by the target's NIC thread (small READ/WRITE and atomics across processes).

use crate::hw::dma::{self, check_key, passthrough, AtomicOp, DmaErr, Fault, Port, Side, Span};
use crate::hw::peer::Peer;
use crate::hw::scratch::{scratch_slot, Scratch};
use crate::hw::segment::{self, QpRec};
use crate::nic::odp;
use crate::nic::qp_ctx::{EState, Entry, QpCtx, Sq};
use crate::nic::responder::{self, Datagram, Delivery, Message};
use crate::nic::state::Nic;
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
fn odp_local(me: &Nic, spans: &[Span], write: bool) -> Result<(), WcStatus> {
    let miss = odp::missing(&me.seg, spans, write);
    if miss.is_empty() {
        return Ok(());
    }
    me.seg.stats().odp_faults_local.fetch_add(1, Ordering::Relaxed);
    if odp::fault_local(me, &me.odp, miss, me.cfg.transport_timeout) {
        Ok(())
    } else {
        Err(WcStatus::LocProtErr)
    }
}

/// ODP model, remote fault: if the target's ODP span has non-present pages, the
/// responder raises them on its host and NAKs.
fn odp_remote(tseg: &crate::hw::segment::Segment, me: &Nic, spans: &[Span], write: bool) -> bool {
    let miss = odp::missing(tseg, spans, write);
    if miss.is_empty() {
        return false;
    }
    me.seg.stats().odp_faults_remote.fetch_add(1, Ordering::Relaxed);
    crate::nic::state::fault_remote(tseg, miss);
    true
}

pub(crate) enum Issue {
    Issued,
    Failed(WcStatus),
    Full,
}

const MAX_MSG: u64 = 1 << 31;

scratch_slot!(SPANS: Span);

/// Validate the local side of a WR (lkeys against this host's MR table).
pub(crate) fn local_spans(q: &QpCtx, e: &Entry, need: Access) -> Result<Scratch<Span>, WcStatus> {
    let mut v = Scratch::take(&SPANS);
    if e.flags.contains(SendFlags::INLINE) {
        v.push(passthrough(e.inline.as_ptr() as u64, e.inline.len() as u64));
        return Ok(v);
    }
    let seg = &q.nic.seg;
    for s in e.sges.iter() {
        if s.length == 0 {
            continue;
        }
        match check_key(seg, s.lkey, q.pd, None, s.addr, s.length as u64, need) {
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
fn remote_odp(seg: &crate::hw::segment::Segment, rkey: u32) -> bool {
    dma::key_index(rkey).and_then(|i| seg.mr(i)).is_some_and(|r| {
        r.key.load(Ordering::Acquire) == rkey
            && Access::from_bits_truncate(r.access.load(Ordering::Relaxed)).contains(Access::ON_DEMAND)
    })
}

/// Whether this host may copy into `peer`'s memory itself: only between two hosts
/// that both opted into trusting their peers (`HostConfig::trusted_peers`), or within
/// one process.
pub(crate) fn direct_ok(me: &Nic, peer: &Peer) -> bool {
    peer.port == Port::Local || (me.cfg.trusted_peers && peer.seg.p.trusted_by_owner())
}

/// Whether this WR goes through the target NIC thread's request ring.
pub(crate) fn uses_ring(q: &QpCtx, sq: &Sq, e: &Entry) -> bool {
    let Some(peer) = sq.peer.as_ref() else { return false };
    let me = &*q.nic;
    if !direct_ok(me, peer) || (me.cfg.inproc_ring && !me.cfg.trusted_peers) {
        // Target-enforced protection (or its protocol inside one process, for tests):
        // the target executes every request itself.
        return true;
    }
    let far = peer.port != Port::Local || me.cfg.inproc_ring;
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

/// Whether a ring WR targets an ON_DEMAND MR of the peer (ODP model: such a WR is
/// issued alone, so a NAK never has later WRs executed behind it).
pub(crate) fn ring_odp(sq: &Sq, e: &Entry) -> bool {
    matches!(e.op, WrOpcode::Read | WrOpcode::Write) && sq.peer.as_ref().is_some_and(|p| remote_odp(&p.seg, e.rkey))
}

/// Send UD WR `e`: hand its datagram to the destination QP — delivered directly (in
/// this process, or between trusting hosts) with its GRH, or put in one slot of the
/// destination QP's request ring, served by its host — or drop it. Nothing is
/// acknowledged, so the status is local: a message longer than the port MTU is not
/// sent yet succeeds (IBA C10-93.1.1, as rxe), a bad gather list is LOC_PROT_ERR; an
/// absent, dead or refusing destination drops it. `None`: the destination's ring has
/// no free slot now (the caller retries, as a lossless fabric holds the packet, and
/// drops it once the transport timeout passed or the destination died).
pub(crate) fn send_ud(q: &QpCtx, e: &Entry) -> Option<WcStatus> {
    Some(match send_ud_inner(q, e) {
        Ok(s) | Err(Some(s)) => s,
        Err(None) => return None,
    })
}

fn send_ud_inner(q: &QpCtx, e: &Entry) -> Result<WcStatus, Option<WcStatus>> {
    let me = &*q.nic;
    let Some(t) = e.ud.as_ref() else {
        return Ok(WcStatus::LocQpOpErr);
    };
    let len = e.len();
    if len > PORT_MTU as u64 {
        return Ok(WcStatus::Success);
    }
    let spans = match local_spans(q, e, local_need(&e.op)) {
        Ok(s) => s,
        Err(s) => return Ok(s),
    };
    if let Err(s) = odp_local(me, &spans, false) {
        return Ok(s);
    }
    let imm = e.op.imm();
    let solicited = e.flags.contains(SendFlags::SOLICITED);
    let section = me.cfg.dma_section;
    let seg = &*t.peer.seg;
    let Some(idx) = seg.find_qp(t.qpn) else {
        return Ok(WcStatus::Success);
    };
    let ring = !direct_ok(me, &t.peer) || (me.cfg.inproc_ring && !me.cfg.trusted_peers);
    if !ring {
        let grh = grh(&me.addr, &t.dest, len as u32, imm.is_some());
        let mut src = Vec::with_capacity(spans.len() + 1);
        src.push(passthrough(grh.as_ptr() as u64, GRH_LEN as u64));
        src.extend(spans.iter().copied());
        let d = Datagram {
            src: Side {
                seg: &me.seg,
                port: Port::Local,
                spans: &src,
            },
            len: GRH_LEN as u64 + len,
            imm,
            src_qpn: q.qpn,
            qpn: t.qpn,
            qkey: t.qkey,
            solicited,
            section,
        };
        return Ok(responder::deliver_ud(&t.peer, idx, &d));
    }
    if len > seg.p.ring_max as u64 {
        return Ok(WcStatus::Success);
    }
    let Some(r) = seg.qp(idx) else {
        return Ok(WcStatus::Success);
    };
    if r.unreliable.load(Ordering::Acquire) != segment::QP_UD {
        return Ok(WcStatus::Success);
    }
    // Claim a free slot (any producer may: slots are claimed, not assigned), stamped
    // with the system-wide monotonic clock: the consumer serves in that order.
    let seq = crate::sys::now_ns();
    let slots = seg.p.ring_slots as u64;
    let Some((h, data)) = (0..slots).map(|k| seg.slot(idx, k)).find(|(h, _)| {
        h.state
            .compare_exchange(
                segment::SLOT_FREE,
                segment::SLOT_FILL,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }) else {
        return Err(None);
    };
    if len > 0 && gather_local(me, &spans, data, len, section).is_err() {
        h.state.store(segment::SLOT_FREE, Ordering::Release);
        return Ok(WcStatus::LocProtErr);
    }
    let mut op = segment::RING_UD;
    if imm.is_some() {
        op |= segment::RING_F_IMM;
    }
    if solicited {
        op |= segment::RING_F_SOLICITED;
    }
    h.op.store(op, Ordering::Relaxed);
    h.len.store(len as u32, Ordering::Relaxed);
    h.raddr
        .store(u64::from(me.addr.pid) << 32 | u64::from(me.addr.fd), Ordering::Relaxed);
    h.rkey.store(t.qkey, Ordering::Relaxed);
    h.src_qpn.store(q.qpn, Ordering::Relaxed);
    h.src_nonce.store(me.addr.nonce, Ordering::Relaxed);
    h.cmp
        .store(u64::from(imm.unwrap_or(0)) | u64::from(t.qpn) << 32, Ordering::Relaxed);
    h.swp.store(seq, Ordering::Relaxed);
    h.state.store(segment::SLOT_REQ, Ordering::Release);
    seg.ring_doorbell(idx);
    Ok(WcStatus::Success)
}

/// Ring parts a WR needs: payloads travel in slot-sized parts (`ring_max` bytes).
pub(crate) fn ring_parts(e: &Entry, chunk: u64) -> u32 {
    if e.op.is_atomic() {
        return 1;
    }
    e.len().div_ceil(chunk.max(1)).max(1) as u32
}

/// Offset and length of part `k` of a WR of `len` bytes (an atomic is one 8-byte part
/// in the slot header, whatever the slot size).
pub(crate) fn part(e: &Entry, k: u32, len: u64, chunk: u64) -> (u64, u64) {
    if e.op.is_atomic() {
        return (0, len);
    }
    let off = k as u64 * chunk;
    (off, (len - off.min(len)).min(chunk))
}

fn target<'a>(q: &QpCtx, sq: &mut Sq, peer: &'a Peer) -> Option<(u32, &'a QpRec)> {
    if sq.tq.is_none() {
        sq.tq = peer.seg.find_qp(sq.attr.dest_qp_num);
    }
    let tq = sq.tq?;
    let h = &*q.nic;
    let r = responder::target_qp(&peer.seg, tq, sq.attr.dest_qp_num, h.addr.nonce, q.qpn)?;
    Some((tq, r))
}

/// The pieces of `spans` covering `[off, off + len)` of the transfer.
pub(crate) fn window(spans: &[Span], off: u64, len: u64) -> Scratch<Span> {
    let mut out = Scratch::take(&WINDOW);
    let cut = |s: &Span, skip: u64, n: u64| Span {
        mr: s.mr,
        addr: s.addr + skip,
        len: n,
    };
    crate::nic::inbound::window_of(spans, off, len, |s| s.len, cut, &mut out);
    out
}

scratch_slot!(WINDOW: Span);

/// Copy `len` bytes of this host's local `spans` (checked SGEs) to `dst`, a
/// buffer of this process (a ring slot being filled).
fn gather_local(me: &Nic, spans: &[Span], dst: *mut u8, len: u64, section: usize) -> Result<u64, DmaErr> {
    let src = Side {
        seg: &me.seg,
        port: Port::Local,
        spans,
    };
    let dst_span = [passthrough(dst as u64, len)];
    let dst = Side {
        seg: &me.seg,
        port: Port::Local,
        spans: &dst_span,
    };
    dma::copy(&src, &dst, len, section)
}

/// Ring requests an issuing pass puts in a target's rings before it wakes the target's
/// NIC thread for them: the requests of one post (NP-RDMA's WRITE is three: page
/// versions, data, versions) reach a sleeping NIC thread with one wake-up and are
/// served in one pass, while a long run of parts (each gathering up to a slot of
/// payload) does not leave the target asleep for long.
pub(crate) const BELL_BATCH: u32 = 8;

/// Put the next parts of WR `i` into the target's request ring, as many as there are
/// free slots (a WR's parts take consecutive slots; nothing behind it issues before
/// its last part). `alone` ([`ring_odp`], known to the caller) is recorded when the WR
/// starts. Each part sets its doorbell bit; the target's NIC thread is woken every
/// [`BELL_BATCH`] parts and by `QpCtx::issue` at the end of the pass.
pub(crate) fn issue_ring(q: &QpCtx, sq: &mut Sq, i: usize, now: u64, alone: bool) -> Issue {
    let Some(peer) = sq.peer.clone() else {
        return Issue::Failed(WcStatus::RetryExcErr);
    };
    if sq.tq.is_none() {
        sq.tq = peer.seg.find_qp(sq.attr.dest_qp_num);
    }
    let Some(tq) = sq.tq else {
        return Issue::Failed(WcStatus::RetryExcErr);
    };
    let me = &*q.nic;
    let chunk = peer.seg.p.ring_max as u64;
    let slots = me.seg.p.ring_slots.min(peer.seg.p.ring_slots) as u64;
    let e = &sq.entries[i];
    let len = e.len();
    if len > MAX_MSG {
        return Issue::Failed(WcStatus::LocLenErr);
    }
    if e.op.is_atomic() && len != 8 {
        return Issue::Failed(WcStatus::LocLenErr);
    }
    let spans = match local_spans(q, e, local_need(&e.op)) {
        Ok(s) => s,
        Err(s) => return Issue::Failed(s),
    };
    let parts = ring_parts(e, chunk);
    let (first_slot, mut sent, since, alone) = match e.st {
        EState::Issued {
            slot,
            sent,
            since,
            alone,
        } => (slot, sent, since, alone),
        _ => (sq.ring_prod, 0, now, alone),
    };
    let mut atoms = 0;
    let sent_before = sent;
    while sent < parts {
        if sq.ring_prod - sq.ring_cons >= slots {
            break;
        }
        let slot = sq.ring_prod;
        let (h, data) = peer.seg.slot(tq, slot);
        match h.state.load(Ordering::Acquire) {
            segment::SLOT_FREE => {}
            // The next slot is never one of ours in flight (`ring_prod - ring_cons <
            // slots`): an answer there was left by a connection before a reset.
            segment::SLOT_DONE => h.state.store(segment::SLOT_FREE, Ordering::Release),
            _ => break,
        }
        let (off, plen) = part(&sq.entries[i], sent, len, chunk);
        let first = if sent == 0 { segment::RING_F_FIRST } else { 0 };
        let last = sent + 1 == parts;
        let e = &sq.entries[i];
        let solicited = if e.flags.contains(SendFlags::SOLICITED) {
            segment::RING_F_SOLICITED
        } else {
            0
        };
        // (op, cmp, swp, raddr, payload in the slot's data area)
        let (op, cmp, swp, raddr, gather) = match e.op {
            WrOpcode::Read => (segment::RING_READ | first, 0, len, e.raddr + off, false),
            WrOpcode::Write => (segment::RING_WRITE | first, 0, len, e.raddr + off, true),
            WrOpcode::WriteImm(imm) if last => (
                segment::RING_WRITE_IMM | solicited,
                imm as u64,
                len,
                e.raddr + off,
                true,
            ),
            WrOpcode::WriteImm(_) => (segment::RING_WRITE | first, 0, len, e.raddr + off, true),
            WrOpcode::Send | WrOpcode::SendImm(_) => {
                let mut f = first | solicited;
                if last {
                    f |= segment::RING_F_LAST;
                }
                if e.op.imm().is_some() {
                    f |= segment::RING_F_IMM;
                }
                (segment::RING_SEND | f, e.op.imm().unwrap_or(0) as u64, len, off, true)
            }
            WrOpcode::CmpSwap { compare, swap } => (segment::RING_CAS, compare, swap, e.raddr, false),
            WrOpcode::FetchAdd { add } => (segment::RING_FADD, add, 0, e.raddr, false),
        };
        h.op.store(op | u32::from(sq.gen) << segment::RING_GEN_SHIFT, Ordering::Relaxed);
        h.len.store(plen as u32, Ordering::Relaxed);
        h.raddr.store(raddr, Ordering::Relaxed);
        h.rkey.store(e.rkey, Ordering::Relaxed);
        h.src_qpn.store(q.qpn, Ordering::Relaxed);
        h.src_nonce.store(me.addr.nonce, Ordering::Relaxed);
        h.cmp.store(cmp, Ordering::Relaxed);
        h.swp.store(swp, Ordering::Relaxed);
        if gather && plen > 0 {
            // READ/WRITE parts of up to 8 bytes travel in the slot header (`cmp`),
            // saving a cache line; message payloads always use the data area.
            let inline = plen <= 8 && op & segment::RING_OP_MASK == segment::RING_WRITE;
            let mut small = [0u8; 8];
            let dst_ptr = if inline { small.as_mut_ptr() } else { data };
            let src_spans = window(&spans, off, plen);
            match gather_local(me, &src_spans, dst_ptr, plen, me.cfg.dma_section) {
                Ok(a) => atoms += a,
                Err(_) => {
                    // Parts already out (if any) are the caller's to abandon.
                    if sent > 0 {
                        sq.entries[i].st = EState::Issued {
                            slot: first_slot,
                            sent,
                            since,
                            alone,
                        };
                    }
                    return Issue::Failed(WcStatus::LocProtErr);
                }
            }
            if inline {
                h.cmp.store(u64::from_le_bytes(small), Ordering::Relaxed);
            }
        }
        if sent == sent_before {
            q.note_issuing();
        }
        h.state.store(segment::SLOT_REQ, Ordering::Release);
        peer.seg.set_doorbell(tq);
        sq.bells += 1;
        if sq.bells >= BELL_BATCH {
            sq.bells = 0;
            match &peer.link {
                Some(l) => l.doorbell(),
                None => peer.seg.wake_for_doorbells(),
            }
        }
        sq.ring_prod += 1;
        sent += 1;
    }
    if sent == sent_before {
        return Issue::Full;
    }
    let e = &mut sq.entries[i];
    e.atoms += atoms;
    e.st = EState::Issued {
        slot: first_slot,
        sent,
        since,
        alone,
    };
    Issue::Issued
}

pub(crate) fn advance_ring(sq: &mut Sq, tq: u32) {
    let Some(peer) = sq.peer.as_ref() else { return };
    while sq.ring_cons < sq.ring_prod
        && peer.seg.slot(tq, sq.ring_cons).0.state.load(Ordering::Acquire) == segment::SLOT_FREE
    {
        sq.ring_cons += 1;
    }
}

fn dma_status(err: DmaErr, local_is_src: bool) -> (WcStatus, bool) {
    // (status, remote side at fault)
    match (err, local_is_src) {
        (DmaErr::Src(_), true) | (DmaErr::Dst(_), false) => (WcStatus::LocProtErr, false),
        _ => (WcStatus::RemAccessErr, true),
    }
}

/// Execute a WR directly against the target (initiator-side DMA).
pub(crate) fn exec_direct(q: &QpCtx, sq: &mut Sq, i: usize) -> Outcome {
    let me: &Nic = &q.nic;
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
        if !tseg.qp(tq).is_some_and(responder::drops_refused) {
            responder::qp_error(tseg, &peer, tq);
        }
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
            // (The clock is read last: small and local transfers never need it.)
            let help = (me.cfg.dma_help
                && peer.port != Port::Local
                && len as usize >= dma::HELP_MIN
                && *ring_prod == *ring_cons
                && crate::sys::now_ns() >= me.help_backoff.load(Ordering::Relaxed))
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
                wc_len: len,
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
