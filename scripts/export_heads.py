#!/usr/bin/env python
"""Export trained heads for a serving engine: the EAGLE-3 checkpoint vLLM and SGLang load, or speculators' layout.

    python scripts/export_heads.py --heads DIR_OR_HUB_ID --format eagle3 --output_dir OUT [--dtype bfloat16]
    python scripts/export_heads.py --heads DIR_OR_HUB_ID --format speculators --output_dir OUT [--verifier HUB_ID]

It prints the backbone folder the engines must serve (the weights the heads were trained on: for an alias, its
converted folder) and the ``vllm serve``, SGLang and ``speculators convert`` commands for this export (README "Serve
in vLLM / SGLang"); a speculators export names the backbone in its config (``--verifier``), and ``vllm serve OUT``
serves it. The backbone is loaded to read its lm_head rows at the draft vocabulary (default: the one the heads name).
Heads without a draft vocabulary on a backbone of more than 65,536 tokens get a note with the file size and how to
shrink it. Bad input ends in one `error:` line and exit status 2 (--debug: the traceback).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmaxx.heads import load_backbone, load_heads
from tokenmaxx.heads.io.backbones import resolve_backbone
from tokenmaxx.heads.io.eagle3_export import export_eagle3
from tokenmaxx.heads.io.speculators_export import export_speculators
from tokenmaxx.scripts.errors import flag_parser, run_script

# format -> what it is for (the --format help)
FORMATS = {"eagle3": "the EAGLE-3 checkpoint vLLM and SGLang take beside the backbone (--speculative-config / "
                     "--speculative-draft-model-path)",
           "speculators": "the vLLM project's speculators layout: speculators loads it with no flag and "
                          "`vllm serve FOLDER` serves it alone (the backbone is named in it)"}
DTYPES = ("auto", "bfloat16", "float16", "float32")
SERVING_DTYPE = "bfloat16"  # --dtype auto: what vLLM and SGLang run EAGLE-3 drafts in on a GPU
LARGE_VOCAB = 65536  # above this, an export without a draft vocabulary gets a note on its size
SUGGESTED_DRAFT_VOCAB = 32768


@dataclass
class ExportArgs:
    heads: str = field(metadata={"help": "heads folder or Hub id (kind eagle3 for --format eagle3)"})
    output_dir: str = field(metadata={"help": "folder to write (refused if it exists and is not empty, unless "
                                              "--overwrite)"})
    format: str = field(default="eagle3", metadata={
        "help": "checkpoint format: " + "; ".join(f"{name}: {what}" for name, what in FORMATS.items())})
    verifier: str | None = field(default=None, metadata={
        "help": "--format speculators: the backbone as the serving machine names it, written into the config (a Hub "
                "id, or a folder there); default: the backbone's folder here"})
    backbone: str | None = field(default=None, metadata={
        "help": "backbone alias / folder / Hub id (default: the one the heads were made for)"})
    dtype: str = field(default="auto", metadata={
        "help": f"weights dtype of the export, one of {DTYPES}: auto = {SERVING_DTYPE}, the dtype serving engines "
                "run the draft in on a GPU (the export is written, not computed, on this machine, so unlike train, "
                "eval and generate its bf16 support does not matter)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder"})

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown --format {self.format!r}: expected one of {sorted(FORMATS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.verifier is not None and self.format != "speculators":
            raise ValueError("--verifier names the backbone inside a --format speculators export; the eagle3 format "
                             "does not name it (the engines take it as their --model)")


def size_note(heads, model, dtype: str) -> str | None:
    """A note for heads that draft over a whole vocabulary of more than LARGE_VOCAB tokens: the export's size (the
    lm_head rows of every token dominate it) and how a draft vocabulary shrinks it; None otherwise."""
    vocab = heads.config.vocab_size
    if heads.draft_vocab is not None or vocab <= LARGE_VOCAB:
        return None
    hidden = model.get_output_embeddings().weight.shape[1]
    weights = sum(t.numel() for name, t in heads.state_dict().items() if name != "draft_vocab") + vocab * hidden
    size = weights * getattr(torch, dtype).itemsize + vocab * 9  # + d2t (int64) and t2d (bool) per token
    return (f"note: these heads draft over the whole {vocab:,}-token vocabulary, so the export will be about "
            f"{size / 1e6:,.0f} MB, most of it lm_head rows; a draft vocabulary (train --draft_vocab_size "
            f"{SUGGESTED_DRAFT_VOCAB}, or scripts/draft_vocab.py --size {SUGGESTED_DRAFT_VOCAB} on these heads) "
            "makes it smaller and drafting cheaper")


def serve_commands(heads, backbone: str, out: Path) -> dict[str, str]:
    """The vLLM and SGLang commands that serve ``backbone`` (a folder or Hub id) with the EAGLE-3 export in ``out``:
    draft steps = the heads' depth; SGLang's tree = the heads' own dynamic tree (its top-k and node count) where
    they have one."""
    depth = heads.config.num_heads
    tree = heads.tree_settings(heads.config, None)
    topk = min(getattr(tree, "topk", None) or 4, 8)
    nodes = getattr(tree, "nodes", None) or 16
    model, draft = shlex.quote(backbone), shlex.quote(str(out))
    config = shlex.quote(json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": depth}))
    return {"vLLM": f"vllm serve {model} --speculative-config {config}",
            "SGLang": f"python -m sglang.launch_server --model-path {model} --speculative-algorithm EAGLE3 "
                      f"--speculative-draft-model-path {draft} --speculative-num-steps {depth} "
                      f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {nodes}"}


def main(argv=None) -> int:
    (args,) = flag_parser(ExportArgs, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    heads = load_heads(args.heads)
    backbone = args.backbone or heads.config.backbone
    if not backbone:
        raise ValueError(f"the heads in {args.heads} name no backbone: pass --backbone")
    dtype = SERVING_DTYPE if args.dtype == "auto" else args.dtype
    model, _ = load_backbone(backbone, dtype="float32", device="cpu")
    note = size_note(heads, model, dtype)
    if note:
        print(note, file=sys.stderr, flush=True)
    served = resolve_backbone(backbone)  # an alias's converted folder; a folder or Hub id as given
    served = str(Path(served).resolve()) if Path(served).exists() else served
    if args.format == "speculators":
        out = export_speculators(heads, model, args.output_dir, verifier=args.verifier or served, dtype=dtype,
                                 overwrite=args.overwrite).resolve()
        print(written(args.format, out, dtype))
        print(f"verifier named in it: {args.verifier or served}")
        print(f"serve with vLLM: vllm serve {shlex.quote(str(out))}")
        print(f"load with speculators: SpeculatorModel.from_pretrained({str(out)!r})")
        return 0
    out = export_eagle3(heads, model, args.output_dir, dtype=dtype, overwrite=args.overwrite).resolve()
    print(written(args.format, out, dtype))
    print(f"backbone to serve (the weights the heads were trained on): {served}")
    for engine, command in serve_commands(heads, served, out).items():
        print(f"serve with {engine}: {command}")
    print(f"convert for speculators: {convert_command(heads, served, out)} (or export --format speculators)")
    return 0


def written(fmt: str, out: Path, dtype: str) -> str:
    """The line that says what an export wrote."""
    return f"wrote {fmt} checkpoint {out} ({dtype}): " + ", ".join(sorted(p.name for p in out.iterdir()))


def convert_command(heads, backbone: str, out: Path) -> str:
    """``speculators convert`` of an eagle3 export, with what its converter does not read from the config: the fused
    layers and norm_before_residual (``--format speculators`` writes that layout directly)."""
    kwargs = json.dumps({"eagle_aux_hidden_state_layer_ids": list(heads.feature_layers),
                         "norm_before_residual": False})
    return (f"speculators convert {shlex.quote(str(out))} --algorithm eagle3 --verifier {shlex.quote(backbone)} "
            f"--algorithm-kwargs {shlex.quote(kwargs)} --output-path OUT")


if __name__ == "__main__":
    sys.exit(run_script(main))
