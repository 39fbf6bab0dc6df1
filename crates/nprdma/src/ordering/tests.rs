//! Unit tests and a model-based property test of the ordering table.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;

fn r(a: u64, l: u64) -> Range {
    Range::new(a, l)
}

fn issued<T>(a: Admit<T>) -> Ticket {
    match a {
        Admit::Issue(t, _) => t,
        Admit::Parked(t) => panic!("expected issue, got parked {t:?}"),
    }
}

fn parked<T>(a: Admit<T>) -> Ticket {
    match a {
        Admit::Parked(t) => t,
        Admit::Issue(t, _) => panic!("expected parked, got issue {t:?}"),
    }
}

#[test]
fn reads_of_the_same_remote_memory_run_together() {
    let mut t = OrderTable::new(OrderConfig::default());
    issued(t.submit(OpDesc::read(r(0, 64), r(1000, 64)), ()).unwrap());
    issued(t.submit(OpDesc::read(r(64, 64), r(1000, 64)), ()).unwrap());
    assert_eq!(t.inflight_len(), 2);
}

#[test]
fn overlap_parks_the_op_and_everything_behind_it() {
    let mut t = OrderTable::new(OrderConfig::default());
    let w = issued(
        t.submit(OpDesc::write(r(0, 100), r(1000, 100)), 'w')
            .unwrap(),
    );
    // READ of remote bytes the WRITE is writing: must wait.
    let rd = parked(
        t.submit(OpDesc::read(r(500, 10), r(1099, 10)), 'r')
            .unwrap(),
    );
    // Unrelated op behind it waits too (FIFO within the QP).
    let other = parked(t.submit(OpDesc::write(r(800, 8), r(5000, 8)), 'o').unwrap());
    assert_eq!(t.parked_len(), 2);
    let rel = t.complete(w).unwrap();
    assert_eq!(rel, vec![(rd, 'r'), (other, 'o')]);
    assert!(t.is_inflight(rd) && t.is_inflight(other));
    t.complete(rd).unwrap();
    t.complete(other).unwrap();
    assert!(t.is_idle());
}

#[test]
fn adjacent_ranges_do_not_conflict_but_local_overlap_does() {
    let mut t = OrderTable::new(OrderConfig::default());
    issued(
        t.submit(OpDesc::write(r(0, 100), r(1000, 100)), ())
            .unwrap(),
    );
    issued(
        t.submit(OpDesc::write(r(100, 100), r(1100, 100)), ())
            .unwrap(),
    );
    // READ landing in a buffer an in-flight WRITE is still sending from.
    parked(t.submit(OpDesc::read(r(150, 10), r(9000, 10)), ()).unwrap());
}

#[test]
fn zero_length_ops_never_conflict() {
    let mut t = OrderTable::new(OrderConfig::default());
    issued(
        t.submit(OpDesc::write(r(0, 100), r(1000, 100)), ())
            .unwrap(),
    );
    issued(t.submit(OpDesc::write(r(10, 0), r(1010, 0)), ()).unwrap());
}

#[test]
fn order_before_waits_for_everything() {
    let mut t = OrderTable::new(OrderConfig::default());
    let a = issued(t.submit(OpDesc::read(r(0, 8), r(0, 8)), ()).unwrap());
    let b = issued(t.submit(OpDesc::read(r(8, 8), r(8, 8)), ()).unwrap());
    let c = parked(
        t.submit(OpDesc::read(r(16, 8), r(16, 8)).order_before(true), ())
            .unwrap(),
    );
    assert!(t.complete(a).unwrap().is_empty());
    assert_eq!(t.complete(b).unwrap(), vec![(c, ())]);
}

#[test]
fn order_after_blocks_what_follows_until_it_completes() {
    let mut t = OrderTable::new(OrderConfig::default());
    let a = issued(
        t.submit(OpDesc::write(r(0, 8), r(0, 8)).order_after(true), 1)
            .unwrap(),
    );
    let b = parked(t.submit(OpDesc::read(r(8, 8), r(64, 8)), 2).unwrap());
    let c = parked(t.submit(OpDesc::read(r(16, 8), r(72, 8)), 3).unwrap());
    assert_eq!(t.complete(a).unwrap(), vec![(b, 2), (c, 3)]);
}

#[test]
fn strict_mode_keeps_one_in_flight() {
    let mut t = OrderTable::new(OrderConfig {
        mode: OrderMode::Strict,
        ..OrderConfig::default()
    });
    let a = issued(t.submit(OpDesc::read(r(0, 8), r(0, 8)), ()).unwrap());
    let b = parked(t.submit(OpDesc::read(r(8, 8), r(8, 8)), ()).unwrap());
    let c = parked(t.submit(OpDesc::read(r(16, 8), r(16, 8)), ()).unwrap());
    assert_eq!(t.complete(a).unwrap(), vec![(b, ())]);
    assert_eq!(t.complete(b).unwrap(), vec![(c, ())]);
}

