#!/usr/bin/env bash
# gpu_train.sh: the training stage of scripts/recipe_eagle3.sh on a lent GPU, as one prepared command that ends inside
# a time budget (a device call runs at most 10 minutes) and brings every run's heads back.
#
#   bash scripts/gpu_train.sh OUT               on a CUDA machine: the committed parts of the mix (distilled/), every kind
#                                               in KINDS trained at once on the one GPU, sized to the budget
#   bash scripts/gpu_train.sh --smoke OUT       the same steps on a tiny random backbone and data (--make-smoke), on
#                                               GPU_TRAIN_DEVICE (default cuda): a minute, before the real run
#   bash scripts/gpu_train.sh --dry-run OUT     the smoke run on the CPU (CI runs it in tests/test_gpu_train.py)
#   bash scripts/gpu_train.sh --make-smoke DIR  here: the tiny backbone and data part the smoke run reads (carried)
#
# Steps (the log has each one's seconds):
#   1. setup   the carried wheels and GGUF pieces (scripts/gpu_check.sh --setup; the CPU runs use this venv)
#   2. merge   the parts -> one dataset (scripts/merge_data.py), as the recipe's merge stage
#   3. probe   each kind PROBE steps, all kinds at once, on the real runs' split: seconds a step (median after the
#              first two), the steps an epoch takes and the run's fixed cost (start, held-out eval, export)
#   4. train   each kind for as many epochs as the budget leaves (at most MAX_EPOCHS, at least MIN_EPOCHS), all at
#              once; the LR schedule is sized to that, so a run ends annealed; a run past the deadline is stopped and
#              its last checkpoint (every SAVE_EVERY steps) is what is left
#   5. pack    OUT/runs.tgz.NN (pieces of 15 MiB: a device call returns files of at most 16 MiB, 8 files, 64 MiB):
#              each run's exported heads, metrics.jsonl and train log; OUT/summary.json; OUT/gpu_train.log
#   Join here: cat OUT/runs.tgz.* | tar -xz -C runs/
#
# What travels (64 MiB a call, the repo's tracked files included): `GPU_CHECK_TRAIN=1 scripts/gpu_check.sh --pack`
# adds DeepSpeed (built here as a pure-Python wheel), datasets and what the machine lacks (dill, multiprocess,
# pydantic, ...) to the GGUF pieces and transformers. Training reads distilled/ (the data) but not heads/pretrained
# (the shipped heads), so that is what stays behind; the calls go back to back (the machine keeps /tmp only while warm):
#   here:   bash scripts/gpu_train.sh --make-smoke .gpu/smoke
#           git rm -r -q --cached heads/pretrained; echo /heads/pretrained/ >>.git/info/exclude  # 22 MiB less a call
#           GPU_CHECK_TRAIN=1 bash scripts/gpu_check.sh --pack .gpu/pack                        # 3 folders, not 6
#   device: run(carry=[".gpu/pack/3", ".gpu/smoke"], command="bash scripts/gpu_check.sh --receive .gpu/pack/3 &&
#               GPU_TRAIN_SMOKE=.gpu/smoke bash scripts/gpu_train.sh --smoke $OUT/smoke")
#           run(carry=[".gpu/pack/1"], command="bash scripts/gpu_check.sh --receive .gpu/pack/1")
#           run(carry=[".gpu/pack/2"], timeout_s=600, command="bash scripts/gpu_check.sh --receive .gpu/pack/2 &&
#               BUDGET=565 bash scripts/gpu_train.sh $OUT")
#   here:   git reset -q HEAD -- heads/pretrained (and drop the exclude line); cat OUT/runs.tgz.* | tar -xz -C DIR
# The seconds each call took when it ran: docs/benchmarks.md, "GPU training".
# Environment: KINDS (default "mtp eagle3"), BUDGET (seconds from the start to the packed output, default 500),
# MAX_EPOCHS (12), MIN_EPOCHS (0.5), PROBE (10 steps), LR (1e-3), WARMUP (100), DRAFT_VOCAB (8192), SEQ_LEN (768),
# MICRO (32 sequences a step, in one micro-batch on a GPU), SAVE_EVERY (100), DYNAMIC_TREE (the exported serving tree,
# default dynamic:nodes=8,topk=8,min_mass=0.5), PARTS (the committed parts to train on, default all of
# distilled/smollm2-mix/part-*), DATA (a dataset folder to train on instead of the merged parts, e.g. make-text-data's),
# LOSS (ce; kl for text the backbone did not write), INIT_HEADS (start from these heads); GPU_TRAIN_SMOKE (the smoke data, default the carried $STAGE/in/smoke), GPU_TRAIN_WORK
# (the runs' folder, default $STAGE/train), GPU_TRAIN_PYTHON (the CPU runs' python: .venv/bin/python, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STAGE=/tmp/tokenmaxx-gpu  # what gpu_check.sh --receive gathered and --setup installed
if [ -x .venv/bin/python ]; then LOCAL_PY=${GPU_TRAIN_PYTHON:-.venv/bin/python}; else LOCAL_PY=${GPU_TRAIN_PYTHON:-python3}; fi
die() { echo "gpu_train: $*" >&2; exit 2; }

