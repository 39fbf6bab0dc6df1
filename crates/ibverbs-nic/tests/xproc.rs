//! User-space mode across processes: the target is a child process (this
//! test binary re-executed) with its own libnprdma.so device, reached over
//! the software NIC's shared-memory transport through the libibverbs C ABI.
//! READ, WRITE and FETCH_ADD with the child's memory swapped out.

mod common;

use std::io::BufRead;
use std::time::Duration;

use ibverbs_nic::VerbsNic;
use nprdma::engine::Backend;
use nprdma::{Access, Config, Context, Cq, Mr, Opcode, Pd, Qp, SendWr};
use nprdma_test_support::child::{self, ep_of, ep_word, ChildProc};
use nprdma_test_support::{inspect, pattern, serve_checks};

const LEN: usize = 256 * 1024;
const CHILD_ENV: &str = "NPRDMA_IBVERBS_XPROC_CHILD";
const IOMMU_CHILD_ENV: &str = "NPRDMA_IBVERBS_XPROC_IOMMU_CHILD";

fn say(s: &str) {
    child::say(&mut std::io::stdout(), s);
}

/// The parent's end of a child test process: this binary re-executed with
/// `env` set, running only `test`, on the device library `lib`.
fn spawn(test: &str, env: &str, lib: &std::path::Path) -> ChildProc {
    let lib = [("NPRDMA_TEST_VERBS_LIB", lib.as_os_str())];
    ChildProc::spawn_with(test, env, &lib, Duration::from_secs(120))
}

/// A user-space context on the library at `lib`, with its pager.
fn context(lib: &std::path::Path) -> (vmem::Pager, Context<VerbsNic>) {
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 64 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let nic = VerbsNic::open(&common::config(lib)).expect("open");
    let ctx = Context::with_nic(nic, &pager, Config::default()).expect("context");
    (pager, ctx)
}

fn register<N: Backend>(pd: &Pd<N>, region: &vmem::Region) -> Mr<N> {
    let acc =
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // SAFETY: private anonymous pager memory; the MR is dropped before it.
    unsafe { pd.reg_mr(region.addr() as u64, LEN as u64, acc) }.expect("reg_mr")
}

/// A child's end of a connection to the parent.
struct ChildSide<N: Backend> {
    /// `LEN` bytes of the pattern (seed 42), registered as `mr`.
    region: vmem::Region,
    mr: Mr<N>,
    cq: Cq<N>,
    qp: Qp<N>,
    /// The parent's lines after its first.
    lines: std::io::Lines<std::io::StdinLock<'static>>,
    /// The parent's first line: its endpoint word, then what it adds.
    parent: Vec<String>,
}

/// Register the pattern region in `ctx`, tell the parent the QP's endpoint, the
/// region's address and rkey, and connect to the endpoint of the parent's answer.
fn child_side<N: Backend>(pager: &vmem::Pager, ctx: &Context<N>) -> ChildSide<N> {
    let mut region = pager.alloc(LEN).expect("alloc");
    region.as_mut_slice().copy_from_slice(&pattern(42, LEN));
    let pd = ctx.alloc_pd();
    let mr = register(&pd, &region);
    let cq = ctx.create_cq(64).expect("cq");
    let qp = pd.create_qp(&cq, &cq, 16).expect("qp");
    say(&format!(
        "{} {} {}",
        ep_word(&qp.endpoint()),
        region.addr(),
        mr.rkey()
    ));
    let mut lines = std::io::stdin().lock().lines();
    let l = lines.next().unwrap().unwrap();
    let parent: Vec<String> = l.split_whitespace().map(str::to_string).collect();
    qp.connect(&ep_of(&parent[0])).expect("connect");
    ChildSide {
        region,
        mr,
        cq,
        qp,
        lines,
        parent,
    }
}