#[test]
fn messages_are_ordered_and_fence_remote_writes() {
    let mut t = OrderTable::new(OrderConfig::default());
    let w = issued(t.submit(OpDesc::write(r(0, 8), r(0, 8)), ()).unwrap());
    let s = parked(t.submit(OpDesc::send(r(100, 8)), ()).unwrap());
    assert_eq!(t.complete(w).unwrap(), vec![(s, ())]);
    // Two sends never overlap in flight.
    parked(t.submit(OpDesc::send(r(200, 8)), ()).unwrap());

    let mut t = OrderTable::new(OrderConfig {
        messages_fence_writes: false,
        ..OrderConfig::default()
    });
    issued(t.submit(OpDesc::write(r(0, 8), r(0, 8)), ()).unwrap());
    issued(t.submit(OpDesc::send(r(100, 8)), ()).unwrap());
    parked(
        t.submit(OpDesc::write_imm(r(300, 8), r(64, 8)), ())
            .unwrap(),
    );
}

#[test]
fn loopback_compares_local_with_remote() {
    let ops = || {
        (
            OpDesc::write(r(0, 8), r(4096, 8)),
            OpDesc::read(r(4096, 8), r(9000, 8)),
        )
    };
    let mut t = OrderTable::new(OrderConfig::default());
    let (a, b) = ops();
    issued(t.submit(a, ()).unwrap());
    issued(t.submit(b, ()).unwrap());
    let mut t = OrderTable::new(OrderConfig {
        loopback: true,
        ..OrderConfig::default()
    });
    let (a, b) = ops();
    issued(t.submit(a, ()).unwrap());
    parked(t.submit(b, ()).unwrap());
}

#[test]
fn bad_input_is_an_error() {
    let mut t = OrderTable::new(OrderConfig::default());
    assert!(matches!(
        t.submit(OpDesc::read(r(u64::MAX - 3, 8), r(0, 8)), ()),
        Err(OrderError::InvalidRange { .. })
    ));
    assert_eq!(
        t.complete(Ticket(7)),
        Err(OrderError::NotInFlight(Ticket(7)))
    );
    let a = issued(t.submit(OpDesc::read(r(0, 8), r(0, 8)), ()).unwrap());
    t.complete(a).unwrap();
    assert_eq!(t.complete(a), Err(OrderError::NotInFlight(a)));
}

#[test]
fn drain_returns_parked_in_order() {
    let mut t = OrderTable::new(OrderConfig::default());
    issued(
        t.submit(OpDesc::write(r(0, 8), r(0, 8)).order_after(true), 0)
            .unwrap(),
    );
    for i in 1..5 {
        parked(t.submit(OpDesc::read(r(0, 8), r(0, 8)), i).unwrap());
    }
    let d: Vec<_> = t.drain_parked().into_iter().map(|(_, p)| p).collect();
    assert_eq!(d, vec![1, 2, 3, 4]);
    assert_eq!(t.parked_len(), 0);
}

// ---------------------------------------------------------------------------
// Model-based property test. The model represents each op by the *sets of
// byte addresses* it reads and writes (in a small address space so overlaps
// are frequent) and re-derives every rule from those sets.

#[derive(Debug, Clone)]
struct ModelOp {
    desc: OpDesc,
    lr: HashSet<u64>,
    lw: HashSet<u64>,
    rr: HashSet<u64>,
    rw: HashSet<u64>,
}

fn bytes(s: &[Touch], acc: Access) -> HashSet<u64> {
    s.iter()
        .filter(|x| x.access == acc)
        .flat_map(|x| x.range.addr..x.range.addr + x.range.len)
        .collect()
}

impl ModelOp {
    fn new(desc: OpDesc) -> Self {
        ModelOp {
            lr: bytes(&desc.local, Access::Read),
            lw: bytes(&desc.local, Access::Write),
            rr: bytes(&desc.remote, Access::Read),
            rw: bytes(&desc.remote, Access::Write),
            desc,
        }
    }
}

fn model_conflict(cfg: &OrderConfig, a: &ModelOp, b: &ModelOp) -> bool {
    let hit = |x: &HashSet<u64>, y: &HashSet<u64>| !x.is_disjoint(y);
    let side = |ar: &HashSet<u64>, aw: &HashSet<u64>, br: &HashSet<u64>, bw: &HashSet<u64>| {
        hit(aw, bw) || hit(aw, br) || hit(ar, bw)
    };
    if a.desc.message && b.desc.message {
        return true;
    }
    if cfg.messages_fence_writes
        && ((a.desc.message && !b.rw.is_empty()) || (b.desc.message && !a.rw.is_empty()))
    {
        return true;
    }
    side(&a.lr, &a.lw, &b.lr, &b.lw)
        || side(&a.rr, &a.rw, &b.rr, &b.rw)
        || (cfg.loopback && (side(&a.lr, &a.lw, &b.rr, &b.rw) || side(&a.rr, &a.rw, &b.lr, &b.lw)))
}

