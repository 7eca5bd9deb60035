#!/usr/bin/env bash
# Set up (if needed), then the main job: speculative generation with the shipped heads on the default backbone,
# compared with plain model.generate (speed and token identity) on a few varied prompts (scripts/demo_prompts.txt:
# a story, an explanation, code, a summary, a translation, arithmetic; none from the benchmark), each prompt's
# speedup and the mean. generate.py's defaults are the library's: hybrid
# drafting (heads + prompt lookup, our fastest mode), the shipped default heads and their own tree. One override, on
# purpose: --dtype float32, where the output is token-identical to plain greedy generate, which --compare checks (in
# bf16, the library's default where bf16 is native, batched verification rounds differently, see the README). Both are timed twice per prompt,
# interleaved, best kept (the machine is shared); any flag given here overrides these (e.g. --dtype bfloat16
# --draft heads --repeats 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/generate.py --compare --repeats 2 --dtype float32 --prompts_file scripts/demo_prompts.txt "$@"
