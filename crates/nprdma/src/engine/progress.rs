//! Progress: polling the NIC CQs and dispatching each completion by its
//! [`WrTag`](super::wrid), the periodic sweep (timeouts, deferred
//! read-backs), the pins owed after answer-first READs, and the context's
//! polling thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::backend::Backend;
use super::fast;
use super::one_sided::{check_batch, eval_one_sided, flush_deferred};
use super::op::{Stage, TKind};
use super::pin::engine_pin;
use super::post::run_ready;
use super::qp::RnrWait;
use super::retire::{fail_qp, finish};
use super::serve::{self, deliver_inbound, handle_msg};
use super::state::{Shared, State};
use super::types::PS;
use super::ucq::UCq;
use super::wrid::{WrKind, WrTag};
use crate::ctrl::{Repr, Status, SLOT};
use crate::nic::{
    CompOp, Completion, MemoryManager as _, NicBuf as _, NicCq as _, NicQp as _, PinFor, WcStatus,
};
use crate::trace::{mark, Step};

/// Drive the engine: poll the NIC CQ and handle everything. Returns the
/// number of NIC completions handled.
pub(crate) fn progress<N: Backend>(sh: &Shared<N>, st: &mut State<N>) -> usize {
    // No application array to fill here (even if an earlier
    // `progress_app_into` unwound without clearing it).
    st.direct.stop();
    progress_inner(sh, st, false)
}

/// [`progress`] from an application thread spinning on user CQ `cq` with
/// room for `out.len()` completions: an idle poll reads the clock (for the
/// timeout sweep) only every 32nd time, and lean-path completions for `cq`
/// go straight into `out` while its queue is empty (so post order holds).
/// Returns how many were put into `out`.
#[inline]
pub(crate) fn progress_app_into<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    cq: &Arc<UCq>,
    out: &mut [Completion],
) -> usize {
    st.direct.begin(cq, out.len());
    progress_inner(sh, st, true);
    st.direct.end(out)
}

fn progress_inner<N: Backend>(sh: &Shared<N>, st: &mut State<N>, app: bool) -> usize {
    let mut wcs = std::mem::take(&mut st.wcs);
    if wcs.is_empty() {
        wcs = vec![Completion::default(); 64];
    }
    let mut total = 0;
    for (k, cq) in [&sh.ncq, &sh.rcq].into_iter().enumerate() {
        // An application thread that just got data-QP completions leaves
        // the control CQ for the next idle poll (at the latest every 16th
        // call): a one-sided op's completion never arrives there.
        if k == 1 && app && total > 0 && st.progress_calls % 16 != 0 {
            break;
        }
        loop {
            let n = match cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    if !st.cq_failed {
                        st.cq_failed = true;
                        tracing::error!(error = %e, "NIC CQ failed");
                    }
                    0
                }
            };
            for wc in &wcs[..n] {
                handle_wc(sh, st, wc);
                run_ready(sh, st);
            }
            if !st.swap_wait.is_empty() {
                serve::serve_swap_wait(sh, st);
                run_ready(sh, st);
            }
            total += n;
            if n < wcs.len() {
                break;
            }
        }
    }
    st.wcs = wcs;
    if !st.flush_qps.is_empty() {
        for qi in std::mem::take(&mut st.flush_qps) {
            flush_deferred(sh, st, qi);
        }
    }
    run_ready(sh, st);
    st.progress_calls = st.progress_calls.wrapping_add(1);
    let idle_check = total == 0 && (!app || st.progress_calls % 32 == 0);
    if (idle_check || st.progress_calls % 256 == 0)
        && st.last_sweep.elapsed() >= std::time::Duration::from_millis(10)
    {
        st.last_sweep = Instant::now();
        sweep_timeouts(sh, st);
    }
    if total == 0 && !st.post_answer.is_empty() {
        // Nothing new arrived: the owed pins + map-ins (counts as work).
        return map_in_owed(sh, st);
    }
    total
}