fn model_may_issue(cfg: &OrderConfig, op: &ModelOp, inflight: &[(Ticket, ModelOp)]) -> bool {
    inflight.is_empty()
        || (!op.desc.order_before
            && cfg.mode == OrderMode::Relaxed
            && inflight
                .iter()
                .all(|(_, f)| !f.desc.order_after && !model_conflict(cfg, op, f)))
}

fn arb_range() -> impl Strategy<Value = Range> {
    (0u64..48, 0u64..12).prop_map(|(a, l)| Range::new(a, l))
}

fn arb_op() -> impl Strategy<Value = OpDesc> {
    (
        0u8..6,
        arb_range(),
        arb_range(),
        proptest::option::of(arb_range()),
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(k, l, rm, extra, ob, oa)| {
            let d = match k {
                0 | 1 => OpDesc::read(l, rm),
                2 | 3 => OpDesc::write(l, rm),
                4 => OpDesc::atomic(l.addr, rm.addr & !7),
                _ if rm.len % 2 == 0 => OpDesc::send(l),
                _ => OpDesc::write_imm(l, rm),
            };
            let d = match extra {
                Some(e) => d.with_local(
                    e,
                    if k % 2 == 0 {
                        Access::Read
                    } else {
                        Access::Write
                    },
                ),
                None => d,
            };
            d.order_before(ob).order_after(oa)
        })
}

#[derive(Debug, Clone)]
enum Action {
    Submit(OpDesc),
    Complete(usize),
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => arb_op().prop_map(Action::Submit),
        2 => any::<usize>().prop_map(Action::Complete),
    ]
}

fn arb_cfg() -> impl Strategy<Value = OrderConfig> {
    (
        prop::bool::weighted(0.15),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(strict, lb, fence, pipeline)| OrderConfig {
            mode: if strict {
                OrderMode::Strict
            } else {
                OrderMode::Relaxed
            },
            loopback: lb,
            messages_fence_writes: fence,
            pipeline,
        })
}

