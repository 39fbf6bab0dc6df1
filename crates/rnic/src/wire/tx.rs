//! The requester side of a connection across the network: the QP's ring requests,
//! put by the ordinary requester into a local shadow of the peer's ring, leave as
//! RoCEv2 request packets (WRITE and SEND messages over all their parts, a READ
//! request per part, atomics), each part kept in its slot until answered, so a
//! retransmission rebuilds its packets from there. Responses (ACKs coalesced or not,
//! NAKs, RNR NAKs, READ responses, atomic ACKs) answer the shadow's slots, where the
//! completer takes them as it takes a peer's answers over shared memory. Go-back-N on
//! a NAK for a PSN sequence error and on the QP's `timeout`, up to `retry_cnt` times,
//! then RETRY_EXC_ERR.

use crate::hw::segment::{self, Segment, SlotHdr};
use crate::verbs::WcStatus;
use crate::wire::conn::{self, is_read_response, psn_add, psn_diff, rc, Counters, Path};
use roce::aeth::{NakCode, Syndrome};
use roce::atomic_eth::AtomicEthRepr;
use roce::exts::ExtHeaders;
use roce::immdt::ImmDtRepr;
use roce::opcode::{Op, Opcode};
use roce::reth::RethRepr;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Write,
    Send,
    Read,
    Atomic,
}

/// A transmitted, unanswered ring part.
struct Out {
    slot: u64,
    /// The part's length (what its READ responses must bring).
    len: usize,
    psn: u32,
    npkts: u32,
    kind: Kind,
    /// READ: response packets taken so far.
    got: u32,
    /// WRITE / SEND: the part starts its message (with the message's RETH for a
    /// WRITE) / ends it.
    first: Option<RethRepr>,
    last: bool,
    gen: u16,
}

/// The message (WRITE or SEND over several parts) being sent.
#[derive(Clone, Copy)]
struct Msg {
    va: u64,
    total: u64,
}

/// A QP's requester state across the network.
pub struct TxConn {
    pub idx: u32,
    dest_qpn: u32,
    shadow: Arc<Segment>,
    tq: u32,
    pub path: Arc<Path>,
    timeout_ns: u64,
    retry_cnt: u8,
    retries_left: u8,
    max_rd: usize,
    psn: u32,
    next_slot: u64,
    out: VecDeque<Out>,
    msg: Option<Msg>,
    blocked_gen: Option<u16>,
    last_progress: u64,
    /// A response gap (a READ response or atomic ACK lost or reordered) was answered
    /// by a go-back-N resend; the next one waits for progress first.
    gap_resent: bool,
}

/// Bytes a connection keeps in flight at most (request packets unacknowledged plus
/// READ responses asked for): what a receive socket buffer takes in one burst.
const WINDOW_BYTES: u32 = 1 << 20;

/// Time the requester waits for an answer before it retransmits: the QP's
/// `timeout` (4.096 µs × 2^timeout; 0, "infinite", taken as 0.5 s), at least 200 µs.
pub fn timeout_ns(timeout: u8) -> u64 {
    if timeout == 0 {
        500_000_000
    } else {
        (4096u64 << timeout.min(31)).max(200_000)
    }
}

/// What a connection's parameters are at RTS.
pub struct TxParams {
    pub idx: u32,
    pub dest_qpn: u32,
    pub shadow: Arc<Segment>,
    pub tq: u32,
    pub path: Arc<Path>,
    pub sq_psn: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub max_rd_atomic: u8,
}

fn answer(h: &SlotHdr, status: u32, result: u64) {
    h.result.store(result, Ordering::Relaxed);
    h.status.store(status, Ordering::Relaxed);
    h.state.store(segment::SLOT_DONE, Ordering::Release);
}

fn wc(s: WcStatus) -> u32 {
    s as u32
}

impl TxConn {
    pub fn new(p: TxParams, now: u64) -> TxConn {
        let retry_cnt = p.retry_cnt.min(7);
        TxConn {
            idx: p.idx,
            dest_qpn: p.dest_qpn,
            tq: p.tq,
            shadow: p.shadow,
            path: p.path,
            timeout_ns: timeout_ns(p.timeout),
            retry_cnt,
            retries_left: retry_cnt,
            max_rd: usize::from(p.max_rd_atomic.max(1)),
            psn: p.sq_psn & conn::PSN_MASK,
            next_slot: 0,
            out: VecDeque::new(),
            msg: None,
            blocked_gen: None,
            last_progress: now,
            gap_resent: false,
        }
    }

