#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, the real-model and interop tiers included (they must not skip here).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
TOKENMAXX_REQUIRE_REAL=1 TOKENMAXX_REQUIRE_INTEROP=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
