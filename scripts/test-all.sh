#!/usr/bin/env bash
# Runs every check and test of the project on a fresh Debian machine of this kind.
# Installs the Debian packages the tests need when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the test suite needs: perftest and ibverbs-utils are run under
# LD_PRELOAD=libnprdma.so by crates/verbs-shim/tests; binutils gives nm for the exports test;
# python3-pyverbs ships rdma-core's own verbs test suite, run below against libnprdma.so.
# libibverbs-dev: <infiniband/verbs.h> for the C programs of crates/verbs-shim/tests/c_programs.rs.
# openmpi-bin, libopenmpi-dev: mpirun and mpicc for the MPI jobs of crates/verbs-shim/tests/mpi.rs.
# tshark (Wireshark's dissector) and python3-scapy (scapy's RoCE ICRC) check the RoCEv2 bytes
# of crates/roce/tests/tools.rs.
PKGS=(perftest ibverbs-utils binutils python3-pyverbs libibverbs-dev librdmacm-dev rdmacm-utils qperf libfabric-bin iproute2 ucx-utils openmpi-bin libopenmpi-dev tshark python3-scapy)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo doc (warnings are errors)"
# Every crate's map and public items, rendered; verbs-shim's library is also named `nprdma`
# (libnprdma.so), so its docs go to their own directory (cargo#6313).
RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps --workspace --locked
RUSTDOCFLAGS=-Dwarnings cargo rustdoc -p verbs-shim --lib --locked --target-dir target/shim-doc
echo "== cargo test"
# A test whose prerequisite (a program, a header, libnprdma.so) is missing skips when run
# by hand; in CI (CI=true: .ci/run) NPRDMA_REQUIRE_ALL=1 makes it fail instead
# (crates/test-support/src/skip.rs). Every skip is also listed in NPRDMA_SKIP_LOG, summed
# up below.
if [ "${CI:-}" = true ]; then export NPRDMA_REQUIRE_ALL=1; fi
SKIPS=$(mktemp)
trap 'rm -f "$SKIPS"' EXIT
export NPRDMA_SKIP_LOG="$SKIPS"
test_rc=0
cargo test --workspace --locked --no-fail-fast || test_rc=$?
if [ -s "$SKIPS" ]; then
  echo "== cargo test: $(wc -l <"$SKIPS") test(s) skipped for a missing prerequisite:"
  sort "$SKIPS"
else
  echo "== cargo test: no test skipped"
fi
[ "$test_rc" -eq 0 ] || exit "$test_rc"

# rdma-core's conformance suite (python3-pyverbs: pyverbs + the tests/ of rdma-core,
# installed compressed under /usr/share/doc) against the freshly built libnprdma.so,
# in both modes. The suite is run as shipped (only decompressed into a temp dir); every
# test that runs must pass; skips are counted (README: "rdma-core test suite").
# Every device-generic module the package ships; the vendor-specific ones (test_mlx5_*,
# test_efa*, and their base modules) need that vendor's device and direct-verbs library.
# Modules that only skip here still run, so their skips are counted (README's table).
PYVERBS_MODULES=(test_device test_pd test_mr test_cq test_cqex test_qp test_qpex test_atomic
  test_odp test_rdmacm test_cq_events test_fork test_relaxed_ordering test_shared_pd
  test_addr test_parent_domain test_flow test_rss_traffic test_tag_matching test_cuda_dmabuf)
echo "== rdma-core test suite (pyverbs) under LD_PRELOAD=libnprdma.so"
cargo build --release --locked -p verbs-shim
LIB="$PWD/target/release/libnprdma.so"
PY=/usr/bin/python3   # Debian's python (pyverbs is built for it), not a PATH shim
SRC=/usr/share/doc/rdma-core/tests
if [ ! -f "$SRC/run_tests.py" ]; then
  # Images that exclude /usr/share/doc from dpkg installs: reinstall with the tests included.
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --reinstall \
    -o DPkg::Options::=--path-include='/usr/share/doc/rdma-core/*' python3-pyverbs || true
fi
if [ ! -f "$SRC/run_tests.py" ]; then
  echo "rdma-core tests not found in $SRC (python3-pyverbs installed with docs excluded?)" >&2
  exit 1
fi
SUITE=$(mktemp -d)
trap 'rm -rf "$SUITE" "$SKIPS"' EXIT
cp -r "$SRC" "$SUITE/tests"
find "$SUITE/tests" -name '*.gz' -exec gunzip -f {} +
# The device is visible to pyverbs through the preload (ibv_get_device_list).
LD_PRELOAD="$LIB" "$PY" -c 'import pyverbs.device as d; n=[x.name.decode() for x in d.get_device_list()]; assert n == ["nprdma0"], n'
fail=0
deadline=$(( $(date +%s) + 240 ))   # the whole suite, both modes (normally ~20 s)
for mode in pinned nprdma; do
  for m in "${PYVERBS_MODULES[@]}"; do
    log="$SUITE/$m.$mode.log"
    rc=0
    left=$(( deadline - $(date +%s) )); left=$(( left < 60 ? left : 60 )); left=$(( left > 1 ? left : 1 ))
    # malloc.perturb fills freed heap memory with a pattern, so a use of an object the
    # library freed (a PD's handle after ibv_unimport_pd, say) crashes here every time
    # instead of corrupting the heap on some machines only.
    # test_rdmacm finds the device's IP through sysfs, which nprdma0 has none of:
    # scripts/pyverbs_sysfs.py answers those reads (netdev `lo`), nothing else.
    runner=("$SUITE/tests/run_tests.py")
    [ "$m" = test_rdmacm ] && runner=("$PWD/scripts/pyverbs_sysfs.py" "$SUITE")
    LD_PRELOAD="$LIB" NPRDMA_MODE=$mode GLIBC_TUNABLES=glibc.malloc.perturb=165 \
      timeout "$left" "$PY" "${runner[@]}" -v "$m" \
      >"$log" 2>&1 || rc=$?
    ran=$(sed -n 's/^Ran \([0-9]*\) tests\{0,1\} in .*/\1/p' "$log" | tail -1)
    status=$(grep -E '^(OK|FAILED)' "$log" | tail -1 || true)
    skipped=$(echo "$status" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p')
    ran=${ran:-0}; skipped=${skipped:-0}
    printf 'pyverbs %-7s %-22s ran %3d  passed %3d  skipped %3d  %s\n' \
      "$mode" "$m" "$ran" "$((ran - skipped))" "$skipped" "${status:-no result (rc=$rc)}"
    if [ "$rc" -ne 0 ] || [ "${status%% *}" != "OK" ]; then
      fail=1
      echo "---- $m ($mode) failed (rc=$rc); its log:"
      cat "$log"
    fi
  done
done
if [ "$fail" -ne 0 ]; then
  echo "rdma-core test suite: failures (see the logs above)" >&2
  exit 1
fi