    fn slot(&self, i: u64) -> (&SlotHdr, *mut u8) {
        self.shadow.slot(self.tq, i)
    }

    /// Whether anything waits for an answer (the engine's timer looks).
    pub fn busy(&self) -> bool {
        !self.out.is_empty()
    }

    /// When the oldest outstanding part times out.
    pub fn deadline(&self) -> Option<u64> {
        self.busy().then_some(self.last_progress + self.timeout_ns)
    }

    /// Send the requests the requester put in the shadow ring since the last call.
    pub fn transmit_new(&mut self, c: &Counters, now: u64) {
        let mut pkts = Vec::new();
        loop {
            let i = self.next_slot;
            if self
                .out
                .front()
                .is_some_and(|o| i >= o.slot + u64::from(self.shadow.p.ring_slots))
            {
                // Slot `i` is the physical slot of a part still outstanding: the
                // requester has not reused it yet.
                break;
            }
            let shadow = self.shadow.clone();
            let (h, _) = shadow.slot(self.tq, i);
            if h.state.load(Ordering::Acquire) != segment::SLOT_REQ {
                break;
            }
            let op = h.op.load(Ordering::Relaxed);
            let code = op & segment::RING_OP_MASK;
            let gen = (op >> segment::RING_GEN_SHIFT) as u16;
            if let Some(b) = self.blocked_gen {
                if b == gen {
                    // Behind an RNR NAK of its generation: refused unsent, as the
                    // responder refuses them (the requester resends from the NAKed WR).
                    answer(h, segment::RING_ST_SEQ, 0);
                    self.next_slot += 1;
                    continue;
                }
                self.blocked_gen = None;
            }
            let kind = match code {
                segment::RING_READ => Kind::Read,
                segment::RING_CAS | segment::RING_FADD => Kind::Atomic,
                segment::RING_WRITE | segment::RING_WRITE_IMM => Kind::Write,
                segment::RING_SEND => Kind::Send,
                _ => {
                    answer(h, wc(WcStatus::LocQpOpErr), 0);
                    self.next_slot += 1;
                    continue;
                }
            };
            if matches!(kind, Kind::Read | Kind::Atomic)
                && self
                    .out
                    .iter()
                    .filter(|o| matches!(o.kind, Kind::Read | Kind::Atomic))
                    .count()
                    >= self.max_rd
            {
                // max_rd_atomic outstanding: the next one leaves when one is answered.
                break;
            }
            let len = u64::from(h.len.load(Ordering::Relaxed));
            let raddr = h.raddr.load(Ordering::Relaxed);
            let swp = h.swp.load(Ordering::Relaxed);
            let flags = op & segment::RING_FLAGS_MASK;
            let mtu = self.path.mtu as u64;
            let npkts = match kind {
                Kind::Atomic => 1,
                _ => len.div_ceil(mtu).max(1) as u32,
            };
            let inflight: u32 = self.out.iter().map(|o| o.npkts).sum();
            if !self.out.is_empty() && inflight + npkts > WINDOW_BYTES / self.path.mtu as u32 {
                // The window is full (requests and the responses they ask for): the
                // receiver's socket would drop the excess, which costs a timeout.
                break;
            }
            let (first, last) = match kind {
                Kind::Write => {
                    let starts = flags & segment::RING_F_FIRST != 0 || self.msg.is_none();
                    if starts {
                        self.msg = Some(Msg { va: raddr, total: swp });
                    }
                    let m = self.msg.expect("set above");
                    let last = code == segment::RING_WRITE_IMM || raddr + len >= m.va + m.total;
                    let reth = RethRepr {
                        va: m.va,
                        rkey: h.rkey.load(Ordering::Relaxed),
                        dma_len: m.total as u32,
                    };
                    (starts.then_some(reth), last)
                }
                Kind::Send => {
                    let starts = flags & segment::RING_F_FIRST != 0;
                    let reth = RethRepr {
                        va: 0,
                        rkey: 0,
                        dma_len: 0,
                    };
                    (starts.then_some(reth), flags & segment::RING_F_LAST != 0)
                }
                _ => (None, true),
            };
            if last {
                self.msg = None;
            }
            let o = Out {
                slot: i,
                len: len as usize,
                psn: self.psn,
                npkts,
                kind,
                got: 0,
                first,
                last,
                gen,
            };
            self.packets(&o, &mut pkts);
            self.psn = psn_add(self.psn, npkts);
            if self.out.is_empty() {
                self.last_progress = now;
            }
            self.out.push_back(o);
            self.next_slot += 1;
        }
        self.send(pkts, c);
    }

