//! The responder side of a connection across the network: request packets in PSN
//! order become requests in the receiving QP's own ring — filled by this thread in
//! its own memory, served by the host's ring server with every check it makes for a
//! peer over shared memory (QP state and connection, rkey, PD, bounds, rights, the
//! receive queue) — and its answers go back as ACKs (coalesced per received batch),
//! READ responses, atomic ACKs, NAKs and RNR NAKs. A packet ahead of the expected PSN
//! gets one PSN-sequence NAK; one behind it is a duplicate: a WRITE or SEND is
//! acknowledged again, a READ executed again, an atomic answered from the replay
//! cache (never executed twice).

use crate::hw::segment::{self, SlotHdr};
use crate::nic::inbound::RingServer;
use crate::nic::qp_ctx::HostQps;
use crate::nic::state::Nic;
use crate::verbs::{QpState, WcStatus};
use crate::wire::conn::{self, is_read_response, psn_add, psn_diff, rc, Counters, Path};
use roce::aeth::{AethRepr, NakCode, Syndrome};
use roce::atomic_ack_eth::AtomicAckEthRepr;
use roce::exts::ExtHeaders;
use roce::opcode::{Op, Position};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Atomics and READs remembered for duplicates.
const REPLAY: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq)]
enum MsgKind {
    Write,
    Send,
}

/// The multi-packet message being received.
struct InMsg {
    kind: MsgKind,
    first_psn: u32,
    va: u64,
    rkey: u32,
    total: u64,
    /// Bytes of the message handed to the ring so far.
    done: u64,
    /// Bytes gathered in the current (unpublished) slot.
    fill: usize,
    /// Whether a part of it was published already.
    published: bool,
}

/// A QP's responder state across the network.
pub struct RxConn {
    pub idx: u32,
    /// The connected peer's address (its GID) and QP.
    pub peer: [u8; 16],
    pub peer_qpn: u32,
    /// `conn::wire_nonce(our GID, peer GID)`: what the QP's record holds.
    pub nonce: u64,
    pub path: Arc<Path>,
    epsn: u32,
    msn: u32,
    nak_sent: bool,
    gen: u16,
    cur: Option<InMsg>,
    atomics: VecDeque<(u32, u64)>,
    reads: VecDeque<ReadRec>,
    pub ack_due: bool,
}

/// A READ the requester may send again (the last `REPLAY`): its request, and the
/// bytes it returned if they fit the replay budget, so a duplicate is answered with
/// what the first execution read — not with memory a later WRITE of the same
/// connection changed since (go-back-N resends a READ after the requests behind it
/// executed). A READ too large to keep is executed again.
struct ReadRec {
    psn: u32,
    va: u64,
    rkey: u32,
    len: u32,
    data: Option<Vec<u8>>,
}

/// Bytes of READ responses a connection keeps for duplicates.
const READ_REPLAY_BYTES: usize = 4 << 20;

/// What one request did.
enum Served {
    Ok(u64),
    /// A `WcStatus` or `RING_ST_*` code.
    Fail(u32),
}

