//! Micro-benchmark of the NP-RDMA pieces on the initiator's hot path: the
//! per-atom read check, read-back compare, version compare, local pre-check,
//! control-message encode/decode and the ordering table — each next to a
//! baseline measured in the same run (memcpy of the same bytes, a naive
//! full-scan magic check).
//!
//! Run: `cargo run --release -p nprdma --example check_bench`

use std::hint::black_box;
use std::time::{Duration, Instant};

use nprdma::check::{check_read, check_readback, check_versions, precheck_local, CheckConfig};
use nprdma::ctrl::{CtrlConfig, FaultKind, FaultRequest, Repr};
use nprdma::ordering::{Admit, OpDesc, OrderConfig, OrderTable, Range};

/// Median ns per call of `f` over several timed batches.
fn time(mut f: impl FnMut()) -> f64 {
    // Calibrate a batch of ~2 ms.
    let mut n = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        if t.elapsed() > Duration::from_millis(2) {
            break;
        }
        n *= 2;
    }
    let mut v: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Compare every aligned u32 against the magic (what a check without the
/// per-atom argument would have to do).
fn naive_full_scan(data: &[u8], magic: u32) -> bool {
    data.chunks_exact(4)
        .any(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) == magic)
}

fn main() {
    let cfg = CheckConfig::default();
    println!(
        "# nprdma check_bench (atom {} B, page {} B)",
        cfg.atom(),
        cfg.page_size()
    );
    println!(
        "{:<28} {:>10} {:>12} {:>12} {:>12}",
        "what", "size", "ns/op", "GB/s", "baseline"
    );
    for &size in &[64usize, 4096, 65536, 1 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i as u8) & 0x7f).collect();
        // Destination offset by 64 B so src and dst do not 4K-alias.
        let mut dst_buf = vec![1u8; size + 64];
        let dst = &mut dst_buf[64..];
        let t_memcpy = time(|| {
            dst.copy_from_slice(black_box(&data));
            black_box(&dst);
        });
        let t_naive = time(|| {
            black_box(naive_full_scan(black_box(&data), cfg.magic()));
        });
        let t_check = time(|| {
            black_box(check_read(black_box(&data), 0x10_0010, 0x20_0100, &cfg)).ok();
        });
        let gbs = |ns: f64| size as f64 / ns;
        println!(
            "{:<28} {:>10} {:>12.1} {:>12.2} {:>12}",
            "check_read (per atom)",
            size,
            t_check,
            gbs(t_check),
            format!("memcpy {:.2} GB/s", gbs(t_memcpy))
        );
        println!(
            "{:<28} {:>10} {:>12.1} {:>12.2} {:>12}",
            "naive full-scan check",
            size,
            t_naive,
            gbs(t_naive),
            ""
        );
        if size <= 65536 {
            let rb = data.clone();
            let t_rb = time(|| {
                black_box(check_readback(
                    black_box(&data),
                    black_box(&rb),
                    0x20_0100,
                    &cfg,
                ))
                .ok();
            });
            println!(
                "{:<28} {:>10} {:>12.1} {:>12.2}",
                "check_readback",
                size,
                t_rb,
                gbs(t_rb)
            );
        }
    }
    // Version compare and local pre-check, per page.
    let pages = 256usize;
    let v: Vec<u32> = (0..pages as u32).map(|i| 2 * i + 1).collect();
    let w = v.clone();
    let t_ver = time(|| {
        black_box(check_versions(black_box(&v), black_box(&w))).ok();
    });
    println!(
        "check_versions: {:.2} ns/page ({} pages)",
        t_ver / pages as f64,
        pages
    );
    let resident = vec![true; pages];
    let t_pre = time(|| {
        black_box(precheck_local(
            0x10_0000,
            (pages * 4096) as u64,
            4096,
            |p| resident[((p - 0x10_0000) / 4096) as usize],
        ))
        .ok();
    });
    println!(
        "precheck_local: {:.2} ns/page ({} pages)",
        t_pre / pages as f64,
        pages
    );

    // Control message encode + decode.
    let ccfg = CtrlConfig::default();
    let msg = Repr::Fault(FaultRequest {
        req_id: 1,
        kind: FaultKind::Read,
        local_addr: 0x1000,
        local_key: 2,
        remote_addr: 0x2000,
        rkey: 3,
        len: 4096,
        inline_ok: true,
        retry_mode: false,
    });
    let mut buf = [0u8; 64];
    let t_ctrl = time(|| {
        black_box(&msg).emit(&mut buf, &ccfg).unwrap();
        black_box(Repr::parse_bytes(black_box(&buf), &ccfg).unwrap());
    });
    println!("ctrl FaultRequest emit+parse: {t_ctrl:.1} ns");

    // Ordering: submit + complete with 16 non-conflicting ops in flight.
    let mut table: OrderTable<u64> = OrderTable::new(OrderConfig::default());
    let mut ring = std::collections::VecDeque::new();
    for i in 0..16u64 {
        if let Admit::Issue(t, _) = table
            .submit(
                OpDesc::read(Range::new(i * 64, 64), Range::new(i * 64, 64)),
                i,
            )
            .unwrap()
        {
            ring.push_back(t);
        }
    }
    let mut i = 16u64;
    let t_ord = time(|| {
        let t = ring.pop_front().unwrap();
        for (rt, _) in table.complete(t).unwrap() {
            ring.push_back(rt);
        }
        let k = i % 64;
        if let Admit::Issue(t, _) = table
            .submit(
                OpDesc::write(Range::new(k * 64, 64), Range::new(k * 64 + 8192, 64)),
                i,
            )
            .unwrap()
        {
            ring.push_back(t);
        }
        i += 1;
    });
    println!(
        "ordering submit+complete (~16 in flight): {t_ord:.1} ns (in flight at end: {}, parked: {})",
        table.inflight_len(),
        table.parked_len()
    );
}
