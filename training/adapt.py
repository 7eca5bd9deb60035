"""Adapt trained heads to the traffic they served (``tokenmaxx adapt``): the verify pass was the teacher.

A recording (``generate(..., record=FOLDER)``, ``heads.io.traffic``) holds, for every generated position, the
backbone's states that the heads read and the backbone's own token: what a training step needs, without the backbone
forward that is most of a step's cost. ``adapt`` fine-tunes the heads on it with the trainer (``trainer.train`` with a
``TrainSource``: the same steps, checkpoints, resume and export), mixed with a replay sample of the heads' original
training data so that what they knew is kept, and ships the result only if it scores better on held-out traffic:

1. traffic    every row of every --traffic folder, the prompt's last positions the heads read and the whole answer
              (``--seq_len`` by default fits the longest); a fixed share held out by a hash of its tokens (stable
              as the recording grows)
2. replay     rows of ``--replay`` (a self-distilled dataset): a seeded sample of its training rows, and of the rows
              the heads' own run held out (the split it recorded); their features computed once by the backbone and
              cached in the run folder (``features.FeatureCache``)
3. train      cross-entropy on the backbone's tokens (greedy traffic: its argmax), or with ``--loss kl`` the KL to
              the backbone's recorded top-k (its own distribution, renormalised over the draft vocabulary; replay
              rows and rows recorded without it: their own token), from the heads' weights, over their draft
              vocabulary; the heads as they serve scored first on the held-out rows
4. ship       the candidate becomes OUT/heads when its held-out traffic tau (``tree_tau_empirical``) beats the init
              heads' as they serve (their own prompt context) by ``--min_gain``; otherwise it is removed and the
              report says why. OUT/adapt.json: before and after, per category ("traffic", "replay"), and the
              run's speed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmaxx.heads import load_backbone, load_heads
from tokenmaxx.heads.config import backbone_identity, lookback
from tokenmaxx.heads.io import traffic as traffic_store

from .batches import Example, SelfDistilledData, load_data, window_start
from .checkpoints import atomic_write_text
from .evaluation import SPLIT_FIELDS, evaluate_heads, recorded_split, recorded_training
from .features import FeatureCache, _pad_windows
from .train_config import DTYPES, LOSSES, TrainConfig, default_threads
from .trainer import TrainSource, train

log = logging.getLogger(__name__)
TRAFFIC, REPLAY = "traffic", "replay"  # the categories of the run's rows
REPLAY_SPLIT = "replay_split"  # config.extra of adapted heads: the replay split of the run they descend from
SCORE = "tree_tau_empirical"  # what decides shipping: the heads' expected tokens a round on held-out traffic


@dataclass
class AdaptConfig:
    heads: str = field(metadata={"help": "the heads to adapt: a folder or Hub id (what the traffic was served with)"})
    traffic: list[str] = field(metadata={
        "help": "folder recorded by generate(..., record=FOLDER) / generate --record; several (a service's shards or "
                "days) are adapted to as one traffic"})
    output_dir: str = field(metadata={"help": "run folder: checkpoints/, metrics.jsonl, adapt.json, and heads/ when "
                                              "the adapted heads win"})
    replay: str | None = field(default=None, metadata={
        "help": "self-distilled dataset the heads were trained on, or a folder of its make-data parts (the shipped "
                "heads': distilled/smollm2-mix, merged into the run folder once): a sample of it is mixed in so that "
                "what the heads knew is kept, and its held-out rows are scored before and after"})
    replay_share: float = field(default=2.0, metadata={
        "help": "replay answer tokens per traffic answer token trained on (2: two to one; less let the categories "
                "the traffic lacks fall)"})
    replay_eval: int = field(default=64, metadata={"help": "held-out replay rows scored before and after"})
    loss: str = field(default="ce", metadata={
        "help": "ce: cross-entropy on the backbone's tokens; kl: KL to its recorded top-k (soft targets: how sure it "
                "was, and its runners-up; the replay rows and rows recorded without a top-k: their token); ce+kl: "
                "both"})
    held_out: float = field(default=0.1, metadata={"help": "share of the traffic rows held out for the score"})
    min_gain: float = field(default=0.0, metadata={
        "help": "ship only if held-out traffic tau rises by more than this"})
    prompt_context: int | None = field(default=512, metadata={
        "help": "the prompt's last positions the adapted heads read before the answer (HeadsConfig.prompt_context): "
                "what they translate or summarise is there; None: the heads' own"})
    backbone: str | None = field(default=None, metadata={"help": "backbone; default: the one the heads name"})
    dtype: str = field(default="auto", metadata={"help": f"one of {DTYPES}"})
    device: str = field(default="auto", metadata={"help": "cpu | cuda[:N] | auto"})
    threads: int = field(default_factory=default_threads, metadata={"help": "torch CPU threads"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    lr: float = field(default=3e-4, metadata={"help": "peak AdamW learning rate (a third of training's: the heads are "
                                                      "trained)"})
    warmup: int = field(default=10, metadata={"help": "warm-up steps"})
    micro_batch_size: int = field(default=8, metadata={"help": "rows per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int | None = field(default=None, metadata={
        "help": "tokens per row at most (prompt tail + answer; answer tokens past it are not trained on); default: "
                "the longest recorded row's, so every recorded answer token trains"})
    seed: int = field(default=0, metadata={"help": "seed of the replay sample and the data order"})
    save_every: int = field(default=25, metadata={"help": "checkpoint every N steps (and at the end)"})
    resume: bool = field(default=False, metadata={"help": "go on from the run folder's newest checkpoint"})

    def __post_init__(self):
        if isinstance(self.traffic, (str, Path)):
            self.traffic = [str(self.traffic)]
        if not self.traffic:
            raise ValueError("--traffic needs at least one recorded folder")
        for name in ("max_steps", "micro_batch_size", "grad_accum", "seq_len", "threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"--held_out must be in (0, 1), got {self.held_out!r}")
        if self.replay_share < 0 or self.replay_eval < 0:
            raise ValueError("--replay_share and --replay_eval must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {LOSSES}, got {self.loss!r}")


class Recordings:
    """Recorded folders read as one recording: their rows one after another (each folder's ``TrafficReader``)."""

    def __init__(self, folders: list[str]):
        self.readers = [traffic_store.TrafficReader(folder) for folder in folders]
        self.index = [(reader, i) for reader in self.readers for i in range(len(reader))]

    def __len__(self) -> int:
        return len(self.index)

    def prompt_len(self, i: int) -> int:
        reader, j = self.index[i]
        return reader.prompt_len(j)

    def row_len(self, i: int) -> int:
        reader, j = self.index[i]
        return reader.row_len(j)

    def ids(self, i: int) -> torch.Tensor:
        reader, j = self.index[i]
        return reader.ids(j)

    def features(self, i: int, start: int = 0) -> torch.Tensor:
        reader, j = self.index[i]
        return reader.features(j, start)

    def topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        reader, j = self.index[i]
        return reader.topk(j)


class RecordedFeatures:
    """``window(i, start)`` of recorded row i: its features from ``start`` on, one zero row for the last position
    (whose state no forward computed, and whose anchor has no target)."""

    def __init__(self, reader: Recordings):
        self.reader = reader

    def window(self, key: tuple[int, int], start: int) -> torch.Tensor:
        """key: (recorded row, the positions its example skips at the start of the recorded prompt)."""
        i, skip = key
        states = self.reader.features(i, skip + start)
        return torch.cat([states, states.new_zeros(1, states.shape[1])])

    def topk_window(self, key: tuple[int, int], start: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The recorded top-k at the window's ``length`` positions from ``start``: ids [length, k] and log-probs
        (-inf at the prompt positions before the last, which have none); None for a row recorded without it."""
        i, skip = key
        top = self.reader.topk(i)
        if top is None:
            return None
        ids, logp = top
        first = self.reader.prompt_len(i) - 1 - (skip + start)  # window position of the recorded top-k's first row
        out_ids = torch.zeros(length, ids.shape[1], dtype=torch.long)
        out_logp = torch.full((length, ids.shape[1]), float("-inf"))
        lo, hi = max(first, 0), min(length, first + ids.shape[0])
        if hi > lo:
            out_ids[lo:hi], out_logp[lo:hi] = ids[lo - first: hi - first].long(), logp[lo - first: hi - first].float()
        return out_ids, out_logp


class MixedFeatures:
    """The run's ``hidden(batch)``: each row's window from where it lives (recorded traffic or the replay cache), in
    the backbone's dtype, on its device."""

    def __init__(self, where: dict[int, tuple[object, int]], device: torch.device, dtype: torch.dtype):
        self.where, self.device, self.dtype = where, device, dtype  # run row -> (source, its row there)

    def hidden(self, batch) -> torch.Tensor:
        windows = []
        for row, start, length in zip(batch.rows, batch.starts, batch.lengths.tolist()):
            source, key = self.where[row]
            windows.append(source.window(key, start)[:length].to(self.dtype))
        return _pad_windows(windows, batch.input_ids.shape[1]).to(self.device)

    def teacher(self, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's recorded top-k teacher: ids and log-probs [B, W, k] (-inf where a position or row has none);
        None when no row of the batch has one (``losses.sparse_teacher`` then teaches each position its token)."""
        tops = []
        for row, start, length in zip(batch.rows, batch.starts, batch.lengths.tolist()):
            source, key = self.where[row]
            window = getattr(source, "topk_window", None)
            tops.append(None if window is None else window(key, start, length))
        if all(t is None for t in tops):
            return None
        width, k = batch.input_ids.shape[1], max(t[0].shape[1] for t in tops if t is not None)
        ids = torch.zeros(len(tops), width, k, dtype=torch.long)
        logp = torch.full((len(tops), width, k), float("-inf"))
        for b, top in enumerate(tops):
            if top is not None:
                ids[b, :top[0].shape[0], :top[0].shape[1]], logp[b, :top[1].shape[0], :top[1].shape[1]] = top
        return ids.to(self.device), logp.to(self.device)


def check_traffic(meta: dict, heads, model, folder, context: int) -> None:
    """The recording was made by these heads' kind of features on this backbone and keeps the prompt positions a
    ``context`` lookback reads (one error naming each field)."""
    ident, revision = backbone_identity(model)
    layers = list(heads.config.feature_layers) if heads.config.feature_layers else None
    wanted = {"backbone": ident, "backbone_revision": revision, "feature_layers": layers}
    differ = [f"{k}: recorded {meta.get(k)!r}, these heads need {v!r}" for k, v in wanted.items() if meta.get(k) != v]
    if meta.get("lookback", 0) < context:
        differ.append(f"lookback: recorded {meta.get('lookback')!r} prompt positions, --prompt_context needs >= "
                      f"{context}")
    if differ:
        raise ValueError(f"--traffic {folder} was not recorded for these heads ({'; '.join(differ)}): record with "
                         "them (generate(..., record=FOLDER) with these heads on this backbone)")


def held_out_row(ids: torch.Tensor, share: float) -> bool:
    """Whether a row is held out: a hash of its tokens, so a row keeps its side as the recording grows."""
    digest = hashlib.sha256(ids.numpy().astype("int64").tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def traffic_windows(reader, context: int) -> list[tuple[int, int, int]]:
    """(first position read, prompt positions read, answer tokens) of each recorded row: the prompt's last
    ``context`` + 1 positions, then the answer."""
    windows = []
    for i in range(len(reader)):
        prompt_len = reader.prompt_len(i)
        skip = window_start(prompt_len, context)
        windows.append((skip, prompt_len - skip, reader.row_len(i) - prompt_len))
    return windows


def traffic_examples(reader, seq_len: int, share: float, context: int) -> tuple[list[Example], list[bool], list]:
    """Examples of the recorded rows (run rows 0..n-1): the prompt's last ``context`` + 1 positions and the answer,
    cut to ``seq_len``; whether each is held out; and where each one's features are (``RecordedFeatures`` keys).
    Rows whose answer ``seq_len`` cuts are counted in a warning (a longer ``--seq_len`` keeps them whole)."""
    examples, held, keys, cut, lost = [], [], [], 0, 0
    for i, (skip, prompt_part, answer) in enumerate(traffic_windows(reader, context)):
        cut += prompt_part + answer > seq_len
        lost += max(0, prompt_part + answer - max(seq_len, prompt_part))
        if prompt_part >= seq_len or not answer:  # no answer token inside seq_len
            continue
        ids = reader.ids(i)
        examples.append(Example(len(examples), ids[skip: skip + seq_len].clone(), prompt_part, TRAFFIC))
        held.append(held_out_row(ids, share))
        keys.append((i, skip))
    if cut:
        log.warning("--seq_len %d cuts the answers of %d of %d recorded rows (%d answer tokens not trained on, %d "
                    "rows left without any): the prompt's last %d positions come first", seq_len, cut, len(reader),
                    lost, len(reader) - len(examples), context + 1)
    return examples, held, keys


def replay_dataset(path: str | Path, out: Path) -> Path:
    """``--replay`` as one dataset: the folder itself, or, for a folder of make-data parts (``part-*``, as
    ``distilled/smollm2-mix``), the parts merged in row order into the run folder (once; ``merge_data``)."""
    path = Path(path)
    parts = sorted(p for p in path.glob("part-*") if (p / "state.json").is_file()) if path.is_dir() else []
    if not parts or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return path
    merged = out / "replay-data"
    if not (merged / "state.json").is_file():
        from .merge_data import merge_data

        merge_data(parts, merged, overwrite=merged.exists())
    return merged


def adapt(cfg: AdaptConfig) -> dict:
    """The whole run (module docstring); returns the report also written to OUT/adapt.json."""
    out = Path(cfg.output_dir)
    heads = load_heads(cfg.heads)
    backbone = cfg.backbone or heads.config.backbone
    model, _ = load_backbone(backbone, dtype=cfg.dtype, device=cfg.device)
    model.requires_grad_(False)
    torch.set_num_threads(cfg.threads)
    reader = Recordings(cfg.traffic)
    prompt_context = cfg.prompt_context or heads.config.prompt_context
    context = lookback(dataclasses.replace(heads.config, prompt_context=prompt_context))  # what the run's windows hold
    for folder, one in zip(cfg.traffic, reader.readers):
        check_traffic(one.meta, heads, model, folder, context)
    folders = " ".join(cfg.traffic)
    seq_len = cfg.seq_len or max((p + a for _, p, a in traffic_windows(reader, context)), default=1)
    examples, held, keys = traffic_examples(reader, seq_len, cfg.held_out, context)
    if cfg.loss != "ce" and not any(one.has_topk(i) for one in reader.readers for i in range(len(one))):
        raise ValueError(f"--loss {cfg.loss} learns from the backbone's recorded top-k, but --traffic {folders} was "
                         "recorded without it (by an older tokenmaxx): record again, or use --loss ce")
    train_rows = [e.row for e, h in zip(examples, held) if not h]
    eval_rows = [e.row for e, h in zip(examples, held) if h]
    if not train_rows or not eval_rows:
        raise ValueError(f"--traffic {folders} holds {len(examples)} usable rows ({len(eval_rows)} held out) of "
                         f"{len(reader)} recorded: too few to adapt and score; record more generations"
                         + (f", or raise --seq_len {seq_len}: a row reads up to {context + 1} prompt positions "
                            "(--prompt_context) before its answer" if len(examples) < len(reader) else ""))
    recorded = RecordedFeatures(reader)
    where = {e.row: (recorded, key) for e, key in zip(examples, keys)}
    all_examples = {e.row: e for e in examples}
    digest = hashlib.sha256()
    for k, folder in enumerate(cfg.traffic):
        for path in traffic_store.shards(folder):
            digest.update(f"{k}/{path.name}:{path.stat().st_size}".encode())
    meta = reader.readers[0].meta
    provenance = {"backbone": meta["backbone"], "backbone_revision": meta["backbone_revision"],
                  "traffic": {"folders": list(cfg.traffic), "rows": len(examples), "held_out": len(eval_rows),
                              "answer_tokens": sum(len(e.ids) - e.prompt_len for e in examples)}}
    training = recorded_training(heads.config)
    split, started = replay_split(heads.config, seq_len, cfg.seed)
    if cfg.replay:
        replay = load_data(replay_dataset(cfg.replay, out), split["seq_len"], split["eval_fraction"],
                           split["eval_max_examples"], split["seed"], seen_parts=started)
        gen = torch.Generator().manual_seed(cfg.seed)
        want = cfg.replay_share * sum(len(all_examples[r].ids) - all_examples[r].prompt_len for r in train_rows)
        picked, answers = [], 0
        for i in torch.randperm(len(replay.train), generator=gen).tolist():  # until the answer tokens are enough
            if answers >= want:
                break
            e = replay.examples[replay.train[i]]
            picked.append(replay.train[i])
            answers += len(e.ids) - e.prompt_len
        picked.sort()
        scored = sorted(replay.eval[i] for i in torch.randperm(len(replay.eval), generator=gen)[:cfg.replay_eval]
                        .tolist())
        subset = dataclasses.replace(replay, examples={r: replay.examples[r] for r in picked + scored},
                                     train=picked, eval=scored)
        key = hashlib.sha256(json.dumps([replay.fingerprint, picked, scored, context]).encode()).hexdigest()[:12]
        cache = FeatureCache.build_or_open(out / f"replay-features-{key}", model, subset, seq_len, context,
                                           layers=heads.feature_layers)
        base = len(examples)
        for i, r in enumerate(picked + scored):
            e = replay.examples[r]
            all_examples[base + i] = Example(base + i, e.ids, e.prompt_len, REPLAY)
            where[base + i] = (cache, r)
        train_rows += [base + i for i in range(len(picked))]
        eval_rows += [base + len(picked) + i for i in range(len(scored))]
        digest.update(key.encode())
        provenance["replay"] = {"data": str(cfg.replay), "fingerprint": replay.fingerprint, "train_rows": len(picked),
                                "held_out_rows": len(scored)}
    data = SelfDistilledData(examples=all_examples, train=train_rows, eval=eval_rows, provenance=provenance,
                             fingerprint=digest.hexdigest(), num_rows=len(all_examples),
                             dropped=len(reader) - len(keys))
    weight = model.get_output_embeddings().weight
    features = MixedFeatures(where, weight.device, weight.dtype)
    vocab = heads.draft_vocab.cpu() if heads.draft_vocab is not None else None
    loss_vocab = training.get("loss_vocab", "full") if vocab is not None else "full"
    candidate = out / "candidate"
    train_cfg = TrainConfig(
        data=folders, output_dir=str(out), export_dir=str(candidate), seq_len=seq_len,
        seed=cfg.seed, backbone=backbone, device=cfg.device, dtype=str(weight.dtype).removeprefix("torch."),
        threads=cfg.threads, kind=heads.config.kind, num_heads=heads.config.num_heads,
        num_layers=heads.config.num_layers, share_lm_head=heads.config.share_lm_head,
        feature_layers=list(heads.config.feature_layers) if heads.config.feature_layers else None,
        init_heads=cfg.heads, prompt_context=prompt_context,
        draft_vocab_size=int(vocab.numel()) if vocab is not None else None,
        loss=cfg.loss, loss_vocab=loss_vocab, head_decay=training.get("head_decay", 0.8), max_steps=cfg.max_steps,
        lr=cfg.lr, warmup=min(cfg.warmup, cfg.max_steps), micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum, save_every=cfg.save_every, resume=cfg.resume, eval_fraction=cfg.held_out,
        eval_max_examples=len(eval_rows))
    # scored before training: the heads as they serve now (their own prompt context), what the adapted ones must beat
    served = functools.partial(evaluate_heads, heads, model, data, micro_batch_size=cfg.micro_batch_size,
                               features=features)
    result = train(train_cfg, model=model, source=TrainSource(data, features, vocab, score_before=served,
                                                              extra={REPLAY_SPLIT: {**split, "seen_parts": started}}))
    report = _report(cfg, result, data)
    shipped = out / "heads"
    if report["shipped"]:
        if shipped.exists():
            shutil.rmtree(shipped)
        candidate.rename(shipped)
    else:
        shutil.rmtree(candidate, ignore_errors=True)
    atomic_write_text(out / "adapt.json", json.dumps(report, indent=2) + "\n")
    return report


def replay_split(config, seq_len: int, seed: int) -> tuple[dict, list[str]]:
    """How the replay data splits for heads of ``config``: the split settings (``SPLIT_FIELDS``) of the training run
    they descend from and the parts that run's init heads had seen (``seen_parts``), so that the replay rows held out
    are the ones that run held out, which no run since trained on. Adapted heads carry it forward
    (``extra[REPLAY_SPLIT]``): adapting them again scores the same replay rows (their own record describes the adapt
    run, whose rows were traffic)."""
    extra = config.extra if isinstance(config.extra, dict) else {}
    carried = extra.get(REPLAY_SPLIT)
    if isinstance(carried, dict) and all(name in carried for name in SPLIT_FIELDS):
        return {name: carried[name] for name in SPLIT_FIELDS}, list(carried.get("seen_parts") or ())
    split = {"seq_len": seq_len, "eval_fraction": 0.05, "eval_max_examples": 256, "seed": seed,
             **recorded_split(config)}
    init = extra.get("init_heads") if isinstance(extra.get("init_heads"), dict) else {}
    return split, list(init.get("seen_parts") or ())  # as their run did


def _scores(metrics: dict) -> dict:
    """Per category ("traffic", "replay"; the whole held-out set when it is traffic alone): the score and depth-1
    top-1."""
    groups = metrics.get("by_category") or {TRAFFIC: metrics}
    return {c: {SCORE: m.get(SCORE), "head1_top1": (m.get("head_top1") or [None])[0]} for c, m in groups.items()}


def _report(cfg: AdaptConfig, result, data: SelfDistilledData) -> dict:
    before, after = _scores(result.metrics_before), _scores(result.metrics)
    gain = after[TRAFFIC][SCORE] - before[TRAFFIC][SCORE]
    shipped = gain > cfg.min_gain
    why = (f"held-out traffic tau {before[TRAFFIC][SCORE]:.4f} -> {after[TRAFFIC][SCORE]:.4f}"
           f"{'' if shipped else f': not above the init heads by more than --min_gain {cfg.min_gain}'}")
    return {"shipped": shipped, "heads": str(Path(cfg.output_dir) / "heads") if shipped else None, "why": why,
            "before": before, "after": after, "steps": result.steps,
            "positions_per_s": round(result.positions_per_s, 1), "wall_seconds": round(result.wall_seconds, 1),
            "rows": {"traffic_train": sum(data.examples[r].category == TRAFFIC for r in data.train),
                     "traffic_held_out": sum(data.examples[r].category == TRAFFIC for r in data.eval),
                     "replay_train": sum(data.examples[r].category == REPLAY for r in data.train),
                     "replay_held_out": sum(data.examples[r].category == REPLAY for r in data.eval)}}
