#!/usr/bin/env bash
# Heads v2 for the default backbone (smollm2-135m): EAGLE-3 heads distilled on the prompt mix, in resumable stages.
#
#   1. prompts   scripts/make_prompts.py: the mix (every ShareGPT user turn in its real context + summarise /
#                translate / answer-from-passages / word-problem prompts), in parts of 2,048 (data/mix/prompts-NNN)
#   2. answers   make_data per part, in order, until PARTS parts are done (each part resumes where it stopped;
#                finished parts are never redone); a finished part's compact copy goes to distilled/smollm2-mix/part-NNN
#                (committed; parts found there are not answered again)
#      stash     (STAGE=stash, run beside or after a stopped answers stage) copies the finished shards of every
#                unfinished part (and the answered batches of its unfinished shard) to
#                distilled/smollm2-mix/unfinished/part-NNN (committed): the answers stage of a later
#                session, on a fresh machine, starts from them instead of from nothing
#   3. merge     merge_data of the finished parts -> data/mix/merged (remade when the part count changed)
#   4. train     train_heads --kind eagle3 with a feature cache (three layers' states), --resume when a checkpoint
#                exists; export to $EXPORT. The held-out metrics come per category of the mix too (chat, math, rag,
#                summarize, translate: make_data keeps each prompt's source as the record's category)
#
# Knobs (environment): PARTS (parts to answer, default 6), STAGE (run up to this stage: prompts | answers | merge |
# train; default train; or stash), DEVICE (auto), DTYPE (the answers' dtype; default auto: bfloat16 on a GPU or a CPU
# with native bf16, float32 on a CPU without; a part keeps the dtype it was started with), TRAIN_DTYPE (the training's
# dtype, bfloat16 | float32; default the same rule: a CPU without native bf16 emulates it several times slower), EXCLUDE
# (benchmark prompts never trained on, default ../shared/bench), RUN, EXPORT, MIX (prompts and working folders), KEPT
# (the committed parts), JOBS (parts answered at once; 2 on a CPU of <= 4 cores, else 1), NPROC (training processes,
# default JOBS), DRAFT_VOCAB (16384), SAVE_EVERY (50 steps), DYNAMIC_TREE (the exported serving tree; default
# dynamic:nodes=8,topk=8,min_mass=0.5, empty = INIT_HEADS' or the library's 32 nodes), EPOCHS (3), LR (1e-3), WARMUP (100),
# INIT_HEADS (start from these trained heads), KIND (eagle3, or mtp: the same data and recipe
# for the MTP kind, which learned faster on this backbone and made the shipped default heads; docs/benchmarks.md,
# session 16). Costs on the 2-core CPU: the mix builds in ~1.5 min; answers ~105 tokens/s in one process (the mix's
# prompts are long: multi-turn context, passages), ~55 min a part on the Xeon; on an AVX2-only EPYC (no native bf16) ~27
# tokens/s per one-thread process in fp32 (bf16 there: 11), ~3.5 h a part; on a GPU (DEVICE=cuda) minutes in all.
# docs/benchmarks.md has the measured figures.
set -euo pipefail
shopt -s nullglob  # a pattern that matches nothing is no word (the stash's shard and batch lists)
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PARTS=${PARTS:-6}
STAGE=${STAGE:-train}
DEVICE=${DEVICE:-auto}
DTYPE=${DTYPE:-auto}
EXCLUDE=${EXCLUDE:-../shared/bench}
MIX=${MIX:-data/mix}
KEPT=${KEPT:-distilled/smollm2-mix}
KIND=${KIND:-eagle3}
RUN=${RUN:-runs/smollm2-$KIND}
EXPORT=${EXPORT:-$RUN/heads}
CORES=$(nproc)
JOBS=${JOBS:-$([ "$DEVICE" = cpu ] || [ "$DEVICE" = auto ] && [ "$CORES" -le 4 ] && echo 2 || echo 1)}
THREADS=$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))
NPROC=${NPROC:-$JOBS}  # training processes (torchrun); one thread each on a small CPU, for the same reason
DRAFT_VOCAB=${DRAFT_VOCAB:-16384}  # the heads' draft vocabulary, also the loss's (see RECIPE: 8192 trains ~1.5x faster)
SAVE_EVERY=${SAVE_EVERY:-50}  # steps between checkpoints: ~10 min of fp32 training on a 2-core AVX2 CPU (12.5 s a step)
# the serving tree written into the exported config (the shipped heads' node budget; tree="auto" re-tunes per machine);
# empty: INIT_HEADS' tree, else the library default (32 nodes)
DYNAMIC_TREE=${DYNAMIC_TREE-dynamic:nodes=8,topk=8,min_mass=0.5}
# training from scratch: 3 epochs, peak lr 1e-3 after 100 warm-up steps; INIT_HEADS (a heads folder / Hub id) starts
# from trained heads instead (train_heads --init_heads: held-out rows only from parts they never saw), e.g. the
# shipped ones on more parts, with fewer EPOCHS and a lower LR
EPOCHS=${EPOCHS:-3}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-100}
INIT_HEADS=${INIT_HEADS:-}

