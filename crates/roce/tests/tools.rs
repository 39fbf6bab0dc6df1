//! Independent tools read this crate's bytes: one packet of every valid (class, opcode)
//! pair over IPv4 and over IPv6 (plus NAK and RNR NAK ACKs), written as a pcap file, is
//! dissected by Wireshark (`tshark`: no malformed packet, no expert error, every packet
//! InfiniBand with the opcode, destination QP, PSN and ICRC we wrote, in order) and its
//! ICRCs are recomputed by scapy's RoCE layer (`tests/icrc_scapy.py`).
//!
//! Needs Debian's `tshark` and `python3-scapy`; without them the tests skip (and fail in
//! CI: `test_support::skip`).

mod common;

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;

use roce::aeth::{AethRepr, NakCode, Syndrome};
use roce::atomic_ack_eth::AtomicAckEthRepr;
use roce::atomic_eth::AtomicEthRepr;
use roce::bth::{BthRepr, MAX_24};
use roce::deth::DethRepr;
use roce::exts::ExtHeaders;
use roce::ieth::IethRepr;
use roce::immdt::ImmDtRepr;
use roce::ip::IpRepr;
use roce::ipv4::Ipv4Repr;
use roce::ipv6::Ipv6Repr;
use roce::opcode::{Direction, Ext, Op, Opcode, Position};
use roce::packet::{self, pad_for, Repr};
use roce::reth::RethRepr;
use roce::udp::UdpRepr;
use test_support::skip::skip;

/// The Debian python3 scapy is installed for (not a `PATH` shim such as pyenv's).
const PYTHON: &str = "/usr/bin/python3";

/// One packet written to the capture, with what the tools must find in it.
struct Written {
    bytes: Vec<u8>,
    repr: Repr,
}

fn ip(v6: bool, ident: u16) -> IpRepr {
    if v6 {
        IpRepr::V6(Ipv6Repr {
            src: Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 1),
            dst: Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 2),
            traffic_class: 0x02, // ECT(0)
            flow_label: 0x3_a5c1,
            hop_limit: 64,
        })
    } else {
        IpRepr::V4(Ipv4Repr {
            src: Ipv4Addr::new(192, 168, 50, 1),
            dst: Ipv4Addr::new(192, 168, 50, 2),
            tos: 0x02, // ECT(0)
            ttl: 64,
            ident,
            dont_frag: true,
        })
    }
}

/// A realistic packet of `opcode`, the `idx`-th of the capture.
fn build(opcode: Opcode, v6: bool, idx: u32, aeth: AethRepr) -> Written {
    let info = opcode.info();
    let op = opcode.op();
    let payload_len = if !info.payload {
        0
    } else {
        match info.position {
            Position::First | Position::Middle => 1024,
            Position::Last => 1021, // pad 3
            Position::Only => match op {
                Op::SendOnly | Op::RdmaWriteOnly | Op::RdmaReadResponseOnly => 4096,
                _ => 37, // pad 3
            },
        }
    };
    let va = 0x7f3a_1c00_0000 + u64::from(idx) * 0x1000;
    let reth = RethRepr {
        va,
        rkey: 0x0012_3a07,
        dma_len: match op {
            Op::RdmaWriteFirst => 3 * 1024 - 3,
            Op::RdmaReadRequest => 8192,
            _ => payload_len as u32,
        },
    };
    let imm = ImmDtRepr { imm: 0x1234_abcd };
    let deth = DethRepr {
        qkey: 0x1111_1111,
        src_qp: 0x00_01a3,
    };
    let exts = match info.headers {
        [] => ExtHeaders::None,
        [Ext::ImmDt] => ExtHeaders::ImmDt(imm),
        [Ext::Ieth] => ExtHeaders::Ieth(IethRepr { rkey: 0x00c0_ffee }),
        [Ext::Reth] => ExtHeaders::Reth(reth),
        [Ext::Reth, Ext::ImmDt] => ExtHeaders::RethImmDt(reth, imm),
        [Ext::Aeth] => ExtHeaders::Aeth(aeth),
        [Ext::Aeth, Ext::AtomicAckEth] => ExtHeaders::AethAtomicAck(
            aeth,
            AtomicAckEthRepr {
                orig: 0x0000_0000_0000_2a2a,
            },
        ),
        [Ext::AtomicEth] => ExtHeaders::AtomicEth(AtomicEthRepr {
            va: va + 8,
            rkey: 0x0012_3a07,
            swap_add: if op == Op::FetchAdd { 1 } else { 0xdead },
            compare: if op == Op::FetchAdd { 0 } else { 0x2a2a },
        }),
        [Ext::Deth] => ExtHeaders::Deth(deth),
        [Ext::Deth, Ext::ImmDt] => ExtHeaders::DethImmDt(deth, imm),
        other => panic!("unknown layout {other:?}"),
    };
    let request = info.direction == Direction::Request;
    let ends = matches!(info.position, Position::Last | Position::Only);
    let repr = Repr {
        ip: ip(v6, idx as u16),
        udp: UdpRepr {
            src_port: 0xc000 | (idx as u16 & 0x3fff),
        },
        bth: BthRepr {
            opcode,
            solicited: matches!(
                op,
                Op::SendLastWithImmediate
                    | Op::SendOnlyWithImmediate
                    | Op::RdmaWriteLastWithImmediate
                    | Op::RdmaWriteOnlyWithImmediate
            ),
            mig_req: false,
            pad_count: pad_for(payload_len),
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: 0x00_0100 + idx,
            ack_req: request && ends,
            psn: (0x00ff_fff0 + idx * 0x101) & MAX_24, // wraps past 2^24 - 1
        },
        exts,
        payload_len,
    };
    let payload: Vec<u8> = (0..payload_len)
        .map(|k| (k as u32 * 7 + idx) as u8)
        .collect();
    let mut bytes = vec![0u8; packet::buffer_len(&repr)];
    packet::emit(&repr, &payload, &mut bytes).expect("emit");
    assert_eq!(packet::parse(&bytes).map(|(r, _)| r), Ok(repr));
    Written { bytes, repr }
}

