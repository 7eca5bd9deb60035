"""TrainConfig: every knob of a head-training run, one validated dataclass (parsed by scripts/train_heads.py).

Fields that DeepSpeed also knows (lr, warmup, max_steps, grad_accum, micro_batch_size, grad_clip, weight_decay,
zero_stage, and dtype -> ``bf16.enabled``) default to None, meaning "not given on the command line": the value then
comes from the DeepSpeed JSON (``--ds_config``) when it holds a concrete value there, else from ``DEFAULTS`` below.
A flag given explicitly that disagrees with a concrete JSON value is an error (see ``ds_setup.resolve_ds_config``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmaxx.heads import DEFAULT_HEAD_KIND, HEAD_KINDS
from tokenmaxx.heads.io.backbones import DEVICE_HELP, resolve_device
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig
from tokenmaxx.heads.sequential import SequentialHeads

DEFAULT_DS_CONFIG = str(Path(__file__).with_name("ds_config.json"))
LOSSES = ("ce", "kl", "ce+kl")
LOSS_VOCABS = ("full", "draft")
DTYPES = ("auto", "float32", "bfloat16")  # auto: heads.io.backbones.resolve_dtype on the run's device
DEFAULT_THREADS = 2  # torch CPU threads of the commands (train, make-data, eval; generate and bench too)

# Defaults of the DeepSpeed-controlled fields, used when neither the flag nor the JSON gives a value.
DEFAULTS: dict[str, Any] = {"lr": 1e-3, "warmup": 20, "weight_decay": 0.0, "grad_accum": 4, "micro_batch_size": 4,
                            "grad_clip": 1.0, "zero_stage": 1, "dtype": "auto"}
THREADS_HELP = (f"torch CPU threads (per process); default: OMP_NUM_THREADS when a launcher sets it (torchrun with "
                f"several processes: 1 each), else {DEFAULT_THREADS}")


def default_threads() -> int:
    """--threads unset: OMP_NUM_THREADS when the environment sets it to a positive integer, else DEFAULT_THREADS."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_THREADS


def _ds_help(text: str, name: str) -> str:
    return f"{text} [unset: the --ds_config value, else {DEFAULTS[name]}]"