    fn send(&self, pkts: Vec<Vec<u8>>, c: &Counters) {
        if pkts.is_empty() {
            return;
        }
        Counters::add(&c.tx_packets, pkts.len() as u64);
        self.path.send(pkts);
    }

    /// The packets of part `o`, from its slot.
    fn packets(&self, o: &Out, out: &mut Vec<Vec<u8>>) {
        let (h, data) = self.slot(o.slot);
        let op = h.op.load(Ordering::Relaxed);
        let code = op & segment::RING_OP_MASK;
        let len = o.len;
        let rkey = h.rkey.load(Ordering::Relaxed);
        let raddr = h.raddr.load(Ordering::Relaxed);
        let cmp = h.cmp.load(Ordering::Relaxed);
        let swp = h.swp.load(Ordering::Relaxed);
        let solicited = op & segment::RING_F_SOLICITED != 0;
        let path = &*self.path;
        let q = self.dest_qpn;
        match o.kind {
            Kind::Read => {
                // Sent again after `got` responses arrived: only the rest is asked
                // for, from the first missing response's PSN (IBA 9.7.5.1.4).
                let skip = (o.got as usize * path.mtu).min(len);
                let b = conn::bth(rc(Op::RdmaReadRequest), q, psn_add(o.psn, o.got), true, false, 0);
                let reth = RethRepr {
                    va: raddr + skip as u64,
                    rkey,
                    dma_len: (len - skip) as u32,
                };
                out.push(conn::build(path, b, ExtHeaders::Reth(reth), &[]));
            }
            Kind::Atomic => {
                let (opc, swap_add, compare) = if code == segment::RING_CAS {
                    (Op::CompareSwap, swp, cmp)
                } else {
                    (Op::FetchAdd, cmp, 0)
                };
                let b = conn::bth(rc(opc), q, o.psn, true, false, 0);
                let a = AtomicEthRepr {
                    va: raddr,
                    rkey,
                    swap_add,
                    compare,
                };
                out.push(conn::build(path, b, ExtHeaders::AtomicEth(a), &[]));
            }
            Kind::Write | Kind::Send => {
                let small;
                let payload: &[u8] = if code == segment::RING_WRITE && len <= 8 {
                    small = cmp.to_le_bytes();
                    &small[..len]
                } else if len == 0 {
                    &[]
                } else {
                    // SAFETY: the slot's data area holds `len` (<= ring_max) bytes the
                    // requester wrote before publishing SLOT_REQ (acquired above, in
                    // transmit_new); it stays unchanged until we answer the slot.
                    unsafe { std::slice::from_raw_parts(data, len) }
                };
                let imm = (op & segment::RING_F_IMM != 0 || code == segment::RING_WRITE_IMM).then_some(cmp as u32);
                let mtu = path.mtu;
                for k in 0..o.npkts as usize {
                    let chunk = &payload[(k * mtu).min(len)..((k + 1) * mtu).min(len)];
                    let f = k == 0 && o.first.is_some();
                    let l = k + 1 == o.npkts as usize && o.last;
                    let (opc, exts) = self.opcode(o.kind, f, l, imm, o.first);
                    let b = conn::bth(
                        opc,
                        q,
                        psn_add(o.psn, k as u32),
                        k + 1 == o.npkts as usize,
                        l && solicited,
                        chunk.len(),
                    );
                    out.push(conn::build(path, b, exts, chunk));
                }
            }
        }
    }

