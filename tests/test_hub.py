"""Hub push / download against real servers on 127.0.0.1 (the card's rendering: test_card.py).

Read side: olah (PyPI ``olah``, offline mode) serves the Hub's read API from git repositories in a temp folder (its
``mirrors-path``). Write side: ``hub_write_standin.HubWriteStandin``, the project's stand-in for the Hub's commit API,
commits into that same folder. No internet: endpoints are passed explicitly (HF_ENDPOINT is read when huggingface_hub
is imported; the card's usage snippet runs in a subprocess that sets it), Xet is disabled, no real token or cache is
used. olah comes from ``TOKENMAXX_OLAH``, ``.venv-olah/bin/olah-cli`` or PATH; without it those tests skip, unless
TOKENMAXX_REQUIRE_HUB / TOKENMAXX_REQUIRE_REAL is set.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import BENCH, random_heads, tiny_model
from huggingface_hub import ModelCard, constants
from hub_write_standin import HubWriteStandin
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import BackboneMismatchError, load_backbone, load_heads, push_heads
from tokenmaxx.heads.io import hub as hub_module
from tokenmaxx.heads.io.hub import HubAuthError, HubUnreachableError, download_heads
from tokenmaxx.inference import SpeculativeGenerator


from tokenmaxx.heads import resolve_heads

# huggingface_hub's LFS upload passes a file object as data= (its own code, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")
REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_secretTOKENforTESTSonly0123456789"
MESSAGES = [{"role": "user", "content": "Explain KV caches in two sentences."}]  # the card snippet's prompt


# ---- servers --------------------------------------------------------------------------------------------------------
def _olah_cli() -> str | None:
    for cand in (os.environ.get("TOKENMAXX_OLAH"), REPO / ".venv-olah" / "bin" / "olah-cli", shutil.which("olah-cli")):
        if cand and Path(cand).is_file():
            return str(cand)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Olah:
    """olah-cli in offline mode, serving the git repositories under ``mirror/models/ORG/NAME``."""

    def __init__(self, cli: str, mirror: Path, work: Path):
        self.log = work / "olah.log"
        for _ in range(3):  # a free port can be taken between probing and binding: retry
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            config = work / "olah.toml"
            config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{work / "cache"}"\n'
                              f'mirrors-path = ["{mirror}"]\nmirror-netloc = "127.0.0.1:{port}"\n'
                              f'mirror-lfs-netloc = "127.0.0.1:{port}"\n[accessibility]\noffline = true\n')
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([cli, "--config", str(config), "--log-path", str(work / "logs")],
                                             cwd=work, stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(timeout=45.0):
                return
        raise RuntimeError(f"olah did not start; its log ends with:\n{self.log.read_text()[-2000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"{self.url}/api/models/none/none/revision/main", timeout=2)
                return True
            except urllib.error.HTTPError:  # any HTTP answer means it is serving
                return True
            except OSError:
                time.sleep(0.1)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _require(found, msg: str) -> None:
    """Skip without a tool the servers need, unless the run must cover the Hub tests."""
    if not found:
        if os.environ.get("TOKENMAXX_REQUIRE_HUB") or os.environ.get("TOKENMAXX_REQUIRE_REAL"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The write stand-in (``.url``) in front of olah (``.read_url``), over one mirror folder; both shut down at the
    end of the module."""
    cli = _olah_cli()
    _require(cli, "olah is not installed: python -m venv .venv-olah && .venv-olah/bin/pip install olah==0.5.4")
    _require(shutil.which("git"), "git is not installed (the write stand-in commits with it)")
    root = tmp_path_factory.mktemp("hub")
    mirror = root / "mirror"
    (mirror / "models").mkdir(parents=True)
    olah = Olah(cli, mirror, root)
    try:
        with HubWriteStandin(mirror, {TOKEN: "tester"}, read_url=olah.url) as standin:
            standin.mirror, standin.olah_log = mirror, olah.log
            yield standin
    finally:
        olah.stop()


