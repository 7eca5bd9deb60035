"""Draft heads: the registry of head kinds, their common base (save / load / backbone checks)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .backbones import backbone_identity
from .config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig

HEAD_KINDS: dict[str, type["DraftHeads"]] = {}


def register_head_kind(name: str):
    """Class decorator: make a DraftHeads subclass loadable by ``HeadsConfig.kind == name``."""

    def wrap(cls):
        if name in HEAD_KINDS:
            raise ValueError(f"head kind {name!r} is already registered by {HEAD_KINDS[name].__name__}")
        HEAD_KINDS[name] = cls
        cls.kind = name
        return cls

    return wrap


class BackboneMismatchError(ValueError):
    """Heads were made for a different backbone than the one they are attached to."""


def _backbone_shapes(model) -> tuple[int, int]:
    """(hidden size, vocabulary size) as the backbone's lm_head actually has them."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    return hidden, vocab


class DraftHeads(nn.Module):
    """Base of all head kinds. Subclasses implement ``forward`` and ``init_from_backbone``.

    Contract of ``forward(hidden, lm_head)``: hidden ``[..., H]`` is the backbone's last (final-normed) hidden state at
    position t; returns logits ``[K, ..., V]`` where head k (row k-1) predicts the token at t+k+1.
    """

    kind: str = ""

    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        # [Vd] long token ids drafting projects onto (None: all); saved with the weights when set
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    # ---- draft vocabulary ---------------------------------------------------------------------------------------
    def set_draft_vocab(self, token_ids) -> None:
        """Restrict drafting to these token ids (plus each prompt's own tokens at generation time); None: all.

        Drafting then projects onto a [Vd, H] slice of the lm_head instead of [V, H]: guesses cost a fraction of the
        time, and a token outside the slice (and outside the prompt) can no longer be guessed. Verification is
        untouched, so the output is the backbone's either way.
        """
        if token_ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.long))
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be non-empty and within [0, {self.config.vocab_size})")
        self.draft_vocab = ids
        self.config.draft_vocab_size = int(ids.numel())

    # ---- backbone compatibility -------------------------------------------------------------------------------
    def check_backbone(self, model, strict_identity: bool = True) -> None:
        """Raise BackboneMismatchError if these heads cannot run on ``model``."""
        hidden, vocab = _backbone_shapes(model)
        cfg = self.config
        if (hidden, vocab) != (cfg.hidden_size, cfg.vocab_size):
            raise BackboneMismatchError(
                f"heads expect hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size} "
                f"(made for backbone {cfg.backbone!r}), but the backbone has hidden size {hidden} and vocabulary {vocab}")
        ident, revision = backbone_identity(model)
        if strict_identity and cfg.backbone and ident and cfg.backbone != ident:
            raise BackboneMismatchError(
                f"heads were made for backbone {cfg.backbone!r} (revision {cfg.backbone_revision}), "
                f"not {ident!r} (revision {revision}); pass strict_identity=False if they really are the same model")
        if strict_identity and cfg.backbone_revision and revision and cfg.backbone_revision != revision \
                and cfg.backbone == ident:
            raise BackboneMismatchError(
                f"heads were made for {cfg.backbone!r} at revision {cfg.backbone_revision}, "
                f"but the backbone is at revision {revision}")
        adapter = getattr(model.config, "tokenmaxx_adapter", None)
        adapter_revision = getattr(model.config, "tokenmaxx_adapter_revision", None)
        if strict_identity and (cfg.adapter is not None or adapter is not None):
            if cfg.adapter_revision and adapter_revision:  # content hashes / commits: paths may differ per machine
                same = cfg.adapter_revision == adapter_revision
            else:
                same = cfg.adapter == adapter
            if not same:
                raise BackboneMismatchError(
                    f"heads were made for the backbone with adapter {cfg.adapter!r} (revision {cfg.adapter_revision}) "
                    f"merged in, but this backbone has adapter {adapter!r} (revision {adapter_revision}); "
                    "load it with load_backbone(..., adapter=...)")

    @classmethod
    def for_backbone(cls, model, **config_kwargs) -> "DraftHeads":
        """New (untrained) heads sized for ``model`` and initialised from it."""
        hidden, vocab = _backbone_shapes(model)
        ident, revision = backbone_identity(model)
        config = HeadsConfig(kind=cls.kind, hidden_size=hidden, vocab_size=vocab, backbone=ident,
                             backbone_revision=revision, adapter=getattr(model.config, "tokenmaxx_adapter", None),
                             adapter_revision=getattr(model.config, "tokenmaxx_adapter_revision", None),
                             **config_kwargs)
        heads = cls(config)
        heads.init_from_backbone(model)
        return heads

    def init_from_backbone(self, model) -> None:
        """Initialise weights that start as copies of the backbone's (e.g. per-head lm_heads)."""

    # ---- save / load ------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write config.json + model.safetensors. Each file is written under a temp name then renamed."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        for name, write in ((WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"})),
                            (CONFIG_NAME, lambda p: Path(p).write_text(self.config.to_json_string()))):
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
            os.close(fd)
            try:
                write(tmp)
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; keep the usual permissions
                os.replace(tmp, out / name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = False, revision: str | None = None,
                    commit_message: str | None = None, **kwargs):
        """Upload config.json, model.safetensors and a generated README.md model card in one commit.

        Creates the repo (and the branch ``revision``) if needed. The token is ``token``, else HF_TOKEN or the saved
        login; it is never printed. ``kwargs``: ``bench`` (bench JSON for the card), ``license``, ``endpoint``. See
        ``tokenmaxx.heads.hub.push_to_hub``; returns huggingface_hub's CommitInfo.
        """
        from .hub import push_to_hub

        return push_to_hub(self, repo_id, token=token, private=private, revision=revision,
                           commit_message=commit_message, **kwargs)

    @staticmethod
    def from_pretrained(path_or_repo: str | os.PathLike, revision: str | None = None,
                        dtype: torch.dtype | None = None, **hub_kwargs) -> "DraftHeads":
        """Load heads saved by ``save_pretrained`` (a local folder, or a Hub repo id), strictly.

        For a Hub repo id, ``hub_kwargs`` go to ``huggingface_hub.snapshot_download`` (endpoint, cache_dir, token,
        local_files_only). Whether the heads fit a backbone is checked when they are attached to one (``check_backbone``).
        """
        folder = Path(path_or_repo)
        if not folder.is_dir():
            folder = _download(str(path_or_repo), revision, **hub_kwargs)
        config = HeadsConfig.from_json_file(folder / CONFIG_NAME)
        weights = folder / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"heads weights {weights} are missing")
        try:
            state = load_file(weights)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"heads weights {weights} are corrupt or truncated ({err})") from None
        heads = HEAD_KINDS[config.kind](config)
        expected = heads.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"heads weights {weights} do not match a {config.kind!r} config: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(f"heads weight {name!r} in {weights} has shape {tuple(tensor.shape)}, "
                                 f"the config expects {tuple(expected[name].shape)}")
        heads.load_state_dict(state, strict=True)
        if dtype is not None:
            heads.to(dtype)
        heads.eval()
        return heads


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _download(repo_id: str, revision: str | None, **hub_kwargs) -> Path:
    """Fetch a heads repo from the Hub (honours HF_HUB_OFFLINE and the local cache); see ``hub.download_heads``."""
    from .hub import download_heads

    return download_heads(repo_id, revision, **hub_kwargs)
