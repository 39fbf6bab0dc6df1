#!/usr/bin/env bash
# Runs every check and test of the project on a fresh Debian machine of this kind.
# Installs the Debian packages the tests need when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the test suite needs: perftest and ibverbs-utils are run under
# LD_PRELOAD=libnprdma.so by crates/verbs-shim/tests; binutils gives nm for the exports test.
PKGS=(perftest ibverbs-utils binutils)
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
echo "== cargo test"
cargo test --workspace --locked --no-fail-fast