@pytest.fixture(autouse=True)
def hermetic_hub(monkeypatch, tmp_path):
    """No real token, login, cache or Xet: what huggingface_hub read from the environment at import is overridden."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-hf-cache"))


def _save_backbone(folder: Path, seed: int):
    tiny_model("llama", seed=seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model, tokenizer = load_backbone(str(folder))  # name_or_path = the folder: the identity heads record
    return model, tokenizer


@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    """Two tiny Llama backbones of the same shapes saved as folders (with a tokenizer): A and B."""
    root = tmp_path_factory.mktemp("backbones")
    return {name: (*_save_backbone(root / name, seed), str(root / name)) for name, seed in (("a", 0), ("b", 1))}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git(hub, repo_id: str, *args: str) -> str:
    return subprocess.run(["git", "-C", str(hub.mirror / "models" / repo_id), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


# ---- round trip -----------------------------------------------------------------------------------------------------
def test_round_trip_is_byte_identical_and_generates_the_same(hub, backbones, tmp_path):
    model, tokenizer, _ = backbones["a"]
    heads = random_heads(model, seed=1, tree=[[0], [1], [0, 0], [0, 0, 0]])
    heads.save_pretrained(tmp_path / "local")
    info = push_heads(heads, "org/round-trip", token=TOKEN, endpoint=hub.url, private=True)
    assert _git(hub, "org/round-trip", "rev-parse", "main") == info.oid
    created = json.loads((hub.mirror / "models" / "org" / "round-trip" / ".git" / "standin.json").read_text())
    assert created == {"owner": "tester", "visibility": "private"}  # recorded only: olah serves every repo
    assert _git(hub, "org/round-trip", "ls-tree", "--name-only", "main").split() == \
        [".gitattributes", "README.md", "config.json", "model.safetensors"]
    assert _git(hub, "org/round-trip", "show", "main:model.safetensors").startswith("version https://git-lfs")

    folder = download_heads("org/round-trip", endpoint=hub.read_url, cache_dir=str(tmp_path / "cache"))
    for name in ("config.json", "model.safetensors"):
        assert _sha256(folder / name) == _sha256(tmp_path / "local" / name), name
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "tokenmaxx" and "speculative-decoding" in card.data.tags

    downloaded = load_heads("org/round-trip", endpoint=hub.read_url, cache_dir=str(tmp_path / "cache"))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    remote = SpeculativeGenerator(model, downloaded, tokenizer=tokenizer, draft="heads").generate(ids, max_new_tokens=48)
    local = SpeculativeGenerator(model, heads, tokenizer=tokenizer, draft="heads").generate(ids, max_new_tokens=48)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    assert remote.new_tokens == local.new_tokens == plain[0, ids.shape[1]:].tolist()
    assert remote.stats.accepted_hist == local.stats.accepted_hist
    print(f"\nround trip: commit {info.oid[:12]}, sha256 config {_sha256(folder / 'config.json')[:12]} "
          f"weights {_sha256(folder / 'model.safetensors')[:12]} identical; {len(remote.new_tokens)} tokens identical "
          f"to local heads and to greedy generate, tau {remote.stats.mean_tau:.2f}")


def test_second_push_is_a_new_commit_and_revisions_pin(hub, backbones, tmp_path):
    model = backbones["a"][0]
    cache = str(tmp_path / "cache")
    v1, v2 = random_heads(model, seed=2), random_heads(model, seed=3)
    first = push_heads(v1, "org/versions", token=TOKEN, endpoint=hub.url)
    second = push_heads(v2, "org/versions", token=TOKEN, endpoint=hub.url, commit_message="retrained")
    assert second.oid != first.oid and _git(hub, "org/versions", "rev-parse", "main^") == first.oid
    assert _git(hub, "org/versions", "log", "-1", "--format=%s", "main") == "retrained"
    # only the weights changed: config.json and README.md were skipped by huggingface_hub as unchanged
    assert _git(hub, "org/versions", "diff", "--name-only", first.oid, second.oid) == "model.safetensors"
    again = push_heads(v2, "org/versions", token=TOKEN, endpoint=hub.url)  # nothing changed: no commit
    assert again.oid == second.oid and _git(hub, "org/versions", "rev-list", "--count", "main") == "3"

    latest = load_heads("org/versions", endpoint=hub.read_url, cache_dir=cache)
    pinned = load_heads("org/versions", revision=first.oid, endpoint=hub.read_url, cache_dir=cache)
    for got, want in ((latest, v2), (pinned, v1)):
        for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
            assert torch.equal(a, b), name

    branch = push_heads(v1, "org/versions", token=TOKEN, endpoint=hub.url, revision="experiment")
    assert _git(hub, "org/versions", "rev-parse", "main") == second.oid  # main untouched
    on_branch = download_heads("org/versions", revision="experiment", endpoint=hub.read_url, cache_dir=cache)
    at_first = download_heads("org/versions", revision=first.oid, endpoint=hub.read_url, cache_dir=cache)
    assert _sha256(on_branch / "model.safetensors") == _sha256(at_first / "model.safetensors")
    print(f"\nversions: v1 {first.oid[:12]} -> v2 {second.oid[:12]} (parent v1), re-push no-op, "
          f"branch 'experiment' {branch.oid[:12]}; revision={first.oid[:12]} returns v1")


@pytest.mark.slow
def test_card_usage_snippet_runs_and_backbone_is_checked(hub, backbones, tmp_path):
    """The card's python block, run as a user would (HF_ENDPOINT set), generates what local heads generate; the
    public API then refuses the heads on another backbone, naming both."""
    model, tokenizer, folder_a = backbones["a"]
    heads = random_heads(model, seed=4)
    push_heads(heads, "org/snippet", token=TOKEN, endpoint=hub.url)
    card = ModelCard.load(download_heads("org/snippet", endpoint=hub.read_url, cache_dir=str(tmp_path / "c")) /
                          "README.md")
    snippet = re.search(r"```python\n(.*?)```", card.text, flags=re.S).group(1)
    assert "SpeculativeGenerator.from_pretrained(backbone=" in snippet and "heads='org/snippet'" in snippet
    folder_b = backbones["b"][2]
    program = snippet + (
        "\nimport json\nprint('TOKENS', json.dumps(out.new_tokens))\n"
        "from tokenmaxx.heads import BackboneMismatchError\n"
        f"try:\n    SpeculativeGenerator.from_pretrained(backbone={folder_b!r}, heads='org/snippet')\n"
        "except BackboneMismatchError as err:\n    print('MISMATCH', err)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.read_url, HF_HUB_CACHE=str(tmp_path / "subprocess-cache"), HF_HUB_DISABLE_XET="1",
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = SpeculativeGenerator(model, heads, tokenizer=tokenizer, draft="heads").generate(MESSAGES, max_new_tokens=64)
    tokens = json.loads(re.search(r"^TOKENS (.*)$", run.stdout, flags=re.M).group(1))
    assert tokens == expected.new_tokens
    assert "tokens per backbone forward (tau)" in run.stdout
    mismatch = re.search(r"^MISMATCH (.*)$", run.stdout, flags=re.M)
    assert mismatch and folder_a in mismatch.group(1) and folder_b in mismatch.group(1)
    print(f"\nsnippet subprocess: {len(tokens)} tokens equal to local heads; mismatch: {mismatch.group(1)[:90]}...")


def test_downloaded_heads_are_checked_against_the_backbone(hub, backbones, tmp_path):
    heads = random_heads(backbones["a"][0], seed=5)
    push_heads(heads, "org/checked", token=TOKEN, endpoint=hub.url)
    got = load_heads("org/checked", endpoint=hub.read_url, cache_dir=str(tmp_path / "c"))
    with pytest.raises(BackboneMismatchError, match=re.escape(backbones["b"][2])) as err:
        SpeculativeGenerator(backbones["b"][0], got, draft="heads")
    assert backbones["a"][2] in str(err.value)
    with pytest.raises(BackboneMismatchError, match="heads expect hidden size 32 .* backbone has hidden size 48"):
        SpeculativeGenerator(tiny_model("llama", hidden_size=48), got, draft="heads")


# ---- failures -------------------------------------------------------------------------------------------------------
def _snapshot(*folders: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for f in folders if f.exists() for p in sorted(f.rglob("*"))}


def test_unreachable_endpoint_is_a_clear_error_and_changes_nothing(backbones, tmp_path):
    heads = random_heads(backbones["a"][0], seed=6)
    heads.save_pretrained(tmp_path / "heads")
    dead = f"http://127.0.0.1:{_free_port()}"
    temp_before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tokenmaxx-push-")}
    before = _snapshot(tmp_path)
    start = time.monotonic()
    message = f"cannot reach the Hub at {dead} to create the repo 'org/x' .*no commit was made"
    with pytest.raises(HubUnreachableError, match=message):
        push_heads(heads, "org/x", token=TOKEN, endpoint=dead)
    with pytest.raises(HubUnreachableError, match=message):
        push_heads(tmp_path / "heads", "org/x", endpoint=dead)  # a saved folder, as the script pushes it
    with pytest.raises(HubUnreachableError, match=f"cannot reach the Hub at {dead} .* holds no copy"):
        load_heads("org/x", endpoint=dead, cache_dir=str(tmp_path / "cache"))
    assert time.monotonic() - start < 10, "unreachable endpoints must fail fast (no retry loops)"
    assert _snapshot(tmp_path) == before
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tokenmaxx-push-")} == temp_before


def test_push_without_or_with_a_wrong_token_is_refused(hub, backbones):
    heads = random_heads(backbones["a"][0], seed=7)
    with pytest.raises(HubAuthError, match=r"refused to create the repo 'org/no-token' \(HTTP 401\): no token was "
                                           r"found: pass token=, set HF_TOKEN"):
        push_heads(heads, "org/no-token", endpoint=hub.url)
    wrong = "hf_wrongTOKEN000000000000000000"
    with pytest.raises(HubAuthError, match="the token from the token= argument was not accepted") as err:
        push_heads(heads, "org/no-token", token=wrong, endpoint=hub.url)
    assert wrong not in str(err.value)
    assert not (hub.mirror / "models" / "org" / "no-token").exists()


def test_offline_mode_uses_the_cache_or_says_why_not(hub, backbones, tmp_path, monkeypatch):
    heads = random_heads(backbones["a"][0], seed=8)
    info = push_heads(heads, "org/offline", token=TOKEN, endpoint=hub.url)
    cache = str(tmp_path / "cache")
    load_heads("org/offline", endpoint=hub.read_url, cache_dir=cache)  # online: fills the cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    for revision in (None, info.oid):
        cached = load_heads("org/offline", revision=revision, endpoint=hub.read_url, cache_dir=cache)
        assert all(torch.equal(a, b) for a, b in zip(cached.state_dict().values(), heads.state_dict().values()))
    with pytest.raises(FileNotFoundError, match=r"not in the Hugging Face cache .*HF_HUB_OFFLINE=1"):
        load_heads("org/offline", endpoint=hub.read_url, cache_dir=str(tmp_path / "empty"))
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE is set"):
        push_heads(heads, "org/offline", token=TOKEN, endpoint=hub.url)


@pytest.mark.parametrize("repo_id", ["", "org/", "a/b/c", "org name/heads", "org/heads!", "-org/x", "org/x" * 30])
def test_malformed_repo_id_fails_before_any_request(hub, backbones, repo_id):
    heads = random_heads(backbones["a"][0], seed=9)
    requests = len(hub.log)
    with pytest.raises(ValueError, match=re.escape(f"malformed Hub repo id {repo_id!r}: expected 'org/name'")):
        push_heads(heads, repo_id, token=TOKEN, endpoint=hub.url)
    assert len(hub.log) == requests
    with pytest.raises(FileNotFoundError, match="no such heads folder .*not a Hub repo id of the form 'org/name'"):
        load_heads(repo_id or "a/b/c", endpoint=hub.read_url)


def test_a_repo_missing_on_the_hub_says_what_was_tried_locally(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_heads("org/never-pushed", endpoint=hub.read_url, cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    assert f"no such heads folder {tmp_path.resolve() / 'org' / 'never-pushed'}" in message
    assert f"no repo 'org/never-pushed' (revision main) on the Hub at {hub.read_url}" in message


def test_token_is_never_printed_or_logged(hub, backbones, tmp_path, capsys, caplog, monkeypatch):
    import logging

    caplog.set_level(logging.DEBUG)
    heads = random_heads(backbones["a"][0], seed=10)
    heads.save_pretrained(tmp_path / "heads")
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    push_heads(heads, "org/secret", token=TOKEN, endpoint=hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the script takes the token from the environment only
    spec = importlib.util.spec_from_file_location("push_to_hub_script", REPO / "scripts" / "push_to_hub.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # dataclasses look their module up while it executes
    spec.loader.exec_module(script)
    assert script.main(["--heads", str(tmp_path / "heads"), "--repo-id", "org/secret", "--revision", "scripted",
                        "--bench", str(tmp_path / "bench.json"), "--endpoint", hub.url]) == 0
    out = capsys.readouterr()
    assert "pushed" in out.out and "org/secret" in out.out
    readme = _git(hub, "org/secret", "show", "scripted:README.md")
    assert "1.91x (tau 2.05)" in readme  # the bench table made it into the card
    committed = "".join(_git(hub, "org/secret", "show", f"{rev}:{name}") for rev in ("main", "scripted")
                        for name in ("README.md", "config.json"))
    for where, text in (("stdout", out.out), ("stderr", out.err), ("logs", caplog.text),
                        ("stand-in log", "\n".join(hub.log)), ("olah log", hub.olah_log.read_text()),
                        ("committed files", committed)):
        assert TOKEN not in text, f"the token leaked into {where}"
        assert TOKEN[:12] not in text, f"part of the token leaked into {where}"


def test_standin_rejects_bad_uploads_and_stays_bounded(tmp_path):
    _require(shutil.which("git"), "git is not installed (the write stand-in commits with it)")
    with pytest.raises(ValueError, match="loopback only"):
        HubWriteStandin(tmp_path, {TOKEN: "tester"}, host="0.0.0.0")

    def call(url, method, body=b"", token=TOKEN):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method, headers=headers),
                                        timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    with HubWriteStandin(tmp_path, {TOKEN: "tester"}, max_body=1000) as st:
        assert call(f"{st.url}/api/repos/create", "POST", b'{"name": "r"}', token=None)[0] == 401
        assert call(f"{st.url}/api/repos/create", "POST", b'{"name": "r"}')[0] == 200  # namespace = the user
        data = os.urandom(100)
        oid = hashlib.sha256(data).hexdigest()
        batch = json.dumps({"operation": "upload", "objects": [{"oid": oid, "size": 100}]}).encode()
        href = call(f"{st.url}/tester/r.git/info/lfs/objects/batch", "POST", batch)[1]["objects"][0]["actions"]
        href = href["upload"]["href"]
        assert call(href, "PUT", os.urandom(100), token=None)[0] == 400  # bytes that do not match the oid
        assert call(href, "PUT", data, token=None)[0] == 403  # the ticket was used up by the failed attempt
        assert call(f"{st.url}/lfs-upload/unknown", "PUT", data, token=None)[0] == 403
        status, err = call(f"{st.url}/api/models/tester/r/commit/main", "POST", b"x" * 2000)
        assert status == 413 and "limit" in err["error"]
        commit = b"\n".join(json.dumps(x).encode() for x in (
            {"key": "header", "value": {"summary": "s"}},
            {"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": oid, "size": 100}}))
        status, err = call(f"{st.url}/api/models/tester/r/commit/main", "POST", commit)
        assert status == 422 and "never uploaded" in err["error"]
        bad_path = commit.replace(b"w.safetensors", b"../escape")
        assert call(f"{st.url}/api/models/tester/r/commit/main", "POST", bad_path)[0] == 400
        assert call(f"{st.url}/api/models/tester/r/commit/nobranch", "POST", commit)[0] == 404
        assert call(f"{st.url}/api/models/tester/r/revision/main", "GET", None)[0] == 404  # no read server behind
        assert TOKEN not in "\n".join(st.log)


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory with a runs/ folder (as after a training run); any Hub request fails the test."""
    def no_hub(*args, **kwargs):
        raise AssertionError(f"the Hub was asked for {args} {kwargs}")

    monkeypatch.setattr(hub_module, "download_heads", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    return tmp_path.resolve()


@pytest.mark.parametrize("spec", ["nope", "./runs/exprt", "../exprt", "runs/exprt/", "runs/a/exprt", "~/no-such-heads",
                                  "org name/heads", "ABSOLUTE"])
def test_a_heads_path_naming_no_folder_is_not_sent_to_the_hub(workdir, spec):
    spec = str(workdir / "runs" / "gone") if spec == "ABSOLUTE" else spec
    resolved = Path(spec).expanduser().resolve()
    with pytest.raises(FileNotFoundError, match=f"no such heads folder {re.escape(str(resolved))}") as err:
        load_heads(spec)
    assert "not a Hub repo id of the form 'org/name' either, so the Hub was not asked" in str(err.value)
    with pytest.raises(FileNotFoundError, match=re.escape(str(resolved))):  # what scripts/generate.py --heads calls
        resolve_heads(spec, None, "smollm2-135m")


def test_a_heads_path_naming_a_file_says_so(workdir):
    (workdir / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(workdir / 'model.safetensors'))} is a file, not a "
                                                "heads folder"):
        load_heads("model.safetensors")


def test_an_unreachable_hub_says_what_was_tried_locally_and_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HubUnreachableError) as err:  # "runs/exprt" has the form org/name: the Hub is asked too
        load_heads("runs/exprt", endpoint=dead, cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    local = tmp_path.resolve() / "runs" / "exprt"
    assert f"no such heads folder {local} (its parent {local.parent} exists: a typo?)" in message
    assert f"cannot reach the Hub at {dead} for heads 'runs/exprt' (revision main)" in message