/// The child: registers a pattern MR, swaps it out, serves until stdin
/// says `check <off> <len> <seed>`, `u64 <off>`, `swap` or `quit`.
fn child_main() {
    let lib = common::lib_path().expect("library (the parent found it)");
    let (pager, ctx) = context(&lib);
    let ChildSide {
        region,
        mr,
        cq: _cq,
        qp,
        lines,
        ..
    } = child_side(&pager, &ctx);
    region.swap_out().expect("swap out");
    say("ready");
    serve_checks(lines, &region);
    say(&format!("served {}", ctx.stats().served));
    drop((qp, mr));
}

#[test]
fn xproc_child() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_main();
    }
}

#[test]
fn user_space_mode_across_processes() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(lib) = common::lib_path() else {
        return;
    };
    let mut child = spawn("xproc_child", CHILD_ENV, &lib);
    let Parent {
        _pager,
        ctx,
        mut region,
        mr,
        cq,
        qp,
        raddr,
        rkey,
    } = Parent::connect(&lib, &mut child);
    assert_eq!(child.ask(&ep_word(&qp.endpoint())), "ready");
    let run = |w: SendWr| assert_eq!(run_one(&qp, &cq, w), 0);
    // READs of swapped-out memory: inline and reverse WRITE.
    let want = pattern(42, LEN);
    for (off, len) in [(100usize, 64usize), (8192, 20000)] {
        run(SendWr::new(
            1,
            Opcode::Read,
            Some(mr.sge(off as u64, len as u32)),
            raddr + off as u64,
            rkey,
        ));
        assert!(
            region.as_slice()[off..off + len] == want[off..off + len],
            "READ {off}+{len}"
        );
    }
    // WRITEs into swapped-out memory, checked by the child.
    assert_eq!(child.ask("swap"), "swapped");
    let mine = pattern(9, 65536);
    region.as_mut_slice()[..65536].copy_from_slice(&mine);
    region.swap_out().expect("swap out");
    run(SendWr::new(
        2,
        Opcode::Write,
        Some(mr.sge(0, 65536)),
        raddr + 65536,
        rkey,
    ));
    run(SendWr::new(
        3,
        Opcode::Write,
        Some(mr.sge(0, 100)),
        raddr + 200_000,
        rkey,
    ));
    assert_eq!(child.ask("check 65536 65536 9"), "ok");
    assert_eq!(child.ask("check 200000 100 9"), "ok");
    // An atomic on the child's CPU.
    let old = u64::from_le_bytes(want[131072..131080].try_into().unwrap());
    run(SendWr::new(
        4,
        Opcode::FetchAdd { add: 3 },
        Some(mr.sge(256, 8)),
        raddr + 131072,
        rkey,
    ));
    assert_eq!(region.as_slice()[256..264], old.to_le_bytes());
    assert_eq!(child.ask("u64 131072"), old.wrapping_add(3).to_string());
    let served = child.ask("quit");
    assert_eq!(
        served, "served 5",
        "the child served every operation two-sided"
    );
    assert!(child.finish(), "the child failed");
    assert_eq!(ctx.stats().optimistic_ok, 0);
    drop((qp, mr));
}

/// Post `w` on `qp` and wait for its one completion: its status.
fn run_one<N: Backend>(qp: &Qp<N>, cq: &Cq<N>, w: SendWr) -> u32 {
    qp.post_send(&[w]).map_err(|(_, e)| e).expect("post");
    let c = cq.poll_wait(1, Duration::from_secs(10));
    assert_eq!(c.len(), 1, "one completion per WR: {c:?}");
    c[0].status
}

/// The parent's user-space host: its context on `lib`, a pattern-filled
/// region registered whole, and a QP connected to the child's, whose first
/// line gave its endpoint, region address and rkey.
struct Parent {
    _pager: vmem::Pager,
    ctx: Context<VerbsNic>,
    region: vmem::Region,
    mr: Mr<VerbsNic>,
    cq: Cq<VerbsNic>,
    qp: Qp<VerbsNic>,
    raddr: u64,
    rkey: u32,
}

