//! Pipelining of overlapping one-sided ops (a perftest-style window on the
//! same buffers) and replay: an early op of the window fails its optimistic
//! check (swapped-out remote memory), goes two-sided, and every later op
//! already issued behind it is discarded and re-executed after it — final
//! bytes are the last op's, one completion per signaled WR, in post order.
//! (`OrderConfig::pipeline`, on by default; these tests set it anyway.)

mod common;

use std::time::Duration;

use common::*;
use nprdma::{Opcode, SendWr};

const WIN: usize = 16;

/// A side with pipelining on (`OrderConfig::pipeline`).
fn pipe_side() -> Side {
    let mut cfg = nprdma::Config::default();
    cfg.order.pipeline = true;
    side_with(cfg)
}

fn op(id: u64, opc: Opcode, l: &Buf, loff: u64, r: &Buf, roff: u64, len: u32) -> SendWr {
    SendWr::new(
        id,
        opc,
        Some(l.mr.sge(loff, len)),
        r.addr() + roff,
        r.mr.rkey(),
    )
}

/// WRITE window: WR `k` writes local slot `k` to the same remote range;
/// the remote memory is swapped out first, so the first WRITE fails.
fn write_window(len: usize, signal_every: usize) {
    let a = pipe_side();
    let b = pipe_side();
    let (qa, _qb) = connect(&a, &b, 64);
    let src = pattern(11, len * WIN);
    let la = Buf::with(&a, len * WIN, Some(&src));
    let rb = Buf::with(&b, len + 4096, Some(&pattern(12, len + 4096)));
    // Key sync and a first pass that pipelines without failures.
    for round in 0..2 {
        if round == 1 {
            rb.swap_out();
        }
        let before = a.ctx.stats();
        let wrs: Vec<SendWr> = (0..WIN)
            .map(|k| {
                let mut w = op(
                    k as u64,
                    Opcode::Write,
                    &la,
                    (k * len) as u64,
                    &rb,
                    8,
                    len as u32,
                );
                w.signaled = (k + 1) % signal_every == 0;
                w
            })
            .collect();
        qa.post_send(&wrs).expect("post");
        let want = WIN / signal_every;
        let v = a.cq.poll_wait(want, Duration::from_secs(10));
        assert_eq!(v.len(), want, "round {round}");
        for (i, c) in v.iter().enumerate() {
            assert_eq!(c.status, 0, "{c:?}");
            assert_eq!(c.wr_id as usize, (i + 1) * signal_every - 1, "post order");
        }
        std::thread::sleep(Duration::from_millis(20));
        let mut more = [nprdma::Completion::default(); 4];
        assert_eq!(a.cq.poll(&mut more), 0, "extra completion {:?}", more[0]);
        assert_eq!(qa.outstanding(), 0);
        let last = (WIN - 1) * len;
        assert!(
            rb.bytes()[8..8 + len] == src[last..last + len],
            "round {round}: remote bytes are not the last WRITE's"
        );
        let after = a.ctx.stats();
        if round == 1 {
            assert!(after.two_sided > before.two_sided, "no check failed");
            assert!(after.replayed > before.replayed, "nothing was replayed");
        }
    }
    assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(b.ctx.nic_stats().nonresident_dma, 0);
}

#[test]
fn a_failed_write_in_a_same_buffer_window_replays_the_later_writes() {
    write_window(4096, 1);
}

#[test]
fn a_failed_versioned_write_in_a_window_replays_the_later_writes() {
    write_window(20000, 1);
}

#[test]
fn a_failed_unsignaled_write_in_a_window_replays_the_later_writes() {
    write_window(2048, 4);
}