/// Checks one issue against the model state and records it.
fn on_issue(
    cfg: &OrderConfig,
    t: Ticket,
    op: ModelOp,
    inflight: &mut Vec<(Ticket, ModelOp)>,
    issue_log: &mut Vec<Ticket>,
) -> Result<(), TestCaseError> {
    // Issue order equals post order.
    if let Some(last) = issue_log.last() {
        prop_assert!(t > *last, "issued {t:?} after {last:?}");
    }
    // No conflicting op in flight; bits and strict mode respected.
    prop_assert!(
        model_may_issue(cfg, &op, inflight),
        "op {t:?} issued while blocked: {op:?} vs {inflight:?}"
    );
    issue_log.push(t);
    inflight.push((t, op));
    if cfg.mode == OrderMode::Strict {
        prop_assert!(inflight.len() <= 1);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn table_matches_model(cfg in arb_cfg(), actions in prop::collection::vec(arb_action(), 1..80)) {
        let mut table: OrderTable<u64> = OrderTable::new(cfg);
        let mut inflight: Vec<(Ticket, ModelOp)> = Vec::new();
        let mut parked: std::collections::VecDeque<(Ticket, ModelOp)> = Default::default();
        let mut issue_log = Vec::new();
        let mut submitted = 0u64;

        let complete = |idx: usize,
                            table: &mut OrderTable<u64>,
                            inflight: &mut Vec<(Ticket, ModelOp)>,
                            parked: &mut std::collections::VecDeque<(Ticket, ModelOp)>,
                            issue_log: &mut Vec<Ticket>|
         -> Result<(), TestCaseError> {
            let (t, _) = inflight.remove(idx % inflight.len());
            let released = table.complete(t).unwrap();
            for (rt, payload) in released {
                prop_assert_eq!(rt.0, payload, "payload travels with its ticket");
                let (mt, mop) = parked.pop_front().expect("released op was parked in the model");
                prop_assert_eq!(mt, rt, "release in post order");
                on_issue(&cfg, rt, mop, inflight, issue_log)?;
            }
            // Maximality: the head of the parked queue really is blocked.
            if let Some((_, head)) = parked.front() {
                prop_assert!(!model_may_issue(&cfg, head, inflight), "missed wake-up");
            }
            Ok(())
        };

        for a in actions {
            match a {
                Action::Submit(desc) => {
                    let mop = ModelOp::new(desc.clone());
                    let expect_issue = parked.is_empty() && model_may_issue(&cfg, &mop, &inflight);
                    match table.submit(desc, submitted).unwrap() {
                        Admit::Issue(t, p) => {
                            prop_assert!(expect_issue, "issued but the model blocks it");
                            prop_assert_eq!(t.0, p);
                            on_issue(&cfg, t, mop, &mut inflight, &mut issue_log)?;
                        }
                        Admit::Parked(t) => {
                            prop_assert!(!expect_issue, "parked although nothing blocks it");
                            parked.push_back((t, mop));
                        }
                    }
                    submitted += 1;
                }
                Action::Complete(i) if !inflight.is_empty() => {
                    complete(i, &mut table, &mut inflight, &mut parked, &mut issue_log)?;
                }
                Action::Complete(_) => {}
            }
            prop_assert_eq!(table.inflight_len(), inflight.len());
            prop_assert_eq!(table.parked_len(), parked.len());
        }
        // No starvation: completing what is in flight eventually issues all.
        let mut steps = 0;
        while !inflight.is_empty() {
            complete(steps, &mut table, &mut inflight, &mut parked, &mut issue_log)?;
            steps += 1;
            prop_assert!(steps <= submitted as usize + 1);
        }
        prop_assert!(parked.is_empty() && table.is_idle());
        prop_assert_eq!(issue_log.len() as u64, submitted, "every op issued exactly once");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The bounds pre-filter never hides a conflict.
    #[test]
    fn bounds_never_hide_a_conflict(cfg in arb_cfg(), a in arb_op(), b in arb_op()) {
        if cfg.conflicts(&a, &b) {
            prop_assert!(Bounds::of(&a).may_conflict(&Bounds::of(&b), &cfg));
            prop_assert!(Bounds::of(&b).may_conflict(&Bounds::of(&a), &cfg));
        }
    }
}

// ---- pipelining behind optimistic ops, replay ----

fn tickets<T>(v: Vec<(Ticket, T)>) -> Vec<Ticket> {
    v.into_iter().map(|(t, _)| t).collect()
}

/// The default configuration with pipelining on (it is off by default).
fn pipe() -> OrderConfig {
    OrderConfig {
        pipeline: true,
        ..OrderConfig::default()
    }
}

#[test]
fn a_read_partly_overwriting_an_optimistic_reads_destination_parks() {
    // Identical destination (a same-buffer window): pipelines.
    let mut t = OrderTable::new(pipe());
    let a = issued(
        t.submit(OpDesc::read(r(0, 4096), r(0, 4096)), 0u32)
            .unwrap(),
    );
    on_nic(&mut t, a);
    issued(
        t.submit(OpDesc::read(r(0, 4096), r(8192, 4096)), 1)
            .unwrap(),
    );
    // Part of it: parks (it would land before `a`'s sampled check).
    let mut t = OrderTable::new(pipe());
    let a = issued(
        t.submit(OpDesc::read(r(0, 4096), r(0, 4096)), 0u32)
            .unwrap(),
    );
    on_nic(&mut t, a);
    let b = parked(
        t.submit(OpDesc::read(r(0, 2048), r(8192, 2048)), 1)
            .unwrap(),
    );
    assert_eq!(tickets(t.complete(a).unwrap()), vec![b]);
    // With loopback, a WRITE into part of it parks too.
    let mut t = OrderTable::new(OrderConfig {
        loopback: true,
        ..pipe()
    });
    let a = issued(
        t.submit(OpDesc::read(r(0, 4096), r(1 << 20, 4096)), 0u32)
            .unwrap(),
    );
    on_nic(&mut t, a);
    parked(
        t.submit(OpDesc::write(r(1 << 21, 64), r(100, 64)), 1)
            .unwrap(),
    );
}

fn on_nic(t: &mut OrderTable<u32>, k: Ticket) -> Vec<Ticket> {
    let mut out = Vec::new();
    t.on_nic(k, &mut out).unwrap();
    tickets(out)
}

#[test]
fn overlapping_writes_pipeline_behind_an_optimistic_one_and_finish_in_order() {
    let mut t = OrderTable::new(pipe());
    let w = || OpDesc::write(r(0, 4096), r(1 << 20, 4096));
    let a = issued(t.submit(w(), 0u32).unwrap());
    // Not on the NIC yet: the next one parks as before.
    let b = parked(t.submit(w(), 1).unwrap());
    assert_eq!(on_nic(&mut t, a), vec![b]);
    // `b` is issued behind `a`: more pipeline behind `b` once it is out.
    let c = parked(t.submit(w(), 2).unwrap());
    assert_eq!(on_nic(&mut t, b), vec![c]);
    on_nic(&mut t, c);
    let d = issued(t.submit(w(), 3).unwrap());
    assert!(!t.must_wait(a).unwrap());
    // `c` has its result first: it must wait for `a` and `b`.
    assert!(t.must_wait(c).unwrap());
    assert_eq!(tickets(t.complete(a).unwrap()), Vec::<Ticket>::new());
    assert!(!t.must_wait(b).unwrap());
    // Completing `b` hands the held `c` back.
    assert_eq!(tickets(t.complete(b).unwrap()), vec![c]);
    t.complete(c).unwrap();
    t.complete(d).unwrap();
    assert!(t.is_idle());
}

#[test]
fn a_failed_check_replays_the_later_overlapping_ops_in_post_order() {
    let mut t = OrderTable::new(pipe());
    let w = |x: u64| OpDesc::write(r(0, 64), r(1000 + x, 64));
    let a = issued(t.submit(w(0), 0u32).unwrap());
    on_nic(&mut t, a);
    let b = issued(t.submit(w(32), 1).unwrap()); // overlaps a
    on_nic(&mut t, b);
    let other = issued(t.submit(OpDesc::read(r(5000, 8), r(9000, 8)), 2).unwrap());
    let c = issued(t.submit(w(90), 3).unwrap()); // overlaps b only
    on_nic(&mut t, c);
    let mut out = Vec::new();
    t.fail(a, &mut out).unwrap();
    assert_eq!(out, vec![(b, 1), (c, 3)], "transitive closure, post order");
    assert_eq!(t.inflight_len(), 2);
    assert!(t.is_inflight(other) && !t.is_inflight(b) && !t.is_inflight(c));
    // `a` goes two-sided: an overlapping post parks behind the replays.
    let e = parked(t.submit(w(0), 4).unwrap());
    assert_eq!(t.parked_len(), 3);
    assert_eq!(tickets(t.complete(other).unwrap()), Vec::<Ticket>::new());
    // Replays run after `a`, then pipeline again as they reach the NIC.
    assert_eq!(tickets(t.complete(a).unwrap()), vec![b]);
    // `e` overlaps only `b` (optimistic now), not the not-yet-posted `c`.
    assert_eq!(on_nic(&mut t, b), vec![c, e]);
    assert_eq!(on_nic(&mut t, c), Vec::<Ticket>::new());
    for k in [b, c, e] {
        t.complete(k).unwrap();
    }
    assert!(t.is_idle());
}

#[test]
fn reads_into_one_buffer_pipeline_but_a_write_after_read_does_not() {
    let mut t = OrderTable::new(pipe());
    let a = issued(t.submit(OpDesc::read(r(0, 64), r(1000, 64)), 0u32).unwrap());
    on_nic(&mut t, a);
    let b = issued(t.submit(OpDesc::read(r(0, 64), r(2000, 64)), 1).unwrap());
    on_nic(&mut t, b);
    // A WRITE of the remote range `a` reads: `a`'s fallback would see it.
    parked(t.submit(OpDesc::write(r(500, 64), r(1000, 64)), 2).unwrap());
    t.complete(a).unwrap();
    t.complete(b).unwrap();
    // A READ into the buffer a WRITE sends from: same hazard, locally.
    let mut t = OrderTable::new(pipe());
    let w = issued(
        t.submit(OpDesc::write(r(0, 64), r(1000, 64)), 0u32)
            .unwrap(),
    );
    on_nic(&mut t, w);
    parked(t.submit(OpDesc::read(r(0, 64), r(3000, 64)), 1).unwrap());
}

#[test]
fn messages_atomics_bits_and_strict_mode_do_not_pipeline() {
    let w = || OpDesc::write(r(0, 64), r(1000, 64));
    let blocked = [
        OpDesc::write_imm(r(0, 64), r(1000, 64)),
        OpDesc::atomic(4096, 1000),
        OpDesc::send(r(100, 8)),
        w().order_before(true),
        w().order_after(true),
    ];
    for op in blocked {
        let mut t = OrderTable::new(pipe());
        let a = issued(t.submit(w(), 0u32).unwrap());
        on_nic(&mut t, a);
        parked(t.submit(op.clone(), 1).unwrap());
    }
    let mut t = OrderTable::new(OrderConfig {
        mode: OrderMode::Strict,
        ..OrderConfig::default()
    });
    let a = issued(t.submit(w(), 0u32).unwrap());
    on_nic(&mut t, a);
    parked(t.submit(w(), 1).unwrap());
    // Nothing issues behind an optimistic op that is order-after either.
    let mut t = OrderTable::new(pipe());
    let a = issued(t.submit(w().order_after(true), 0u32).unwrap());
    on_nic(&mut t, a);
    parked(t.submit(w(), 1).unwrap());
}

#[derive(Debug, Clone)]
enum RAction {
    Submit(OpDesc),
    Nic(usize),
    Result(usize),
    Fail(usize),
    Complete(usize),
}

fn arb_raction() -> impl Strategy<Value = RAction> {
    actions_of(arb_op())
}

/// Random replay actions whose submitted ops come from `ops`.
fn actions_of(ops: impl Strategy<Value = OpDesc>) -> impl Strategy<Value = RAction> {
    prop_oneof![
        4 => ops.prop_map(RAction::Submit),
        3 => any::<usize>().prop_map(RAction::Nic),
        1 => any::<usize>().prop_map(RAction::Result),
        1 => any::<usize>().prop_map(RAction::Fail),
        2 => any::<usize>().prop_map(RAction::Complete),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Pipelining and replay against a model: ops issue in post order
    /// behind conflicting ops only if all of those are optimistic (no
    /// write-after-read); `must_wait` is "an earlier conflicting op is in
    /// flight"; `fail` returns exactly the transitive closure of later
    /// conflicting in-flight ops, in post order, and they re-issue (once)
    /// before anything parked; every op issues and completes.
    #[test]
    fn replay_matches_model(cfg in arb_cfg(), actions in prop::collection::vec(arb_raction(), 1..100)) {
        let mut table: OrderTable<u64> = OrderTable::new(cfg);
        // In flight (ticket order): (ticket, op, optimistic).
        let mut inflight: Vec<(Ticket, OpDesc, bool)> = Vec::new();
        let mut parked: std::collections::VecDeque<(Ticket, OpDesc)> = Default::default();
        let mut submitted = 0u64;
        let mut completed = 0u64;

        fn admissible(cfg: &OrderConfig, op: &OpDesc, inflight: &[(Ticket, OpDesc, bool)]) -> bool {
            inflight.is_empty()
                || (!op.order_before
                    && cfg.mode == OrderMode::Relaxed
                    && inflight.iter().all(|(_, f, opt)| {
                        !f.order_after
                            && (!cfg.conflicts(op, f)
                                || (*opt
                                    && cfg.pipeline
                                    && op.optimistic
                                    && !op.message
                                    && !op.order_after
                                    && !cfg.overwrites(op, f)))
                    }))
        }
        fn issue(
            cfg: &OrderConfig,
            released: Vec<(Ticket, u64)>,
            parked: &mut std::collections::VecDeque<(Ticket, OpDesc)>,
            inflight: &mut Vec<(Ticket, OpDesc, bool)>,
        ) -> Result<(), TestCaseError> {
            for (rt, p) in released {
                prop_assert_eq!(rt.0, p);
                let (mt, op) = parked.pop_front().expect("released op was parked");
                prop_assert_eq!(mt, rt, "release in post order");
                prop_assert!(admissible(cfg, &op, inflight), "{:?} issued while blocked", rt);
                let at = inflight.partition_point(|(t, _, _)| *t < rt);
                inflight.insert(at, (rt, op, false));
            }
            if let Some((_, head)) = parked.front() {
                prop_assert!(!admissible(cfg, head, inflight), "missed wake-up");
            }
            Ok(())
        }

        for a in actions {
            match a {
                RAction::Submit(desc) => {
                    let expect = parked.is_empty() && admissible(&cfg, &desc, &inflight);
                    match table.submit(desc.clone(), submitted).unwrap() {
                        Admit::Issue(t, _) => {
                            prop_assert!(expect);
                            inflight.push((t, desc, false));
                        }
                        Admit::Parked(t) => {
                            prop_assert!(!expect);
                            parked.push_back((t, desc));
                        }
                    }
                    submitted += 1;
                }
                RAction::Nic(i) if !inflight.is_empty() => {
                    let i = i % inflight.len();
                    let t = inflight[i].0;
                    let d = &inflight[i].1;
                    inflight[i].2 = d.optimistic && !d.message && !d.order_before
                        && !d.order_after && cfg.mode == OrderMode::Relaxed;
                    let mut out = Vec::new();
                    table.on_nic(t, &mut out).unwrap();
                    issue(&cfg, out, &mut parked, &mut inflight)?;
                }
                RAction::Result(i) if !inflight.is_empty() => {
                    let i = i % inflight.len();
                    let (t, op, _) = &inflight[i];
                    let expect = inflight[..i].iter().any(|(_, f, _)| cfg.conflicts(op, f));
                    prop_assert_eq!(table.must_wait(*t).unwrap(), expect);
                }
                RAction::Fail(i) if !inflight.is_empty() => {
                    let i = i % inflight.len();
                    let t = inflight[i].0;
                    inflight[i].2 = false;
                    let mut set = vec![i];
                    for k in i + 1..inflight.len() {
                        if set.iter().any(|&s| cfg.conflicts(&inflight[k].1, &inflight[s].1)) {
                            set.push(k);
                        }
                    }
                    let mut out = Vec::new();
                    table.fail(t, &mut out).unwrap();
                    let want: Vec<Ticket> = set[1..].iter().map(|&k| inflight[k].0).collect();
                    prop_assert_eq!(tickets(out.clone()), want, "replay set = closure, post order");
                    for (_, p) in &out {
                        prop_assert!(*p > t.0);
                    }
                    for &k in set[1..].iter().rev() {
                        let (rt, op, _) = inflight.remove(k);
                        parked.push_front((rt, op));
                    }
                }
                RAction::Complete(i) if !inflight.is_empty() => {
                    let (t, _, _) = inflight.remove(i % inflight.len());
                    completed += 1;
                    let out = table.complete(t).unwrap();
                    // Held ops come back first (they stay in flight).
                    let released: Vec<_> = out
                        .into_iter()
                        .filter(|(rt, _)| !inflight.iter().any(|(x, _, _)| x == rt))
                        .collect();
                    issue(&cfg, released, &mut parked, &mut inflight)?;
                }
                _ => {}
            }
            prop_assert_eq!(table.inflight_len(), inflight.len());
            prop_assert_eq!(table.parked_len(), parked.len());
        }
        // Drain: complete in post order; everything issues and completes once.
        let mut steps = 0;
        while !inflight.is_empty() {
            let (t, _, _) = inflight.remove(0);
            completed += 1;
            let out = table.complete(t).unwrap();
            let released: Vec<_> = out
                .into_iter()
                .filter(|(rt, _)| !inflight.iter().any(|(x, _, _)| x == rt))
                .collect();
            issue(&cfg, released, &mut parked, &mut inflight)?;
            steps += 1;
            prop_assert!(steps <= 4 * submitted as usize + 4);
        }
        prop_assert!(parked.is_empty() && table.is_idle());
        prop_assert_eq!(completed, submitted);
    }
}

/// A small READ into the perftest-style shared buffer `[0, 64)` from
/// remote page `page`, answered inline on the two-sided path.
fn window_read(page: u64) -> OpDesc {
    OpDesc::read(r(0, 64), r(page << 12, 64)).suppressible(true)
}

fn fail(t: &mut OrderTable<u32>, k: Ticket) -> Vec<Ticket> {
    let mut out = Vec::new();
    t.fail(k, &mut out).unwrap();
    tickets(out)
}

#[test]
fn a_failed_read_in_a_same_buffer_window_replays_nothing_and_its_answer_is_dead() {
    let mut t = OrderTable::new(pipe());
    let ks: Vec<Ticket> = (0..4)
        .map(|i| {
            let k = issued(t.submit(window_read(i), i as u32).unwrap());
            on_nic(&mut t, k);
            k
        })
        .collect();
    assert!(!t.must_wait(ks[0]).unwrap());
    // The first check fails: the later READs (same destination, other
    // pages) are not replayed; they replace its bytes, so its answer dies.
    assert_eq!(fail(&mut t, ks[0]), Vec::<Ticket>::new());
    assert!(t.data_dead(ks[0]));
    assert_eq!(t.inflight_len(), 4);
    // The next one may finish (or go two-sided) without waiting for it.
    assert!(!t.must_wait(ks[1]).unwrap());
    assert_eq!(fail(&mut t, ks[1]), Vec::<Ticket>::new());
    assert!(t.data_dead(ks[1]));
    // Still optimistic, `ks[2]` holds the last one back until it is safe.
    assert!(t.must_wait(ks[3]).unwrap());
    assert!(!t.must_wait(ks[2]).unwrap());
    assert_eq!(fail(&mut t, ks[2]), Vec::<Ticket>::new());
    // The last one of the window is superseded by nobody: its answer lands.
    assert!(!t.must_wait(ks[3]).unwrap());
    assert_eq!(fail(&mut t, ks[3]), Vec::<Ticket>::new());
    assert!(!t.data_dead(ks[3]));
    // A READ posted now is admitted past the two-sided ones and buries
    // the last one.
    let n = issued(t.submit(window_read(9), 9).unwrap());
    assert!(t.data_dead(ks[3]));
    assert!(t.is_inflight(n));
}

#[test]
fn a_read_that_is_not_suppressible_still_replays_its_window() {
    let mut t = OrderTable::new(pipe());
    let ks: Vec<Ticket> = (0..3)
        .map(|i| {
            let k = issued(
                t.submit(window_read(i).suppressible(false), i as u32)
                    .unwrap(),
            );
            on_nic(&mut t, k);
            k
        })
        .collect();
    assert_eq!(fail(&mut t, ks[0]), vec![ks[1], ks[2]]);
    assert!(!t.data_dead(ks[0]));
    // A later READ of the destination waits for the two-sided one.
    parked(t.submit(window_read(7), 7).unwrap());
}

#[test]
fn a_superseding_read_is_replayed_when_an_earlier_op_it_depends_on_fails() {
    // `x` writes remote page 5; `a` reads page 5 into the buffer (it
    // conflicts with `x`), `b` reads page 6 into the same buffer. When `x`
    // fails, `a` replays — and `b`, which must land after `a`, too.
    let mut t = OrderTable::new(pipe());
    let x = issued(
        t.submit(OpDesc::write(r(8192, 64), r(5 << 12, 64)), 0)
            .unwrap(),
    );
    on_nic(&mut t, x);
    let a = issued(t.submit(window_read(5), 1).unwrap());
    on_nic(&mut t, a);
    let b = issued(t.submit(window_read(6), 2).unwrap());
    on_nic(&mut t, b);
    // `b` may not finish before `a` is safe.
    assert!(t.must_wait(b).unwrap());
    assert_eq!(fail(&mut t, x), vec![a, b]);
    assert!(!t.data_dead(x));
}

#[test]
fn a_held_superseding_read_buries_the_failed_one_when_released() {
    let mut t = OrderTable::new(pipe());
    let a = issued(t.submit(window_read(0), 0).unwrap());
    on_nic(&mut t, a);
    let b = issued(t.submit(window_read(1), 1).unwrap());
    on_nic(&mut t, b);
    // `b`'s check passes while `a` is still optimistic: held.
    assert!(t.must_wait(b).unwrap());
    // `a` fails: `b` is not replayed and `a`'s answer is dead.
    assert_eq!(fail(&mut t, a), Vec::<Ticket>::new());
    assert!(t.data_dead(a));
    // `a` completes: `b` is handed back.
    assert_eq!(tickets(t.complete(a).unwrap()), vec![b]);
}

/// Ops of deep same-buffer windows (the twins' home) with a few of every
/// other kind mixed in: READs into one of two destinations (or part of
/// one), from a handful of remote pages, suppressible or not; WRITEs,
/// atomics, messages and ordering bits now and then.
fn arb_window_op() -> impl Strategy<Value = OpDesc> {
    (0u8..20, 0u64..6, 0u8..3, any::<bool>(), 0u8..10).prop_map(|(k, page, dst, sup, bits)| {
        let local = match dst {
            0 => r(0, 64),
            1 => r(64, 64),
            _ => r(0, 32),
        };
        let remote = r(page * 100, 40);
        let d = match k {
            0..=13 => OpDesc::read(local, remote).suppressible(sup),
            14 | 15 => OpDesc::write(local, remote),
            16 => OpDesc::atomic(local.addr, remote.addr & !7),
            17 => OpDesc::send(local),
            _ => OpDesc::read(local, remote)
                .suppressible(sup)
                .with_local(r(200, 8), Access::Write),
        };
        d.order_before(bits == 0).order_after(bits == 1)
    })
}

/// A table call that hands back ops (`on_nic`, `fail`).
type Handout = fn(&mut OrderTable<u64>, Ticket, &mut Vec<(Ticket, u64)>) -> Result<(), OrderError>;

/// The outputs of one call of `f` on ticket `t` of both tables, asserted
/// equal.
fn both(
    fast: &mut OrderTable<u64>,
    slow: &mut OrderTable<u64>,
    t: Ticket,
    f: Handout,
) -> Result<Vec<(Ticket, u64)>, TestCaseError> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    f(fast, t, &mut x).unwrap();
    f(slow, t, &mut y).unwrap();
    prop_assert_eq!(&x, &y);
    Ok(x)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// The twin shortcuts answer exactly as the full scans: two tables, one
    /// with and one without them, driven through the same deep windows give
    /// the same admissions, releases, holds, replays and dead answers at
    /// every step.
    #[test]
    fn twin_shortcuts_answer_as_the_full_scans(
        cfg in arb_cfg(),
        actions in prop::collection::vec(actions_of(arb_window_op()), 1..300),
    ) {
        let mut fast: OrderTable<u64> = OrderTable::new(cfg);
        let mut slow: OrderTable<u64> = OrderTable::without_shortcuts(cfg);
        // In-flight tickets, post order.
        let mut inflight: Vec<Ticket> = Vec::new();
        let mut n = 0u64;
        for a in actions {
            match a {
                RAction::Submit(d) => {
                    let (x, y) = (fast.submit(d.clone(), n).unwrap(), slow.submit(d, n).unwrap());
                    prop_assert_eq!(&x, &y);
                    if let Admit::Issue(t, _) = x {
                        inflight.push(t);
                    }
                    n += 1;
                }
                RAction::Nic(i) if !inflight.is_empty() => {
                    let t = inflight[i % inflight.len()];
                    let x = both(&mut fast, &mut slow, t, OrderTable::on_nic)?;
                    inflight.extend(x.iter().map(|(t, _)| *t));
                }
                RAction::Result(i) if !inflight.is_empty() => {
                    let t = inflight[i % inflight.len()];
                    prop_assert_eq!(fast.must_wait(t).unwrap(), slow.must_wait(t).unwrap());
                }
                RAction::Fail(i) if !inflight.is_empty() => {
                    let t = inflight[i % inflight.len()];
                    let x = both(&mut fast, &mut slow, t, OrderTable::fail)?;
                    inflight.retain(|k| !x.iter().any(|(r, _)| r == k));
                }
                RAction::Complete(i) if !inflight.is_empty() => {
                    let t = inflight.remove(i % inflight.len());
                    let (x, y) = (fast.complete(t).unwrap(), slow.complete(t).unwrap());
                    prop_assert_eq!(&x, &y);
                    for (r, _) in x {
                        if !inflight.contains(&r) {
                            inflight.push(r);
                        }
                    }
                }
                _ => {}
            }
            inflight.sort();
            prop_assert_eq!(fast.inflight_len(), inflight.len());
            prop_assert!(fast.holding_counted() && slow.holding_counted());
            prop_assert_eq!(fast.parked_len(), slow.parked_len());
            for &t in &inflight {
                prop_assert_eq!(fast.data_dead(t), slow.data_dead(t), "dead answer of {:?}", t);
            }
        }
    }
}
