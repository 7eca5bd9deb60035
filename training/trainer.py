"""Train draft heads on a frozen backbone with DeepSpeed: data -> features -> engine -> steps -> metrics -> export.

``train(cfg)`` is the whole run, as named steps:

1. processes     join the process group (gloo on CPU, nccl on CUDA; a plain single process gets RANK / WORLD_SIZE
                 defaults); the device is ``cfg.device`` (cuda:LOCAL_RANK per rank on GPUs); ``cfg.threads`` torch
                 CPU threads
2. data          self-distilled examples, train / held-out split (``batches.load_data``)
3. config        DeepSpeed JSON merged with the flags (``ds_setup.resolve_ds_config``)
4. backbone      frozen, eval mode; never handed to DeepSpeed (its weights stay bit-identical)
5. heads         ``HEAD_KINDS[cfg.kind].for_backbone`` (eagle3, mtp, medusa), with the serving tree the export
                 records (``serving_tree``); the held-out tau is scored on it (``metrics.scoring_tree``); the
                 objective module wraps them
                 (``losses.HeadsObjective``); the checkpoint folder is checked against the run's identity before any
                 expensive work
6. features      cached hidden states on disk (``--feature_cache``) or the backbone per batch
7. engine        DeepSpeed over the heads' parameters only (the backbone's lm_head and input embedding are passed
                 per call): torch AdamW, warm-up + cosine, accumulation, clipping
8. checkpoints   resume (``--resume``) from the newest checkpoint: weights, optimizer, scheduler, RNG
9. loop          optimizer steps; metrics.jsonl (each step once, across resumes); checkpoints every ``save_every``
                 steps; held-out metrics
10. export       fp32 master weights -> ``heads.save_pretrained(export_dir)`` with config.extra = provenance

The data order is a function of (seed, epoch, step) and DeepSpeed restores weights, optimizer and scheduler, so a
resumed run continues bit-identically. See ``ds_setup`` for the launchers (plain, torchrun, deepspeed).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from tokenmaxx.heads import HEAD_KINDS, DynamicTreeConfig, HeadsConfig, backbone_identity, load_backbone, load_heads
from tokenmaxx.heads.config import lookback
from tokenmaxx.heads.machine import clock, cpu_info, device_name
from tokenmaxx.heads.sequential import SequentialHeads

from . import checkpoints
from .batches import SelfDistilledData, collate, load_data, part_digests, step_micro_batches, trained_parts
from .checkpoints import atomic_write_text
from .ds_setup import build_engine, comm_device, init_distributed, resolve_ds_config, steps_per_epoch, training_device
from .features import BackboneFeatures, FeatureCache, final_state_index
from .losses import STATS, HeadsObjective, gives_teacher, shifted_targets
from .metrics import MetricsLogger, evaluate, scoring_tree
from .train_config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class TrainSource:
    """What a run trains on when it is not ``cfg.data`` read through the backbone (``adapt``: recorded traffic and a
    replay sample): the examples, a features object (``hidden(batch)`` -> [B, W, F]), the draft vocabulary kept
    (the init heads'; None: one from the data, as ``--draft_vocab_size`` says) and ``score_before``, which scores the
    heads the run starts from on its held-out rows, called once per run (``TrainResult.metrics_before``)."""

    data: SelfDistilledData
    features: object
    vocab: torch.Tensor | None = None
    score_before: Callable[[], dict] | None = None
    extra: dict = field(default_factory=dict)  # recorded in the exported heads' config.extra beside the run's own


@dataclass
class TrainResult:
    export_dir: Path
    steps: int  # optimizer steps done in total (including those before a resume)
    losses: list[float] = field(default_factory=list)  # loss of each step run by this call (all ranks' mean)
    metrics: dict = field(default_factory=dict)  # final held-out metrics
    metrics_before: dict = field(default_factory=dict)  # a ``TrainSource`` run's ``score_before``
    positions_per_s: float = 0.0  # trained positions per second over this call's steps (all ranks)
    wall_seconds: float = 0.0


# ---- collectives (no-ops in a single process) ------------------------------------------------------------------
def _all_reduce(t: torch.Tensor) -> None:
    import deepspeed.comm as dist

    if dist.get_world_size() > 1:
        t.copy_(_reduced(t))


def _reduced(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ranks, summed in float64 where the process group's backend needs it (nccl: the GPU)."""
    import deepspeed.comm as dist

    out = t.double().to(comm_device(), copy=True)
    dist.all_reduce(out)
    return out.to(t.device, t.dtype)


def _barrier() -> None:
    import deepspeed.comm as dist

    if dist.get_world_size() > 1:
        dist.barrier()


# ---- steps --------------------------------------------------------------------------------------------------------
def load_frozen_backbone(cfg: TrainConfig, device: torch.device):
    """Step 4: the backbone by alias / folder / Hub id, in cfg.dtype on ``device``, with the PEFT adapter merged."""
    kwargs = {"dtype": cfg.dtype, "device": device}
    if cfg.adapter is not None:
        kwargs["adapter"] = cfg.adapter
    model, _ = load_backbone(cfg.backbone, **kwargs)
    return model


def check_frozen_backbone(model, cfg: TrainConfig, data: SelfDistilledData, device: torch.device) -> None:
    """The backbone is frozen, in the run's dtype, on the run's device, and the one the data was distilled from (when
    recorded)."""
    weight = model.get_output_embeddings().weight
    if weight.device != device:
        raise ValueError(f"the backbone is on {weight.device} but the run's device is {device}; move it there or "
                         f"pass --device {weight.device}")
    if weight.dtype != getattr(torch, cfg.dtype):
        raise ValueError(f"the backbone is {weight.dtype} but the run's dtype is {cfg.dtype}; "
                         f"load it with dtype={cfg.dtype!r} or pass --dtype {str(weight.dtype).removeprefix('torch.')}")
    model.eval()
    model.requires_grad_(False)
    ident, revision = backbone_identity(model)
    made_rev = data.provenance.get("backbone_revision")
    if made_rev and revision and made_rev != revision:
        raise ValueError(f"the data was distilled from backbone {data.provenance.get('backbone')!r} at revision "
                         f"{made_rev}, but training runs on {ident!r} at revision {revision}: heads must learn the "
                         "backbone's own answers")
    if data.provenance.get("backbone") not in (None, ident):
        log.warning("data provenance names backbone %r, training on %r", data.provenance.get("backbone"), ident)


def rank_weight_digests(heads, world: int) -> list[str]:
    """sha256 of the heads' weights on every rank (collective); data parallelism must keep them identical."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in heads.named_parameters():
        digest.update(name.encode() + param.detach().float().cpu().numpy().tobytes())
    digests = [digest.hexdigest()]
    if world > 1:
        digests = [None] * world
        torch.distributed.all_gather_object(digests, digest.hexdigest())
    if len(set(digests)) != 1:
        raise RuntimeError(f"head weights differ between ranks after training: {digests}")
    return digests


def draft_vocab_from(data: SelfDistilledData, size: int) -> tuple[torch.Tensor, dict]:
    """The ``size`` most frequent tokens of the training sequences, and a record with its held-out coverage."""
    from tokenmaxx.heads.draft_vocab import frequent_tokens

    ids = frequent_tokens((data.examples[r].ids.tolist() for r in data.train), size)
    held = torch.cat([data.examples[r].ids for r in data.eval]) if data.eval else torch.zeros(0, dtype=torch.long)
    coverage = float(torch.isin(held, ids).float().mean()) if held.numel() else None
    return ids, {"size": int(ids.numel()), "requested": size, "heldout_token_coverage": coverage}


def init_heads_for(cfg: TrainConfig):
    """--init_heads, loaded and checked against the run's flags before anything is built: kind, depths, layers, the
    projection and the feature layers must be theirs (one error naming each difference); None without the flag."""
    if not cfg.init_heads:
        return None
    init = load_heads(cfg.init_heads)
    wanted = {"kind": cfg.kind, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
              "share_lm_head": cfg.share_lm_head}
    if cfg.feature_layers:
        wanted["feature_layers"] = list(cfg.feature_layers)
    differ = [f"{name}: theirs {getattr(init.config, name)!r}, this run {value!r}"
              for name, value in wanted.items() if getattr(init.config, name) != value]
    if differ:
        raise ValueError(f"--init_heads {cfg.init_heads} do not fit this run ({'; '.join(differ)}): give the flags "
                         "they were trained with")
    return init


# what the record of a warm start keeps of its init heads' own run (their card's "started from" row): not the per-part
# provenance, the weight digests or the draft vocabulary, which belong to those heads
INIT_RUN_KEYS = ("training", "world_size", "machine", "steps", "wall_seconds", "train_positions_per_s", "processes",
                 "time_note", "init_heads")


def init_heads_record(init, source: str, seen) -> dict:
    """``extra.init_heads`` of a warm start: where the init heads came from, the parts they had seen, their held-out
    metrics and a summary of their own run (data without the per-part provenance; a chain of warm starts nests)."""
    theirs = init.config.extra if isinstance(init.config.extra, dict) else {}
    run = {key: theirs[key] for key in INIT_RUN_KEYS if key in theirs}
    if isinstance(theirs.get("data"), dict):
        data = {k: v for k, v in theirs["data"].items() if k != "provenance"}
        if isinstance(theirs["data"].get("provenance"), dict):
            data["provenance"] = {k: v for k, v in theirs["data"]["provenance"].items() if k != "parts"}
        run["data"] = data
    return {"source": source, "seen_parts": sorted(seen), "metrics": theirs.get("metrics"), "run": run}


def serving_tree(cfg: TrainConfig, init) -> dict:
    """The serving tree the exported heads record (``for_backbone`` settings; not part of the checkpoint identity):
    --dynamic_tree, else the --init_heads' tree, else the library's default, written out (a dynamic tree's
    ``DynamicTreeConfig()``) so that the heads generate with the tree the run scored, whatever the default later is."""
    if issubclass(HEAD_KINDS[cfg.kind], SequentialHeads):
        if cfg.dynamic_tree and cfg.dynamic_tree != "default":
            return {"dynamic_tree": DynamicTreeConfig.parse(cfg.dynamic_tree)}
        if cfg.dynamic_tree is None and init is not None and init.config.dynamic_tree is not None:
            return {"dynamic_tree": init.config.dynamic_tree}
        return {"dynamic_tree": DynamicTreeConfig()}
    return {"tree": init.config.tree} if init is not None and init.config.tree is not None else {}


def start_from(heads, init, model) -> None:
    """Step 5 with --init_heads: the fresh ``heads`` (built with ``init``'s settings) take its weights; ``init`` must
    fit the backbone."""
    init.check_backbone(model)
    state = {k: v for k, v in init.state_dict().items() if k != "draft_vocab"}  # the run picks its own vocabulary
    heads.load_state_dict(state, strict=True)


def export_heads(heads, cfg: TrainConfig, extra: dict, rank: int) -> Path:
    """Step 10: gather fp32 master weights (collective), then rank 0 writes config.json + model.safetensors."""
    from deepspeed.utils import safe_get_full_fp32_param

    vocab = extra.pop("_draft_vocab", None)  # token ids (a tensor: not part of the JSON record)
    state = {}
    for name, param in heads.named_parameters():
        full = safe_get_full_fp32_param(param)  # ZeRO-partitioned fp32 master copy, gathered on every rank
        state[name] = (full if full is not None else param).detach().float().cpu().clone()
    out = cfg.heads_export_dir
    if rank == 0:
        config = HeadsConfig.from_dict({**heads.config.to_dict(), "extra": extra})
        exported = HEAD_KINDS[config.kind](config)
        exported.load_state_dict(state, strict=True)
        if vocab is not None:
            exported.set_draft_vocab(vocab)
        exported.save_pretrained(out)
    _barrier()
    return out


def step_norm(objective, batches: list, lm_head, world: int = 1) -> torch.Tensor:
    """``HeadsObjective.loss``'s norm for one step's micro-batches [K]: the step's target count per micro-batch, over
    all ranks (DeepSpeed averages the ranks' gradients, each the mean of its micro-batches'), so that every target of
    the step weighs the same."""
    counts = sum(objective.target_counts(b.input_ids, b.answer_start, b.lengths, lm_head) for b in batches)
    counts = _reduced(counts) if world > 1 else counts
    return counts.double() / (len(batches) * world)


def run_step(engine, features, data: SelfDistilledData, micro_batches: list[list[int]], lm_head, embed,
             num_heads: int, world: int = 1, context: int | None = None) -> tuple[torch.Tensor, float, float]:
    """One optimizer step over ``grad_accum`` micro-batches (``lm_head``, ``embed``: the frozen backbone's; ``world``
    processes; ``context``: the prompt positions before the last that a window holds, ``config.lookback`` of the
    heads; None: ``num_heads``).

    Returns (sums [1 + len(STATS) * K + 1]: loss sum, per-head stats, trained positions; this rank's), feature
    seconds (backbone forward or cache read), total seconds.
    """
    device = lm_head.weight.device
    start = clock(device)
    steps_before, feature_s = engine.global_steps, 0.0
    sums = torch.zeros(2 + len(STATS) * num_heads, dtype=torch.float64, device=device)  # read once, by step_record
    batches = [collate(data, rows, num_heads if context is None else context).to(device) for rows in micro_batches]
    norm = step_norm(engine.module, batches, lm_head, world)
    for batch in batches:
        t0 = clock(device)
        hidden = features.hidden(batch)  # [B, W, H]
        feature_s += clock(device) - t0
        given = features.teacher(batch) if engine.module.given_teacher else None
        loss, stats = engine(hidden, batch.input_ids, batch.answer_start, batch.lengths, lm_head=lm_head,
                             embed=embed, norm=norm, given=given)
        engine.backward(loss)
        engine.step()
        _, valid = shifted_targets(batch.input_ids, batch.answer_start, batch.lengths, num_heads)  # [K, B, W]
        stats = stats.double()
        stats[:2] *= stats[3]  # means -> sums, to average over micro-batches and ranks by target count
        sums += torch.cat([loss.detach().double().view(1), stats.flatten(), valid.any(0).sum().double().view(1)])
    if engine.global_steps != steps_before + 1:
        raise RuntimeError(f"{len(micro_batches)} micro-batches made {engine.global_steps - steps_before} optimizer "
                           "steps, expected exactly 1 (gradient_accumulation_steps mismatch)")
    return sums.cpu(), feature_s, clock(device) - start


def step_record(step: int, sums: torch.Tensor, num_micro: int, num_heads: int, lr: float, seconds: float,
                feature_s: float) -> dict:
    stats = sums[1:-1].view(len(STATS), num_heads)  # summed over micro-batches and ranks
    count = stats[3].clamp(min=1)
    record = {"split": "train", "step": step, "loss": round(float(sums[0] / num_micro), 6), "lr": lr,
              "head_ce": [round(float(v), 5) for v in stats[0] / count],
              "head_top1": [round(float(v), 4) for v in stats[2] / count],
              "positions": int(sums[-1]), "positions_per_s": round(float(sums[-1]) / seconds, 1),
              "step_s": round(seconds, 4), "feature_s": round(feature_s, 4)}
    if stats[1].any():
        record["head_kl"] = [round(float(v), 5) for v in stats[1] / count]
    return record


# ---- the run ------------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, model=None, stop_after: int | None = None,
          source: TrainSource | None = None) -> TrainResult:
    """Train heads as ``cfg`` says.

    model: an already loaded backbone (else ``cfg.backbone`` is loaded). stop_after: end this call right after the
    checkpoint of that step, without final metrics or export, as an interruption would (``--resume`` continues).
    source: the examples and features to train on instead of ``cfg.data`` through the backbone (``TrainSource``).
    """
    wall_start = time.perf_counter()
    requested = cfg.to_dict()
    device = training_device(cfg.device)
    rank, world = init_distributed(device)  # 1. processes
    torch.set_num_threads(cfg.threads)
    init = init_heads_for(cfg)
    seen = trained_parts(init.config) if init is not None else []
    if init is not None and not seen:
        log.warning("the --init_heads %s record no training data: held-out rows may include rows they were trained "
                    "on", cfg.init_heads)
    data = source.data if source is not None else \
        load_data(cfg.data, cfg.seq_len, cfg.eval_fraction, cfg.eval_max_examples, cfg.seed, seen_parts=seen)  # 2.
    if data.provenance.get("answers") == "text" and cfg.loss != "kl":
        raise ValueError(f"--data {cfg.data} holds text the backbone did not write (make-text-data): its labels are "
                         f"the backbone's own distribution, so train it with --loss kl, not --loss {cfg.loss} (which "
                         "would teach the heads the text instead of the backbone)")
    cfg, ds = resolve_ds_config(cfg, world, len(data.train))  # 3. config
    if model is None:  # 4. backbone
        model = load_frozen_backbone(cfg, device)
    check_frozen_backbone(model, cfg, data, device)
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    torch.manual_seed(cfg.seed)  # 5. heads (identical on every rank; DeepSpeed also broadcasts rank 0's)
    layers = cfg.feature_layers or (init.config.feature_layers if init is not None else None)
    settings = {"feature_layers": list(layers)} if layers else {}
    if cfg.prompt_context or (init is not None and init.config.prompt_context):
        settings["prompt_context"] = cfg.prompt_context or init.config.prompt_context
    heads = HEAD_KINDS[cfg.kind].for_backbone(model, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                              share_lm_head=cfg.share_lm_head, **settings, **serving_tree(cfg, init))
    if init is not None:
        start_from(heads, init, model)
    context = lookback(heads.config)  # the prompt positions a window holds before the last (the drafter reads them)
    tree = scoring_tree(heads)  # the held-out tau's tree: the serving tree, or one of its node budget
    if source is not None and source.vocab is not None:
        vocab, vocab_record = source.vocab, {"size": int(source.vocab.numel()), "from": "init_heads"}
    else:
        vocab, vocab_record = draft_vocab_from(data, cfg.draft_vocab_size) if cfg.draft_vocab_size else (None, None)
    if vocab_record is not None and vocab_record["size"] < cfg.draft_vocab_size and rank == 0:
        print(f"note: --draft_vocab_size {cfg.draft_vocab_size} shrank to {vocab_record['size']}: the training "
              f"sequences hold only {vocab_record['size']} distinct tokens (more data gives a larger draft "
              "vocabulary)", file=sys.stderr, flush=True)
    objective = HeadsObjective(heads, cfg.loss, cfg.head_decay, vocab=vocab if cfg.loss_vocab == "draft" else None,
                               given_teacher=source is not None and gives_teacher(source.features))
    # held-out ranks over what the exported heads draft over (their draft vocabulary, where the run makes one), as
    # ``tokenmaxx eval`` scores them: one computation, labelled "vocab" in both records
    rank_vocab = vocab if objective.vocab is None else None
    identity = checkpoints.run_identity(cfg, heads.config, data.fingerprint, world, seen)  # checked before any work
    resumed = checkpoints.prepare(cfg.checkpoint_dir, identity, cfg.resume, rank)
    _barrier()
    read = objective.feature_layers(final_state_index(model))  # the heads' layers (+ the KL teacher's)
    if source is not None:  # 6. features
        features = source.features
    elif cfg.feature_cache:
        features = FeatureCache.build_or_open(cfg.feature_cache, model, data, cfg.seq_len, context,
                                              rank=rank, world=world, barrier=_barrier, layers=read,
                                              store_layers=cfg.feature_cache_layers)
    else:
        features = BackboneFeatures(model, data, read)
    out = Path(cfg.output_dir)
    if rank == 0:
        atomic_write_text(out / "run_config.json", _json({"resolved": cfg.to_dict(), "requested": requested}))
        atomic_write_text(out / "ds_config.resolved.json", _json(ds))
    objective.to(device)  # the heads; DeepSpeed keeps them where they are (checked in build_engine)
    engine = build_engine(objective, ds, device)  # 7. engine
    if resumed:  # 8. checkpoints
        step, before = checkpoints.load(engine, cfg.checkpoint_dir)
    else:
        step, before = 0, checkpoints.Progress()
        # WarmupCosineLR starts at iteration -1 (lr 0, and a warning) and its warm-up at iteration 0 is lr 0 again:
        # one step here makes the first optimizer step the warm-up's first (lr 0, as HF's linear warm-up does).
        engine.lr_scheduler.step()

    # 9. loop; metrics.jsonl drops what an earlier process logged after this run's starting step (logged again)
    logger = MetricsLogger(out, enabled=rank == 0, start_step=step, last_step=step >= cfg.max_steps)
    per_epoch = steps_per_epoch(len(data.train), world, cfg.micro_batch_size, cfg.grad_accum)
    order = step_micro_batches(data.train, step, per_epoch, cfg.grad_accum, cfg.seed, rank, world,
                               cfg.micro_batch_size,
                               data.window_lengths(context) if cfg.group_by_length else None)
    result = TrainResult(export_dir=cfg.heads_export_dir, steps=step)
    positions = seconds = 0.0
    if source is not None and source.score_before is not None:  # once per run (a resumed run reads it back)
        scored = out / "metrics_before.json"
        if not scored.is_file():
            if rank == 0:
                atomic_write_text(scored, _json(source.score_before()))
            _barrier()
        result.metrics_before = json.loads(scored.read_text())

    def progress() -> checkpoints.Progress:  # the run's totals so far, this process included
        return checkpoints.Progress(before.wall_seconds + time.perf_counter() - wall_start,
                                    before.step_seconds + seconds, before.positions + positions,
                                    before.processes + 1, before.known)

    bar = tqdm(total=cfg.max_steps, initial=step, desc="train heads", unit="step", disable=rank != 0)
    saved_at = step if resumed else -1
    while step < cfg.max_steps:
        lr = engine.get_lr()[0]  # this step's learning rate (the scheduler moves on inside the step)
        sums, feature_s, step_s = run_step(engine, features, data, next(order), lm_head, embed, cfg.num_heads,
                                           world, context)
        step += 1
        sums = _reduced(sums) if world > 1 else sums
        step_s = float(_reduced(torch.tensor([step_s]))[0]) / world if world > 1 else step_s
        record = step_record(step, sums, cfg.grad_accum * world, cfg.num_heads, lr, step_s, feature_s)
        result.losses.append(record["loss"])
        positions += record["positions"]
        seconds += step_s
        bar.update(1)
        bar.set_postfix(loss=record["loss"], pos_s=record["positions_per_s"])
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            logger.log(record)
        if cfg.save_every and step % cfg.save_every == 0:
            checkpoints.save(engine, cfg.checkpoint_dir, step, cfg.keep_checkpoints, rank, progress())
            saved_at = step
        if stop_after is not None and step >= stop_after:
            if saved_at != step:
                raise ValueError(f"stop_after={stop_after} is not a checkpoint step (save_every={cfg.save_every})")
            bar.close()
            logger.close()
            result.steps = step
            return result
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            logger.log({"split": "eval", "step": step, **_evaluate(objective, lm_head, embed, features, data, tree,
                                                                  cfg, rank, world, rank_vocab=rank_vocab)})
    bar.close()
    if saved_at != step:
        checkpoints.save(engine, cfg.checkpoint_dir, step, cfg.keep_checkpoints, rank, progress())
    result.metrics = _evaluate(objective, lm_head, embed, features, data, tree, cfg, rank, world, by_category=True,
                               rank_vocab=rank_vocab)
    logger.log({"split": "eval", "step": step, **result.metrics})
    logger.close()
    result.steps = step
    result.positions_per_s = positions / seconds if seconds else 0.0
    result.wall_seconds = time.perf_counter() - wall_start
    total = progress()
    extra = {"training": cfg.to_dict(), "requested": requested, "deepspeed": ds, "world_size": world,
             "machine": {**cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "device": device_name(device)},
             "data": {"path": str(cfg.data), "provenance": data.provenance, "fingerprint": data.fingerprint,
                      "rows": data.num_rows, "train_examples": len(data.train), "eval_examples": len(data.eval),
                      "dropped": data.dropped},
             "metrics": result.metrics, "steps": step, "wall_seconds": round(total.wall_seconds, 2),
             "train_positions_per_s": round(total.positions / total.step_seconds, 1) if total.step_seconds else 0.0,
             "processes": total.processes,
             **({} if total.known else {"time_note": "resumed from a checkpoint made before time was recorded: "
                                                     "wall_seconds and train_positions_per_s cover the later "
                                                     "processes only"}),
             "rank_weight_digests": rank_weight_digests(engine.module.heads, world),
             "seen_parts": sorted(set(seen) | set(part_digests(data.provenance)))}
    if init is not None:
        extra["init_heads"] = init_heads_record(init, cfg.init_heads, seen)
    if source is not None:
        extra.update(source.extra)
    if result.metrics_before:
        extra["metrics_before"] = result.metrics_before
    if vocab is not None:
        extra["_draft_vocab"], extra["draft_vocab"] = vocab, {**vocab_record, "loss": cfg.loss_vocab == "draft"}
    export_heads(engine.module.heads, cfg, extra, rank)  # 10. export
    return result


def _evaluate(objective, lm_head, embed, features, data, tree, cfg: TrainConfig, rank: int, world: int,
              by_category: bool = False, rank_vocab: torch.Tensor | None = None) -> dict:
    """Held-out metrics; ``by_category``: also per category of the data (``by_category``: {category: metrics}), when
    it has more than one. ``rank_vocab``: ``metrics.evaluate``'s."""
    def run(rows=None):
        return evaluate(objective, lm_head, features, data, tree, cfg.micro_batch_size, rank, world,
                        all_reduce=_all_reduce if world > 1 else None, embed=embed, rows=rows, rank_vocab=rank_vocab)

    metrics = run()
    groups = data.eval_by_category() if by_category else {}
    if len(groups) > 1:
        metrics["by_category"] = {category: {"eval_examples": len(rows), **run(rows)}
                                  for category, rows in groups.items()}
    return metrics


def _json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"

