#!/usr/bin/env bash
# Start the whole system locally (see services/tools/local_stack.py); Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${PYTHON:-python3}" -m services.cli local-stack "$@"
