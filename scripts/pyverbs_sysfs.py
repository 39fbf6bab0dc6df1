#!/usr/bin/env python3
"""Run rdma-core's test runner (tests/run_tests.py, args passed on) with the one sysfs
fact libnprdma.so's device has no sysfs for: the network interface behind it.

rdma-core's tests find a device's IP address by listing
/sys/class/infiniband/<dev>/device/net/ (base.py: os.path.exists, then `ls`), then
`ip -j addr show <netdev>`. nprdma0 serves every interface of the host and has no
sysfs node; this wrapper answers those two sysfs reads with `lo` (so the suite's
rdma_cm tests use 127.0.0.1) and leaves everything else, the tests' logic included,
as shipped. Usage: pyverbs_sysfs.py <suite dir containing tests/> [run_tests args].
"""
import os
import runpy
import subprocess
import sys

DEV, NETDEV = "nprdma0", "lo"
NET = f"/sys/class/infiniband/{DEV}/device/net/"

suite = os.path.abspath(sys.argv[1])
sys.path[:0] = [os.path.join(suite, "tests"), suite]

_exists = os.path.exists
os.path.exists = lambda p: p == NET or _exists(p)

_check_output = subprocess.check_output


def check_output(args, *a, **kw):
    if isinstance(args, (list, tuple)) and list(args) == ["ls", NET]:
        return (NETDEV + "\n").encode()
    return _check_output(args, *a, **kw)


subprocess.check_output = check_output
sys.argv = [os.path.join(suite, "tests", "run_tests.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
