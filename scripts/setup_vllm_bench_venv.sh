#!/usr/bin/env bash
# Make a throwaway venv that can import vLLM's block-hashing code (no engine, no GPU), for
# the vLLM column of scripts/bench_hash.py and for scripts/make_vllm_hash_vectors.py.
#
#   scripts/setup_vllm_bench_venv.sh [VENV_DIR] [VLLM_VERSION]    # defaults: /tmp/vllm-venv 0.28.0
#   python scripts/bench_hash.py --vllm-python /tmp/vllm-venv/bin/python
#
# vLLM's full requirements include CUDA-only packages, so it is installed with --no-deps
# and only what vllm.v1.core.kv_cache_utils, vllm.utils.hashing and vllm.v1.request import
# is added (the list was found by iterating on ImportErrors for 0.28.0). torch comes from
# pip's configured sources (a CPU wheel, about 200 MB); vLLM itself is a ~300 MB download.
# Never used by the project's own code or tests. About 2 GB on disk.
set -euo pipefail

VENV="${1:-/tmp/vllm-venv}"
VLLM_VERSION="${2:-0.28.0}"
PY="${PYTHON:-python3}"

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
# What vLLM's hashing/request modules import, without their own dependency trees.
"${PIP[@]}" --no-deps \
  numpy regex cachetools psutil py-cpuinfo pyyaml pyzmq msgspec cbor2 \
  pydantic pydantic_core typing_inspection annotated_types typing_extensions \
  transformers tokenizers safetensors huggingface_hub hf-xet filelock fsspec packaging tqdm \
  requests charset_normalizer urllib3 idna certifi httpx2 httpcore2 h11 anyio sniffio truststore \
  pillow pybase64 prometheus_client cloudpickle openai openai-harmony partial_json_parser \
  xgrammar apache-tvm-ffi==0.1.11 llguidance \
  fastapi starlette annotated_doc opentelemetry-api opentelemetry-sdk \
  opentelemetry-semantic-conventions \
  aiohttp aiosignal aiohappyeyeballs attrs frozenlist multidict propcache yarl \
  uvloop click jinja2 markupsafe

PYTHONHASHSEED=0 VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" - <<'EOF'
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

kv_cache_utils.init_none_hash(sha256_cbor)
hasher = kv_cache_utils.get_request_block_hasher(16, sha256_cbor)
request = Request("check", list(range(32)), SamplingParams(max_tokens=1), None,
                  block_hasher=hasher)
assert len(request.block_hashes) == 2
print("vLLM block hashing imports and runs")
EOF
echo "ready: $VENV/bin/python"
