//! perftest-like text tables and JSON lines for perf results.

use crate::perf::PerfResult;
use crate::spec::Test;

/// The table header for latency or bandwidth rows.
pub fn header(test: Test) -> String {
    match test {
        Test::Lat => format!(
            "{:>10} {:>11} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10}",
            "#bytes",
            "#iterations",
            "t_min[us]",
            "t_typical[us]",
            "t_avg[us]",
            "p99[us]",
            "p99.9[us]",
            "t_max[us]"
        ),
        Test::Bw => format!(
            "{:>10} {:>11} {:>16} {:>12}",
            "#bytes", "#iterations", "BW average[GB/s]", "MsgRate[Mpps]"
        ),
    }
}

/// One table row.
pub fn row(r: &PerfResult) -> String {
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    match r.test {
        Test::Lat => format!(
            "{:>10} {:>11} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10}",
            r.bytes,
            r.iterations,
            f(r.t_min_us),
            f(r.t_typical_us),
            f(r.t_avg_us),
            f(r.p99_us),
            f(r.p99_9_us),
            f(r.t_max_us)
        ),
        Test::Bw => format!(
            "{:>10} {:>11} {:>16} {:>12}",
            r.bytes,
            r.iterations,
            r.bw_avg_gbps.map_or("-".into(), |v| format!("{v:.3}")),
            r.mops.map_or("-".into(), |v| format!("{v:.6}"))
        ),
    }
}

/// The banner printed above a table.
pub fn banner(r: &PerfResult) -> String {
    let pinned_note = if r.mode == crate::spec::Mode::Pinned && r.fault != crate::spec::Fault::None
    {
        " (pinned memory cannot fault: pinned reference)"
    } else {
        ""
    };
    let swap = r
        .swap_io
        .as_ref()
        .map_or(String::new(), |s| format!(", swap {s}"));
    format!(
        "# {} {} test, mode {}, fault {}{}{}, transport {}, tx-depth {}, signal every {}",
        r.op.name().to_uppercase(),
        match r.test {
            Test::Lat => "latency",
            Test::Bw => "bandwidth",
        },
        r.mode_label,
        r.fault.name(),
        pinned_note,
        swap,
        r.transport,
        r.tx_depth,
        r.signal_every
    )
}

/// The line printed under a major-fault row: the swap device's own 4 KiB read
/// latency and IOPS, measured in the same run on the same swap file.
pub fn device_line(r: &PerfResult) -> Option<String> {
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    if let Some(e) = &r.device_error {
        return Some(format!("# device baseline not measured: {e}"));
    }
    r.device_read_4k_us?;
    Some(format!(
        "# device (swap file, O_DIRECT 4 KiB random reads, same run): median {} us (min {}, max {}; polled for: median {} us), {:.0} IOPS at depth 1; {:.0} IOPS at depth {} (median {} us)",
        f(r.device_read_4k_us),
        f(r.device_read_4k_min_us),
        f(r.device_read_4k_max_us),
        f(r.device_read_4k_polled_us),
        r.device_iops.unwrap_or(0.0),
        r.device_iops_at_depth.unwrap_or(0.0),
        r.device_depth.unwrap_or(0),
        f(r.device_read_4k_at_depth_us),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Fault, Mode, Op};

    fn sample(test: Test) -> PerfResult {
        let lat = test == Test::Lat;
        PerfResult {
            op: Op::Read,
            mode: Mode::Pinned,
            mode_label: "pinned RDMA".into(),
            fault: Fault::None,
            test,
            transport: "inproc".into(),
            bytes: 64,
            iterations: 10,
            tx_depth: 1,
            signal_every: 1,
            t_min_us: lat.then_some(1.0),
            t_typical_us: lat.then_some(1.5),
            t_avg_us: lat.then_some(1.6),
            p99_us: lat.then_some(2.0),
            p99_9_us: lat.then_some(2.5),
            t_max_us: lat.then_some(3.0),
            bw_avg_gbps: (!lat).then_some(1.25),
            mops: (!lat).then_some(0.5),
            fault_pages_prepared: 0,
            target_minor_faults: 0,
            target_major_faults: 0,
            np_optimistic_ok: None,
            np_two_sided: None,
            nonresident_dma: 0,
            swap_io: None,
            device_read_4k_us: None,
            device_read_4k_min_us: None,
            device_read_4k_max_us: None,
            device_read_4k_polled_us: None,
            device_iops: None,
            device_depth: None,
            device_iops_at_depth: None,
            device_read_4k_at_depth_us: None,
            device_error: None,
        }
    }

    #[test]
    fn lat_row_has_all_columns() {
        let r = sample(Test::Lat);
        let cols: Vec<_> = row(&r).split_whitespace().map(String::from).collect();
        assert_eq!(
            cols,
            ["64", "10", "1.00", "1.50", "1.60", "2.00", "2.50", "3.00"]
        );
        assert_eq!(header(Test::Lat).split_whitespace().count(), 8);
        assert!(r.all_finite());
    }

    #[test]
    fn bw_row_and_json_round_trip() {
        let r = sample(Test::Bw);
        let cols: Vec<_> = row(&r).split_whitespace().map(String::from).collect();
        assert_eq!(cols, ["64", "10", "1.250", "0.500000"]);
        let j = serde_json::to_string(&r).unwrap();
        let back: PerfResult = serde_json::from_str(&j).unwrap();
        assert_eq!(back, r);
        assert!(j.contains("\"bw_avg_gbps\":1.25"));
    }

    #[test]
    fn device_baseline_line_and_json() {
        let mut r = sample(Test::Lat);
        assert_eq!(device_line(&r), None, "no baseline, no line");
        assert!(!banner(&r).contains("swap"));
        r.fault = Fault::Major;
        r.mode = Mode::Nprdma;
        r.swap_io = Some("O_DIRECT".into());
        r.device_read_4k_us = Some(45.5);
        r.device_read_4k_min_us = Some(30.25);
        r.device_read_4k_max_us = Some(900.0);
        r.device_read_4k_polled_us = Some(41.75);
        r.device_iops = Some(20000.0);
        r.device_depth = Some(16);
        r.device_iops_at_depth = Some(50000.0);
        r.device_read_4k_at_depth_us = Some(300.0);
        let l = device_line(&r).unwrap();
        for want in [
            "45.50",
            "30.25",
            "900.00",
            "polled for: median 41.75",
            "20000 IOPS",
            "50000 IOPS at depth 16",
        ] {
            assert!(l.contains(want), "{want} in {l}");
        }
        assert!(banner(&r).contains("swap O_DIRECT"));
        let j = serde_json::to_string(&r).unwrap();
        assert!(j.contains("\"device_read_4k_us\":45.5"));
        assert!(j.contains("\"device_iops_at_depth\":50000.0"));
        let back: PerfResult = serde_json::from_str(&j).unwrap();
        assert_eq!(back, r);
        r.device_error = Some("swap device full".into());
        assert!(device_line(&r)
            .unwrap()
            .contains("not measured: swap device full"));
    }

    #[test]
    fn non_finite_is_detected() {
        let mut r = sample(Test::Lat);
        r.t_avg_us = Some(f64::NAN);
        assert!(!r.all_finite());
    }
}
