"""STAND-IN for the Hugging Face Hub's write (commit) API, for tests only: it is not the Hub and not a mirror.

Nothing installable accepts uploads, so tokenmaxx keeps this small stdlib server. It implements just the requests that
huggingface_hub 2.4.0's create_repo / create_branch / create_commit / upload_folder send with HF_HUB_DISABLE_XET=1 (the
LFS upload path), and commits into git repositories laid out the way olah's offline mirror reads them:
``ROOT/models/NS/NAME`` is a git repository whose LFS objects live in ``.git/lfs/objects/aa/bb/OID``; LFS files are
committed as LFS pointer blobs. olah serves the read API from the same folder. GET/HEAD requests sent here are forwarded
to that read server, so this endpoint looks like a whole Hub to a writer (huggingface_hub reads the repo info back after
a commit where nothing changed).

Endpoints (``Authorization: Bearer TOKEN`` with a token from ``tokens`` where marked *, else 401):
  POST /api/repos/create *                     {"name", "organization", "visibility" | "private", "type"}
  POST /api/validate-yaml                      README.md front matter must be a YAML mapping
  POST /api/models/NS/NAME/preupload/REV *     upload mode per file: "lfs" for weights, binary or >= 10 MB files
  POST /NS/NAME.git/info/lfs/objects/batch *   LFS batch: a one-use upload URL per object not stored yet
  PUT  /lfs-upload/TICKET                      the object's bytes (the one-use ticket is the credential, as on S3)
  POST /NS/NAME.git/info/lfs/objects/verify *  {"oid", "size"}: is it stored?
  POST /api/models/NS/NAME/branch/BRANCH *     {"startingPoint"?}
  POST /api/models/NS/NAME/commit/REV *        ndjson: header, file (base64), lfsFile, deletedFile, deletedFolder
Not modelled: datasets and spaces, pull requests, Xet, multipart LFS, repo deletion, organisations and permissions (any
valid token writes to any namespace), private visibility (recorded, not enforced: olah serves everything).

Bounded: loopback only; request bodies <= ``max_body`` bytes; <= MAX_ITEMS files per request; socket and git timeouts;
writes serialised by one lock, each commit landing with a compare-and-swap on the branch ref. The request log keeps
"METHOD path status" lines only, never headers, so never a token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

MAX_ITEMS = 10_000
GIT_TIMEOUT = 30
LOG_LINES = 2_000
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
OID_RE = re.compile(r"^[0-9a-f]{64}$")
POINTER_RE = re.compile(r"^version https://git-lfs\.github\.com/spec/v1\noid sha256:([0-9a-f]{64})\nsize ([0-9]+)\n$")
POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".onnx", ".npy", ".npz", ".pkl",
                ".msgpack", ".arrow", ".parquet", ".zip", ".gz", ".tar")
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES)
ZERO = "0" * 40
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


class HubError(Exception):
    """An HTTP error answer: status, message (JSON "error" and X-Error-Message), optional X-Error-Code."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


