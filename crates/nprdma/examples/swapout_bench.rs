//! Benchmark of the swap-out of a page registered with NP-RDMA (its swap-out
//! listener remaps both IOVA views, bumps the page version and flushes the
//! IOMMU) next to the swap-out of a page nobody registered, in the same run,
//! one page at a time and in batches of 64 pages. Prints per-page medians
//! (min / median / max over rounds) for each swap device mode.
//!
//! Run: `cargo run --release -p nprdma --example swapout_bench [rounds]`

use std::time::Instant;

use nprdma::{Access, Config, Context};

const PAGE: usize = vmem::PAGE_SIZE;
/// Pages swapped out per round and mode.
const PAGES: usize = 512;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per-page µs (median over the pages, or over the batches) of swapping out
/// `PAGES` resident pages of a fresh region, `batch` pages per call;
/// registered with NP-RDMA if `pd` is given.
fn swap_out_per_page(pager: &vmem::Pager, pd: Option<&nprdma::Pd>, batch: usize) -> f64 {
    let len = PAGES * PAGE;
    let mut reg = pager.alloc(len).expect("alloc");
    reg.as_mut_slice().fill(7);
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    // SAFETY: pager-allocated private anonymous memory that outlives the MR
    // (dropped explicitly below, before the region).
    #[allow(unsafe_code)]
    let mr = pd.map(|pd| unsafe { pd.reg_mr(reg.addr() as u64, len as u64, acc) }.expect("reg_mr"));
    let mut v = Vec::new();
    for k in (0..PAGES).step_by(batch) {
        let t = Instant::now();
        let n = pager
            .swap_out(reg.addr() + k * PAGE, batch * PAGE)
            .expect("swap_out");
        let us = t.elapsed().as_secs_f64() * 1e6;
        assert_eq!(n, batch, "pages swapped out");
        v.push(us / batch as f64);
    }
    drop(mr);
    drop(reg);
    median(&mut v)
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    for o_direct in [true, false] {
        let pager = vmem::Pager::new(vmem::PagerConfig {
            swap_size: 256 << 20,
            o_direct,
            ..Default::default()
        })
        .expect("pager");
        let host = rnic::Host::new(rnic::HostConfig::default()).expect("host");
        let ctx = Context::new(&host, &pager, Config::default()).expect("context");
        let pd = ctx.alloc_pd();
        println!("swap device: {:?}", pager.swap_io());
        println!("| batch | unregistered µs/page | NP-RDMA µs/page | added µs/page |");
        println!("|---|---|---|---|");
        for batch in [1usize, 64] {
            let (mut plain, mut np, mut add) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                // Alternate, so drift hits both the same way.
                let p = swap_out_per_page(&pager, None, batch);
                let n = swap_out_per_page(&pager, Some(&pd), batch);
                plain.push(p);
                np.push(n);
                add.push(n - p);
            }
            let mmm = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                format!(
                    "{:.2} / {:.2} / {:.2}",
                    v[0],
                    v[v.len() / 2],
                    v[v.len() - 1]
                )
            };
            println!(
                "| {batch} | {} | {} | {} |",
                mmm(&mut plain),
                mmm(&mut np),
                mmm(&mut add)
            );
        }
        println!();
    }
}