impl RxConn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(idx: u32, peer: [u8; 16], peer_qpn: u32, nonce: u64, path: Arc<Path>, rq_psn: u32) -> RxConn {
        RxConn {
            idx,
            peer,
            peer_qpn,
            nonce,
            path,
            epsn: rq_psn & conn::PSN_MASK,
            msn: 0,
            nak_sent: false,
            gen: 0,
            cur: None,
            atomics: VecDeque::new(),
            reads: VecDeque::new(),
            ack_due: false,
        }
    }

    /// The coalesced ACK of what arrived in order.
    pub fn ack(&mut self) -> Vec<u8> {
        self.ack_due = false;
        conn::ack(
            &self.path,
            self.peer_qpn,
            psn_add(self.epsn, conn::PSN_MASK),
            Syndrome::Ack { credit: 31 },
            self.msn,
        )
    }

    fn nak(&self, psn: u32, s: Syndrome, c: &Counters) -> Vec<u8> {
        Counters::add(&c.naks_sent, 1);
        conn::ack(&self.path, self.peer_qpn, psn, s, self.msn)
    }

    /// One request packet for this QP (its source already checked). Response packets
    /// go to `out`.
    pub fn on_request(
        &mut self,
        nic: &Nic,
        qps: &HostQps,
        repr: &roce::packet::Repr,
        payload: &[u8],
        c: &Counters,
        out: &mut Vec<Vec<u8>>,
    ) {
        let r = nic.seg.qp(self.idx);
        let st = r.map(|r| QpState::from_u32(r.state.load(Ordering::Acquire)));
        if !matches!(st, Some(QpState::Rtr | QpState::Rts)) {
            Counters::add(&c.stray_packets, 1);
            return;
        }
        let op = repr.bth.opcode;
        if is_read_response(op) || op == rc(Op::Acknowledge) || op == rc(Op::AtomicAcknowledge) {
            return;
        }
        let psn = repr.bth.psn;
        let d = psn_diff(psn, self.epsn);
        if d > 0 {
            Counters::add(&c.out_of_sequence, 1);
            if !self.nak_sent {
                self.nak_sent = true;
                out.push(self.nak(self.epsn, Syndrome::Nak(NakCode::PsnSequenceError), c));
            }
            return;
        }
        if d < 0 {
            tracing::trace!(psn, epsn = self.epsn, op = op.byte(), "RoCEv2 duplicate");
            Counters::add(&c.duplicates, 1);
            self.duplicate(nic, qps, repr, out, c);
            return;
        }
        self.nak_sent = false;
        let info = op.info();
        // Opcode sequence: inside a message only its MIDDLE / LAST may come.
        let continues = matches!(info.position, Position::Middle | Position::Last);
        let ok_seq = match (&self.cur, continues) {
            (Some(m), true) => (m.kind == MsgKind::Write) == is_write(op),
            (None, false) => true,
            _ => false,
        };
        if !ok_seq {
            self.fatal(nic, NakCode::InvalidRequest, psn, out, c);
            return;
        }
        if op == rc(Op::RdmaReadRequest) {
            let ExtHeaders::Reth(reth) = repr.exts else { return };
            let npkts = (u64::from(reth.dma_len)).div_ceil(self.path.mtu as u64).max(1) as u32;
            self.epsn = psn_add(self.epsn, npkts);
            if self.reads.len() == REPLAY {
                self.reads.pop_front();
            }
            let kept: usize = self.reads.iter().filter_map(|r| r.data.as_ref()).map(Vec::len).sum();
            let keep = kept + reth.dma_len as usize <= READ_REPLAY_BYTES;
            let data = self.read_at(nic, qps, psn, 0, reth.va, reth.rkey, reth.dma_len, keep, out, c);
            self.reads.push_back(ReadRec {
                psn,
                va: reth.va,
                rkey: reth.rkey,
                len: reth.dma_len,
                data,
            });
            self.msn = psn_add(self.msn, 1);
            return;
        }
        if op == rc(Op::CompareSwap) || op == rc(Op::FetchAdd) {
            let ExtHeaders::AtomicEth(a) = repr.exts else { return };
            let (code, cmp, swp) = if op == rc(Op::CompareSwap) {
                (segment::RING_CAS, a.compare, a.swap_add)
            } else {
                (segment::RING_FADD, a.swap_add, 0)
            };
            match self.serve(nic, qps, code, a.va, a.rkey, 8, cmp, swp, &[]) {
                Served::Ok(orig) => {
                    self.epsn = psn_add(self.epsn, 1);
                    self.msn = psn_add(self.msn, 1);
                    if self.atomics.len() == REPLAY {
                        self.atomics.pop_front();
                    }
                    self.atomics.push_back((psn, orig));
                    out.push(self.atomic_ack(psn, orig));
                }
                Served::Fail(s) => self.refused(nic, s, psn, out, c),
            }
            return;
        }
        // WRITE / SEND packets.
        if matches!(info.position, Position::First | Position::Only) {
            let (va, rkey, total) = match repr.exts {
                ExtHeaders::Reth(x) | ExtHeaders::RethImmDt(x, _) => (x.va, x.rkey, u64::from(x.dma_len)),
                _ => (0, 0, 0),
            };
            self.cur = Some(InMsg {
                kind: if is_write(op) { MsgKind::Write } else { MsgKind::Send },
                first_psn: psn,
                va,
                rkey,
                total,
                done: 0,
                fill: 0,
                published: false,
            });
        }
        let last = matches!(info.position, Position::Last | Position::Only);
        let mtu = self.path.mtu;
        if (!last && payload.len() != mtu) || payload.len() > mtu {
            self.fatal(nic, NakCode::InvalidRequest, psn, out, c);
            return;
        }
        let imm = match repr.exts {
            ExtHeaders::ImmDt(i) | ExtHeaders::RethImmDt(_, i) => Some(i.imm),
            _ => None,
        };
        let ring_max = nic.seg.p.ring_max as usize;
        let m = self.cur.as_mut().expect("set above or in progress");
        if m.kind == MsgKind::Write && m.done + (m.fill + payload.len()) as u64 > m.total {
            self.fatal(nic, NakCode::InvalidRequest, psn, out, c);
            return;
        }
        if m.fill + payload.len() > ring_max {
            // The slot is full: it goes to the ring as a part of the message first.
            let first_psn = m.first_psn;
            if let Err(s) = self.publish(nic, qps, false, None, false) {
                self.failed(nic, s, first_psn, psn, out, c);
                return;
            }
        }
        let m = self.cur.as_mut().expect("in progress");
        let (h, data) = nic.seg.slot(self.idx, ring_pos(nic, self.idx));
        let _ = h;
        // SAFETY: the slot at the ring's consumer index is this thread's to fill (the
        // QP's ring has no other producer: it is connected across the network, and this
        // thread serves each request before it fills the next); `fill + len <= ring_max`,
        // the slot's data area.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), data.add(m.fill), payload.len()) };
        m.fill += payload.len();
        self.epsn = psn_add(self.epsn, 1);
        if repr.bth.ack_req {
            self.ack_due = true;
        }
        if last {
            let solicited = repr.bth.solicited;
            let first_psn = m.first_psn;
            match self.publish(nic, qps, true, imm, solicited) {
                Ok(()) => {
                    self.msn = psn_add(self.msn, 1);
                    self.ack_due = true;
                }
                Err(s) => self.failed(nic, s, first_psn, psn, out, c),
            }
        }
    }

    /// The ring did not take a part of the message that began at `first_psn`.
    fn failed(&mut self, nic: &Nic, s: u32, first_psn: u32, psn: u32, out: &mut Vec<Vec<u8>>, c: &Counters) {
        self.cur = None;
        if s & !0xffff == segment::RING_ST_RNR {
            // Receiver not ready: NAK the message's first PSN; its packets come again
            // after the timer (nothing of it was consumed).
            self.epsn = first_psn;
            self.gen = self.gen.wrapping_add(1);
            self.ack_due = false;
            out.push(self.nak(
                first_psn,
                Syndrome::RnrNak {
                    timer: (s & 0x1f) as u8,
                },
                c,
            ));
            return;
        }
        self.refused(nic, s, psn, out, c);
    }

    /// Hand the gathered bytes of the message in progress to the ring as one part and
    /// serve it. `last`: the message ends with it.
    fn publish(&mut self, nic: &Nic, qps: &HostQps, last: bool, imm: Option<u32>, solicited: bool) -> Result<(), u32> {
        let Some(m) = self.cur.as_mut() else {
            return Err(WcStatus::RemInvReqErr as u32);
        };
        let (len, first, done) = (m.fill as u64, !m.published, m.done);
        m.published = true;
        m.done += len;
        m.fill = 0;
        let (kind, va, rkey, total) = (m.kind, m.va, m.rkey, m.total);
        if last {
            self.cur = None;
        }
        let f = |b: bool, flag: u32| if b { flag } else { 0 };
        let sol = f(solicited, segment::RING_F_SOLICITED);
        let (code, raddr, cmp, swp) = match kind {
            MsgKind::Write if last && imm.is_some() => (
                segment::RING_WRITE_IMM | sol,
                va + done,
                u64::from(imm.unwrap_or(0)),
                total,
            ),
            MsgKind::Write => (
                segment::RING_WRITE | f(first, segment::RING_F_FIRST),
                va + done,
                0,
                total,
            ),
            MsgKind::Send => {
                // One part: its length is the message's; more: only the last tells.
                let open = !(first && last);
                let flags = f(first, segment::RING_F_FIRST)
                    | f(last, segment::RING_F_LAST)
                    | f(open, segment::RING_F_OPEN)
                    | f(imm.is_some(), segment::RING_F_IMM)
                    | sol;
                (
                    segment::RING_SEND | flags,
                    done,
                    u64::from(imm.unwrap_or(0)),
                    if open { 0 } else { len },
                )
            }
        };
        // A WRITE's payload of up to 8 bytes travels in the header, as the ring has it.
        let inline = code & segment::RING_OP_MASK == segment::RING_WRITE && len <= 8;
        let cmp = if inline {
            let (_, data) = nic.seg.slot(self.idx, ring_pos(nic, self.idx));
            let mut b = [0u8; 8];
            // SAFETY: `len <= 8` bytes gathered at the start of this thread's slot.
            unsafe { std::ptr::copy_nonoverlapping(data, b.as_mut_ptr(), len as usize) };
            u64::from_le_bytes(b)
        } else {
            cmp
        };
        let _ = rkey;
        match self.serve(nic, qps, code, raddr, rkey, len as u32, cmp, swp, &[]) {
            Served::Ok(_) => Ok(()),
            Served::Fail(s) => Err(s),
        }
    }

    /// Put one request in the QP's ring at its consumer index and serve it there.
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        nic: &Nic,
        qps: &HostQps,
        code: u32,
        raddr: u64,
        rkey: u32,
        len: u32,
        cmp: u64,
        swp: u64,
        _data: &[u8],
    ) -> Served {
        let pos = ring_pos(nic, self.idx);
        let (h, _) = nic.seg.slot(self.idx, pos);
        h.op.store(code | u32::from(self.gen) << segment::RING_GEN_SHIFT, Ordering::Relaxed);
        h.len.store(len, Ordering::Relaxed);
        h.raddr.store(raddr, Ordering::Relaxed);
        h.rkey.store(rkey, Ordering::Relaxed);
        h.src_qpn.store(self.peer_qpn, Ordering::Relaxed);
        h.src_nonce.store(self.nonce, Ordering::Relaxed);
        h.cmp.store(cmp, Ordering::Relaxed);
        h.swp.store(swp, Ordering::Relaxed);
        h.state.store(segment::SLOT_REQ, Ordering::Release);
        crate::nic::thread::retire_answered(qps, self.idx);
        {
            let mut srv: parking_lot::MutexGuard<'_, RingServer> = nic.ring_server.lock();
            crate::nic::thread::serve_qp(nic, &mut srv, self.idx);
        }
        let st = take(h);
        match st {
            Some((s, v)) if s == WcStatus::Success as u32 => Served::Ok(v),
            Some((s, _)) => Served::Fail(s),
            None => Served::Fail(WcStatus::RemOpErr as u32),
        }
    }

    fn atomic_ack(&self, psn: u32, orig: u64) -> Vec<u8> {
        conn::build(
            &self.path,
            conn::bth(rc(Op::AtomicAcknowledge), self.peer_qpn, psn, false, false, 0),
            ExtHeaders::AethAtomicAck(
                AethRepr {
                    syndrome: Syndrome::Ack { credit: 31 },
                    msn: self.msn,
                },
                AtomicAckEthRepr { orig },
            ),
            &[],
        )
    }

    /// Execute READ `psn` (`len` bytes at `va`) part by part through the ring from its
    /// response `k0` on (0: all of it), and send those responses; with `keep`, return
    /// the bytes read (for duplicates).
    #[allow(clippy::too_many_arguments)]
    fn read_at(
        &self,
        nic: &Nic,
        qps: &HostQps,
        psn: u32,
        k0: usize,
        va: u64,
        rkey: u32,
        len: u32,
        keep: bool,
        out: &mut Vec<Vec<u8>>,
        c: &Counters,
    ) -> Option<Vec<u8>> {
        let mut kept = keep.then(|| Vec::with_capacity(len as usize));
        let mtu = self.path.mtu;
        let ring_max = (nic.seg.p.ring_max as usize / mtu).max(1) * mtu;
        let npkts = (len as usize).div_ceil(mtu).max(1);
        let mut k = k0;
        let mut off = (k0 * mtu).min(len as usize);
        loop {
            let plen = (len as usize - off).min(ring_max);
            let code = segment::RING_READ | if off == 0 { segment::RING_F_FIRST } else { 0 };
            let pos = ring_pos(nic, self.idx);
            let result = match self.serve(
                nic,
                qps,
                code,
                va + off as u64,
                rkey,
                plen as u32,
                0,
                u64::from(len),
                &[],
            ) {
                Served::Ok(v) => v,
                Served::Fail(s) => {
                    let code = nak_code(s);
                    out.push(self.nak(psn, Syndrome::Nak(code), c));
                    return None;
                }
            };
            let (_, data) = nic.seg.slot(self.idx, pos);
            let small = result.to_le_bytes();
            let bytes: &[u8] = if plen <= 8 {
                &small[..plen]
            } else {
                // SAFETY: the ring server copied `plen` bytes into this slot's data
                // area (served above, SLOT_DONE acquired in `take`); nobody else
                // writes this QP's slots.
                unsafe { std::slice::from_raw_parts(data, plen) }
            };
            if let Some(v) = kept.as_mut() {
                v.extend_from_slice(bytes);
            }
            k = self.responses(psn, k, npkts, bytes, out);
            off += plen;
            if off >= len as usize {
                break;
            }
        }
        kept
    }

    /// The READ responses carrying `bytes`, packets `k..` of `npkts` of READ `psn`;
    /// returns the next packet index.
    fn responses(&self, psn: u32, mut k: usize, npkts: usize, bytes: &[u8], out: &mut Vec<Vec<u8>>) -> usize {
        let mtu = self.path.mtu;
        let mut p = 0;
        loop {
            let chunk = &bytes[p..(p + mtu).min(bytes.len())];
            let opc = match (k == 0, k + 1 == npkts) {
                (true, true) => Op::RdmaReadResponseOnly,
                (true, false) => Op::RdmaReadResponseFirst,
                (false, true) => Op::RdmaReadResponseLast,
                (false, false) => Op::RdmaReadResponseMiddle,
            };
            let exts = if opc == Op::RdmaReadResponseMiddle {
                ExtHeaders::None
            } else {
                ExtHeaders::Aeth(AethRepr {
                    syndrome: Syndrome::Ack { credit: 31 },
                    msn: self.msn,
                })
            };
            let b = conn::bth(
                rc(opc),
                self.peer_qpn,
                psn_add(psn, k as u32),
                false,
                false,
                chunk.len(),
            );
            out.push(conn::build(&self.path, b, exts, chunk));
            k += 1;
            p += chunk.len();
            if p >= bytes.len() {
                return k;
            }
        }
    }

    fn duplicate(&mut self, nic: &Nic, qps: &HostQps, repr: &roce::packet::Repr, out: &mut Vec<Vec<u8>>, c: &Counters) {
        let psn = repr.bth.psn;
        let op = repr.bth.opcode;
        if op == rc(Op::RdmaReadRequest) {
            // The READ this one repeats, whole or from a response on (the requester
            // asks again from its first missing response).
            let mtu = self.path.mtu;
            let npkts_of = |len: u32| (len as usize).div_ceil(mtu).max(1);
            let Some(r) = self.reads.iter().find(|r| {
                let k = psn_diff(psn, r.psn);
                k >= 0 && (k as usize) < npkts_of(r.len)
            }) else {
                tracing::debug!(psn, epsn = self.epsn, "RoCEv2: duplicate READ no longer known: ignored");
                return;
            };
            let k = psn_diff(psn, r.psn) as usize;
            let skip = (k * mtu).min(r.len as usize);
            let ExtHeaders::Reth(reth) = repr.exts else { return };
            if reth.va != r.va + skip as u64 || reth.rkey != r.rkey || reth.dma_len as usize != r.len as usize - skip {
                // Not a repeat of what was read: malformed.
                Counters::add(&c.bad_packets, 1);
                return;
            }
            let npkts = npkts_of(r.len);
            match &r.data {
                Some(d) => {
                    self.responses(r.psn, k, npkts, &d[skip..], out);
                }
                None => {
                    let (p0, va, rkey, len) = (r.psn, r.va, r.rkey, r.len);
                    self.read_at(nic, qps, p0, k, va, rkey, len, false, out, c);
                }
            }
            return;
        }
        if op == rc(Op::CompareSwap) || op == rc(Op::FetchAdd) {
            if let Some(&(p, orig)) = self.atomics.iter().find(|a| a.0 == psn) {
                out.push(self.atomic_ack(p, orig));
            }
            return;
        }
        self.ack_due = true;
    }

    /// A request the ring refused with `s`: NAK it (the QP failed in the ring server,
    /// as a responder error fails it on hardware).
    fn refused(&mut self, _nic: &Nic, s: u32, psn: u32, out: &mut Vec<Vec<u8>>, c: &Counters) {
        self.cur = None;
        if s == WcStatus::RetryExcErr as u32 || s == segment::RING_ST_DROPPED {
            // Not connected to this peer (any more): what a fabric drops.
            Counters::add(&c.stray_packets, 1);
            return;
        }
        out.push(self.nak(psn, Syndrome::Nak(nak_code(s)), c));
    }

    /// A malformed request: NAK it and fail the QP.
    fn fatal(&mut self, nic: &Nic, code: NakCode, psn: u32, out: &mut Vec<Vec<u8>>, c: &Counters) {
        Counters::add(&c.bad_packets, 1);
        self.cur = None;
        crate::nic::responder::qp_error(&nic.seg, &nic.self_peer, self.idx);
        out.push(self.nak(psn, Syndrome::Nak(code), c));
    }
}

