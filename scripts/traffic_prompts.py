#!/usr/bin/env python
"""Prompts of one shape from public text, to record as traffic (generate --prompts_file F --record DIR) and adapt to.

    python scripts/traffic_prompts.py --shape translate --count 320 --exclude ../shared/bench --out translate.jsonl
    python scripts/traffic_prompts.py --shape translate --language German --packages django wagtail plone.app.locales \
        --count 800 --exclude ../shared/bench --out german.jsonl
    python scripts/traffic_prompts.py --shape summarize --source news --count 320 --exclude ../shared/bench \
        --out news.jsonl
    python scripts/traffic_prompts.py --shape question --count 320 --exclude ../shared/bench --out questions.jsonl
    python scripts/traffic_prompts.py --shape rag --count 400 --exclude ../shared/bench --out rag.jsonl
    python scripts/traffic_prompts.py --shape math --count 600 --exclude ../shared/bench --out math.jsonl

translate: "Translate <Language> to English: <text>" over the sentences of installed packages' gettext catalogs
(``--packages``, located and never imported: ``pip install --no-deps django==5.2.9 wagtail==8.0.1
plone.app.locales==7.0.4``) and ShareGPT's German paragraphs and their sentences; ``--language`` keeps one source
language. summarize: "<ask>\n\n<passage>" over prose that ShareGPT's users pasted (``--source sharegpt``, 60-300
words; the training prompt mix summarises assistant answers instead, so the two never share a passage) or over the
news reports of gensim's Lee corpus (``--source news``: 350 ABC news articles in gensim's test data; ``pip install
--no-deps gensim==4.4.0``). question: the short standalone questions that open ShareGPT conversations. rag:
retrieval-augmented questions: five 100-word Wikipedia passages ("<title> <text>" a line: the one a question is
about, two more of its article, two of others, shuffled) and a question about the first passage's article section,
over the 106 articles of gensim's Wikipedia sample (its test data; wikitext read with ``mwparserfromhell``). math:
math questions in words: ShareGPT's word problems (a user's turn of 60-700 characters, two numbers or more, a quantity
asked, no code) and the problems of mathgenerator's generators that read as words (four words outside the formulas; at
most ten distinct a generator; ``pip install mathgenerator==1.5.0``). Seeded; records equal to an --exclude prompt are
dropped. Writes {"prompt": ...} lines.
"""

from __future__ import annotations

import bz2
import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from tokenmaxx.scripts.errors import parse_flags, run_script
from tokenmaxx.scripts.make_text_data import installed_package_root
from tokenmaxx.training.data import load_exclusions, normalize, read_json_array, sharegpt_path
from tokenmaxx.training.prompt_mix import SUMMARY_ASKS, _clean, _prose, language
from tokenmaxx.training.text_mix import CATALOG_LOCALES, read_catalogs

SHAPES = ("translate", "summarize", "question", "rag", "math")
SOURCES = ("sharegpt", "news")
GERMAN = re.compile(r"\b(und|der|die|das|nicht|ist|mit|für|ein|eine|auf|sich|auch|werden)\b")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ„\"])")
NEWS_FILES = ("lee_background.cor", "lee.cor")  # gensim/test/test_data: one news report a line
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"  # gensim/test/test_data
NOT_PROSE_SECTIONS = re.compile(r"^(see also|references|notes|footnotes|citations|external links|further reading"
                                r"|bibliography|sources|works|discography|filmography)\b", re.I)
RAG_QUESTIONS = ("What is {}?", "What is known about {}?", "What do the passages say about {}?",
                 "Can you explain {}?", "Tell me about {}.")
RAG_OWN, RAG_OTHERS = 2, 2  # passages beside the asked one: more of its article, and of other articles
QUESTION = re.compile(r"^(who|what|when|where|which|why|how (many|much|long|old|far|tall|big)|is|are|was|were|did|does"
                      r"|do) ", re.I)
