"""Draft heads on the Hugging Face Hub: push (one commit, with a generated model card), download, and load heads from
a local folder or a Hub repo id.

Push, ``push_heads(heads_or_folder, repo_id, ...)``:
  1. check    the repo id ("org/name"), the heads (loaded strictly), the bench JSON: all before any network call
  2. card     README.md rendered by ``card.render_model_card`` (offline)
  3. repo     ``HfApi.create_repo(exist_ok=True)``; ``create_branch`` when ``revision`` names a branch
  4. commit   config.json + model.safetensors + README.md in ONE ``HfApi.create_commit`` (unchanged files are skipped
              by huggingface_hub; nothing changed at all means no new commit)
The token is ``token=`` or huggingface_hub's usual places (``HF_TOKEN``, the saved ``hf auth login``). It is handed to
huggingface_hub only: never printed, logged, or put into an error message (those name where the token came from).

Download, ``download_heads(repo_id, revision)``: ``snapshot_download`` of the three files (the Hugging Face cache;
``HF_HUB_OFFLINE=1`` is honoured). Whether the heads fit a backbone is checked where they are attached to one
(``DraftHeads.check_backbone``, called by ``SpeculativeGenerator``), for local folders and Hub repos alike.

Load, ``load_heads(path_or_repo, revision)``: a local folder (``loading.load_folder``, strict), else a Hub repo id
downloaded as above.

Errors: ValueError (malformed repo id / bench JSON), HubUnreachableError (a ConnectionError), HubAuthError (a
PermissionError), FileNotFoundError (heads that are neither on the Hub nor in the cache).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from ..config import CONFIG_NAME, WEIGHTS_NAME
from ..modeling import DraftHeads
from .card import CARD_NAME, load_bench, render_model_card
from .loading import check_repo_id, is_repo_id, load_folder, looks_like_path, missing_folder

log = logging.getLogger(__name__)


class HubUnreachableError(ConnectionError):
    """The Hub endpoint could not be reached (or HF_HUB_OFFLINE forbids it)."""


class HubAuthError(PermissionError):
    """The Hub refused the credentials (missing, invalid, or without write access)."""


# ---- push -----------------------------------------------------------------------------------------------------------
def _token_source(token: str | None) -> str | None:
    """Where the token comes from (never the token itself), or None when there is none."""
    from huggingface_hub import get_token

    if token is not None:
        return "the token= argument"
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "HF_TOKEN"
    return "the saved login (hf auth login)" if get_token() else None


@contextlib.contextmanager
def _hub_errors(endpoint: str, repo_id: str, token_source: str | None, stage: list[str]):
    """Turn huggingface_hub / transport errors into ones that say what failed and what to do."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        yield
    except OfflineModeIsEnabled:
        raise HubUnreachableError(f"HF_HUB_OFFLINE is set, so the Hub cannot be asked to {stage[-1]} {repo_id!r}; "
                                  "unset it to push") from None
    except httpx2.RequestError as err:
        raise HubUnreachableError(f"cannot reach the Hub at {endpoint} to {stage[-1]} {repo_id!r} "
                                  f"({type(err).__name__}: {err}); no commit was made") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status not in (401, 403):
            raise
        hint = "no token was found: pass token=, set HF_TOKEN, or log in with `hf auth login`" if token_source is None \
            else f"the token from {token_source} was not accepted, or may not write to this namespace"
        raise HubAuthError(f"the Hub at {endpoint} refused to {stage[-1]} {repo_id!r} (HTTP {status}): {hint}; "
                           "no commit was made") from None