if [ "${1:-}" = "--make-smoke" ]; then
    DIR=${2:?usage: gpu_train.sh --make-smoke DIR}
    rm -rf "$DIR" && mkdir -p "$DIR"
    PYTHONPATH=tests $LOCAL_PY - "$DIR" <<'EOF' || die "making the smoke backbone failed"
import json, sys
from pathlib import Path

import torch
from datasets import Dataset
from helpers import greedy_answers, tiny_model
from tiny_tokenizer import tiny_tokenizer

out = Path(sys.argv[1])
model = tiny_model("llama", seed=1)
model.save_pretrained(out / "backbone")
tiny_tokenizer().save_pretrained(out / "backbone")
gen, rows = torch.Generator().manual_seed(0), []
for n, prompt_len in enumerate((3, 6, 9, 12) * 4):  # 16 groups of 8 prompts, two categories
    prompts = torch.randint(4, 96, (8, prompt_len), generator=gen)
    for p, a in zip(prompts.tolist(), greedy_answers(model, prompts, 24).tolist()):
        rows.append({"prompt": " ".join(map(str, p)), "prompt_ids": p, "answer_ids": a,
                     "category": ("chat", "math")[n % 2]})
Dataset.from_list(rows).save_to_disk(str(out / "part-000"))
(out / "part-000" / "provenance.json").write_text(json.dumps(
    {"backbone": str(out / "backbone"), "backbone_revision": None, "sampling": {"greedy": True}}))
EOF
    echo "smoke backbone and data in $DIR"
    exit 0
fi

MODE=real
case "${1:-}" in --smoke) MODE=smoke; shift ;; --dry-run) MODE=dry; shift ;; esac
OUT=${1:?usage: gpu_train.sh [--smoke | --dry-run] OUT | --make-smoke DIR}
mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS
BUDGET=${BUDGET:-500}
KINDS=${KINDS:-mtp eagle3}
MAX_EPOCHS=${MAX_EPOCHS:-12} MIN_EPOCHS=${MIN_EPOCHS:-0.5} PROBE=${PROBE:-10} LR=${LR:-1e-3} WARMUP=${WARMUP:-100}
SAVE_EVERY=${SAVE_EVERY:-100} DYNAMIC_TREE=${DYNAMIC_TREE-dynamic:nodes=8,topk=8,min_mass=0.5}
WORK=${GPU_TRAIN_WORK:-$STAGE/train}  # the runs (removed first)
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee "$OUT/gpu_train.log") 2>&1
phase() { echo "==== $1 at $((SECONDS - START)) s"; }

# 1. setup
phase setup
if [ $MODE = dry ]; then
    PY=$LOCAL_PY DEVICE=cpu DTYPE=float32
else
    PY=python3 DEVICE=${GPU_TRAIN_DEVICE:-cuda} DTYPE=bfloat16
    GPU_CHECK_IMPORT=$([ $MODE = real ] && echo 1 || echo 0) bash scripts/gpu_check.sh --setup || die "setup failed"
    source "$STAGE/env.sh"
fi
if [ $MODE = real ]; then
    BACKBONE=smollm2-135m SEQ_LEN=${SEQ_LEN:-768} MICRO=${MICRO:-32} DRAFT_VOCAB=${DRAFT_VOCAB:-8192} LAYERS=()
    PARTS=(${PARTS:-distilled/smollm2-mix/part-*})
else  # the tiny smoke backbone: 2 layers (eagle3 reads layers 0, 1, 2 of its hidden states), vocabulary 96
    SMOKE=${GPU_TRAIN_SMOKE:-$STAGE/in/smoke}
    [ -d "$SMOKE/backbone" ] || die "no smoke backbone in $SMOKE: make it with --make-smoke and carry it"
    BACKBONE=$SMOKE/backbone SEQ_LEN=48 MICRO=8 DRAFT_VOCAB=64 LAYERS=(--feature_layers 0 1 2) PARTS=("$SMOKE/part-000")
    BUDGET=${GPU_TRAIN_SMOKE_BUDGET:-240} PROBE=4 WARMUP=2 SAVE_EVERY=4 MAX_EPOCHS=3
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import sys, torch, transformers, deepspeed, datasets, pyarrow; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| datasets', \
datasets.__version__, '| pyarrow', pyarrow.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1 | grep -v WARNING
} || die "the environment is incomplete"

# 2. merge (unless DATA names the dataset)
phase merge
LOSS=${LOSS:-ce} INIT_HEADS=${INIT_HEADS:-}
if [ -n "${DATA:-}" ]; then
    [ -d "$DATA" ] || die "DATA=$DATA is no folder"
else
    DATA=$WORK/merged
    $PY scripts/merge_data.py "${PARTS[@]}" --output_dir "$DATA" --overwrite --token_dtype uint16 \
        || die "merging ${PARTS[*]} failed"
fi