/// The pins + map-ins owed by answer-first inline READs, all in one pass:
/// page-adjacent ranges of one MR merge into a run that is faulted in
/// with one range pin (one zero-fill / swap-in per run of pages, see
/// `vmem`'s range pin) and mapped with one shadow pass. Returns the
/// number of runs.
fn map_in_owed<N: Backend>(sh: &Shared<N>, st: &mut State<N>) -> usize {
    let mut owed: Vec<_> = st.post_answer.drain(..).collect();
    owed.sort_unstable_by_key(|(m, addr, _)| (Arc::as_ptr(m) as usize, *addr));
    let mut runs = 0;
    let mut i = 0;
    while i < owed.len() {
        let (m, start, len) = &owed[i];
        let mut end = start + len;
        let mut j = i + 1;
        while j < owed.len() && Arc::ptr_eq(&owed[j].0, m) && owed[j].1 <= end.next_multiple_of(PS)
        {
            end = end.max(owed[j].1 + owed[j].2);
            j += 1;
        }
        drop(engine_pin(&sh.mm, m, *start, end - start, PinFor::Read));
        runs += 1;
        i = j;
    }
    runs
}

/// How long a two-sided request waits for its answer before the sweep asks
/// whether the peer's process is still there: the retry budget of the NIC QPs the
/// engine programs (timeout 14 = 67.1 ms per try, retry_cnt 7 = 8 tries), so a
/// vanished peer fails the engine's requests when a NIC's own retries to it would
/// have run out — not sooner (an application that exits with its peer's last
/// messages in flight does not fail the peer), not at the two-sided timeout.
const PEER_CHECK_AFTER: std::time::Duration = std::time::Duration::from_nanos(8 * (4096 << 14));

/// Two-sided requests the peer never answered (it destroyed its QP or
/// died) complete with RETRY_EXC_ERR, like an RC transport timeout; a peer
/// whose process is gone fails them as soon as the sweep sees it.
fn sweep_timeouts<N: Backend>(sh: &Shared<N>, st: &mut State<N>) {
    let limit = sh.cfg.two_sided_timeout;
    let mut late = Vec::new();
    let mut gone = Vec::new();
    for (qi, q) in st.qps.iter_mut().enumerate() {
        let Some(qp) = q else { continue };
        let mut waiting = false;
        for (id, op) in qp.ops.iter() {
            if op.sent.is_some_and(|t| t.elapsed() > limit) {
                late.push((qi, id));
            }
            waiting |= op.sent.is_some_and(|t| t.elapsed() > PEER_CHECK_AFTER);
        }
        // An answer overdue from a peer whose process is gone never comes: fail
        // at once (as the NIC does for its own requests), not at the timeout.
        if waiting && (qp.ctrl.as_ref().is_some_and(|c| c.peer_gone()) || qp.data.peer_gone()) {
            gone.push(qi);
        } else if waiting && !qp.probed.is_some_and(|t| t.elapsed() <= PEER_CHECK_AFTER) {
            // A device that cannot say: ask its transport.
            qp.probe_peer();
        }
    }
    // Leases: ours whose time of use is over and that nothing uses go back;
    // those lent to peers that never gave them back close at their time.
    // Messages held for a RECV: answered RNR past their budget; the others'
    // senders are told they are still held (see `serve::rnr_refresh`).
    let now = Instant::now();
    sh.leases.sweep(now);
    for q in st.qps.iter_mut().flatten() {
        for (key, seq) in q.held.retire(now) {
            q.send_ctrl(&sh.cfg.ctrl, &Repr::LeaseRelease { key, seq });
        }
        if matches!(q.rnr_wait, RnrWait::Until(t) if t <= now) {
            serve::rnr_expire(sh, q);
        }
        serve::rnr_refresh(sh, q, now);
    }
    // (The failed QPs' ops are all completed by `fail_qp`.)
    late.retain(|(qi, _)| !gone.contains(qi));
    for qi in gone {
        tracing::warn!(qi, "peer gone while answers were owed");
        fail_qp(st, qi, WcStatus::RetryExcErr);
    }
    for (qi, id) in late {
        tracing::warn!(qi, id, "two-sided request timed out");
        finish(st, qi, id, WcStatus::RetryExcErr, 0);
    }
    // Deferred read-backs are not left waiting for a signaled WR forever.
    let idle: Vec<usize> = st
        .qps
        .iter()
        .enumerate()
        .filter_map(|(qi, q)| q.as_ref().filter(|q| !q.deferred.is_empty()).map(|_| qi))
        .collect();
    for qi in idle {
        flush_deferred(sh, st, qi);
    }
    run_ready(sh, st);
}