    fn opcode(
        &self,
        kind: Kind,
        first: bool,
        last: bool,
        imm: Option<u32>,
        reth: Option<RethRepr>,
    ) -> (Opcode, ExtHeaders) {
        let imm_x = imm.map(|imm| ImmDtRepr { imm });
        let reth = reth.unwrap_or(RethRepr {
            va: 0,
            rkey: 0,
            dma_len: 0,
        });
        match (kind, first, last, imm_x) {
            (Kind::Write, true, true, Some(i)) => (rc(Op::RdmaWriteOnlyWithImmediate), ExtHeaders::RethImmDt(reth, i)),
            (Kind::Write, true, true, None) => (rc(Op::RdmaWriteOnly), ExtHeaders::Reth(reth)),
            (Kind::Write, true, false, _) => (rc(Op::RdmaWriteFirst), ExtHeaders::Reth(reth)),
            (Kind::Write, false, true, Some(i)) => (rc(Op::RdmaWriteLastWithImmediate), ExtHeaders::ImmDt(i)),
            (Kind::Write, false, true, None) => (rc(Op::RdmaWriteLast), ExtHeaders::None),
            (Kind::Write, false, false, _) => (rc(Op::RdmaWriteMiddle), ExtHeaders::None),
            (_, true, true, Some(i)) => (rc(Op::SendOnlyWithImmediate), ExtHeaders::ImmDt(i)),
            (_, true, true, None) => (rc(Op::SendOnly), ExtHeaders::None),
            (_, true, false, _) => (rc(Op::SendFirst), ExtHeaders::None),
            (_, false, true, Some(i)) => (rc(Op::SendLastWithImmediate), ExtHeaders::ImmDt(i)),
            (_, false, true, None) => (rc(Op::SendLast), ExtHeaders::None),
            (_, false, false, _) => (rc(Op::SendMiddle), ExtHeaders::None),
        }
    }

    /// WRITE / SEND parts whose last PSN is before `psn` (`inclusive`: up to it) are
    /// acknowledged. Stops at an unanswered READ or atomic (its response is its ACK).
    fn ack_upto(&mut self, psn: u32, inclusive: bool, now: u64) -> bool {
        let mut any = false;
        while let Some(o) = self.out.front() {
            let last = psn_add(o.psn, o.npkts - 1);
            let d = psn_diff(psn, last);
            let covered = if inclusive { d >= 0 } else { d > 0 };
            if !covered || matches!(o.kind, Kind::Read | Kind::Atomic) {
                break;
            }
            answer(self.slot(o.slot).0, wc(WcStatus::Success), 0);
            self.out.pop_front();
            any = true;
        }
        if any {
            self.progress(now);
        }
        any
    }

    fn progress(&mut self, now: u64) {
        self.last_progress = now;
        self.retries_left = self.retry_cnt;
        self.gap_resent = false;
    }

    /// A response arrived ahead of the one awaited (an earlier one was lost or is
    /// late): send everything outstanding again now, once per gap, rather than wait
    /// for the timeout (the responder answers duplicates: READs from its replay
    /// data, atomics from its cache, WRITEs and SENDs with an ACK).
    fn gap(&mut self, c: &Counters, now: u64) {
        if !self.gap_resent {
            self.gap_resent = true;
            self.retransmit(c, now, false);
        }
    }

    /// Answer every outstanding part with `status` (the first: `first`).
    fn fail_all(&mut self, first: u32, rest: u32) {
        let mut s = first;
        while let Some(o) = self.out.pop_front() {
            answer(self.slot(o.slot).0, s, 0);
            s = rest;
        }
        self.msg = None;
    }

    /// A response packet for this connection. Returns whether a slot was answered.
    pub fn on_response(&mut self, repr: &roce::packet::Repr, payload: &[u8], c: &Counters, now: u64) -> bool {
        let psn = repr.bth.psn;
        match repr.exts {
            ExtHeaders::Aeth(a) if repr.bth.opcode == rc(Op::Acknowledge) => match a.syndrome {
                Syndrome::Ack { .. } => self.ack_upto(psn, true, now),
                Syndrome::RnrNak { timer } => {
                    Counters::add(&c.naks_received, 1);
                    self.ack_upto(psn, false, now);
                    let Some(o) = self.out.front() else { return false };
                    if psn_diff(psn, o.psn) < 0 || psn_diff(psn, psn_add(o.psn, o.npkts - 1)) > 0 {
                        return false;
                    }
                    self.blocked_gen = Some(o.gen);
                    self.psn = o.psn;
                    self.fail_all(segment::RING_ST_RNR | u32::from(timer), segment::RING_ST_SEQ);
                    self.progress(now);
                    true
                }
                Syndrome::Nak(code) => {
                    Counters::add(&c.naks_received, 1);
                    self.ack_upto(psn, false, now);
                    if code == NakCode::PsnSequenceError {
                        self.retransmit(c, now, false);
                        return true;
                    }
                    let status = match code {
                        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                        NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                        _ => WcStatus::RemInvReqErr,
                    };
                    self.fail_all(wc(status), wc(WcStatus::WrFlushErr));
                    true
                }
            },
            ExtHeaders::AethAtomicAck(_, ack) => {
                self.ack_upto(psn, false, now);
                match self.out.front() {
                    Some(o) if o.kind == Kind::Atomic && o.psn == psn => {
                        answer(self.slot(o.slot).0, wc(WcStatus::Success), ack.orig);
                        self.out.pop_front();
                        self.progress(now);
                        true
                    }
                    Some(o) if psn_diff(psn, o.psn) > 0 => {
                        self.gap(c, now);
                        false
                    }
                    _ => {
                        Counters::add(&c.duplicates, 1);
                        false
                    }
                }
            }
            _ if is_read_response(repr.bth.opcode) => {
                if let ExtHeaders::Aeth(a) = repr.exts {
                    if let Syndrome::Nak(_) | Syndrome::RnrNak { .. } = a.syndrome {
                        return false;
                    }
                }
                self.ack_upto(psn, false, now);
                self.read_data(psn, payload, c, now)
            }
            _ => false,
        }
    }