# 1. prompts (deterministic: the same parts on every machine)
if [ ! -f "$MIX/mix.json" ]; then
  "$PY" scripts/make_prompts.py --output_dir "$MIX" --exclude "$EXCLUDE"
fi
[ "$STAGE" = prompts ] && exit 0

# 2. answers, part by part; each finished part is also kept as a compact copy (uint16 token ids) in $KEPT, which is
#    committed to git: a later session or a user retrains from it without answering those prompts again. JOBS parts
#    are answered at once, each process on its share of the cores (on 2 cores, 2 one-thread processes answered
#    1.3-1.8x the tokens/s of one two-thread process: batched generation's small matmuls scale poorly across
#    threads). A part stopped midway resumes at its first unanswered batch of 32 prompts.
UNFINISHED=$KEPT/unfinished
stash_part() {  # finished shards and answered batches (each written under a temp name, then renamed) of a part still
  # being answered; safe beside a running answers stage: an item that vanishes while it is copied (a chunk finished,
  # its batches folded into a shard) is left out, and a part that finished meanwhile is not stashed
  local p=$1 src=$MIX/part-$1 dst=$UNFINISHED/part-$1
  [ -f "$src/settings.json" ] && [ -d "$src/shards" ] && [ ! -f "$src/state.json" ] || return 0
  local shards=("$src"/shards/[0-9][0-9][0-9][0-9][0-9]) batches=("$src"/shards/partial-*/[0-9][0-9][0-9][0-9][0-9])
  [ $(( ${#shards[@]} + ${#batches[@]} )) -gt 0 ] || return 0
  rm -rf "$dst.tmp" && mkdir -p "$dst.tmp/shards"
  cp "$src/settings.json" "$dst.tmp/"
  local item into copied_shards=0 copied_batches=0
  for item in "${shards[@]}" "${batches[@]}"; do
    into=$dst.tmp/shards/${item#"$src"/shards/}
    mkdir -p "$(dirname "$into")"
    if cp -r "$item" "$into" 2>/dev/null; then
      case $item in */partial-*) copied_batches=$((copied_batches + 1)) ;; *) copied_shards=$((copied_shards + 1)) ;; esac
    else
      rm -rf "$into"
    fi
  done
  if [ -f "$src/state.json" ] || [ -f "$KEPT/part-$p/provenance.json" ] \
      || [ $((copied_shards + copied_batches)) -eq 0 ]; then
    rm -rf "$dst.tmp"
    return 0
  fi
  rm -rf "$dst" && mv "$dst.tmp" "$dst"
  echo "stashed part $p: $copied_shards finished shards and $copied_batches answered batches -> $dst"
}
restore_part() {  # a stash from an earlier session, on a machine that has no working copy of the part
  local p=$1 src=$UNFINISHED/part-$1 dst=$MIX/part-$1
  if [ -f "$src/settings.json" ] && [ ! -e "$dst" ]; then
    mkdir -p "$dst" && cp -r "$src/settings.json" "$src/shards" "$dst/"
    local shards=("$src"/shards/[0-9][0-9][0-9][0-9][0-9]) batches=("$src"/shards/partial-*/[0-9][0-9][0-9][0-9][0-9])
    echo "part $p resumes from ${#shards[@]} stashed shards and ${#batches[@]} answered batches"
  fi
}
part_dtype() {  # a part resumes in the dtype it was started with (make_data refuses other settings); a new one: DTYPE
  local settings=$MIX/part-$1/settings.json
  if [ -f "$settings" ]; then sed -n 's/^ *"dtype": *"\([a-z0-9]*\)".*/\1/p' "$settings"; else echo "$DTYPE"; fi
}
answer_part() {
  local p=$1
  "$PY" scripts/make_data.py --output_dir "$MIX/part-$p" --sources "$MIX/prompts-$p.jsonl" --whole_conversation true \
    --exclude "$EXCLUDE" --backbone smollm2-135m --dtype "$(part_dtype "$p")" --device "$DEVICE" --max_new_tokens 256 \
    --batch_size 32
  "$PY" scripts/merge_data.py "$MIX/part-$p" --output_dir "$KEPT/part-$p" --token_dtype uint16
  rm -rf "$UNFINISHED/part-$p"
  rmdir "$UNFINISHED" 2>/dev/null || true
}
TODO=()
for p in $(seq -f "%03g" 0 $((PARTS - 1))); do
  if [ -f "$KEPT/part-$p/provenance.json" ]; then
    rm -rf "$UNFINISHED/part-$p"  # a stash made while the part was finishing
  else
    TODO+=("$p")
  fi
done
rmdir "$UNFINISHED" 2>/dev/null || true
if [ "$STAGE" = stash ]; then
  for p in "${TODO[@]}"; do stash_part "$p"; done
  exit 0
fi
for ((i = 0; i < ${#TODO[@]}; i += JOBS)); do
  PIDS=()
  for p in "${TODO[@]:i:JOBS}"; do
    restore_part "$p"
    echo "answering part $p (log: $MIX/part-$p.log)"
    OMP_NUM_THREADS=$THREADS answer_part "$p" > "$MIX/part-$p.log" 2>&1 &
    PIDS+=($!)
  done
  for pid in "${PIDS[@]}"; do wait "$pid"; done  # a failed part stops the recipe (set -e); rerun to resume it
done
DONE=()
for p in $(seq -f "%03g" 0 $((PARTS - 1))); do DONE+=("$KEPT/part-$p"); done
[ "$STAGE" = answers ] && exit 0

# 3. merge the finished parts
"$PY" scripts/merge_data.py "${DONE[@]}" --output_dir "$MIX/merged" --overwrite
[ "$STAGE" = merge ] && exit 0

# 4. train and export (--resume continues bit-identically from the newest checkpoint). 32 sequences a step in all:
#    8 per micro-batch, 4 micro-batches spread over the NPROC processes.
if [ -z "${TRAIN_DTYPE:-}" ]; then
  TRAIN_DTYPE=$("$PY" -c "from tokenmaxx.heads.io.backbones import resolve_device, resolve_dtype
print(str(resolve_dtype('auto', resolve_device('$DEVICE'))).removeprefix('torch.'))")
fi
RESUME=()
if [ -f "$RUN/checkpoints/latest" ]; then RESUME=(--resume); fi
ARGS=(--data "$MIX/merged" --backbone smollm2-135m --dtype "$TRAIN_DTYPE" --device "$DEVICE"
      --kind "$KIND" --num_heads 4 --seq_len 768 --micro_batch_size 8 --grad_accum $((4 / NPROC)) --epochs "$EPOCHS"
      --lr "$LR" --warmup "$WARMUP" --loss ce --head_decay 0.8 --draft_vocab_size "$DRAFT_VOCAB" --loss_vocab draft
      --feature_cache "$RUN/features" --save_every "$SAVE_EVERY" --eval_every 1000 --output_dir "$RUN" --export_dir "$EXPORT"
      ${DYNAMIC_TREE:+--dynamic_tree "$DYNAMIC_TREE"} ${INIT_HEADS:+--init_heads "$INIT_HEADS"} "${RESUME[@]}")
if [ "$NPROC" -gt 1 ]; then
  OMP_NUM_THREADS=$THREADS "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" scripts/train_heads.py "${ARGS[@]}"
else
  "$PY" scripts/train_heads.py "${ARGS[@]}"
fi
echo "heads exported to $EXPORT; metrics in $RUN/metrics.jsonl"
