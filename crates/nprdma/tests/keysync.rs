//! Key sync race: a WR posted while the first-use KeyQuery is out must not
//! fail on that query's answer when its key was registered after the peer
//! answered (the answer is an older snapshot; the key arrives by push).
//! The race depends on timing: before the fix this failed 5/5 runs of 40
//! rounds on the loaded 2-core VM and about 1 run in 3 of the default 20
//! rounds idle. `NPRDMA_KEYSYNC_ROUNDS` sets the number of rounds.

mod common;

use std::time::Duration;

use common::*;
use nprdma::{Opcode, SendWr};

const LEN: usize = 4096;

#[test]
fn key_registered_after_first_query_answer() {
    let rounds: usize = std::env::var("NPRDMA_KEYSYNC_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    for round in 0..rounds {
        let a = side();
        let b = side();
        let (qa, _qb) = connect(&a, &b, 16);
        let la = Buf::with(&a, LEN, Some(&pattern(1, LEN)));
        // A large table makes the answer to the first query many chunks,
        // so A is still waiting for its end when the next WR is posted.
        let fill: Vec<Buf> = (0..40).map(|_| Buf::new(&b, LEN)).collect();
        let rb0 = Buf::with(&b, LEN, Some(&pattern(2, LEN)));
        qa.post_send(&[SendWr::new(
            1,
            Opcode::Read,
            Some(la.mr.sge(0, 8)),
            rb0.addr(),
            rb0.mr.rkey(),
        )])
        .unwrap();
        let c = a.cq.poll_wait(1, Duration::from_secs(10));
        assert_eq!(c.len(), 1, "round {round}: no completion within 10 s");
        assert_eq!(c[0].status, 0, "round {round}: first READ");
        drop(rb0);
        let pb1 = pattern(3, LEN);
        let rb1 = Buf::with(&b, LEN, Some(&pb1));
        qa.post_send(&[SendWr::new(
            2,
            Opcode::Read,
            Some(la.mr.sge(8, 8)),
            rb1.addr(),
            rb1.mr.rkey(),
        )])
        .unwrap();
        let mut got = Vec::new();
        while got.is_empty() {
            let c = a.cq.poll_wait(1, Duration::from_secs(10));
            assert!(!c.is_empty(), "round {round}: no completion within 10 s");
            got.extend(c);
        }
        for c in &got {
            assert_eq!(c.status, 0, "round {round}: wr {} {c:?}", c.wr_id);
        }
        assert!(la.bytes()[8..16] == pb1[..8], "round {round}: data");
        drop(fill);
        drop(rb1);
    }
}

/// Post one WR on `qp` and wait for its completion on `cq`.
fn run1(qp: &nprdma::Qp, cq: &nprdma::Cq, wr: SendWr) -> nprdma::Completion {
    qp.post_send(&[wr]).unwrap();
    wait1(cq)
}

/// An MR registered after the local QP connected but before the peer's QP
/// did: its key must not be pushed to the unconnected peer (that SEND used
/// to fail and kill the control QP: every later operation completed with
/// WR_FLUSH_ERR). The peer learns it by its first-use query; an MR
/// registered after that initial sync is pushed. Operations in both
/// directions then succeed with the new keys.
#[test]
fn register_between_local_and_peer_connect() {
    let a = side();
    let b = side();
    let qa = a.pd.create_qp(&a.cq, &a.rcq, 16).expect("qp a");
    let qb = b.pd.create_qp(&b.cq, &b.rcq, 16).expect("qp b");
    qa.connect(&qb.endpoint()).expect("connect a");
    // A's QP is connected, B's is not: registrations on A happen now.
    let pa = pattern(11, LEN);
    let ma = Buf::with(&a, LEN, Some(&pa));
    let la = Buf::with(&a, LEN, None);
    // Give a (wrongly) pushed KeySync time to reach B's unconnected QP.
    std::thread::sleep(Duration::from_millis(50));
    qb.connect(&qa.endpoint()).expect("connect b");
    let pb = pattern(12, LEN);
    let mb = Buf::with(&b, LEN, Some(&pb));
    let lb = Buf::with(&b, LEN, Some(&pattern(13, LEN)));

    // B -> A: READ then WRITE with the key registered before B connected.
    let c = run1(
        &qb,
        &b.cq,
        SendWr::new(
            1,
            Opcode::Read,
            Some(lb.mr.sge(0, 64)),
            ma.addr(),
            ma.mr.rkey(),
        ),
    );
    assert_eq!(c.status, 0, "B reads A's new MR: {c:?}");
    assert_eq!(&lb.bytes()[..64], &pa[..64], "B read data");
    let c = run1(
        &qb,
        &b.cq,
        SendWr::new(
            2,
            Opcode::Write,
            Some(lb.mr.sge(64, 64)),
            ma.addr() + 128,
            ma.mr.rkey(),
        ),
    );
    assert_eq!(c.status, 0, "B writes A's new MR: {c:?}");
    assert_eq!(&ma.bytes()[128..192], &lb.bytes()[64..128], "B write data");

    // A -> B: READ and WRITE on A's QP (connected first), with B's keys.
    let c = run1(
        &qa,
        &a.cq,
        SendWr::new(
            3,
            Opcode::Read,
            Some(la.mr.sge(0, 64)),
            mb.addr(),
            mb.mr.rkey(),
        ),
    );
    assert_eq!(c.status, 0, "A reads B's MR: {c:?}");
    assert_eq!(&la.bytes()[..64], &pb[..64], "A read data");
    let c = run1(
        &qa,
        &a.cq,
        SendWr::new(
            4,
            Opcode::Write,
            Some(ma.mr.sge(0, 64)),
            mb.addr() + 256,
            mb.mr.rkey(),
        ),
    );
    assert_eq!(c.status, 0, "A writes B's MR: {c:?}");
    assert_eq!(&mb.bytes()[256..320], &pa[..64], "A write data");

    // After the initial sync both ways, new MRs are pushed (or, if the
    // push is still in flight, found by a KeyQuery for that key).
    let pa2 = pattern(14, LEN);
    let ma2 = Buf::with(&a, LEN, Some(&pa2));
    let c = run1(
        &qb,
        &b.cq,
        SendWr::new(
            5,
            Opcode::Read,
            Some(lb.mr.sge(512, 64)),
            ma2.addr(),
            ma2.mr.rkey(),
        ),
    );
    assert_eq!(
        c.status, 0,
        "B reads A's MR registered after the sync: {c:?}"
    );
    assert_eq!(
        &lb.bytes()[512..576],
        &pa2[..64],
        "B read data (pushed key)"
    );
    let pb2 = pattern(15, LEN);
    let mb2 = Buf::with(&b, LEN, Some(&pb2));
    let c = run1(
        &qa,
        &a.cq,
        SendWr::new(
            6,
            Opcode::Read,
            Some(la.mr.sge(512, 64)),
            mb2.addr(),
            mb2.mr.rkey(),
        ),
    );
    assert_eq!(
        c.status, 0,
        "A reads B's MR registered after the sync: {c:?}"
    );
    assert_eq!(
        &la.bytes()[512..576],
        &pb2[..64],
        "A read data (pushed key)"
    );
}