impl Parent {
    fn connect(lib: &std::path::Path, child: &mut ChildProc) -> Parent {
        let first = child.read_line();
        let w: Vec<&str> = first.split_whitespace().collect();
        let (raddr, rkey): (u64, u32) = (w[1].parse().unwrap(), w[2].parse().unwrap());
        let (pager, ctx) = context(lib);
        let mut region = pager.alloc(LEN).expect("alloc");
        region.as_mut_slice().copy_from_slice(&pattern(7, LEN));
        let pd = ctx.alloc_pd();
        let mr = register(&pd, &region);
        let cq = ctx.create_cq(64).expect("cq");
        let qp = pd.create_qp(&cq, &cq, 16).expect("qp");
        qp.connect(&ep_of(w[0])).expect("connect");
        Parent {
            _pager: pager,
            ctx,
            region,
            mr,
            cq,
            qp,
            raddr,
            rkey,
        }
    }
}

/// The IOMMU-mode child of the interoperability test: NP-RDMA on the software
/// NIC with IOMMU control (the kernel-module mode), its memory swapped out. It
/// serves the parent's requests and, on `read`/`write` lines, sends its own to
/// the parent's user-space host.
fn iommu_child_main() {
    let host = rnic::Host::new(rnic::HostConfig::default()).expect("host");
    let pager = vmem::Pager::new(vmem::PagerConfig {
        swap_size: 64 << 20,
        ..vmem::PagerConfig::default()
    })
    .expect("pager");
    let ctx = Context::new(&host, &pager, Config::default()).expect("IOMMU-mode context");
    let ChildSide {
        region,
        mr,
        cq,
        qp,
        lines,
        parent,
    } = child_side(&pager, &ctx);
    let (praddr, prkey): (u64, u32) = (parent[1].parse().unwrap(), parent[2].parse().unwrap());
    region.swap_out().expect("swap out");
    say("ready");
    for l in lines {
        let l = l.unwrap();
        let w: Vec<&str> = l.split_whitespace().collect();
        let num = |i: usize| -> u64 { w[i].parse().unwrap() };
        if let Some(a) = inspect(&region, &w) {
            say(&a);
            continue;
        }
        match w.as_slice() {
            // Our READ of the parent's memory at `roff` into ours at `loff`.
            ["read", _, _, _] => {
                let (roff, len, loff) = (num(1), num(2) as u32, num(3));
                let wr = SendWr::new(
                    9,
                    Opcode::Read,
                    Some(mr.sge(loff, len)),
                    praddr + roff,
                    prkey,
                );
                say(&format!("status {}", run_one(&qp, &cq, wr)));
            }
            // Our WRITE of ours at `loff` into the parent's memory at `roff`.
            ["write", _, _, _] => {
                let (loff, len, roff) = (num(1), num(2) as u32, num(3));
                let wr = SendWr::new(
                    9,
                    Opcode::Write,
                    Some(mr.sge(loff, len)),
                    praddr + roff,
                    prkey,
                );
                say(&format!("status {}", run_one(&qp, &cq, wr)));
            }
            _ => break,
        }
    }
    let s = ctx.stats();
    say(&format!(
        "stats {} {} {} {}",
        s.served,
        s.two_sided,
        s.optimistic_ok,
        ctx.nic_stats().nonresident_dma
    ));
    drop((qp, mr));
}

#[test]
fn xproc_iommu_child() {
    if std::env::var_os(IOMMU_CHILD_ENV).is_some() {
        iommu_child_main();
    }
}

