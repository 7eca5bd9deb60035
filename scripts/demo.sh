#!/usr/bin/env bash
# Set up (if needed), then the main job: speculative generation with the shipped heads on the default backbone,
# compared with plain model.generate (speed and token identity).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/generate.py --compare "$@"