MARKUP = re.compile(r"[`{}<>#*|=_\\]|http")  # code, markup or links: not prose
QUANTITY_ASKED = re.compile(r"\b(how (many|much|long|far|old)|in total|altogether|left over"
                            r"|per (hour|day|week|month|year|person))\b", re.I)
CODE = re.compile(r"[{}<>=;#`|\\]|\bdef |\bimport |http")
NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
WORD = re.compile(r"[A-Za-z]{2,}")
FORMULA = re.compile(r"\$[^$]*\$")
MATH_DRAWS = 10  # distinct problems a mathgenerator generator gives at most; one that gives under 3 is dropped
CONTEXTUAL = re.compile(r"\b(this|that|these|those|above|below|previous|step|it|me|my|i|we|our|code|script|python"
                        r"|function)\b", re.I)  # refers to something before it, or not a fact


@dataclass
class TrafficPromptArgs:
    shape: str = field(metadata={"help": f"one of {SHAPES}"})
    out: str = field(metadata={"help": "the .jsonl file to write"})
    count: int = field(default=320, metadata={"help": "prompts to write"})
    exclude: list[str] = field(default_factory=list, metadata={"help": "benchmark prompts never to use"})
    seed: int = field(default=0, metadata={"help": "seed of the sample"})
    language: str | None = field(default=None, metadata={
        "help": f"translate: the one source language to keep, one of {sorted(CATALOG_LOCALES)}; default: all"})
    packages: list[str] = field(default_factory=lambda: ["django"], metadata={
        "help": "translate: installed packages whose gettext catalogs give the sentences"})
    source: str = field(default="sharegpt", metadata={"help": f"summarize: the passages, one of {SOURCES}"})

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {SHAPES}, got {self.shape!r}")
        if self.language is not None and self.language not in CATALOG_LOCALES:
            raise ValueError(f"--language must be one of {sorted(CATALOG_LOCALES)}, got {self.language!r}")
        if self.source not in SOURCES:
            raise ValueError(f"--source must be one of {SOURCES}, got {self.source!r}")
        if self.count <= 0:
            raise ValueError(f"--count must be positive, got {self.count}")


def _paragraphs(roles: tuple[str, ...]):
    for record in read_json_array(sharegpt_path()):
        for turn in record.get("conversations", []):
            if turn.get("from") in roles:
                for para in str(turn.get("value", "")).split("\n\n"):
                    yield _clean(para)


def package_root(name: str, why: str) -> Path:
    root = installed_package_root(name)
    if root is None:
        raise ValueError(f"package {name!r} is not installed ({why}): pip install --no-deps {name}")
    return root


