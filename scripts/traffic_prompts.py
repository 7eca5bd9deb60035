#!/usr/bin/env python
"""Prompts of one shape from public text, to record as traffic (generate --prompts_file F --record DIR) and adapt to.

    python scripts/traffic_prompts.py --shape translate --count 320 --exclude ../shared/bench --out translate.jsonl
    python scripts/traffic_prompts.py --shape summarize --count 320 --exclude ../shared/bench --out summarize.jsonl

translate: "Translate <Language> to English: <text>" over the sentences of Django's message catalogs (8 languages;
``pip install --no-deps django==5.2.9``) and ShareGPT's German paragraphs. summarize: "<ask>\\n\\n<passage>" over
prose that ShareGPT's users pasted (60-300 words; the training prompt mix summarises assistant answers instead, so the
two never share a passage). Seeded; records equal to an --exclude prompt are dropped. Writes {"prompt": ...} lines.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tokenmaxx.scripts.errors import parse_flags, run_script
from tokenmaxx.scripts.make_text_data import django_locale_root
from tokenmaxx.training.data import load_exclusions, normalize, read_json_array, sharegpt_path
from tokenmaxx.training.prompt_mix import SUMMARY_ASKS, _clean, _prose, language
from tokenmaxx.training.text_mix import CATALOG_LOCALES, read_catalogs

SHAPES = ("translate", "summarize")
GERMAN = re.compile(r"\b(und|der|die|das|nicht|ist|mit|für|ein|eine|auf|sich|auch|werden)\b")


@dataclass
class TrafficPromptArgs:
    shape: str = field(metadata={"help": f"one of {SHAPES}"})
    out: str = field(metadata={"help": "the .jsonl file to write"})
    count: int = field(default=320, metadata={"help": "prompts to write"})
    exclude: list[str] = field(default_factory=list, metadata={"help": "benchmark prompts never to use"})
    seed: int = field(default=0, metadata={"help": "seed of the sample"})

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {SHAPES}, got {self.shape!r}")
        if self.count <= 0:
            raise ValueError(f"--count must be positive, got {self.count}")


def _paragraphs(roles: tuple[str, ...]):
    for record in read_json_array(sharegpt_path()):
        for turn in record.get("conversations", []):
            if turn.get("from") in roles:
                for para in str(turn.get("value", "")).split("\n\n"):
                    yield _clean(para)


def translate_texts() -> list[str]:
    texts = set()
    for name, pairs in read_catalogs(django_locale_root()).items():
        texts |= {f"Translate {name} to English: {foreign}" for _, foreign in pairs
                  if len(foreign.split()) >= 5 and not re.search(r"[%{<]", foreign)}
    for para in _paragraphs(("human", "gpt")):
        words = para.split()
        if 15 <= len(words) <= 120 and len(GERMAN.findall(para.lower())) >= max(3, len(words) // 8) and _prose(para):
            texts.add(f"Translate German to English: {para}")
    return sorted(texts)


def summarize_texts(rng: random.Random) -> list[str]:
    passages = {p for p in _paragraphs(("human",)) if 60 <= len(p.split()) <= 300 and _prose(p) and language(p) == "en"}
    return [f"{rng.choice(SUMMARY_ASKS)}\n\n{p}" for p in sorted(passages)]


def main(argv: list[str] | None = None) -> int:
    args = parse_flags(TrafficPromptArgs, argv, description=__doc__.split("\n\n")[0])
    rng = random.Random(args.seed)
    texts = translate_texts() if args.shape == "translate" else summarize_texts(rng)
    excluded = load_exclusions(args.exclude)
    texts = [t for t in texts if normalize(t) not in excluded]
    if len(texts) < args.count:
        raise ValueError(f"only {len(texts)} {args.shape} prompts are available, --count asks for {args.count}")
    picked = rng.sample(texts, args.count)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in picked))
    print(json.dumps({"shape": args.shape, "available": len(texts), "written": len(picked), "out": args.out,
                      "languages": sorted(CATALOG_LOCALES) if args.shape == "translate" else ["English"]}))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
