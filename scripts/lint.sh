#!/usr/bin/env bash
# Static checks CI runs after the tests: ruff (lint, and `ruff format --check`) over everything,
# mypy --strict over common and services (settings in pyproject.toml). Installs the pinned
# tools when they are missing. `ruff format common services tests scripts` fixes the format.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -m ruff --version >/dev/null 2>&1 || ! $PY -m mypy --version >/dev/null 2>&1; then
  $PY -m pip install -q --disable-pip-version-check -e ".[lint]"
fi
$PY -m ruff check common services tests scripts
$PY -m ruff format --check common services tests scripts
$PY -m mypy
