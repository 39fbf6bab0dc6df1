//! The engine in user-space mode (no IOMMU control: every READ/WRITE
//! two-sided, MRs registered on the fly) over the libibverbs backend, with
//! this repository's libnprdma.so (pinned mode) as the device: two
//! contexts in this process, each with its own pager; READ, WRITE,
//! WRITE_WITH_IMM, atomics and SEND/RECV with data checks, over memory
//! never touched and memory the pager swapped out.

mod common;

use nprdma_test_support::chaos::Rng;

use nprdma_test_support::{pattern, wait1};

use ibverbs_nic::VerbsNic;
use nprdma::nic::Nic;
use nprdma::{Access, CompOp, Completion, Config, Context, Cq, Opcode, Pd, Qp, RecvWr, SendWr};

struct Side {
    pager: vmem::Pager,
    ctx: Context<VerbsNic>,
    pd: Pd<VerbsNic>,
    cq: Cq<VerbsNic>,
    rcq: Cq<VerbsNic>,
}

fn side(nic: VerbsNic, cfg: Config) -> Side {
    assert!(nic.iommu().is_none());
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 64 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::with_nic(nic, &pager, cfg).expect("user-space context");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(256).expect("cq");
    let rcq = ctx.create_cq(256).expect("rcq");
    Side {
        pager,
        ctx,
        pd,
        cq,
        rcq,
    }
}

/// Pager memory registered as an NP-RDMA MR (the shared helper).
type Buf = nprdma_test_support::Buf<VerbsNic>;

impl nprdma_test_support::Mem<VerbsNic> for Side {
    fn pager(&self) -> &vmem::Pager {
        &self.pager
    }
    fn pd(&self) -> &Pd<VerbsNic> {
        &self.pd
    }
}

fn post(qp: &Qp<VerbsNic>, w: SendWr) {
    qp.post_send(&[w])
        .map_err(|(i, e)| format!("{i}: {e}"))
        .expect("post");
}

fn ok(c: Completion, id: u64) {
    assert_eq!((c.wr_id, c.status), (id, 0), "{c:?}");
}

type Connected = (Side, Side, Qp<VerbsNic>, Qp<VerbsNic>);

/// Two user-space contexts over libnprdma.so and a connected QP pair.
fn connected(cfg: Config) -> Option<Connected> {
    let (na, nb) = common::pair()?;
    let (a, b) = (side(na, cfg.clone()), side(nb, cfg));
    let qa = a.pd.create_qp(&a.cq, &a.rcq, 16).expect("qp a");
    let qb = b.pd.create_qp(&b.cq, &b.rcq, 16).expect("qp b");
    qa.connect(&qb.endpoint()).expect("connect a");
    qb.connect(&qa.endpoint()).expect("connect b");
    Some((a, b, qa, qb))
}

#[test]
fn user_space_mode_over_libnprdma() {
    // No registration cache and no leases: every two-sided operation
    // registers and deregisters its MRs (the paper's user-space mode as
    // written).
    all_ops(Config {
        reg_cache_bytes: 0,
        lease_ms: 0,
        ..Config::default()
    });
}

/// The control channel on the data QP (`Config::ctrl_on_data_qp`, what
/// the verbs shim uses: an unmodified program exchanges only the data
/// QPN): each endpoint names its data QP as its control QP, every
/// operation works as with a separate control QP, and a peer that does
/// not run the same way is refused at connect.
#[test]
fn control_channel_on_the_data_qp() {
    all_ops(Config {
        reg_cache_bytes: 0,
        lease_ms: 0,
        ctrl_on_data_qp: true,
        ..Config::default()
    });
    let Some((na, nb)) = common::pair() else {
        return;
    };
    let shared = Config {
        ctrl_on_data_qp: true,
        ..Config::default()
    };
    let (a, b) = (side(na, shared), side(nb, Config::default()));
    let qa = a.pd.create_qp(&a.cq, &a.rcq, 4).expect("qp a");
    let qb = b.pd.create_qp(&b.cq, &b.rcq, 4).expect("qp b");
    assert_eq!(qa.endpoint().ctrl_qpn, qa.qpn());
    assert_ne!(qb.endpoint().ctrl_qpn, qb.qpn());
    assert!(matches!(
        qa.connect(&qb.endpoint()),
        Err(nprdma::Error::Invalid(_))
    ));
    assert!(matches!(
        qb.connect(&qa.endpoint()),
        Err(nprdma::Error::Invalid(_))
    ));
}

