#!/usr/bin/env bash
# Run every test on this machine, installing what they need first (scripts/setup.sh).
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -k blockhash
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