/// Interoperability across processes (issue 14, item 7): a user-space host
/// (this process: NP-RDMA over libibverbs, here libnprdma.so's software NIC in
/// pinned mode) and a host in IOMMU mode (a child process: NP-RDMA on the
/// software NIC with IOMMU control) speak one control protocol, both ways,
/// with both sides' memory swapped out. The IOMMU host learns from the
/// user-space host's key mapping that nothing of it is reachable one-sided and
/// goes two-sided; the user-space host's requests are served by the IOMMU
/// host like any two-sided request.
#[test]
fn user_space_host_and_iommu_host_across_processes() {
    if std::env::var_os(CHILD_ENV).is_some() || std::env::var_os(IOMMU_CHILD_ENV).is_some() {
        return;
    }
    let Some(lib) = common::lib_path() else {
        return;
    };
    let mut child = spawn("xproc_iommu_child", IOMMU_CHILD_ENV, &lib);
    let Parent {
        _pager,
        ctx,
        mut region,
        mr,
        cq,
        qp,
        raddr,
        rkey,
    } = Parent::connect(&lib, &mut child);
    assert_eq!(
        child.ask(&format!(
            "{} {} {}",
            ep_word(&qp.endpoint()),
            region.addr(),
            mr.rkey()
        )),
        "ready"
    );
    region.swap_out().expect("swap out");
    let theirs = pattern(42, LEN);
    // Ours to theirs: READ (inline and reverse WRITE), WRITE, FETCH_ADD.
    for (off, len) in [(100usize, 64usize), (8192, 20000)] {
        let wr = SendWr::new(
            1,
            Opcode::Read,
            Some(mr.sge(off as u64, len as u32)),
            raddr + off as u64,
            rkey,
        );
        assert_eq!(run_one(&qp, &cq, wr), 0, "READ {off}+{len}");
        assert!(region.as_slice()[off..off + len] == theirs[off..off + len]);
    }
    let mine = pattern(9, 65536);
    region.as_mut_slice()[..65536].copy_from_slice(&mine);
    region.swap_out().expect("swap out");
    for (len, roff) in [(65536u32, 65536u64), (100, 200_000)] {
        let wr = SendWr::new(2, Opcode::Write, Some(mr.sge(0, len)), raddr + roff, rkey);
        assert_eq!(run_one(&qp, &cq, wr), 0, "WRITE {len} B");
        assert_eq!(
            child.ask(&format!("check {roff} {len} 9")),
            "ok",
            "WRITE {len} B landed"
        );
    }
    let old = u64::from_le_bytes(theirs[131072..131080].try_into().unwrap());
    let wr = SendWr::new(
        3,
        Opcode::FetchAdd { add: 3 },
        Some(mr.sge(70_000, 8)),
        raddr + 131072,
        rkey,
    );
    assert_eq!(run_one(&qp, &cq, wr), 0, "FETCH_ADD");
    assert_eq!(region.as_slice()[70_000..70_008], old.to_le_bytes());
    assert_eq!(child.ask("u64 131072"), old.wrapping_add(3).to_string());
    // Theirs to ours, into our swapped-out memory: READ (small and large), WRITE.
    region.swap_out().expect("swap out");
    assert_eq!(child.ask("read 0 64 1000"), "status 0");
    assert_eq!(
        child.ask("check 1000 64 9"),
        "ok",
        "their small READ of our memory"
    );
    assert_eq!(child.ask("read 0 30000 100000"), "status 0");
    assert_eq!(
        child.ask("check 100000 30000 9"),
        "ok",
        "their large READ of our memory"
    );
    assert_eq!(child.ask("write 8192 5000 150000"), "status 0");
    assert!(
        region.as_slice()[150_000..155_000] == theirs[8192..13192],
        "their WRITE into our memory"
    );
    // A key we never registered is refused by the target, both ways.
    let wr = SendWr::new(4, Opcode::Read, Some(mr.sge(0, 8)), raddr, rkey ^ 0x5a5a);
    assert_ne!(run_one(&qp, &cq, wr), 0, "a bad rkey is refused");
    let w: Vec<u64> = child
        .ask("quit")
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    let (served, two_sided, optimistic_ok, nonresident_dma) = (w[0], w[1], w[2], w[3]);
    assert!(
        served >= 5,
        "the IOMMU host served our requests two-sided: {w:?}"
    );
    assert_eq!(
        (two_sided, optimistic_ok),
        (3, 0),
        "its requests to a user-space host went two-sided"
    );
    assert_eq!(nonresident_dma, 0);
    assert!(child.finish(), "the child failed");
    let s = ctx.stats();
    assert_eq!(s.optimistic_ok, 0, "{s:?}");
    assert!(s.served >= 3, "we served the IOMMU host's requests: {s:?}");
    drop((qp, mr));
}