class HubWriteStandin:
    """The server. ``tokens``: token -> user name. ``read_url``: the read server (olah) GET/HEAD are forwarded to."""

    def __init__(self, root: str | os.PathLike, tokens: dict[str, str], read_url: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_body: int = 64 << 20):
        if host not in ("127.0.0.1", "::1"):
            raise ValueError(f"the write stand-in binds to loopback only (127.0.0.1 or ::1), not {host!r}")
        self.root = Path(root)
        self.tokens = dict(tokens)
        self.read_url = read_url.rstrip("/") if read_url else None
        self.max_body = max_body
        self.log: list[str] = []
        self._tickets: dict[str, tuple[Path, str, int]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self._server.standin = self
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> "HubWriteStandin":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="hub-write-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "HubWriteStandin":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers ------------------------------------------------------------------------------------------------
    def user(self, authorization: str | None) -> str:
        if not authorization or not authorization.startswith("Bearer "):
            raise HubError(401, "You must be authenticated to access this endpoint (no token was sent)")
        given = authorization[len("Bearer "):].encode()
        for token, user in self.tokens.items():
            if secrets.compare_digest(given, token.encode()):
                return user
        raise HubError(401, "Invalid credentials in Authorization header")

    def _git(self, repo: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> str:
        run = subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, timeout=GIT_TIMEOUT,
                             env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", **(env or {})})
        if run.returncode != 0:
            raise HubError(500, f"git {args[0]} failed: {run.stderr.decode(errors='replace').strip()}")
        return run.stdout.decode(errors="replace").strip()

    @staticmethod
    def _ident(user: str) -> dict[str, str]:
        return {"GIT_AUTHOR_NAME": user, "GIT_AUTHOR_EMAIL": f"{user}@users.noreply.invalid",
                "GIT_COMMITTER_NAME": "hub write stand-in", "GIT_COMMITTER_EMAIL": "standin@noreply.invalid"}

    def repo_path(self, ns: str, name: str) -> Path:
        for part in (ns, name):
            if not isinstance(part, str) or not NAME_RE.match(part) or ".." in part:
                raise HubError(400, f"invalid repo id part {part!r}: expected letters, digits, '-', '_', '.'")
        return self.root / "models" / ns / name

    def _existing(self, ns: str, name: str) -> Path:
        repo = self.repo_path(ns, name)
        if not (repo / ".git").is_dir():
            raise HubError(404, f"Repository {ns}/{name} not found", "RepoNotFound")
        return repo

    def _head(self, repo: Path, branch: str) -> str:
        run = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "-q", f"refs/heads/{branch}^{{commit}}"],
                             capture_output=True, timeout=GIT_TIMEOUT)
        if run.returncode != 0:
            raise HubError(404, f"Invalid rev id: {branch} (no such branch)", "RevisionNotFound")
        return run.stdout.decode().strip()

    @staticmethod
    def _clean_path(path) -> str:
        parts = path.split("/") if isinstance(path, str) and 0 < len(path) <= 1000 else None
        if not parts or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git" or \
                any(c in path for c in "\\\0\n\r"):
            raise HubError(400, f"invalid path in repo {path!r}")
        return path

    def _lfs_object(self, repo: Path, oid: str) -> Path:
        return repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid

    def _remote_oid(self, repo: Path, head: str, path: str) -> str | None:
        """The oid huggingface_hub compares against: sha256 for an LFS pointer, else the git blob sha."""
        listing = self._git(repo, "ls-tree", head, "--", path)
        if not listing:
            return None
        blob = listing.split()[2]
        pointer = POINTER_RE.match(self._git(repo, "cat-file", "blob", blob) + "\n") \
            if int(self._git(repo, "cat-file", "-s", blob)) < 200 else None
        return pointer.group(1) if pointer else blob

    # ---- endpoints ----------------------------------------------------------------------------------------------
    def create_repo(self, user: str, body: dict) -> dict:
        if body.get("type") not in (None, "model"):
            raise HubError(400, f"the stand-in only hosts model repos, not {body.get('type')!r}")
        ns, name = body.get("organization") or user, body.get("name")
        repo = self.repo_path(ns, name)
        with self._lock:
            if repo.exists():
                raise HubError(409, f"You already created this model repo: {ns}/{name}",  # the Hub sends the url too
                               extra={"url": f"{self.url}/{ns}/{name}"})
            repo.mkdir(parents=True)
            try:
                self._git(repo, "init", "-q", "-b", "main")
                blob = self._git(repo, "hash-object", "-w", "--stdin", data=GITATTRIBUTES.encode())
                tree = self._git(repo, "mktree", data=f"100644 blob {blob}\t.gitattributes\n".encode())
                commit = self._git(repo, "commit-tree", tree, "-m", "initial commit", env=self._ident(user))
                self._git(repo, "update-ref", "refs/heads/main", commit, ZERO)
                visibility = body.get("visibility") or ("private" if body.get("private") else "public")
                (repo / ".git" / "standin.json").write_text(json.dumps({"owner": user, "visibility": visibility}))
            except (HubError, OSError, subprocess.SubprocessError):
                shutil.rmtree(repo, ignore_errors=True)
                raise
        return {"url": f"{self.url}/{ns}/{name}", "name": f"{ns}/{name}"}

    @staticmethod
    def validate_yaml(body: dict) -> dict:
        match = re.match(r"^\s*---\n(.*?)\n---\s*\n", body.get("content") or "", flags=re.S)
        if match is None:
            return {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as err:
            raise HubError(400, f"invalid YAML metadata: {err}") from None
        if not isinstance(meta, dict):
            raise HubError(400, f"YAML metadata must be a mapping, got {type(meta).__name__}")
        return {"errors": [], "warnings": []}

    def preupload(self, ns: str, name: str, rev: str, body: dict) -> dict:
        repo = self._existing(ns, name)
        head = self._head(repo, rev)
        files = body.get("files")
        if not isinstance(files, list) or len(files) > MAX_ITEMS:
            raise HubError(400, f"'files' must be a list of at most {MAX_ITEMS} entries")
        out = []
        for f in files:
            path = self._clean_path(f.get("path"))
            sample = base64.b64decode(f.get("sample") or "")
            lfs = path.endswith(LFS_SUFFIXES) or int(f.get("size") or 0) >= LFS_MIN_SIZE or b"\0" in sample
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": self._remote_oid(repo, head, path)})
        return {"files": out, "commitOid": head}

    def lfs_batch(self, ns: str, name: str, body: dict) -> dict:
        repo = self._existing(ns, name)
        objects = body.get("objects")
        if body.get("operation") != "upload" or not isinstance(objects, list) or len(objects) > MAX_ITEMS:
            raise HubError(400, f"expected an LFS upload batch of at most {MAX_ITEMS} objects")
        out = []
        for obj in objects:
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not OID_RE.match(oid) or not isinstance(size, int) or size < 0:
                out.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                            "error": {"code": 422, "message": "oid must be a sha256 hex digest, size an int >= 0"}})
            elif size > self.max_body:
                out.append({"oid": oid, "size": size,
                            "error": {"code": 413, "message": f"object larger than the stand-in's {self.max_body} B"}})
            elif self._lfs_object(repo, oid).is_file():
                out.append({"oid": oid, "size": size})  # stored already: no actions, nothing to upload
            else:
                ticket = secrets.token_urlsafe(16)
                with self._lock:
                    if len(self._tickets) >= MAX_ITEMS:
                        raise HubError(429, "too many pending LFS uploads")
                    self._tickets[ticket] = (repo, oid, size)
                out.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{self.url}/lfs-upload/{ticket}", "expires_in": 900},
                    "verify": {"href": f"{self.url}/{ns}/{name}.git/info/lfs/objects/verify"}}})
        return {"transfer": "basic", "objects": out}

    def lfs_put(self, ticket: str, data: bytes) -> dict:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None:
            raise HubError(403, "unknown or already used LFS upload ticket")
        repo, oid, size = entry
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != size or digest != oid:
            raise HubError(400, f"uploaded bytes (sha256 {digest}, {len(data)} B) are not the announced object "
                                f"(sha256 {oid}, {size} B)")
        target = self._lfs_object(repo, oid)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{oid}.{ticket}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        return {}

    def lfs_verify(self, ns: str, name: str, body: dict) -> dict:
        stored = self._lfs_object(self._existing(ns, name), str(body.get("oid")))
        if not OID_RE.match(str(body.get("oid"))) or not stored.is_file() or stored.stat().st_size != body.get("size"):
            raise HubError(404, f"LFS object {body.get('oid')} ({body.get('size')} B) is not stored")
        return {}

    def create_branch(self, user: str, ns: str, name: str, branch: str, body: dict) -> dict:
        repo = self._existing(ns, name)
        if subprocess.run(["git", "check-ref-format", f"refs/heads/{branch}"], timeout=GIT_TIMEOUT).returncode != 0:
            raise HubError(400, f"invalid branch name {branch!r}")
        start = body.get("startingPoint") or "main"
        with self._lock:
            run = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "-q", f"{start}^{{commit}}"],
                                 capture_output=True, timeout=GIT_TIMEOUT)
            if run.returncode != 0:
                raise HubError(404, f"Invalid rev id: {start}", "RevisionNotFound")
            if subprocess.run(["git", "-C", str(repo), "show-ref", "-q", "--verify", f"refs/heads/{branch}"],
                              timeout=GIT_TIMEOUT).returncode == 0:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            self._git(repo, "update-ref", f"refs/heads/{branch}", run.stdout.decode().strip(), ZERO)
        return {}

    def commit(self, user: str, ns: str, name: str, rev: str, data: bytes) -> dict:
        repo = self._existing(ns, name)
        lines = [line for line in data.splitlines() if line.strip()]
        if not 0 < len(lines) <= MAX_ITEMS + 1:
            raise HubError(400, f"a commit is 1 header line + at most {MAX_ITEMS} operation lines of ndjson")
        try:
            items = [json.loads(line) for line in lines]
        except json.JSONDecodeError as err:
            raise HubError(400, f"commit body is not ndjson ({err})") from None
        header = items[0].get("value") if items[0].get("key") == "header" else None
        if not isinstance(header, dict) or not header.get("summary"):
            raise HubError(400, "the first ndjson line must be the header with a non-empty summary")
        with self._lock:
            parent = self._head(repo, rev)
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, f"parentCommit {header['parentCommit']} is not the head of {rev} ({parent})")
            index = repo / ".git" / f"standin-index-{secrets.token_hex(4)}"
            env = {"GIT_INDEX_FILE": str(index)}
            try:
                self._git(repo, "read-tree", parent, env=env)
                for item in items[1:]:
                    self._apply(repo, item.get("key"), item.get("value") or {}, env)
                tree = self._git(repo, "write-tree", env=env)
                message = header["summary"] + (f"\n\n{header['description']}" if header.get("description") else "")
                new = self._git(repo, "commit-tree", tree, "-p", parent, "-m", message,
                                env={**env, **self._ident(user)})
                self._git(repo, "update-ref", f"refs/heads/{rev}", new, parent)  # compare-and-swap
            finally:
                index.unlink(missing_ok=True)
        return {"success": True, "commitOid": new, "commitUrl": f"{self.url}/{ns}/{name}/commit/{new}",
                "hookOutput": "", "pullRequestUrl": None}

    def _apply(self, repo: Path, key: str, value: dict, env: dict) -> None:
        """One commit operation into the temporary index."""
        path = self._clean_path(value.get("path"))
        if key in ("deletedFile", "deletedFolder"):
            spec = path.rstrip("/") + "/" if key == "deletedFolder" else path
            found = [p for p in self._git(repo, "ls-files", "-z", "--", spec, env=env).split("\0") if p]
            if not found:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            self._git(repo, "update-index", "--force-remove", "--", *found, env=env)
            return
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubError(400, f"file {path}: only base64 encoding is supported")
            content = base64.b64decode(value.get("content") or "")
        elif key == "lfsFile":
            oid = str(value.get("oid"))
            stored = self._lfs_object(repo, oid)
            if value.get("algo", "sha256") != "sha256" or not OID_RE.match(oid) or not stored.is_file():
                raise HubError(422, f"lfsFile {path}: LFS object sha256 {oid} was never uploaded")
            size = stored.stat().st_size
            if value.get("size") not in (None, size):
                raise HubError(422, f"lfsFile {path}: size {value.get('size')} != stored {size}")
            content = POINTER.format(oid=oid, size=size).encode()
        else:
            raise HubError(400, f"unknown commit operation {key!r}")
        blob = self._git(repo, "hash-object", "-w", "--stdin", data=content)
        self._git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=env)