    fn read_data(&mut self, psn: u32, payload: &[u8], c: &Counters, now: u64) -> bool {
        let mtu = self.path.mtu;
        let Some(o) = self.out.front_mut() else { return false };
        let expected = psn_add(o.psn, o.got);
        if psn_diff(psn, expected) > 0 {
            self.gap(c, now);
            return false;
        }
        if o.kind != Kind::Read || psn != expected {
            Counters::add(&c.duplicates, 1);
            return false;
        }
        let (h, data) = self.shadow.slot(self.tq, o.slot);
        let len = o.len;
        let off = o.got as usize * mtu;
        let last = o.got + 1 == o.npkts;
        let want = if last { len - off.min(len) } else { mtu };
        if payload.len() != want {
            // Not the response this READ asked for: malformed, dropped.
            Counters::add(&c.bad_packets, 1);
            return false;
        }
        if off + want > len.max(8) {
            Counters::add(&c.bad_packets, 1);
            return false;
        }
        if len <= 8 {
            let mut b = [0u8; 8];
            b[..payload.len()].copy_from_slice(payload);
            h.result.store(u64::from_le_bytes(b), Ordering::Relaxed);
        } else {
            // SAFETY: `off + want <= len <= ring_max`, inside the slot's data area, which
            // only this connection writes while the slot is outstanding (the completer
            // reads it after SLOT_DONE, published with Release below).
            unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), data.add(off), want) };
        }
        o.got += 1;
        self.last_progress = now;
        self.gap_resent = false;
        if last {
            let slot = o.slot;
            let result = h.result.load(Ordering::Relaxed);
            self.out.pop_front();
            answer(self.shadow.slot(self.tq, slot).0, wc(WcStatus::Success), result);
            self.progress(now);
            return true;
        }
        false
    }

    /// Go back N: send every outstanding part again, from its first packet (a READ
    /// from its first response).
    fn retransmit(&mut self, c: &Counters, now: u64, timed_out: bool) {
        let mut pkts = Vec::new();
        for o in self.out.iter() {
            self.packets(o, &mut pkts);
        }
        Counters::add(&c.retransmissions, self.out.len() as u64);
        if timed_out {
            Counters::add(&c.timeouts, 1);
        }
        self.last_progress = now;
        self.send(pkts, c);
    }

    /// The timer: past the deadline, retransmit, or give up once `retry_cnt`
    /// retransmissions went unanswered. Returns whether slots were answered.
    pub fn tick(&mut self, c: &Counters, now: u64) -> bool {
        let Some(dl) = self.deadline() else { return false };
        if now < dl {
            return false;
        }
        if self.retries_left == 0 {
            if let Some(o) = self.out.front() {
                tracing::warn!(
                    dest_qpn = self.dest_qpn,
                    psn = o.psn,
                    kind = ?o.kind,
                    got = o.got,
                    npkts = o.npkts,
                    outstanding = self.out.len(),
                    "RoCEv2: no answer after {} retransmissions: RETRY_EXC_ERR",
                    self.retry_cnt
                );
            }
            self.fail_all(segment::RING_ST_RETRY_EXC, segment::RING_ST_RETRY_EXC);
            return true;
        }
        self.retries_left -= 1;
        self.retransmit(c, now, true);
        false
    }

    /// The QP is going away (reset, destroyed): answer what is outstanding, so the
    /// completer's zombies free their slots.
    pub fn close(&mut self) {
        self.fail_all(wc(WcStatus::WrFlushErr), wc(WcStatus::WrFlushErr));
    }
}
