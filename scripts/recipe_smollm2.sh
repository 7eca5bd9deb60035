#!/usr/bin/env bash
# End-to-end recipe for the default backbone, SmolLM2-135M-Instruct (alias smollm2-135m):
#   1. self-distilled data: ShareGPT prompts answered by the backbone itself (greedy, bf16)
#   2. feature cache + DeepSpeed training of 4 Medusa heads (1 residual block each, shared frozen lm_head)
#   3. export into heads/pretrained/smollm2-135m-medusa (config.json records training config, data provenance, metrics)
# Every step resumes where it stopped when re-run with the same settings.
#
# Knobs (environment): MAX_PROMPTS (20000), MAX_NEW_TOKENS (256), EPOCHS (2), NPROC (1 process; 2 = torchrun),
# SAVE_EVERY (50 steps between checkpoints: ~7 min of training at the rate below, so a stopped run loses little),
# DATA, RUN, EXPORT (folders), EXCLUDE (benchmark prompts never trained on; default ../shared/bench, from the repo
# root). Cost on a 2-core CPU: data ~520 tokens/s (about 3 h for 20000 x 256 tokens); training over the 16,384-token
# draft vocabulary ~2,000 positions/s in bf16 (about 45 min per epoch of 5M positions; ~500 positions/s without
# --loss_vocab draft); the feature cache takes ~1.2 KB per position (about 6 GB for 5M positions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-data/sharegpt-smollm2}
RUN=${RUN:-runs/smollm2-135m}
EXPORT=${EXPORT:-heads/pretrained/smollm2-135m-medusa}
NPROC=${NPROC:-1}
EXCLUDE=${EXCLUDE:-../shared/bench}

# 1. Data. The flags are scripts/make_data.py's (training/data.py, DataConfig); the benchmark prompts in $EXCLUDE (the
#    Spec-Bench-style sets the heads are measured on) are never trained on.
"$PY" scripts/make_data.py --output_dir "$DATA" --backbone smollm2-135m --dtype bfloat16 --exclude "$EXCLUDE" \
  --max_prompts "${MAX_PROMPTS:-20000}" --max_new_tokens "${MAX_NEW_TOKENS:-256}" --batch_size 32

# 2 + 3. Training and export. --resume continues bit-identically from the newest checkpoint when there is one.
RESUME=()
if [ -f "$RUN/checkpoints/latest" ]; then RESUME=(--resume); fi
ARGS=(--data "$DATA" --backbone smollm2-135m --dtype bfloat16 --num_heads 4 --num_layers 1 --share_lm_head true
      --seq_len 512 --micro_batch_size 8 --grad_accum 4 --epochs "${EPOCHS:-2}" --lr 1e-3 --warmup 100
      --loss ce --head_decay 0.8 --draft_vocab_size 16384 --loss_vocab draft --feature_cache "$RUN/features"
      --save_every "${SAVE_EVERY:-50}" --eval_every 1000 --output_dir "$RUN" --export_dir "$EXPORT" "${RESUME[@]}")
if [ "$NPROC" -gt 1 ]; then
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" scripts/train_heads.py "${ARGS[@]}"
else
  "$PY" scripts/train_heads.py "${ARGS[@]}"
fi
echo "heads exported to $EXPORT; metrics in $RUN/metrics.jsonl"