/// Dispatch one NIC completion by its [`WrTag`].
pub(super) fn handle_wc<N: Backend>(sh: &Shared<N>, st: &mut State<N>, wc: &Completion) {
    let Some(WrTag {
        qi,
        gen,
        mut kind,
        step,
        mut id,
    }) = WrTag::from_wr_id(wc.wr_id)
    else {
        return;
    };
    if st.gens.get(qi) != Some(&gen) {
        return;
    }
    if kind == WrKind::Fast {
        match fast::on_wc(sh, st, qi, step, wc) {
            Some(pid) => (kind, id) = (WrKind::Op, pid),
            None => return,
        }
    }
    let status = WcStatus::from_code(wc.status);
    match kind {
        WrKind::Op => on_op_wc(sh, st, qi, id, step, status),
        WrKind::Rev => on_rev_wc(sh, st, qi, id, status == WcStatus::Success),
        WrKind::CtrlSend => on_ctrl_send_wc(st, qi, status),
        WrKind::Probe => {
            if status != WcStatus::Success && status != WcStatus::WrFlushErr {
                tracing::warn!(status = ?status, "liveness probe failed: peer gone");
                fail_qp(st, qi, WcStatus::RetryExcErr);
            }
        }
        WrKind::Readback => {
            if st.qp(qi).is_some() {
                check_batch(sh, st, qi, id, status);
            }
        }
        WrKind::CtrlRecv => on_ctrl_recv_wc(sh, st, qi, id, status == WcStatus::Success),
        // Routed above: to the lean path, or as `Op` once promoted.
        WrKind::Fast => {}
    }
}

/// NIC WR `step` of operation `id`'s one-sided attempt completed: once no
/// completion is due any more, evaluate the attempt.
fn on_op_wc<N: Backend>(
    sh: &Shared<N>,
    st: &mut State<N>,
    qi: usize,
    id: u32,
    step: u8,
    status: WcStatus,
) {
    let Some(op) = st.op_mut(qi, id) else { return };
    if let Stage::OneSided {
        steps, left, err, ..
    } = &mut op.stage
    {
        // Completions still due after step `step`: none on success
        // (only the last WR is signaled), the flushed WRs behind a
        // failed one otherwise.
        let behind = (*steps as u64).saturating_sub(u64::from(step) + 1) as u8;
        *left = (*left).min(behind);
        if status != WcStatus::Success && *err == WcStatus::Success {
            *err = status;
        }
        if *left == 0 {
            mark(Step::IOptDone);
            eval_one_sided(sh, st, qi, id);
        }
    }
}