/// READ, WRITE, atomics, SEND, WRITE_WITH_IMM with data checks over a
/// connected pair of user-space contexts configured by `cfg` (without a
/// registration cache: every operation registers on the fly).
fn all_ops(cfg: Config) {
    assert_eq!(cfg.reg_cache_bytes, 0);
    let Some((a, b, qa, qb)) = connected(cfg) else {
        return;
    };
    let before = (a.ctx.nic_stats(), b.ctx.nic_stats());

    const LEN: usize = 256 << 10;
    let src = pattern(1, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let la2 = Buf::with(&a, LEN, None); // never touched
    let rb = Buf::with(&b, LEN, None); // never touched
    let sge = |m: &Buf, off: u64, len: u32| Some(m.mr.sge(off, len));

    // WRITE into untouched remote memory: large (reverse READ by the
    // target over MRs registered on the fly) and small (inline).
    post(
        &qa,
        SendWr::new(
            1,
            Opcode::Write,
            sge(&la, 0, 128 << 10),
            rb.addr(),
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 1);
    post(
        &qa,
        SendWr::new(
            2,
            Opcode::Write,
            sge(&la, 200_000, 100),
            rb.addr() + 200_000,
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 2);
    assert_eq!(&rb.bytes()[..128 << 10], &src[..128 << 10]);
    assert_eq!(&rb.bytes()[200_000..200_100], &src[200_000..200_100]);
    assert!(rb.bytes()[(128 << 10)..200_000].iter().all(|&x| x == 0));

    // READ into untouched local memory, then with the remote swapped out.
    post(
        &qa,
        SendWr::new(
            3,
            Opcode::Read,
            sge(&la2, 0, 64 << 10),
            rb.addr(),
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 3);
    assert_eq!(&la2.bytes()[..64 << 10], &src[..64 << 10]);
    rb.swap_out();
    assert!(b.pager.stats().swap_outs > 0);
    post(
        &qa,
        SendWr::new(
            4,
            Opcode::Read,
            sge(&la2, 64 << 10, 64 << 10),
            rb.addr() + (64 << 10),
            rb.mr.rkey(),
        ),
    );
    post(
        &qa,
        SendWr::new(
            5,
            Opcode::Read,
            sge(&la2, 200_000, 100),
            rb.addr() + 200_000,
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 4);
    ok(wait1(&a.cq), 5);
    assert_eq!(&la2.bytes()[64 << 10..128 << 10], &src[64 << 10..128 << 10]);
    assert_eq!(&la2.bytes()[200_000..200_100], &src[200_000..200_100]);

    // WRITE from swapped-out local memory into swapped-out remote memory.
    la.swap_out();
    rb.swap_out();
    post(
        &qa,
        SendWr::new(
            6,
            Opcode::Write,
            sge(&la, 128 << 10, 128 << 10),
            rb.addr() + (128 << 10),
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 6);
    assert_eq!(&rb.bytes()[128 << 10..], &src[128 << 10..]);

    // Atomics on the target's CPU (8-byte aligned), remote swapped out.
    rb.swap_out();
    post(
        &qa,
        SendWr::new(
            7,
            Opcode::FetchAdd { add: 5 },
            sge(&la2, 250_000, 8),
            rb.addr() + 8,
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 7);
    let old = u64::from_le_bytes(src[8..16].try_into().unwrap());
    assert_eq!(la2.bytes()[250_000..250_008], old.to_le_bytes());
    assert_eq!(rb.bytes()[8..16], old.wrapping_add(5).to_le_bytes());
    post(
        &qa,
        SendWr::new(
            8,
            Opcode::CmpSwap {
                compare: old.wrapping_add(5),
                swap: 42,
            },
            sge(&la2, 250_008, 8),
            rb.addr() + 8,
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 8);
    assert_eq!(rb.bytes()[8..16], 42u64.to_le_bytes());

    // SEND (inline and rendezvous) and WRITE_WITH_IMM into posted RECVs.
    let rr = Buf::with(&b, LEN, None);
    qb.post_recv(&[
        RecvWr {
            wr_id: 20,
            sge: Some(rr.mr.sge(0, 4096)),
        },
        RecvWr {
            wr_id: 21,
            sge: Some(rr.mr.sge(65536, 65536)),
        },
        RecvWr {
            wr_id: 22,
            sge: None,
        },
    ])
    .map_err(|(i, e)| format!("{i}: {e}"))
    .expect("post recv");
    la.swap_out();
    post(&qa, SendWr::new(9, Opcode::Send, sge(&la, 0, 100), 0, 0));
    post(
        &qa,
        SendWr::new(10, Opcode::SendImm(77), sge(&la, 0, 65536), 0, 0),
    );
    post(
        &qa,
        SendWr::new(
            11,
            Opcode::WriteImm(99),
            sge(&la, 0, 32768),
            rb.addr(),
            rb.mr.rkey(),
        ),
    );
    for id in 9..=11 {
        ok(wait1(&a.cq), id);
    }
    let r = [wait1(&b.rcq), wait1(&b.rcq), wait1(&b.rcq)];
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].op, r[0].byte_len),
        (20, 0, CompOp::Recv, 100)
    );
    assert_eq!((r[1].wr_id, r[1].status, r[1].imm), (21, 0, Some(77)));
    assert_eq!(
        (r[2].wr_id, r[2].status, r[2].op, r[2].imm),
        (22, 0, CompOp::RecvWithImm, Some(99))
    );
    assert_eq!(&rr.bytes()[..100], &src[..100]);
    assert_eq!(&rr.bytes()[65536..131072], &src[..65536]);
    assert_eq!(&rb.bytes()[..32768], &src[..32768]);

    // All two-sided, none optimistic; registrations on the fly, none left.
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    println!("user-space mode: initiator {sa:?}\ntarget {sb:?}");
    assert_eq!(sa.optimistic_ok, 0, "{sa:?}");
    assert!(sa.two_sided >= 11, "{sa:?}");
    let (aa, ab) = (a.ctx.nic_stats(), b.ctx.nic_stats());
    println!("registrations: initiator {aa:?} target {ab:?}");
    assert!(
        aa.regs > before.0.regs && ab.regs > before.1.regs,
        "on-the-fly MRs"
    );
    assert_eq!(
        aa.live_mrs, before.0.live_mrs,
        "no initiator MR left: {aa:?}"
    );
    assert_eq!(ab.live_mrs, before.1.live_mrs, "no target MR left: {ab:?}");
    assert_eq!((aa.reg_failures, ab.reg_failures), (0, 0));
    drop((qa, qb));
}

/// WRITEs alternating over `ranges` 64 KiB chunks, `rounds` times; the
/// hit rate of the initiator's and the target's caches.
fn hit_rates(budget: u64, ranges: u64, rounds: u64) -> Option<(f64, f64)> {
    let cfg = Config {
        reg_cache_bytes: budget,
        lease_ms: 0,
        ..Config::default()
    };
    let (a, b, qa, _qb) = connected(cfg)?;
    const CHUNK: u64 = 64 << 10;
    let src = pattern(3, (ranges * CHUNK) as usize);
    let la = Buf::with(&a, src.len(), Some(&src));
    let rb = Buf::with(&b, src.len(), None);
    let mut id = 0;
    for _ in 0..rounds {
        for r in 0..ranges {
            id += 1;
            let w = SendWr::new(
                id,
                Opcode::Write,
                Some(la.mr.sge(r * CHUNK, CHUNK as u32)),
                rb.addr() + r * CHUNK,
                rb.mr.rkey(),
            );
            post(&qa, w);
            ok(wait1(&a.cq), id);
        }
    }
    assert_eq!(rb.bytes(), &src[..]);
    let rate =
        |s: nprdma::Stats| s.reg_cache_hits as f64 / (s.reg_cache_hits + s.reg_cache_misses) as f64;
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    println!(
        "budget {budget} B, {ranges} x 64 KiB ranges x {rounds}: hit rate initiator {:.2} ({} hits, {} registrations), target {:.2} ({} hits, {} registrations)",
        rate(sa), sa.reg_cache_hits, sa.reg_cache_misses, rate(sb), sb.reg_cache_hits, sb.reg_cache_misses
    );
    Some((rate(sa), rate(sb)))
}

#[test]
fn the_registration_cache_hits_within_its_budget_and_thrashes_beyond() {
    // 4 ranges of 64 KiB, 8 rounds: a 1 MiB budget keeps all four (the
    // first round misses), a 128 KiB budget keeps two (LRU over four in
    // turn: never a hit), no budget never caches.
    let Some((ia, ta)) = hit_rates(1 << 20, 4, 8) else {
        return;
    };
    assert!(ia > 0.8 && ta > 0.8, "{ia} {ta}");
    let Some((ib, tb)) = hit_rates(128 << 10, 4, 8) else {
        return;
    };
    assert_eq!((ib, tb), (0.0, 0.0));
    let Some((ic, tc)) = hit_rates(0, 4, 2) else {
        return;
    };
    assert_eq!((ic, tc), (0.0, 0.0));
}

#[test]
fn a_cached_registration_is_dropped_before_its_pages_are_evicted() {
    // (No leases: a leased page stays resident for the lease's time.)
    let cfg = Config {
        lease_ms: 0,
        ..Config::default()
    };
    let Some((a, b, qa, _qb)) = connected(cfg) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let src = pattern(5, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let rb = Buf::with(&b, LEN, None);
    let write = |id| {
        post(
            &qa,
            SendWr::new(
                id,
                Opcode::Write,
                Some(la.mr.sge(0, LEN as u32)),
                rb.addr(),
                rb.mr.rkey(),
            ),
        );
        ok(wait1(&a.cq), id);
    };
    write(1);
    write(2);
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!((sa.reg_cache_misses, sa.reg_cache_hits), (1, 1), "{sa:?}");
    assert_eq!((sb.reg_cache_misses, sb.reg_cache_hits), (1, 1), "{sb:?}");
    let live = b.ctx.nic_stats().live_mrs;
    // The target's pages go: its cached MR over them goes first.
    rb.swap_out();
    let sb = b.ctx.stats();
    assert!(sb.reg_cache_invalidations >= 1, "{sb:?}");
    assert_eq!(b.ctx.nic_stats().live_mrs, live - 1);
    // The next WRITE registers anew (and faults the pages back in).
    write(3);
    let sb = b.ctx.stats();
    assert_eq!((sb.reg_cache_misses, sb.reg_cache_hits), (2, 1), "{sb:?}");
    assert_eq!(rb.bytes(), &src[..]);
    // Deregistering the application MR drops the cached MR over it too.
    let live = a.ctx.nic_stats().live_mrs;
    drop(la);
    assert_eq!(a.ctx.nic_stats().live_mrs, live - 1);
    assert_eq!(a.ctx.stats().reg_cache_invalidations, 1);
}

/// Randomized READ/WRITE/FETCH_ADD against a model of the remote memory,
/// both pagers over budget (pages swapped out and back all along, explicit
/// swap-outs besides), the registration cache small enough to evict and be
/// invalidated: every READ returns what the model says.
#[test]
fn randomized_ops_under_memory_pressure_match_the_model() {
    let cfg = Config {
        reg_cache_bytes: 256 << 10,
        ..Config::default()
    };
    let Some((a, b, qa, _qb)) = connected(cfg) else {
        return;
    };
    const LEN: usize = 1 << 20;
    let ops: u64 = std::env::var("NPRDMA_CHAOS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let src = pattern(9, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let lr = Buf::with(&a, LEN, None);
    let rb = Buf::with(&b, LEN, None);
    let mut model = vec![0u8; LEN];
    a.pager.set_budget(Some(160));
    b.pager.set_budget(Some(64));
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let len_of = |rng: &mut Rng| -> u64 {
        match rng.below(4) {
            0 => 1 + rng.below(256),
            1 => 1 + rng.below(8192),
            _ => 1 + rng.below(128 << 10),
        }
    };
    for id in 1..=ops {
        match rng.below(10) {
            0..=3 => {
                let len = len_of(&mut rng);
                let (lo, ro) = (rng.below(LEN as u64 - len), rng.below(LEN as u64 - len));
                let w = SendWr::new(
                    id,
                    Opcode::Write,
                    Some(la.mr.sge(lo, len as u32)),
                    rb.addr() + ro,
                    rb.mr.rkey(),
                );
                post(&qa, w);
                ok(wait1(&a.cq), id);
                model[ro as usize..(ro + len) as usize]
                    .copy_from_slice(&src[lo as usize..(lo + len) as usize]);
            }
            4..=7 => {
                let len = len_of(&mut rng);
                let (lo, ro) = (rng.below(LEN as u64 - len), rng.below(LEN as u64 - len));
                let w = SendWr::new(
                    id,
                    Opcode::Read,
                    Some(lr.mr.sge(lo, len as u32)),
                    rb.addr() + ro,
                    rb.mr.rkey(),
                );
                post(&qa, w);
                ok(wait1(&a.cq), id);
                let got = &lr.bytes()[lo as usize..(lo + len) as usize];
                assert!(
                    got == &model[ro as usize..(ro + len) as usize],
                    "op {id}: READ {len} B at {ro} differs"
                );
            }
            8 => {
                let ro = rng.below(LEN as u64 / 8) * 8;
                let lo = rng.below(LEN as u64 / 8) * 8;
                let add = rng.below(1000);
                let w = SendWr::new(
                    id,
                    Opcode::FetchAdd { add },
                    Some(lr.mr.sge(lo, 8)),
                    rb.addr() + ro,
                    rb.mr.rkey(),
                );
                post(&qa, w);
                ok(wait1(&a.cq), id);
                let r = ro as usize;
                let old = u64::from_le_bytes(model[r..r + 8].try_into().unwrap());
                assert_eq!(
                    lr.bytes()[lo as usize..lo as usize + 8],
                    old.to_le_bytes(),
                    "op {id}"
                );
                model[r..r + 8].copy_from_slice(&old.wrapping_add(add).to_le_bytes());
            }
            _ => {
                // Swap a random 64 KiB-aligned window out, on either side.
                let off = rng.below(16) as usize * (64 << 10);
                let (region, pager) = if rng.below(2) == 0 {
                    (&rb.region, &b.pager)
                } else {
                    (&lr.region, &a.pager)
                };
                let _ = pager.swap_out(region.addr() + off, 64 << 10);
            }
        }
    }
    assert!(
        rb.bytes() == &model[..],
        "remote memory differs from the model at the end"
    );
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    println!(
        "{ops} ops: initiator {sa:?}\ntarget {sb:?}\npager swap-outs a {} b {}",
        a.pager.stats().swap_outs,
        b.pager.stats().swap_outs
    );
    assert_eq!(sa.optimistic_ok, 0);
    assert!(b.pager.stats().swap_outs > 0);
    assert_eq!(
        (
            a.ctx.nic_stats().reg_failures,
            b.ctx.nic_stats().reg_failures
        ),
        (0, 0)
    );
}

/// The application's QP access flags bind the peer's operations (checked
/// by the target), not the engine's own reverse operations: a READ-only
/// target refuses WRITEs, and an initiator granting nothing still gets its
/// READs answered (the target's reverse WRITE into its temporary MR).
#[test]
fn qp_access_flags_bind_the_peer_not_the_reverse_operations() {
    let Some((a, b, qa, qb)) = connected(Config::default()) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let src = pattern(11, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let lr = Buf::with(&a, LEN, None);
    let rb = Buf::with(&b, LEN, None);
    qb.set_remote_access(Access::REMOTE_READ)
        .expect("READ only");
    qa.set_remote_access(Access(0)).expect("nothing");
    for (id, len) in [(1u64, LEN as u32), (2, 64)] {
        post(
            &qa,
            SendWr::new(
                id,
                Opcode::Write,
                Some(la.mr.sge(0, len)),
                rb.addr(),
                rb.mr.rkey(),
            ),
        );
        let c = wait1(&a.cq);
        assert_eq!((c.wr_id, c.status), (id, 9), "REM_INV_REQ_ERR: {c:?}");
        if qa.is_error() {
            break; // a remote error may take the QP to ERR, as on hardware
        }
    }
    assert!(rb.bytes().iter().all(|&x| x == 0), "nothing written");
    let Some((a, b, qa, qb)) = connected(Config::default()) else {
        return;
    };
    let la = Buf::with(&a, LEN, None);
    let rb = Buf::with(&b, LEN, Some(&src));
    qb.set_remote_access(Access::REMOTE_READ)
        .expect("READ only");
    qa.set_remote_access(Access(0)).expect("nothing");
    post(
        &qa,
        SendWr::new(
            3,
            Opcode::Read,
            Some(la.mr.sge(0, LEN as u32)),
            rb.addr(),
            rb.mr.rkey(),
        ),
    );
    ok(wait1(&a.cq), 3);
    assert_eq!(la.bytes(), &src[..]);
    drop(lr);
}

/// One signaled READ or WRITE of `len` bytes between `l` (local) and `r`
/// (the peer's MR), waited for; its completion status.
fn rw(
    side: &Side,
    qp: &Qp<VerbsNic>,
    id: u64,
    op: Opcode,
    l: &Buf,
    r: &nprdma::Mr<VerbsNic>,
    len: u32,
) -> u32 {
    post(
        qp,
        SendWr::new(id, op, Some(l.mr.sge(0, len)), r.addr(), r.rkey()),
    );
    let c = wait1(&side.cq);
    assert_eq!(c.wr_id, id, "{c:?}");
    c.status
}

/// Wait up to 2 s for `f` to hold.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "{what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Leases (beyond the paper): after a peer's two-sided WRITE (READ) of a
/// range, the target lends it its registration of those pages, and the
/// peer's next WRITEs (READs) of them go one-sided with the same bytes; the
/// leased pages stay resident while lent and no longer: then they
/// can be swapped out, and the next operation is two-sided again.
#[test]
fn a_lease_makes_repeated_operations_one_sided_and_ends_in_time() {
    let cfg = Config {
        lease_ms: 200,
        ..Config::default()
    };
    let Some((a, b, qa, _qb)) = connected(cfg) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let (s1, s2) = (pattern(21, LEN), pattern(22, LEN));
    let mut la = Buf::with(&a, LEN, Some(&s1));
    let lr = Buf::with(&a, LEN, None);
    let rb = Buf::with(&b, LEN, None);
    let n = LEN as u32;
    // The first WRITE of these pages: no lease (scattered operations are
    // lent nothing); the second comes back to them and is lent them.
    assert_eq!(rw(&a, &qa, 1, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(b.ctx.stats().leases_granted, 0);
    assert_eq!(rw(&a, &qa, 11, Opcode::Write, &la, &rb.mr, n), 0);
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!((sa.leased_ops, sb.leases_granted), (0, 1), "{sa:?} {sb:?}");
    la.bytes_mut().copy_from_slice(&s2);
    assert_eq!(rw(&a, &qa, 2, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(a.ctx.stats().leased_ops, 1, "the third WRITE on the lease");
    assert_eq!(rb.bytes(), &s2[..]);
    // A READ needs a READ lease: the first is two-sided and asks for one.
    assert_eq!(rw(&a, &qa, 3, Opcode::Read, &lr, &rb.mr, n), 0);
    assert_eq!(rw(&a, &qa, 4, Opcode::Read, &lr, &rb.mr, 4096), 0);
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!((sa.leased_ops, sb.leases_granted), (2, 2), "{sa:?} {sb:?}");
    assert_eq!(lr.bytes(), &s2[..]);
    // Leased pages are pinned: the pager cannot take them.
    rb.swap_out();
    let resident = || b.pager.resident_count(rb.addr() as usize, LEN).unwrap();
    assert_eq!(resident(), LEN / 4096, "leased pages stay");
    // Past its time of use the initiator gives each lease back (nothing of it
    // in flight), the target drops it, and the pages can go.
    eventually("the leases are given back", || {
        b.ctx.stats().leases_released == 2
    });
    assert_eq!(b.ctx.stats().leases_expired, 0);
    rb.swap_out();
    assert_eq!(resident(), 0, "no pin left");
    let two = a.ctx.stats().two_sided;
    assert_eq!(rw(&a, &qa, 5, Opcode::Read, &lr, &rb.mr, n), 0);
    let sa = a.ctx.stats();
    assert_eq!(
        (sa.two_sided, sa.leased_ops),
        (two + 1, 2),
        "two-sided again: {sa:?}"
    );
    assert_eq!(lr.bytes(), &s2[..]);
}

/// Deregistering the target's MR ends its leases before `dereg` returns:
/// the peer's next WRITE fails with REM_ACCESS_ERR, as for any
/// deregistered MR, and not a byte of the memory changes after it.
#[test]
fn deregistering_a_leased_mr_ends_its_leases_at_once() {
    let Some((a, b, qa, _qb)) = connected(Config::default()) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let (s1, s2) = (pattern(23, LEN), pattern(24, LEN));
    let mut la = Buf::with(&a, LEN, Some(&s1));
    let rb = Buf::with(&b, LEN, None);
    let n = LEN as u32;
    // A first WRITE of the pages; the next one is lent them.
    assert_eq!(rw(&a, &qa, 10, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(rw(&a, &qa, 1, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(rw(&a, &qa, 2, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(a.ctx.stats().leased_ops, 1);
    let rkey = rb.mr.rkey();
    let live = b.ctx.nic_stats().live_mrs;
    let Buf { mr, region } = rb;
    let addr = mr.addr();
    drop(mr);
    assert!(
        b.ctx.nic_stats().live_mrs < live,
        "the lease's registration went"
    );
    la.bytes_mut().copy_from_slice(&s2);
    post(
        &qa,
        SendWr::new(3, Opcode::Write, Some(la.mr.sge(0, n)), addr, rkey),
    );
    let c = wait1(&a.cq);
    assert_eq!((c.wr_id, c.status), (3, 10), "REM_ACCESS_ERR: {c:?}");
    assert_eq!(
        &region.as_slice()[..LEN],
        &s1[..],
        "nothing written after dereg"
    );
}

/// A lease's key is valid on every QP of the device's PD: while a QP of
/// another application PD exists no lease is lent, and connecting it first
/// waits out the leases it could reach.
#[test]
fn a_qp_of_another_pd_waits_out_the_leases_it_could_reach() {
    let cfg = Config {
        lease_ms: 300,
        ..Config::default()
    };
    let Some((a, b, qa, _qb)) = connected(cfg) else {
        return;
    };
    const LEN: usize = 16 << 10;
    let src = pattern(25, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let lr = Buf::with(&a, LEN, None);
    let rb = Buf::with(&b, LEN, None);
    let n = LEN as u32;
    // A first WRITE of the pages; the next one is lent them.
    assert_eq!(rw(&a, &qa, 10, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(rw(&a, &qa, 1, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(b.ctx.stats().leases_granted, 1);
    let pd2 = b.ctx.alloc_pd();
    let q2 = pd2.create_qp(&b.cq, &b.rcq, 4).expect("qp of pd 2");
    assert_eq!(rw(&a, &qa, 2, Opcode::Read, &lr, &rb.mr, n), 0);
    assert_eq!(lr.bytes(), &src[..]);
    assert_eq!(
        b.ctx.stats().leases_granted,
        1,
        "no lease while a QP of another PD exists"
    );
    let qa2 = a.pd.create_qp(&a.cq, &a.rcq, 4).expect("peer of q2");
    let t = std::time::Instant::now();
    q2.connect(&qa2.endpoint()).expect("connect");
    let waited = t.elapsed();
    let sb = b.ctx.stats();
    assert_eq!(sb.leases_released, 1, "given back at its time: {sb:?}");
    assert!(
        waited >= std::time::Duration::from_millis(100),
        "{waited:?}"
    );
    // The initiator no longer uses it either: two-sided, and still right.
    let two = a.ctx.stats().two_sided;
    assert_eq!(rw(&a, &qa, 3, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(a.ctx.stats().two_sided, two + 1);
    assert_eq!(rb.bytes(), &src[..]);
}

/// Unmapping leased memory (the MR still registered) ends its leases too: the
/// pager tells the engine, which drops them without waiting on anything.
#[test]
fn unmapping_leased_memory_ends_its_leases() {
    let Some((a, b, qa, _qb)) = connected(Config::default()) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let src = pattern(26, LEN);
    let la = Buf::with(&a, LEN, Some(&src));
    let rb = Buf::with(&b, LEN, None);
    let n = LEN as u32;
    // A first WRITE of the pages; the next one is lent them.
    assert_eq!(rw(&a, &qa, 10, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(rw(&a, &qa, 1, Opcode::Write, &la, &rb.mr, n), 0);
    assert_eq!(b.ctx.stats().leases_granted, 1);
    let live = b.ctx.nic_stats().live_mrs;
    #[allow(unsafe_code)]
    // SAFETY: the test's own mapping, used by nothing after this but the
    // pager's unregistration at drop (which skips unmapped pages).
    let r = unsafe { libc::munmap(rb.addr() as *mut libc::c_void, LEN) };
    assert_eq!(r, 0);
    eventually("the lease's registration goes", || {
        b.ctx.nic_stats().live_mrs < live
    });
    drop(rb);
}

/// Small (inline) operations are lent their page when they come back to it:
/// the second small WRITE of a page asks and gets a lease, the third goes
/// one-sided; small operations scattered over many pages are never lent
/// anything (no registration each).
#[test]
fn small_operations_are_lent_a_page_they_come_back_to() {
    let Some((a, b, qa, _qb)) = connected(Config::default()) else {
        return;
    };
    const LEN: usize = 64 << 10;
    let mut la = Buf::with(&a, 4096, None);
    let lr = Buf::with(&a, 4096, None);
    let rb = Buf::with(&b, LEN, None);
    for (id, v) in [(1u64, 7u8), (2, 8), (3, 9)] {
        la.bytes_mut()[..8].fill(v);
        assert_eq!(rw(&a, &qa, id, Opcode::Write, &la, &rb.mr, 8), 0);
        assert_eq!(&rb.bytes()[..8], &[v; 8]);
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!((sa.leased_ops, sb.leases_granted), (1, 1), "{sa:?} {sb:?}");
    for id in 4..=6 {
        assert_eq!(rw(&a, &qa, id, Opcode::Read, &lr, &rb.mr, 8), 0);
        assert_eq!(&lr.bytes()[..8], &[9; 8]);
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!((sa.leased_ops, sb.leases_granted), (3, 2), "{sa:?} {sb:?}");
    // Fifteen other pages, once each: nothing lent.
    for p in 1..16u64 {
        post(
            &qa,
            SendWr::new(
                100 + p,
                Opcode::Write,
                Some(la.mr.sge(0, 8)),
                rb.addr() + p * 4096,
                rb.mr.rkey(),
            ),
        );
        ok(wait1(&a.cq), 100 + p);
    }
    assert_eq!(b.ctx.stats().leases_granted, 2);
}
