#!/usr/bin/env bash
# Static checks CI runs after the tests: ruff (lint, and `ruff format --check`) over everything,
# mypy --strict over common and services (settings in pyproject.toml), then the size limits
# (scripts/check_structure.py: modules <= 400 lines, functions <= 50). Installs the pinned
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
$PY scripts/check_structure.py