/// The ring position this thread fills next for QP `idx`.
fn ring_pos(nic: &Nic, idx: u32) -> u64 {
    nic.seg.qp(idx).map_or(0, |r| r.ring_cons.load(Ordering::Acquire))
}

/// Take the answer of a served slot and free it: (status, result), None if it was
/// not served (the QP went away under it).
fn take(h: &SlotHdr) -> Option<(u32, u64)> {
    if h.state.load(Ordering::Acquire) != segment::SLOT_DONE {
        // Not served: withdraw it.
        h.state.store(segment::SLOT_FREE, Ordering::Release);
        return None;
    }
    let v = (h.status.load(Ordering::Relaxed), h.result.load(Ordering::Relaxed));
    h.state.store(segment::SLOT_FREE, Ordering::Release);
    Some(v)
}

fn is_write(op: roce::opcode::Opcode) -> bool {
    [
        Op::RdmaWriteFirst,
        Op::RdmaWriteMiddle,
        Op::RdmaWriteLast,
        Op::RdmaWriteLastWithImmediate,
        Op::RdmaWriteOnly,
        Op::RdmaWriteOnlyWithImmediate,
    ]
    .iter()
    .any(|&o| rc(o) == op)
}

/// The NAK code for a ring status.
fn nak_code(s: u32) -> NakCode {
    match s {
        x if x == WcStatus::RemAccessErr as u32 => NakCode::RemoteAccessError,
        x if x == WcStatus::RemOpErr as u32 => NakCode::RemoteOperationalError,
        _ => NakCode::InvalidRequest,
    }
}