def _german(text: str) -> bool:
    return len(GERMAN.findall(text.lower())) >= max(2, len(text.split()) // 8) and not MARKUP.search(text)


def translate_texts(packages: list[str], language: str | None = None) -> list[str]:
    """Catalog messages of 5+ words and ShareGPT's German paragraphs (15-120 words) and sentences (6-60 words)."""
    languages = [language] if language else list(CATALOG_LOCALES)
    texts = set()
    for package in packages:
        for name, pairs in read_catalogs(package_root(package, "its message catalogs"), languages).items():
            texts |= {f"Translate {name} to English: {foreign}" for _, foreign in pairs
                      if len(foreign.split()) >= 5 and not re.search(r"[%{<$]", foreign)}
    if "German" in languages:
        for para in _paragraphs(("human", "gpt")):
            if not (_german(para) and _prose(para)):
                continue
            if 15 <= len(para.split()) <= 120:
                texts.add(f"Translate German to English: {para}")
            for sentence in SENTENCE_END.split(para):
                if 6 <= len(sentence.split()) <= 60 and sentence[-1] in ".!?" and _german(sentence):
                    texts.add(f"Translate German to English: {sentence}")
    return sorted(texts)


def news_passages() -> list[str]:
    """The news reports of gensim's Lee corpus (gensim/test/test_data; one report a line, cp1252 bytes in places)."""
    passages = []
    for name in NEWS_FILES:
        path = gensim_test_file(name)
        passages += [" ".join(line.split()) for line in path.read_bytes().decode("cp1252").splitlines() if line.strip()]
    return passages


def gensim_test_file(name: str) -> Path:
    path = package_root("gensim", f"its test data holds {name}") / "test" / "test_data" / name
    if not path.is_file():
        raise ValueError(f"{path} is missing: gensim's wheel (4.4.0) ships it; reinstall gensim")
    return path


def wiki_passages(words: int = 100) -> list[tuple[str, str | None, str]]:
    """(title, section heading or None for the lead, passage) over the articles of gensim's Wikipedia sample: each
    section's prose paragraphs (20+ words; references, headings and lists dropped) cut into ``words``-word passages
    (a last piece of at least half that kept), in the dump's order."""
    try:
        import mwparserfromhell
    except ImportError:
        raise ValueError("--shape rag reads wikitext with mwparserfromhell: pip install mwparserfromhell") from None
    passages = []
    for _, element in ElementTree.iterparse(bz2.open(gensim_test_file(WIKI_FILE))):
        namespace, _, tag = element.tag.rpartition("}")
        if tag != "page":
            continue
        ns = namespace + "}" if namespace else ""
        title, text = element.findtext(f"{ns}title"), element.findtext(f"{ns}revision/{ns}text") or ""
        element.clear()
        if text.lstrip().lower().startswith("#redirect"):
            continue
        for section in mwparserfromhell.parse(text).get_sections(flat=True, include_lead=True):
            headings = section.filter_headings(recursive=False)
            heading = (headings[0].title.strip_code().strip() or None) if headings else None
            if heading is not None and NOT_PROSE_SECTIONS.match(heading):
                continue
            for node in [*headings, *(t for t in section.filter_tags() if str(t.tag).strip().lower() == "ref")]:
                try:
                    section.remove(node)
                except ValueError:  # inside a node removed already
                    pass
            prose = [" ".join(p.split()) for p in section.strip_code().split("\n") if len(p.split()) >= 20]
            flat = " ".join(prose).split()
            passages += [(title, heading, " ".join(flat[i:i + words]))
                         for i in range(0, len(flat), words) if len(flat) - i >= words // 2]
    return passages


def rag_texts(rng: random.Random) -> list[str]:
    """One retrieval-augmented prompt a Wikipedia passage (see the module's docstring)."""
    passages = wiki_passages()
    by_title: dict[str, list[int]] = {}
    for i, (title, _, _) in enumerate(passages):
        by_title.setdefault(title, []).append(i)
    others_of = {title: [j for j in range(len(passages)) if passages[j][0] != title] for title in by_title}
    texts = []
    for i, (title, heading, _) in enumerate(passages):
        own, others = [j for j in by_title[title] if j != i], others_of[title]
        if len(own) < RAG_OWN or len(others) < RAG_OTHERS:
            continue
        chosen = [i, *rng.sample(own, RAG_OWN), *rng.sample(others, RAG_OTHERS)]
        rng.shuffle(chosen)
        if heading is None:
            subject = title
        else:  # "the history of Alaska", "the medieval Europe of Alchemy"; acronyms keep their capitals
            subject = f"the {heading[0].lower() + heading[1:] if heading[1:2].islower() else heading} of {title}"
        question = rng.choice(RAG_QUESTIONS).format(subject)
        texts.append("\n".join(f"{passages[j][0]} {passages[j][2]}" for j in chosen) + "\n" + question)
    return texts


def summarize_texts(rng: random.Random, source: str = "sharegpt") -> list[str]:
    if source == "news":
        passages = set(news_passages())
    else:
        passages = {p for p in _paragraphs(("human",))
                    if 60 <= len(p.split()) <= 300 and _prose(p) and language(p) == "en"}
    return [f"{rng.choice(SUMMARY_ASKS)}\n\n{p}" for p in sorted(passages)]


def question_texts() -> list[str]:
    """Short standalone questions (4-20 words, one question mark, a wh-word or an auxiliary first, nothing that refers
    to an earlier turn) that open a ShareGPT conversation."""
    texts = set()
    for record in read_json_array(sharegpt_path()):
        turns = record.get("conversations", [])
        if not turns or turns[0].get("from") != "human":
            continue
        text = " ".join(str(turns[0].get("value", "")).split())
        if (4 <= len(text.split()) <= 20 and text.endswith("?") and text.count("?") == 1 and QUESTION.match(text)
                and not CONTEXTUAL.search(text) and not MARKUP.search(text) and language(text) == "en"):
            texts.add(text)
    return sorted(texts)


def word_problem_texts() -> list[str]:
    """ShareGPT users' turns that pose a word problem: 60-700 characters, two numbers or more, a quantity asked (how
    many, how much, in total, per day...), no code or markup, English, ending in a question mark or a full stop."""
    texts = set()
    for record in read_json_array(sharegpt_path()):
        for turn in record.get("conversations", []):
            text = " ".join(str(turn.get("value", "")).split())
            if (turn.get("from") == "human" and 60 <= len(text) <= 700 and len(NUMBER.findall(text)) >= 2
                    and QUANTITY_ASKED.search(text) and not CODE.search(text) and text.endswith(("?", "."))
                    and language(text) == "en"):
                texts.add(text)
    return sorted(texts)


def generated_math_texts(seed: int, draws: int = MATH_DRAWS) -> list[str]:
    """The problems of mathgenerator's generators that read as words (four words of two letters or more outside the
    ``$...$`` formulas; a draw that raises counts as a try): up to ``draws`` distinct ones a generator in ``4 *
    draws`` tries, drawn from ``random`` seeded with ``seed`` (mathgenerator draws from the module's state, restored
    after); a generator that gives under 3 (a fixed text) is dropped."""
    try:
        import mathgenerator
    except ImportError:
        raise ValueError("--shape math draws problems from mathgenerator: pip install mathgenerator==1.5.0") from None
    state = random.getstate()
    random.seed(seed)
    texts = []
    try:
        for generator_id, *_ in mathgenerator.getGenList():
            got = []
            for _ in range(4 * draws):
                try:
                    problem, _answer = mathgenerator.genById(generator_id)
                except Exception:  # noqa: BLE001 - some draws of some generators fail (1.5.0); a failed try
                    continue
                text = " ".join(str(problem).split())
                if len(WORD.findall(FORMULA.sub(" ", text))) >= 4 and text not in got:
                    got.append(text)
                    if len(got) == draws:
                        break
            texts += got if len(got) >= 3 else []
    finally:
        random.setstate(state)
    return texts


def math_texts(seed: int) -> list[str]:
    return sorted(set(word_problem_texts()) | set(generated_math_texts(seed)))


def main(argv: list[str] | None = None) -> int:
    args = parse_flags(TrafficPromptArgs, argv, description=__doc__.split("\n\n")[0])
    rng = random.Random(args.seed)
    if args.shape == "translate":
        texts = translate_texts(args.packages, args.language)
    elif args.shape == "question":
        texts = question_texts()
    elif args.shape == "rag":
        texts = rag_texts(rng)
    elif args.shape == "math":
        texts = math_texts(args.seed)
    else:
        texts = summarize_texts(rng, args.source)
    excluded = load_exclusions(args.exclude)
    texts = [t for t in texts if normalize(t) not in excluded]
    if len(texts) < args.count:
        raise ValueError(f"only {len(texts)} {args.shape} prompts are available, --count asks for {args.count}")
    picked = rng.sample(texts, args.count)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in picked))
    print(json.dumps({"shape": args.shape, "available": len(texts), "written": len(picked), "out": args.out,
                      "languages": ([args.language] if args.language else sorted(CATALOG_LOCALES))
                      if args.shape == "translate" else ["English"],
                      "source": {"translate": args.packages, "summarize": args.source,
                                 "rag": "gensim Wikipedia sample",
                                 "math": "sharegpt and mathgenerator"}.get(args.shape, "sharegpt")}))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
