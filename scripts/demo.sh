#!/usr/bin/env bash
# Set up (if needed), then the main job: speculative generation with the shipped heads on the default backbone,
# compared with plain model.generate (speed and token identity). Defaults: hybrid drafting (heads + prompt lookup, our
# fastest mode) in fp32, where the output is token-identical to plain greedy generate (in bf16 batched verification
# rounds differently, see the README); any flag given here overrides them (e.g. --dtype bfloat16 --draft heads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/generate.py --compare --draft hybrid --dtype float32 "$@"