# train_run KIND NAME STEPS_OR_EPOCHS...: one run in the background, its output in WORK/NAME.log
train_run() {
    local kind=$1 name=$2; shift 2
    local layers=()
    [ "$kind" = eagle3 ] && layers=("${LAYERS[@]}")
    timeout -k 10 "$((BUDGET - (SECONDS - START) - 15))" $PY scripts/train_heads.py --data "$DATA" \
        --backbone "$BACKBONE" --device "$DEVICE" --dtype "$DTYPE" --kind "$kind" --num_heads 4 "${layers[@]}" \
        --seq_len "$SEQ_LEN" --micro_batch_size "$MICRO" --grad_accum 1 --lr "$LR" --loss "$LOSS" --head_decay 0.8 \
        --draft_vocab_size "$DRAFT_VOCAB" --loss_vocab draft --output_dir "$WORK/$name" --export_dir "$WORK/$name/heads" \
        ${DYNAMIC_TREE:+--dynamic_tree "$DYNAMIC_TREE"} ${INIT_HEADS:+--init_heads "$INIT_HEADS"} "$@" \
        >"$WORK/$name.log" 2>&1
}

# 3. probe: every kind at once, as the real runs will share the GPU
phase probe
declare -A PID  # kind -> its running process
for kind in $KINDS; do
    train_run "$kind" "probe-$kind" --max_steps "$PROBE" --warmup 2 --save_every 0 &  # the real runs' split and eval
    PID[$kind]=$!
done
for kind in $KINDS; do
    wait "${PID[$kind]}"; status=$?
    [ $status = 0 ] || { tail -20 "$WORK/probe-$kind.log"; die "the $kind probe failed (exit $status)"; }
done
probe_end=$SECONDS

# 4. train: epochs from the probe (step seconds and fixed cost), the time left, and the steps an epoch takes
phase train
left=$((BUDGET - (SECONDS - START) - 45))  # 45 s: packing, and the slack of concurrent runs
for kind in $KINDS; do
    epochs=$($PY - "$WORK/probe-$kind" "$left" "$MICRO" "$MAX_EPOCHS" "$MIN_EPOCHS" <<'EOF'
import json, statistics, sys
from pathlib import Path

from tokenmaxx.training.ds_setup import steps_per_epoch
run, left, micro, most, least = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
step_s = statistics.median(r["step_s"] for r in steps if r["split"] == "train" and r["step"] > 2)
config = json.loads((run / "heads" / "config.json").read_text())["extra"]
fixed = config["wall_seconds"] - sum(r["step_s"] for r in steps if r["split"] == "train")
per_epoch = steps_per_epoch(config["data"]["train_examples"], 1, micro, 1)
epochs = max(least, min(most, (left - 1.5 * fixed) / (step_s * per_epoch)))
print(f"{epochs:.2f}")
print(f"probe: {step_s:.3f} s a step, fixed {fixed:.0f} s, {per_epoch} steps an epoch, {left:.0f} s left -> "
      f"{epochs:.2f} epochs", file=sys.stderr)
EOF
) || die "reading the $kind probe failed"
    echo "$kind: $epochs epochs"
    train_run "$kind" "run-$kind" --epochs "$epochs" --warmup "$WARMUP" --save_every "$SAVE_EVERY" &
    PID[$kind]=$!
done
failed=0
for kind in $KINDS; do
    wait "${PID[$kind]}"; status=$?
    echo "run-$kind: exit $status after $((SECONDS - probe_end)) s"
    [ $status = 0 ] || { tail -5 "$WORK/run-$kind.log"; failed=1; }
done

# 5. pack
phase pack
$PY - "$WORK" $KINDS >"$OUT/summary.json" <<'EOF'
import json, sys
from pathlib import Path
work, summary = Path(sys.argv[1]), {}
for kind in sys.argv[2:]:
    config = work / f"run-{kind}" / "heads" / "config.json"
    if not config.exists():
        summary[kind] = {"exported": False}
        continue
    extra = json.loads(config.read_text())["extra"]
    summary[kind] = {"exported": True, "steps": extra["steps"], "wall_seconds": extra["wall_seconds"],
                     "train_positions_per_s": extra["train_positions_per_s"], "device": extra["machine"]["device"],
                     "epochs": extra["requested"].get("epochs"), "data_rows": extra["data"]["rows"],
                     **{k: extra["metrics"][k] for k in ("head_top1", "head_top5", "eval_examples") if k in extra["metrics"]}}
print(json.dumps(summary, indent=2))
EOF
cat "$OUT/summary.json"
runs=()
for kind in $KINDS; do
    [ -d "$WORK/run-$kind" ] && runs+=("run-$kind")
    cp "$WORK/probe-$kind.log" "$WORK/run-$kind.probe.log" 2>/dev/null && runs+=("run-$kind.probe.log")
    [ -f "$WORK/run-$kind.log" ] && runs+=("run-$kind.log")
done
tar -C "$WORK" --exclude checkpoints -czf - "${runs[@]}" | split -b 15M -d -a 2 - "$OUT/runs.tgz." \
    || die "packing failed"
ls -l "$OUT"
phase done
exit $failed