/// Reverse operation `tid` (target side) completed: answer the fault
/// request, or complete the RECV of a rendezvous SEND.
fn on_rev_wc<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, tid: u32, ok: bool) {
    let Some(qp) = st.qp(qi) else { return };
    let Some(t) = qp.treqs.take(tid) else { return };
    let status = if ok { Status::Ok } else { Status::RemoteOp };
    let (reply, kind) = (t.reply, t.kind);
    // Temporary MR first (waits for DMA), then the pin.
    drop(t);
    match kind {
        TKind::Retry => {}
        TKind::Fault { len } => {
            serve::reply(qp, sh, reply, status, if ok { len } else { 0 });
        }
        TKind::Rendezvous {
            recv_wr_id,
            len,
            imm,
            solicited,
        } => {
            qp.rdv_busy = false;
            let c = Completion {
                wr_id: recv_wr_id,
                status: if ok {
                    WcStatus::Success
                } else {
                    WcStatus::LocProtErr
                }
                .code(),
                op: CompOp::Recv,
                byte_len: if ok { len } else { 0 },
                imm,
                qp_num: qp.qpn,
            };
            if ok {
                qp.push_recv(c, solicited);
            } else {
                qp.recv_error(c);
            }
            serve::reply(qp, sh, reply, status, if ok { len } else { 0 });
            deliver_inbound(sh, st, qi);
        }
    }
}

/// A control SEND completed: a send credit is back (a failure other than
/// a flush means the peer is gone).
fn on_ctrl_send_wc<N: Backend>(st: &mut State<N>, qi: usize, status: WcStatus) {
    let Some(qp) = st.qp(qi) else { return };
    qp.ctrl_out = qp.ctrl_out.saturating_sub(1);
    if status != WcStatus::Success && status != WcStatus::WrFlushErr {
        tracing::warn!(status = ?status, qpn = qp.qpn, "control send failed: peer gone");
        fail_qp(st, qi, WcStatus::RetryExcErr);
        return;
    }
    qp.flush_ctrl();
}

/// Command slot `slot` received: reassemble, handle a complete message,
/// re-post the slot.
fn on_ctrl_recv_wc<N: Backend>(sh: &Shared<N>, st: &mut State<N>, qi: usize, slot: u32, ok: bool) {
    let Some(qp) = st.qp(qi) else { return };
    if !ok {
        return;
    }
    mark(Step::CtrlRecv);
    let mut buf = [0u8; SLOT];
    qp.ring.read(slot as usize * SLOT, &mut buf);
    // The message is copied out of the reassembler (it lives in the
    // engine state the handler mutates) onto the stack: parsing
    // borrows from it, so no allocation for any message up to the
    // default inline limit.
    let mut bytes: SmallVec<[u8; 2048]> = SmallVec::new();
    match qp.reasm.push(&buf) {
        Ok(Some(b)) => bytes.extend_from_slice(b),
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "broken control stream"),
    }
    if !bytes.is_empty() {
        match Repr::parse_bytes(&bytes, &sh.cfg.ctrl) {
            Ok(msg) => handle_msg(sh, st, qi, msg),
            Err(e) => tracing::warn!(error = %e, "malformed control message"),
        }
    }
    // The slot was copied out above; it is re-posted only after the
    // message was handled, so an answer leaves without waiting for
    // the NIC's receive post (the ring has slots to spare, and the
    // control QP retries on RNR forever).
    if let Some(qp) = st.qp(qi).filter(|q| !q.dead) {
        if let Err(e) = qp.post_slot(slot) {
            tracing::warn!(error = %e, "re-posting a command slot failed");
        }
    }
}

/// Spinning without work longer than this yields the core at every turn.
/// Short, because a spinning initiator may share this thread's core (the
/// scheduler leaves a cache-hot thread where it is for milliseconds): at
/// 20 µs, ib_read_lat's default 1 000 iterations ran at 46–60 µs in half the
/// runs once this thread stopped mistaking ring work for idleness (it had
/// yielded at every turn); at 8 µs, 0.95–1.32 µs (BENCHMARKS.md, session 16).
const YIELD_AFTER: Duration = Duration::from_micros(8);

/// An idle turn that came this long after the previous one (a yield, or a
/// preemption while spinning) means another busy thread shares the core:
/// the polling thread then blocks (its NIC
/// thread serves peers' requests with a wake-up each) until the next event or
/// its blocking timeout. With a busy second core, spinning on regardless
/// gave ib_read_lat medians of 27–48 µs in most runs, a wake-up per request
/// 6.5–8.5 µs (BENCHMARKS.md, session 16).
const CONTENDED: Duration = Duration::from_micros(200);