/// Every valid opcode over IPv4, then over IPv6, then two more ACKs (NAK, RNR NAK).
fn capture() -> Vec<Written> {
    let mut out = Vec::new();
    let ack = AethRepr {
        syndrome: Syndrome::Ack { credit: 0x1f },
        msn: 0x00_0042,
    };
    for v6 in [false, true] {
        for op in Opcode::all() {
            let idx = out.len() as u32;
            out.push(build(op, v6, idx, ack));
        }
    }
    let rc_ack = Opcode::all()
        .find(|o| o.op() == Op::Acknowledge)
        .expect("RC ACK");
    for (v6, syndrome) in [
        (false, Syndrome::Nak(NakCode::PsnSequenceError)),
        (true, Syndrome::RnrNak { timer: 14 }),
    ] {
        let idx = out.len() as u32;
        out.push(build(rc_ack, v6, idx, AethRepr { syndrome, msn: 7 }));
    }
    let pads = out.iter().filter(|w| w.repr.bth.pad_count > 0).count();
    let full = out.iter().filter(|w| w.repr.payload_len == 4096).count();
    assert!(
        pads > 0 && full > 0,
        "pads {pads}, 4096-byte payloads {full}"
    );
    out
}

/// A fresh directory for this test's files.
fn scratch(name: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("roce-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Removes `dir`, unless `ROCE_KEEP_PCAP` is set (to look at the capture by hand).
fn cleanup(dir: &Path) {
    if std::env::var_os("ROCE_KEEP_PCAP").is_none() {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        eprintln!("kept {}", dir.display());
    }
}

fn write_capture(dir: &Path, packets: &[Written]) -> PathBuf {
    let path = dir.join("roce.pcap");
    let mut f = std::fs::File::create(&path).expect("pcap file");
    let bytes: Vec<Vec<u8>> = packets.iter().map(|w| w.bytes.clone()).collect();
    common::write_pcap(&mut f, &bytes).expect("write pcap");
    path
}

/// `tshark` with `args`, or `None` (after a skip) if it cannot run.
fn tshark(args: &[&str]) -> Option<String> {
    let out = match Command::new("tshark").args(args).output() {
        Ok(o) => o,
        Err(e) => {
            skip(format!(
                "tshark not runnable ({e}): install Debian package tshark"
            ));
            return None;
        }
    };
    assert!(
        out.status.success(),
        "tshark {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).expect("tshark output is UTF-8"))
}

/// A tshark field value: decimal or `0x` hex.
fn num(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .unwrap_or_else(|e| panic!("field value {s:?}: {e}"))
}

/// The Wireshark fields compared, after `frame.protocols`.
const FIELDS: &[&str] = &[
    "ip.checksum.status",
    "udp.checksum.status",
    "infiniband.bth.opcode",
    "infiniband.bth.se",
    "infiniband.bth.padcnt",
    "infiniband.bth.p_key",
    "infiniband.bth.destqp",
    "infiniband.bth.a",
    "infiniband.bth.psn",
    "infiniband.reth.va",
    "infiniband.reth.r_key",
    "infiniband.reth.dmalen",
    "infiniband.aeth.syndrome",
    "infiniband.aeth.msn",
    "infiniband.deth.q_key",
    "infiniband.deth.srcqp",
    "infiniband.atomiceth.swapdt",
    "infiniband.atomiceth.cmpdt",
    "infiniband.atomicacketh.origremdt",
    "infiniband.immdt",
    "infiniband.ieth",
    "infiniband.invariant.crc",
];

/// Wireshark's checksum status values (`proto_checksum_enum_e`).
const CHECKSUM_GOOD: u64 = 1;
const CHECKSUM_NOT_PRESENT: u64 = 3;

/// What each of [`FIELDS`] must show for `w`: a number, 4 bytes as hex, or nothing.
#[derive(Debug, PartialEq)]
enum Want {
    Num(u64),
    Hex(u32),
    Absent,
}

fn wanted(w: &Written) -> Vec<Want> {
    use Want::{Absent, Hex, Num};
    let r = &w.repr;
    let b = &r.bth;
    let v4 = matches!(r.ip, IpRepr::V4(_));
    let n = w.bytes.len();
    // Wireshark shows the ICRC's four bytes read big-endian; it does not verify it.
    let icrc_shown = u32::from_be_bytes([
        w.bytes[n - 4],
        w.bytes[n - 3],
        w.bytes[n - 2],
        w.bytes[n - 1],
    ]);
    let (mut reth, mut aeth, mut deth, mut atomic, mut orig, mut imm, mut ieth) =
        (None, None, None, None, None, None, None);
    match r.exts {
        ExtHeaders::None => {}
        ExtHeaders::ImmDt(i) => imm = Some(i),
        ExtHeaders::Ieth(i) => ieth = Some(i),
        ExtHeaders::Reth(x) => reth = Some(x),
        ExtHeaders::RethImmDt(x, i) => (reth, imm) = (Some(x), Some(i)),
        ExtHeaders::Aeth(a) => aeth = Some(a),
        ExtHeaders::AethAtomicAck(a, o) => (aeth, orig) = (Some(a), Some(o)),
        ExtHeaders::AtomicEth(a) => atomic = Some(a),
        ExtHeaders::Deth(d) => deth = Some(d),
        ExtHeaders::DethImmDt(d, i) => (deth, imm) = (Some(d), Some(i)),
    }
    let opt = |v: Option<u64>| v.map_or(Absent, Num);
    vec![
        if v4 { Num(CHECKSUM_GOOD) } else { Absent },
        Num(if v4 {
            CHECKSUM_NOT_PRESENT
        } else {
            CHECKSUM_GOOD
        }),
        Num(u64::from(b.opcode.byte())),
        Num(u64::from(b.solicited)),
        Num(u64::from(b.pad_count)),
        Num(u64::from(b.pkey)),
        Num(u64::from(b.dest_qp)),
        Num(u64::from(b.ack_req)),
        Num(u64::from(b.psn)),
        // Wireshark shows an AtomicETH's address and R_Key in the RETH's fields.
        opt(reth.map(|x| x.va).or(atomic.map(|a| a.va))),
        opt(reth
            .map(|x| u64::from(x.rkey))
            .or(atomic.map(|a| u64::from(a.rkey)))),
        opt(reth.map(|x| u64::from(x.dma_len))),
        opt(aeth.map(|a| u64::from(a.syndrome.byte()))),
        opt(aeth.map(|a| u64::from(a.msn))),
        opt(deth.map(|d| u64::from(d.qkey))),
        opt(deth.map(|d| u64::from(d.src_qp))),
        opt(atomic.map(|a| a.swap_add)),
        opt(atomic.map(|a| a.compare)),
        opt(orig.map(|o| o.orig)),
        imm.map_or(Absent, |i| Hex(i.imm)),
        ieth.map_or(Absent, |i| Hex(i.rkey)),
        Num(u64::from(icrc_shown)),
    ]
}

/// One tshark field value as a [`Want`]: empty is absent; `0x…` or decimal a number;
/// a bytes field (`1234abcd`, Wireshark lists ImmDt and IETH twice) its hex.
fn shown(field: &str, value: &str) -> Want {
    let v = value.trim();
    if v.is_empty() {
        return Want::Absent;
    }
    if field == "infiniband.immdt" || field == "infiniband.ieth" {
        let mut parts = v.split(',');
        let first = parts.next().unwrap_or_default();
        assert!(
            parts.all(|p| p == first),
            "{field} lists different values: {v}"
        );
        return Want::Hex(
            u32::from_str_radix(first, 16).unwrap_or_else(|e| panic!("{field}={v}: {e}")),
        );
    }
    Want::Num(num(v))
}

#[test]
fn wireshark_dissects_every_opcode() {
    let packets = capture();
    let dir = scratch("tshark");
    let pcap = write_capture(&dir, &packets);
    let pcap = pcap.to_str().expect("UTF-8 path");
    // Wireshark verifies the IPv4 and UDP checksums only when asked.
    let checks = [
        "-o",
        "ip.check_checksum:TRUE",
        "-o",
        "udp.check_checksum:TRUE",
    ];

    let mut args = vec!["-r", pcap];
    args.extend(checks);
    args.extend(["-T", "fields", "-E", "separator=|", "-e", "frame.protocols"]);
    for f in FIELDS {
        args.extend(["-e", f]);
    }
    let Some(fields) = tshark(&args) else {
        return;
    };
    let rows: Vec<&str> = fields.lines().collect();
    assert_eq!(
        rows.len(),
        packets.len(),
        "tshark saw every packet:\n{fields}"
    );
    for (i, (row, w)) in rows.iter().zip(&packets).enumerate() {
        let cols: Vec<&str> = row.split('|').collect();
        assert_eq!(cols.len(), 1 + FIELDS.len(), "packet {}: {row}", i + 1);
        assert!(
            cols[0].ends_with(":udp:infiniband") || cols[0].ends_with(":udp:infiniband:data"),
            "packet {} not InfiniBand: {row}",
            i + 1
        );
        for ((field, value), want) in FIELDS.iter().zip(&cols[1..]).zip(wanted(w)) {
            assert_eq!(
                shown(field, value),
                want,
                "packet {} ({:?}) {field}: {row}",
                i + 1,
                w.repr.bth.opcode
            );
        }
    }

    // No malformed packet and no expert info of severity error or warning anywhere.
    let mut args = vec!["-r", pcap];
    args.extend(checks);
    args.push("-V");
    let Some(verbose) = tshark(&args) else {
        return;
    };
    let frames = verbose.lines().filter(|l| l.starts_with("Frame ")).count();
    assert_eq!(frames, packets.len(), "tshark -V frames");
    let ib = verbose.lines().filter(|l| *l == "InfiniBand").count();
    assert_eq!(ib, packets.len(), "tshark -V InfiniBand trees");
    for bad in [
        "Malformed",
        "[Expert Info (Error",
        "[Expert Info (Warning",
        "Unknown",
        "[incorrect",
    ] {
        assert!(
            !verbose.contains(bad),
            "tshark -V reports {bad:?}:\n{verbose}"
        );
    }
    let mut args = vec!["-r", pcap];
    args.extend(checks);
    args.extend(["-q", "-z", "expert"]);
    let Some(expert) = tshark(&args) else {
        return;
    };
    for bad in ["Errors (", "Warnings (", "Malformed"] {
        assert!(
            !expert.contains(bad),
            "tshark -z expert: {bad:?}:\n{expert}"
        );
    }
    cleanup(&dir);
}

#[test]
fn scapy_recomputes_every_icrc() {
    let packets = capture();
    let dir = scratch("scapy");
    let pcap = write_capture(&dir, &packets);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/icrc_scapy.py");
    let probe = Command::new(PYTHON)
        .args(["-c", "import scapy.contrib.roce"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            skip(format!(
                "{PYTHON} has no scapy.contrib.roce ({}): install Debian package python3-scapy",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            return;
        }
        Err(e) => {
            skip(format!(
                "{PYTHON} not runnable ({e}): install Debian package python3"
            ));
            return;
        }
    }
    let out = Command::new(PYTHON)
        .arg(&script)
        .arg(&pcap)
        .output()
        .expect("run icrc_scapy.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "icrc_scapy.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The script's last line: `packets=N v4_matched=A v6_matched=B corrupt_caught=C`.
    let last = stdout.lines().last().unwrap_or_default();
    let get = |key: &str| -> usize {
        last.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {last:?}\n{stdout}"))
    };
    let v4 = packets
        .iter()
        .filter(|w| matches!(w.repr.ip, IpRepr::V4(_)))
        .count();
    let v6 = packets.len() - v4;
    assert_eq!(get("packets"), packets.len(), "{stdout}");
    assert_eq!(get("v4_matched"), v4, "{stdout}");
    assert_eq!(get("v6_matched"), v6, "{stdout}");
    assert_eq!(get("corrupt_caught"), packets.len(), "{stdout}");
    cleanup(&dir);
}
