#!/usr/bin/env bash
# Set up (if needed), then the main job: speculative generation with the shipped heads on the default backbone,
# compared with plain model.generate (speed and token identity). Defaults: hybrid drafting (heads + prompt lookup, our
# fastest mode) in fp32, where the output is token-identical to plain greedy generate (in bf16 batched verification
# rounds differently, see the README), both timed 3 times interleaved, best kept (the machine is shared); any flag
# given here overrides them (e.g. --dtype bfloat16 --draft heads --repeats 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/generate.py --compare --repeats 3 --draft hybrid --dtype float32 "$@"