ROUTES = [  # (method, path pattern, endpoint, needs a token)
    ("POST", r"/api/repos/create", "create_repo", True),
    ("POST", r"/api/validate-yaml", "validate_yaml", False),
    ("POST", r"/api/models/(?P<ns>[^/]+)/(?P<name>[^/]+)/preupload/(?P<rev>[^/]+)", "preupload", True),
    ("POST", r"/(?P<ns>[^/]+)/(?P<name>[^/]+)\.git/info/lfs/objects/batch", "lfs_batch", True),
    ("POST", r"/(?P<ns>[^/]+)/(?P<name>[^/]+)\.git/info/lfs/objects/verify", "lfs_verify", True),
    ("PUT", r"/lfs-upload/(?P<ticket>[A-Za-z0-9_-]+)", "lfs_put", False),
    ("POST", r"/api/models/(?P<ns>[^/]+)/(?P<name>[^/]+)/branch/(?P<branch>[^/]+)", "create_branch", True),
    ("POST", r"/api/models/(?P<ns>[^/]+)/(?P<name>[^/]+)/commit/(?P<rev>[^/]+)", "commit", True),
]


class _Handler(BaseHTTPRequestHandler):
    server_version = "hub-write-standin"
    timeout = 15  # seconds per socket operation: a stalled client cannot hold a thread forever

    @property
    def standin(self) -> HubWriteStandin:
        return self.server.standin

    def log_message(self, fmt, *args) -> None:  # request line + status only: never headers
        log = self.standin.log
        log.append(fmt % args)
        del log[:-LOG_LINES]

    def _send(self, status: int, payload=None, body: bytes | None = None, headers: dict | None = None) -> None:
        data = body if body is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        for key, value in (headers or {"Content-Type": "application/json"}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        limit = self.standin.max_body
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            for _ in range(1 << 20):
                size = int(self.rfile.readline(100).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    for _ in range(100):  # trailers, up to the blank line
                        if self.rfile.readline(1000) in (b"\r\n", b"\n", b""):
                            break
                    return b"".join(chunks)
                total += size
                if total > limit:
                    raise HubError(413, f"request body over the stand-in's limit of {limit} B")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(10)
            raise HubError(400, "too many chunks")
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            raise HubError(413, f"request body of {length} B over the stand-in's limit of {limit} B")
        return self.rfile.read(length)

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        try:
            for method, pattern, endpoint, auth in ROUTES:
                match = re.fullmatch(pattern, url.path) if method == self.command else None
                if match is None:
                    continue
                if "create_pr" in parse_qs(url.query):
                    raise HubError(400, "pull requests are not supported by the stand-in")
                args = {k: unquote(v) for k, v in match.groupdict().items()}
                if auth:
                    user = self.standin.user(self.headers.get("Authorization"))
                    if endpoint in ("create_repo", "create_branch", "commit"):
                        args["user"] = user
                data = self._body()
                if endpoint in ("lfs_put", "commit"):
                    args["data"] = data
                else:
                    try:
                        args["body"] = json.loads(data or b"{}")
                    except json.JSONDecodeError as err:
                        raise HubError(400, f"request body is not JSON ({err})") from None
                    if not isinstance(args["body"], dict):
                        raise HubError(400, "request body must be a JSON object")
                self._send(200, getattr(self.standin, endpoint)(**args))
                return
            if self.command in ("GET", "HEAD"):
                self._forward()
            else:
                raise HubError(404, f"the write stand-in has no {self.command} {url.path}")
        except HubError as err:
            headers = {"Content-Type": "application/json", "X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send(err.status, {"error": err.message, **err.extra}, headers=headers)
        except (ValueError, KeyError, TypeError) as err:  # malformed input: base64, ints, fields
            self._send(400, {"error": f"bad request ({type(err).__name__}: {err})"})

    def _forward(self) -> None:
        """GET/HEAD go to the read server (olah): the writer sees one Hub."""
        read_url = self.standin.read_url
        if read_url is None:
            raise HubError(404, "no read server is configured behind the write stand-in")
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range", "if-none-match")}
        request = urllib.request.Request(read_url + self.path, method=self.command, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                status, reply, body = resp.status, resp.headers, resp.read(self.standin.max_body + 1)
        except urllib.error.HTTPError as err:
            status, reply, body = err.code, err.headers, err.read(self.standin.max_body + 1)
        except (urllib.error.URLError, OSError) as err:
            raise HubError(502, f"read server {read_url} unreachable ({err})") from None
        if len(body) > self.standin.max_body:
            raise HubError(502, f"read server answer over {self.standin.max_body} B")
        self._send(status, body=body, headers={k: v for k, v in reply.items() if k.lower() not in HOP_BY_HOP})

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch


def main() -> None:
    """Run it by hand: ``STANDIN_TOKEN=... python tests/hub_write_standin.py ROOT [READ_URL] [PORT]``."""
    import sys

    token = os.environ.get("STANDIN_TOKEN")
    if not token or len(sys.argv) < 2:
        raise SystemExit("usage: STANDIN_TOKEN=TOKEN python tests/hub_write_standin.py ROOT [READ_URL] [PORT]")
    server = HubWriteStandin(sys.argv[1], {token: "tester"}, sys.argv[2] if len(sys.argv) > 2 else None,
                             port=int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    print(f"hub write stand-in on {server.url} (user 'tester'), writing into {server.root}/models", flush=True)
    server.start()
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