/// READ window into one local buffer: WR 0 reads swapped-out remote
/// memory (its check fails), WRs 1.. read distinct resident slots into the
/// first half of the buffer. They overwrite *part* of WR 0's destination,
/// which could hide a torn atom from WR 0's sampled check (the bug the long
/// chaos test found), so they park behind it instead of pipelining: WR 0
/// goes two-sided first, nothing is replayed, and the final bytes are the
/// last READ's over the first half and WR 0's over the second.
#[test]
fn a_read_window_partly_overwriting_a_failed_read_parks_behind_it() {
    let a = pipe_side();
    let b = pipe_side();
    let (qa, _qb) = connect(&a, &b, 64);
    const LEN: usize = 4096;
    const HALF: usize = LEN / 2;
    let la = Buf::with(&a, LEN, Some(&pattern(21, LEN)));
    let bad_src = pattern(22, LEN);
    let bad = Buf::with(&b, LEN, Some(&bad_src));
    let good_src = pattern(23, LEN * WIN);
    let good = Buf::with(&b, LEN * WIN, Some(&good_src));
    for round in 0..3 {
        let before = a.ctx.stats();
        if round > 0 {
            bad.swap_out();
        }
        let mut wrs = vec![op(0, Opcode::Read, &la, 0, &bad, 0, LEN as u32)];
        wrs.extend((1..WIN).map(|k| {
            op(
                k as u64,
                Opcode::Read,
                &la,
                0,
                &good,
                (k * LEN) as u64,
                HALF as u32,
            )
        }));
        if round == 2 {
            // The last READ is the failing one: nothing to replay behind it.
            wrs.rotate_left(1);
            for (k, w) in wrs.iter_mut().enumerate() {
                w.wr_id = k as u64;
            }
        }
        qa.post_send(&wrs).expect("post");
        let v = a.cq.poll_wait(WIN, Duration::from_secs(10));
        assert_eq!(v.len(), WIN);
        for (i, c) in v.iter().enumerate() {
            assert_eq!((c.wr_id, c.status), (i as u64, 0));
            let full = (round < 2 && i == 0) || (round == 2 && i == WIN - 1);
            assert_eq!(c.byte_len as usize, if full { LEN } else { HALF });
        }
        let mut want = bad_src.clone();
        if round < 2 {
            let last = (WIN - 1) * LEN;
            want[..HALF].copy_from_slice(&good_src[last..last + HALF]);
        }
        assert!(
            la.bytes() == &want[..],
            "round {round}: local bytes are not the last READs'"
        );
        let after = a.ctx.stats();
        if round == 1 {
            assert!(after.two_sided > before.two_sided, "no check failed");
            assert_eq!(
                after.replayed, before.replayed,
                "partly overlapping READs parked, nothing to replay"
            );
        }
        assert_eq!(qa.outstanding(), 0);
    }
}

/// READ window of small READs (answered inline on the two-sided path) into
/// one local buffer, each from its own remote page, some of them swapped
/// out: the failed ones go two-sided *concurrently* — none waits for another
/// and nothing is replayed — and the answers of those a later READ
/// supersedes are dropped, so the final bytes are the last READ's whatever
/// order the answers arrive in.
#[test]
fn small_reads_of_a_same_buffer_window_resolve_their_faults_concurrently() {
    let a = pipe_side();
    let b = pipe_side();
    let (qa, _qb) = connect(&a, &b, 64);
    const PAGE: usize = 4096;
    let src = pattern(31, PAGE * WIN);
    let rb = Buf::with(&b, PAGE * WIN, Some(&src));
    for len in [64usize, 1024] {
        let la = Buf::with(&a, len, Some(&pattern(32, len)));
        // Which remote pages are swapped out before the window.
        let masks: [fn(usize) -> bool; 5] = [
            |_| false,
            |_| true,
            |k| k % 2 == 0,
            |k| k != WIN - 1,
            |k| k == WIN - 1,
        ];
        for (round, swapped) in masks.iter().enumerate() {
            for k in (0..WIN).filter(|&k| swapped(k)) {
                b.pager
                    .swap_out(rb.addr() as usize + k * PAGE, PAGE)
                    .expect("swap out");
            }
            let before = a.ctx.stats();
            let wrs: Vec<SendWr> = (0..WIN)
                .map(|k| {
                    let off = (k * PAGE + 8 * k) as u64;
                    op(k as u64, Opcode::Read, &la, 0, &rb, off, len as u32)
                })
                .collect();
            qa.post_send(&wrs).expect("post");
            let v = a.cq.poll_wait(WIN, Duration::from_secs(10));
            assert_eq!(v.len(), WIN, "len {len} round {round}");
            for (i, c) in v.iter().enumerate() {
                assert_eq!((c.wr_id, c.status, c.byte_len as usize), (i as u64, 0, len));
            }
            std::thread::sleep(Duration::from_millis(20));
            let mut more = [nprdma::Completion::default(); 4];
            assert_eq!(a.cq.poll(&mut more), 0, "extra completion {:?}", more[0]);
            let last = (WIN - 1) * PAGE + 8 * (WIN - 1);
            assert!(
                la.bytes() == &src[last..last + len],
                "len {len} round {round}: local bytes are not the last READ's"
            );
            let after = a.ctx.stats();
            // Every READ lands before any check runs here, so the checks
            // see the last READ's bytes: they fail iff its page was out.
            if swapped(WIN - 1) {
                assert!(
                    after.two_sided > before.two_sided,
                    "len {len} round {round}: no check failed ({before:?} -> {after:?})"
                );
            }
            assert_eq!(
                after.replayed, before.replayed,
                "a superseded READ replayed"
            );
            assert_eq!(qa.outstanding(), 0);
        }
    }
    assert_eq!(a.ctx.nic_stats().nonresident_dma, 0);
    assert_eq!(b.ctx.nic_stats().nonresident_dma, 0);
}
