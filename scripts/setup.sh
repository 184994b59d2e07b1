#!/usr/bin/env bash
# Install what cache-indexer and its tests need on a fresh Debian machine (idempotent):
# redis-server, libibverbs1 (for the Mooncake wheel), iproute2 + util-linux (network
# namespaces for the Mooncake store clients), and the Python packages.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need_apt+=(libibverbs1)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  echo "setup: installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if ! $PY -c 'import common.blockhash, numpy, zmq, msgpack, cbor2, redis, httpx, kubernetes, falcon, gunicorn, orjson, yaml, pytest, fakeredis, lupa, hypothesis' 2>/dev/null \
   || ! $PY -c 'import mooncake.store' 2>/dev/null \
   || ! command -v cache-indexer >/dev/null 2>&1; then
  echo "setup: installing Python packages"
  $PY -m pip install -q --disable-pip-version-check -e ".[test,l3]"
fi

# Helm's own template engine for the chart tests (tests/unit/test_chart.py skip without it).
if ! $PY -c 'import helm_python' 2>/dev/null; then
  $PY -m pip install -q --disable-pip-version-check -e ".[chart]" \
    || echo "setup: WARNING: helm-python-sdk could not be installed; chart render tests will be skipped"
fi