@dataclass
class TrainConfig:
    # ---- data in, run folder out (both required) ------------------------------------------------------------------
    data: str = field(metadata={"help": "self-distilled dataset folder (datasets.save_to_disk) with columns prompt, "
                                        "prompt_ids, answer_ids and a provenance.json in it (scripts/make_data.py)"})
    output_dir: str = field(metadata={
        "help": "run folder (required; nothing is written to a default place): checkpoints/, metrics.jsonl, "
                "run_config.json, ds_config.resolved.json, and heads/ unless --export_dir says otherwise"})
    seq_len: int = field(default=512, metadata={
        "help": "max tokens per sequence (prompt + answer); longer answers are cut, prompts that leave no answer "
                "token inside seq_len are dropped"})
    eval_fraction: float = field(default=0.05, metadata={
        "help": "fraction of examples held out for metrics (used when the data has no validation/test split)"})
    eval_max_examples: int = field(default=256, metadata={"help": "cap on held-out examples"})
    feature_cache: str | None = field(default=None, metadata={
        "help": "folder for the frozen backbone's cached hidden states, those the heads read (built on first use, "
                "resumable); omit to run the backbone on every micro-batch"})
    feature_cache_layers: list[int] | None = field(default=None, metadata={
        "help": "the backbone hidden states a new --feature_cache stores (indices; L = the backbone's layer count is "
                "the final-normed state medusa and mtp heads read; eagle3 reads three others); a superset of what the "
                "heads read lets runs of other kinds or --feature_layers share one cache (one backbone pass for an "
                "ablation); default: exactly what the heads read"})
    seed: int = field(default=0, metadata={"help": "seed of the train/eval split and the per-epoch data order"})
    group_by_length: bool = field(default=True, metadata={
        "help": "regroup each optimizer step's sequences into micro-batches of similar length (less padding; the "
                "step's rows and every target's weight stay the same)"})

    # ---- backbone and heads --------------------------------------------------------------------------------------
    backbone: str = field(default="smollm2-135m", metadata={
        "help": "backbone alias (see tokenmaxx.heads.BACKBONES), local HF folder, or Hub id"})
    adapter: str | None = field(default=None, metadata={
        "help": "PEFT adapter merged into the backbone (folder / Hub id)"})
    device: str = field(default="auto", metadata={
        "help": DEVICE_HELP + "; with several processes on GPUs each rank takes cuda:LOCAL_RANK"})
    dtype: str | None = field(default=None, metadata={
        "help": _ds_help(f"backbone and head compute dtype, one of {DTYPES}: auto = bfloat16 where it is native (a "
                         "GPU, a CPU with AVX-512 BF16 / AMX), else float32 (emulated bf16 is slow on an AVX2-only "
                         "CPU), as in generate, make-data and eval; bfloat16 is DeepSpeed bf16 with fp32 master "
                         "weights (JSON bf16.enabled)", "dtype")})
    threads: int = field(default_factory=default_threads, metadata={"help": THREADS_HELP})
    kind: str = field(default=DEFAULT_HEAD_KIND, metadata={
        "help": f"head kind, one of {sorted(HEAD_KINDS)}: 'eagle3' (the default: the shipped heads' kind, the one "
                "`export` writes) = one Llama decoder layer over a fusion of three backbone layers' states, unrolled "
                "K times, 'mtp' = one "
                "decoder block of the backbone's family on its last hidden state, unrolled K times, each guess "
                "conditioned on the last, 'medusa' = K independent heads on the last hidden state"})
    num_heads: int = field(default=4, metadata={
        "help": "number of heads (medusa) or draft depth (sequential kinds: eagle3, mtp): head k, or depth d = k, "
                "predicts the token k+1 positions ahead"})
    num_layers: int = field(default=1, metadata={
        "help": "residual blocks per head (medusa) or decoder layers (mtp, >= 1; eagle3: always 1)"})
    feature_layers: list[int] | None = field(default=None, metadata={
        "help": "kind eagle3: the backbone hidden states the draft fuses (indices; i = the input of layer i); default "
                "EAGLE-3's (2, L//2, L-3)"})
    share_lm_head: bool = field(default=True, metadata={
        "help": "project with the backbone's frozen lm_head (small checkpoints) instead of a trained copy per head "
                "(eagle3, mtp: always)"})

    init_heads: str | None = field(default=None, metadata={
        "help": "start from these trained heads (folder or Hub id) instead of fresh ones: continue training on more "
                "data, or adapt shipped heads to your own. Same kind, depths, layers and backbone; their serving tree "
                "is kept. Where --data shares parts with their training data (by the parts' provenance), held-out "
                "rows come only from the other parts (--eval_fraction of them) and copy no row of a shared part; a validation "
                "split in --data is used as it is"})
    prompt_context: int | None = field(default=None, metadata={
        "help": "sequential kinds: the prompt's last positions the module reads before the answer, in training and "
                "drafting (recorded in the heads); default: the --init_heads' setting, else num_heads + 1"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "give the exported heads a draft vocabulary: the N most frequent tokens of the training sequences "
                "(drafting then projects onto those + the prompt's tokens: much cheaper guesses); unset = all tokens"})

    dynamic_tree: str | None = field(default=None, metadata={
        "help": "the serving tree written into the exported heads' config (sequential kinds: mtp, eagle3): "
                "'dynamic:N' (N nodes) or 'dynamic:nodes=N,topk=K,depth=D,min_mass=M' (any subset), or 'default' "
                "(the library's, 32 nodes); unset: the --init_heads' tree, else the library's. The export records it "
                "(what the heads generate with) and the held-out tau is scored on a tree of its node budget "
                "(tree_nodes); the weights do not depend on it, so a resume may change it. tree='auto' measures the "
                "best one on a given machine"})

    # ---- objective -----------------------------------------------------------------------------------------------
    loss_vocab: str = field(default="full", metadata={
        "help": f"one of {LOSS_VOCABS}: score the heads over all tokens, or only over the draft vocabulary (needs "
                "--draft_vocab_size; the frozen lm_head projection, most of a step, shrinks by V/Vd, ~3x for SmolLM2 "
                "at 16K; targets outside it are not trained, and held-out metrics count them as misses)"})
    loss: str = field(default="ce", metadata={
        "help": f"one of {LOSSES}: cross-entropy on the self-distilled tokens, KL to the backbone's own "
                "distribution at t+k, or their sum"})
    head_decay: float = field(default=0.8, metadata={"help": "head k's loss weight is head_decay**(k-1)"})

    # ---- optimisation (unset: the DeepSpeed JSON's concrete value, else the default in brackets) -------------------
    ds_config: str = field(default=DEFAULT_DS_CONFIG, metadata={
        "help": "DeepSpeed JSON config; its 'auto' values are filled from the flags below"})
    max_steps: int | None = field(default=None, metadata={
        "help": "optimizer steps to train (scheduler total_num_steps); exclusive with --epochs"})
    epochs: float | None = field(default=None, metadata={"help": "epochs to train (1 when --max_steps and the JSON's "
                                                                 "total_num_steps are unset)"})
    lr: float | None = field(default=None, metadata={"help": _ds_help("peak AdamW learning rate", "lr")})
    warmup: int | None = field(default=None, metadata={
        "help": _ds_help("linear warm-up steps before the cosine decay", "warmup")})
    weight_decay: float | None = field(default=None, metadata={"help": _ds_help("AdamW weight decay", "weight_decay")})
    grad_accum: int | None = field(default=None, metadata={
        "help": _ds_help("micro-batches per optimizer step and process", "grad_accum")})
    micro_batch_size: int | None = field(default=None, metadata={
        "help": _ds_help("sequences per micro-batch and process", "micro_batch_size")})
    grad_clip: float | None = field(default=None, metadata={
        "help": _ds_help("gradient norm clip, 0 = off", "grad_clip")})
    zero_stage: int | None = field(default=None, metadata={"help": _ds_help("ZeRO stage 0, 1 or 2", "zero_stage")})

    # ---- run -----------------------------------------------------------------------------------------------------
    export_dir: str | None = field(default=None, metadata={"help": "where the trained heads are exported "
                                                                    "(default: OUTPUT_DIR/heads)"})
    save_every: int = field(default=200, metadata={"help": "checkpoint every N optimizer steps (and at the end); 0 = "
                                                           "only at the end"})
    keep_checkpoints: int = field(default=2, metadata={"help": "newest checkpoints kept; older ones are deleted"})
    eval_every: int = field(default=0, metadata={
        "help": "held-out metrics every N steps (and at the end); 0 = end only"})
    log_every: int = field(default=1, metadata={"help": "log training metrics every N optimizer steps"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the newest checkpoint in OUTPUT_DIR/checkpoints (bit-identical to an uninterrupted "
                "run)"})

    def __post_init__(self) -> None:
        resolve_device(self.device)  # refuses a device this machine does not have
        if not self.data:
            raise ValueError("--data is required: the self-distilled dataset folder")
        if not self.output_dir:
            raise ValueError("--output_dir is required: the run folder for checkpoints, metrics.jsonl and the heads")
        positive = {"seq_len": self.seq_len, "eval_max_examples": self.eval_max_examples, "num_heads": self.num_heads,
                    "log_every": self.log_every, "max_steps": self.max_steps, "warmup": self.warmup,
                    "grad_accum": self.grad_accum, "micro_batch_size": self.micro_batch_size, "lr": self.lr}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise ValueError(f"--draft_vocab_size must be > 0, got {self.draft_vocab_size!r}")
        non_negative = {"num_layers": self.num_layers, "save_every": self.save_every, "eval_every": self.eval_every,
                        "keep_checkpoints": self.keep_checkpoints, "weight_decay": self.weight_decay,
                        "grad_clip": self.grad_clip}
        for name, value in non_negative.items():
            if value is not None and value < 0:
                raise ValueError(f"--{name} must be >= 0, got {value!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"--kind must be a registered head kind, one of {sorted(HEAD_KINDS)}; got {self.kind!r}")
        if not HEAD_KINDS[self.kind].own_lm_head and not self.share_lm_head:
            raise ValueError(f"--kind {self.kind} always projects with the backbone's frozen lm_head: "
                             "--share_lm_head must be true")
        if self.dynamic_tree is not None:
            if not issubclass(HEAD_KINDS[self.kind], SequentialHeads):
                raise ValueError(f"--dynamic_tree is the serving tree of sequential heads (kinds "
                                 f"{sorted(k for k, c in HEAD_KINDS.items() if issubclass(c, SequentialHeads))}); "
                                 f"--kind {self.kind} drafts the static tree of its config")
            if self.dynamic_tree != "default":
                DynamicTreeConfig.parse(self.dynamic_tree)  # one error naming the bad spec and the expected forms
        if self.prompt_context is not None and self.prompt_context < self.num_heads + 1:
            raise ValueError(f"--prompt_context must be >= num_heads + 1 = {self.num_heads + 1} (every depth's target "
                             f"needs that many prompt positions), got {self.prompt_context}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss_vocab not in LOSS_VOCABS:
            raise ValueError(f"--loss_vocab must be one of {LOSS_VOCABS}, got {self.loss_vocab!r}")
        if self.loss_vocab == "draft" and not self.draft_vocab_size:
            raise ValueError("--loss_vocab draft scores the heads over the draft vocabulary: give its size with "
                             "--draft_vocab_size")
        if self.feature_cache_layers is not None:
            if not self.feature_cache:
                raise ValueError("--feature_cache_layers says which hidden states a feature cache stores: give the "
                                 "cache's folder with --feature_cache")
            if (not self.feature_cache_layers or len(set(self.feature_cache_layers)) != len(self.feature_cache_layers)
                    or min(self.feature_cache_layers) < 0):
                raise ValueError(f"--feature_cache_layers must be distinct hidden-state indices >= 0, got "
                                 f"{self.feature_cache_layers!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads <= 0:
            raise ValueError(f"--threads must be a positive integer, got {self.threads!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 < self.head_decay <= 1.0:
            raise ValueError(f"--head_decay must be in (0, 1], got {self.head_decay!r}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2):
            raise ValueError(f"--zero_stage must be 0, 1 or 2 (stage 3 is not supported for heads), "
                             f"got {self.zero_stage}")
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give either --max_steps or --epochs, not both")
        if self.warmup is not None and self.max_steps is not None and self.warmup > self.max_steps:
            # both given, or both resolved by resolve_ds_config (flag, else --ds_config, else DEFAULTS)
            raise ValueError(f"--warmup {self.warmup} is more than --max_steps {self.max_steps}: the learning rate "
                             f"would still be warming up when training ends; give --warmup <= {self.max_steps} (an "
                             f"unset --warmup is the --ds_config value, else {DEFAULTS['warmup']}; --epochs counts as "
                             "its number of steps)")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs!r}")
        if not Path(self.ds_config).is_file():
            raise FileNotFoundError(f"--ds_config {self.ds_config} does not exist")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    @property
    def heads_export_dir(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.output_dir) / "heads"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