/// While the application polls (and so progresses inline), the polling
/// thread naps, first for [`NAP_MIN`], doubling up to [`NAP_MAX`] while the
/// polls go on: each wake-up to look takes a core from a spinning thread of
/// this machine for a scheduler slice (on 2 cores, one operation in a few
/// hundred waits µs for it), and an application that stops polling is
/// noticed at the latest one nap later. Arming a CQ (an application about
/// to wait for its event) and the context's end wake it at once.
const NAP_MIN: Duration = Duration::from_micros(500);
/// See [`NAP_MIN`].
const NAP_MAX: Duration = Duration::from_millis(2);

/// The polling thread: progress while there is work, spin briefly, then
/// block on the NIC completion channel. While an application thread is
/// polling its CQ (and so progressing inline), it stays out of the way.
///
/// The spin window adapts: work that arrives only after the thread blocked
/// doubles it (up to 40 × `Config::spin`), so a peer whose requests come a
/// little slower than `spin` apart (e.g. two-sided fault requests on a loaded
/// machine) is not served through a sleep/wake (~40–50 µs here, ms under
/// load) every time; a blocking wait that times out idle resets it.
pub(super) fn poller<N: Backend>(sh: Arc<Shared<N>>) {
    let mut last_work = Instant::now();
    let mut window = sh.cfg.spin;
    let max_window = sh.cfg.spin.saturating_mul(40);
    let mut seen = sh.app_polls.load(Ordering::Relaxed);
    let mut nap = NAP_MIN;
    // An idle turn found the core contended (see `CONTENDED`): block at the
    // next one. `prev_idle`: the last idle turn since the last work.
    let mut contended = false;
    let mut prev_idle: Option<Instant> = None;
    // While spinning, this thread also serves the NIC's request rings (peers'
    // small READ/WRITE and atomics) so the NIC thread need not spin as well: a
    // second spinner per process on a 2-core machine turns µs into ms.
    let mut rings = RingPolling::new(&sh.nic, !sh.cfg.interrupt_mode);
    // This loop yields by its own rule (below), not every so many empty polls.
    sh.nic.pace_own_polls();
    // With `ring_takeover`, blocked, it is woken when the NIC thread starts
    // serving peers' requests: it then takes the rings back (a stream of them
    // would otherwise cost a NIC-thread sleep and wake-up each).
    let waker = (sh.cfg.ring_takeover && !sh.cfg.interrupt_mode).then(|| sh.nic.add_ring_waker());
    // A spinning thread with a core to itself waits for the swap reads of the
    // faults it serves by polling, not sleeping (a sleeping reader's idle core
    // costs the read a halted vCPU's wake-up); not while its core is
    // contended.
    let mut polls_reads = !sh.cfg.interrupt_mode;
    sh.mm.poll_own_reads(polls_reads);
    while !sh.stop.load(Ordering::Acquire) {
        let polls = sh.app_polls.load(Ordering::Relaxed);
        // An application that polls progresses inline; one waiting for an event
        // on an armed CQ does not (it polls once per event).
        if polls != seen && !sh.armed_cqs.any() {
            seen = polls;
            rings.stop();
            std::thread::park_timeout(nap);
            nap = nap.saturating_mul(2).min(NAP_MAX);
            continue;
        }
        nap = NAP_MIN;
        let n = {
            let mut st = sh.st.lock();
            progress(&sh, &mut st)
        };
        if n > 0 || rings.serve() {
            last_work = Instant::now();
            prev_idle = None;
            continue;
        }
        let now = Instant::now();
        let idle_for = now.duration_since(last_work);
        contended |= prev_idle.is_some_and(|p| now.duration_since(p) > CONTENDED);
        prev_idle = Some(now);
        let want = !contended && !sh.cfg.interrupt_mode;
        if want != polls_reads {
            polls_reads = want;
            sh.mm.poll_own_reads(want);
        }
        if !sh.cfg.interrupt_mode && idle_for < window && !contended {
            rings.start();
            if sh.armed_cqs.any() || idle_for >= YIELD_AFTER {
                // Spin yielding the core: an application waiting for an event is
                // asleep and needs a core to run what it is woken for; and a peer
                // or application thread whose next request this thread waits for
                // may be queued behind it on this core (the scheduler does not move
                // a cache-hot thread to the idle core for milliseconds).
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        if rings.stop() {
            last_work = Instant::now();
            continue;
        }
        for cq in [&sh.ncq, &sh.rcq] {
            if let Err(e) = cq.arm(false) {
                tracing::error!(error = %e, "arming a NIC CQ failed");
            }
        }
        let n = {
            let mut st = sh.st.lock();
            progress(&sh, &mut st)
        };
        if n > 0 {
            last_work = Instant::now();
            continue;
        }
        contended = false;
        prev_idle = None;
        match sh.nic.wait_event(Duration::from_millis(20)) {
            // An event, or the NIC thread serving peers' requests.
            Ok(true) => {
                last_work = Instant::now();
                window = window.saturating_mul(2).min(max_window);
            }
            Ok(false) => window = sh.cfg.spin,
            Err(e) => {
                tracing::error!(error = %e, "completion channel failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    rings.stop();
    if let Some(id) = waker {
        sh.nic.remove_ring_waker(id);
    }
}

/// The polling thread's turn at serving the NIC's request rings
/// (`Nic::set_ring_polling`, a software-NIC hook): on while it spins, off
/// before it blocks.
pub(super) struct RingPolling<'a, N: Backend> {
    host: &'a N,
    enabled: bool,
    on: bool,
    /// The NIC's serving passes when last looked at (`Backend::ring_passes`).
    passes: u64,
}

impl<'a, N: Backend> RingPolling<'a, N> {
    pub(super) fn new(host: &'a N, enabled: bool) -> Self {
        RingPolling {
            host,
            enabled,
            on: false,
            passes: 0,
        }
    }
    pub(super) fn start(&mut self) {
        if self.enabled && !self.on {
            self.on = true;
            self.host.set_ring_polling(true);
            self.passes = self.host.ring_passes();
        }
    }
    /// Serve pending ring requests (while on); whether any was served since
    /// the last look, here or inside the CQ polls of `progress` (which serve
    /// them too: without counting those, a steady stream of peers' requests
    /// served there looked like idleness, and the thread yielded its core at
    /// every turn after [`YIELD_AFTER`]).
    pub(super) fn serve(&mut self) -> bool {
        if !self.on {
            return false;
        }
        let now = self.host.serve_rings();
        let before = std::mem::replace(&mut self.passes, self.host.ring_passes());
        now || self.passes != before
    }
    /// Hand the rings back to the NIC thread; whether pending ones were served.
    pub(super) fn stop(&mut self) -> bool {
        if !self.on {
            return false;
        }
        self.on = false;
        self.host.set_ring_polling(false)
    }
}

#[cfg(test)]
mod tests {
    use super::RingPolling;
    use crate::testutil::FakeNic;

    #[test]
    fn ring_polling_counts_serving_done_inside_cq_polls_as_work() {
        let (nic, _peer) = FakeNic::pair();
        let mut rings = RingPolling::new(&nic, true);
        nic.count_ring_pass();
        assert!(!rings.serve(), "off: nothing is this thread's work");
        // Passes before polling started were the NIC thread's.
        rings.start();
        assert!(!rings.serve(), "nothing served since the start");
        // A CQ poll of `progress` served peers' requests: work, counted once.
        nic.count_ring_pass();
        assert!(rings.serve());
        assert!(!rings.serve());
        nic.count_ring_pass();
        nic.count_ring_pass();
        assert!(rings.serve());
        assert!(!rings.stop(), "nothing pending at the hand-back");
        nic.count_ring_pass();
        assert!(!rings.serve(), "off again");
    }
}