def push_heads(heads: DraftHeads | str | os.PathLike, repo_id: str, token: str | None = None, private: bool = False,
               revision: str | None = None, commit_message: str | None = None, *,
               bench: str | os.PathLike | dict | None = None, license: str | None = None, endpoint: str | None = None,
               bench_methods: list[str] | None = None):
    """Upload heads (a DraftHeads or a folder saved by ``save_pretrained``) with a generated README.md model card.

    Creates the repo if needed (``private`` applies only then) and the branch ``revision`` if it is missing (from
    main); commits config.json, model.safetensors and README.md in one commit. ``bench``: a bench JSON (path or dict)
    whose tau and speedup per category go into the card; ``bench_methods`` the raw method names of its rows to show
    (default ``card.card_methods``: the references and the methods named after the heads' kind). ``endpoint``: a Hub
    URL (default: huggingface_hub's, i.e. HF_ENDPOINT at import). Returns huggingface_hub's CommitInfo (``.oid``,
    ``.commit_url``).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    check_repo_id(repo_id)
    bench = load_bench(bench) if bench is not None else None
    with tempfile.TemporaryDirectory(prefix="tokenmaxx-push-") as tmp:
        if isinstance(heads, (str, os.PathLike)):
            folder = Path(heads)
            if not folder.is_dir():
                raise FileNotFoundError(f"heads folder {folder} does not exist (expected a save_pretrained folder)")
            heads = load_folder(folder)  # strict: refuses to upload broken files
        else:
            folder = Path(tmp)
            heads.save_pretrained(folder)
        card = render_model_card(heads.config, repo_id, bench, license, bench_methods)
        api = HfApi(endpoint=endpoint, token=token, library_name="tokenmaxx")
        message = commit_message or (f"Upload tokenmaxx {heads.config.kind} heads (K={heads.config.num_heads}) "
                                     f"for {heads.config.backbone or 'their backbone'}")
        stage = ["create the repo"]
        with _hub_errors(api.endpoint, repo_id, _token_source(token), stage):
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            if revision is not None and revision != "main":
                stage.append(f"create the branch {revision!r} in")
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            stage.append("commit to")
            operations = [CommitOperationAdd(CONFIG_NAME, str(folder / CONFIG_NAME)),
                          CommitOperationAdd(WEIGHTS_NAME, str(folder / WEIGHTS_NAME)),
                          CommitOperationAdd(CARD_NAME, str(card).encode("utf-8"))]
            info = api.create_commit(repo_id, operations, commit_message=message, revision=revision)
    log.info("pushed heads to %s (revision %s): commit %s", repo_id, revision or "main", info.oid)
    return info


# ---- download -------------------------------------------------------------------------------------------------------
def download_heads(repo_id: str, revision: str | None = None, **hub_kwargs) -> Path:
    """Local folder of a heads repo at ``revision``, through the Hugging Face cache (honours HF_HUB_OFFLINE).

    ``hub_kwargs`` go to ``huggingface_hub.snapshot_download`` (endpoint, cache_dir, token, local_files_only, ...).
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        check_repo_id(repo_id)
    except ValueError as err:
        raise FileNotFoundError(f"heads {repo_id!r}: no such local folder, and not a valid Hub repo id "
                                f"({err})") from None
    endpoint = hub_kwargs.get("endpoint") or constants.ENDPOINT
    cache = hub_kwargs.get("cache_dir") or constants.HF_HUB_CACHE
    at = f"{repo_id!r} (revision {revision or 'main'})"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision,
                                        allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME], **hub_kwargs))
    except LocalEntryNotFoundError as err:
        if constants.is_offline_mode() or hub_kwargs.get("local_files_only"):
            raise FileNotFoundError(f"heads {at} are not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 (or "
                                    "local_files_only) forbids downloading them: download them once online") from err
        raise HubUnreachableError(f"cannot reach the Hub at {endpoint} for heads {at}, and the Hugging Face cache "
                                  f"{cache} holds no copy of that revision ({err.__cause__ or err})") from err
    except RevisionNotFoundError as err:
        raise FileNotFoundError(f"heads repo {repo_id!r} has no revision {revision!r} on the Hub at "
                                f"{endpoint}") from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"no repo {at} on the Hub at {endpoint} (or it is private and no token with "
                                "access was given)") from err
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"Hub repo {at} holds no {CONFIG_NAME}: not tokenmaxx heads (push_heads writes "
                                f"{CONFIG_NAME}, {WEIGHTS_NAME} and {CARD_NAME})")
    return folder


# ---- load -----------------------------------------------------------------------------------------------------------
def load_heads(path_or_repo: str | os.PathLike, revision: str | None = None, dtype: torch.dtype | None = None,
               **hub_kwargs) -> DraftHeads:
    """Load heads saved by ``save_pretrained`` (a local folder, or a Hub repo id), strictly.

    A spec that names no folder goes to the Hub (``download_heads``; ``hub_kwargs`` go there) only when it has the
    form "org/name" and is not one that can only be a path (``loading.looks_like_path``); any other gets a
    FileNotFoundError naming the folder, resolved. A Hub miss says what was tried on both sides. Whether the heads fit
    a backbone is checked when they are attached to one (``check_backbone``).
    """
    folder = Path(path_or_repo).expanduser()
    if folder.is_dir():
        return load_folder(folder, dtype=dtype)
    spec = os.fspath(path_or_repo)
    if not isinstance(path_or_repo, str) or looks_like_path(spec) or not is_repo_id(spec):
        raise FileNotFoundError(f"heads {spec!r}: {missing_folder(spec)}; not a Hub repo id "
                                "of the form 'org/name' either, so the Hub was not asked")
    try:
        folder = download_heads(spec, revision, **hub_kwargs)
    except (FileNotFoundError, HubUnreachableError) as err:  # say what was tried on both sides
        raise type(err)(f"heads {spec!r}: {missing_folder(spec)}, and on the Hub: {err}") from err
    return load_folder(folder, dtype=dtype)
