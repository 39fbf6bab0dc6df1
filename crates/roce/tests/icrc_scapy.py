#!/usr/bin/python3
"""Recompute the ICRC of every RoCEv2 packet of a pcap with scapy's RoCE layer.

Usage: icrc_scapy.py FILE.pcap   (run by crates/roce/tests/tools.rs)

For each packet: scapy dissects it (IP or IPv6 / UDP 4791 / BTH, the ICRC being the
BTH's trailing FCSField), and the ICRC is recomputed with scapy.contrib.roce's own
BTH.compute_icrc and compared with the packet's last four bytes. scapy 2.5's
compute_icrc supports IPv4 only (it warns and returns zeros for IPv6), so an IPv6
packet is checked by icrc_v6 below: compute_icrc's own steps, with the IPv6 fields
Annex A17 / rxe_icrc.c mask (traffic class, flow label, hop limit) in place of IPv4's
(TOS, TTL, checksum). If scapy ever computes IPv6 itself (a nonzero result), that is
used instead.

Each packet is then corrupted (one bit of the BTH's PSN flipped), re-dissected and
recomputed: the ICRC must no longer match, so the check above can fail.

The last line printed is the summary tools.rs reads:
    packets=N v4_matched=A v6_matched=B corrupt_caught=C
Exits nonzero on any mismatch.
"""

import logging
import sys
from zlib import crc32

from scapy.compat import raw
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.packet import Raw
from scapy.utils import rdpcap


# compute_icrc's "IPv6 is not supported" warning, once per IPv6 packet: expected (above).
logging.getLogger("scapy.runtime").setLevel(logging.ERROR)


def icrc_v6(bth):
    """scapy's BTH.compute_icrc, step for step, over an IPv6 underlayer."""
    ip = bth.underlayer.underlayer
    # pseudo-LRH / IPv6 / UDP / BTH / payload
    pshdr = Raw(b"\xff" * 8) / ip.copy()
    pshdr[IPv6].tc = 0xFF
    pshdr[IPv6].fl = 0xFFFFF
    pshdr[IPv6].hlim = 0xFF
    pshdr[UDP].chksum = 0xFFFF
    pshdr[BTH].fecn = 1
    pshdr[BTH].becn = 1
    pshdr[BTH].resv6 = 0xFF
    b = pshdr[BTH].self_build()
    payload = raw(pshdr[BTH].payload)
    pshdr[UDP].payload = Raw(b + payload + b"\xff\xff\xff\xff")
    icrc = crc32(raw(pshdr)[:-4]) & 0xFFFFFFFF
    return BTH.pack_icrc(icrc)


def icrc_of(pkt):
    """The ICRC scapy computes for pkt, and which route computed it."""
    bth = pkt[BTH]
    got = bth.compute_icrc(raw(bth))
    if pkt.haslayer(IPv6) and got == b"\x00" * 4:
        return icrc_v6(bth), "v6"
    return got, "v4" if pkt.haslayer(IP) else "v6-scapy"


def reparse(data):
    return IP(data) if data[0] >> 4 == 4 else IPv6(data)


def main(path):
    packets = rdpcap(path)
    failures = []
    v4 = v6 = caught = 0
    for n, pkt in enumerate(packets, 1):
        if not (pkt.haslayer(UDP) and pkt.haslayer(BTH)):
            failures.append(f"packet {n}: scapy did not dissect a BTH: {pkt.summary()}")
            continue
        data = raw(pkt)
        want = data[-4:]
        got, route = icrc_of(pkt)
        if got != want:
            failures.append(f"packet {n} ({route}): ICRC {want.hex()} in packet, scapy {got.hex()}")
        elif route == "v4":
            v4 += 1
        else:
            v6 += 1
        # The corrupted copy: one bit of the PSN (BTH byte 11) flipped.
        ip_len = len(data) - len(raw(pkt[UDP]))
        at = ip_len + 8 + 11
        bad = bytearray(data)
        bad[at] ^= 0x01
        bad_pkt = reparse(bytes(bad))
        bad_got, _ = icrc_of(bad_pkt)
        if bad_got != want:
            caught += 1
        else:
            failures.append(f"packet {n}: a flipped PSN bit kept ICRC {want.hex()}")
    for f in failures:
        print(f)
    print(f"packets={len(packets)} v4_matched={v4} v6_matched={v6} corrupt_caught={caught}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
