"""A small local stand-in for the Hugging Face Hub, so that tests can push and pull offline.

`LocalHub` serves a directory over HTTP on 127.0.0.1 (a free port) and answers the part of the
Hub's API that the real, unpatched `huggingface_hub` client uses, alone or under `transformers`
and `datasets`, to create repositories, commit files and download them again. Point a client at
it with `HF_ENDPOINT=hub.url`; `huggingface_hub` reads that variable when imported, so clients
run in new processes.

Storage: a repository is a plain folder, `<root>/models/<org>/<name>/` or
`<root>/datasets/<org>/<name>/`, holding the files of its only branch, `main`. There is no
history: the commit sha of a repository is a hash of its current files, so it changes with each
commit and a download pinned to it works until the next one. Every file is a regular git file:
preupload answers "regular" for all, so commits carry contents inline (base64); LFS and Xet
uploads are not implemented (nor pull requests, branches, tags, Spaces).

Routes; anything else is answered 501 and recorded in `LocalHub.unhandled`:

    GET  /api/whoami-v2
    POST /api/repos/create                                     {"name", "organization", "type"}
    POST /api/validate-yaml                                    README.md front matter must be YAML
    GET  /api/{models,datasets}/<id>[/revision/<rev>]          sha, siblings
    GET  /api/{models,datasets}/<id>/tree/<rev>[/<path>]       ?recursive=, ?expand=; one page
    GET  /api/{models,datasets}/<id>/refs
    POST /api/{models,datasets}/<id>/paths-info/<rev>          form: paths=..., expand=...
    POST /api/{models,datasets}/<id>/preupload/<rev>           every file "regular"
    POST /api/{models,datasets}/<id>/commit/<rev>              NDJSON: header, file, deletedFile, deletedFolder
    HEAD|GET /[datasets/]<id>/resolve/<rev>/<path>             X-Repo-Commit, ETag, Content-Length, Range

Errors carry the Hub's `X-Error-Code` header (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`),
from which the client raises its typed exceptions (a missing optional file must be a 404
`EntryNotFound`, or `AutoTokenizer` fails). Writes need `Authorization: Bearer <token>` when the
hub was given a token.
"""

import base64
import hashlib
import json
import re
import shutil
import sys
import threading
import traceback
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

_REPO = r"(?P<kind>models|datasets)/(?P<repo_id>[\w.-]+/[\w.-]+)"
ROUTES = [  # (method, path pattern on the raw path, LocalHub method); HEAD is served by GET routes
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"/api/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("GET", rf"/api/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ("GET", rf"/api/{_REPO}/refs", "refs"),
    ("POST", rf"/api/{_REPO}/paths-info/(?P<rev>[^/]+)", "paths_info"),
    ("POST", rf"/api/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/{_REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("GET", r"/(?:(?P<kind>datasets)/)?(?P<repo_id>[\w.-]+/[\w.-]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
USER = "local-tester"


class HubError(Exception):
    """An error answer: HTTP status, message, and the Hub's `X-Error-Code` when it has one."""

    def __init__(self, status: int, message: str, code: str | None = None, headers=None, body=None):
        super().__init__(message)
        self.status, self.code, self.headers, self.body = status, code, headers or {}, body or {}


def git_blob_oid(content: bytes) -> str:
    """The git object id of a file (what the Hub reports as `oid`/`blobId` and ETag of regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class Request:
    def __init__(self, method: str, query: dict[str, list[str]], headers, body: bytes):
        self.method, self.query, self.headers, self.body = method, query, headers, body

    def flag(self, name: str) -> bool:
        return self.query.get(name, ["false"])[-1].lower() in ("1", "true")

    def json(self):
        return json.loads(self.body or b"{}")


class LocalHub:
    """The server. Use as a context manager; `url` is the value for `HF_ENDPOINT`.

    Attributes:
        root: the storage directory (created if missing).
        url: "http://127.0.0.1:<port>".
        requests: "METHOD /path" of every request, in order (for asserting what clients did).
        unhandled: requests no route matched (answered 501).
        errors: tracebacks of server bugs (answered 500).
    """

    def __init__(self, root: str | Path, token: str | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.requests: list[str] = []
        self.created: dict[str, dict] = {}  # repository id: the create request's JSON (its visibility, say)
        self.unhandled: list[str] = []
        self.errors: list[str] = []
        self._lock = threading.RLock()  # one request at a time: commits are atomic, reads consistent
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="local-hub", daemon=True)

    def __enter__(self) -> "LocalHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def repo_dir(self, repo_id: str, repo_type: str = "model") -> Path:
        """The folder that stores a repository."""
        return self.root / f"{repo_type}s" / repo_id

    # ------------------------------------------------------------------ helpers

    def _repo_url(self, kind: str, repo_id: str) -> str:
        return f"{self.url}/{repo_id}" if kind == "models" else f"{self.url}/{kind}/{repo_id}"

    def _check_token(self, request: Request) -> None:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _open(self, kind: str, repo_id: str, rev: str | None = "main") -> tuple[Path, dict[str, bytes], str]:
        """Folder, files ({path: content}) and commit sha of a repository at a revision."""
        if any(part in (".", "..") for part in repo_id.split("/")):
            raise HubError(400, f"Invalid repository id {repo_id!r}")
        folder = self.root / kind / repo_id
        if not folder.is_dir():
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(f"{kind}/{repo_id}\n".encode())
        for path, content in files.items():
            digest.update(f"{path}\0{git_blob_oid(content)}\n".encode())
        sha = digest.hexdigest()
        if rev not in (None, "main", "refs/heads/main", sha):
            raise HubError(404, f"Revision {rev} not found (this hub keeps main only)", "RevisionNotFound")
        return folder, files, sha

    @staticmethod
    def _safe_path(path: str) -> str:
        parts = path.strip("/").split("/")
        if any(part in ("", ".", "..") for part in parts) or "\\" in path:
            raise HubError(400, f"Invalid path in repo: {path!r}")
        return "/".join(parts)

    @staticmethod
    def _entries(files: dict[str, bytes], sha: str, expand: bool) -> dict[str, dict]:
        """Tree entries ({path: entry}) of every file and folder, as the tree and paths-info routes give them."""
        folder_date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        entries = {}
        for path, content in files.items():
            entries[path] = {"type": "file", "oid": git_blob_oid(content), "size": len(content), "path": path}
            parent = path.rpartition("/")[0]
            while parent and parent not in entries:
                entries[parent] = {"type": "directory", "oid": hashlib.sha1(parent.encode()).hexdigest(), "size": 0,
                                   "path": parent}  # fmt: skip
                parent = parent.rpartition("/")[0]
        if expand:
            for entry in entries.values():
                entry["lastCommit"] = {"id": sha, "title": "Commit on the local hub", "date": folder_date}
        return entries

    # ------------------------------------------------------------------ routes

    def whoami(self, request: Request):
        self._check_token(request)
        return {"type": "user", "name": USER, "fullname": "Local Tester", "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}}}  # fmt: skip

    def create_repo(self, request: Request):
        self._check_token(request)
        payload = request.json()
        repo_type = payload.get("type") or "model"
        if repo_type not in ("model", "dataset"):
            raise HubError(400, f"Repository type {repo_type!r} is not supported by the local hub")
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or any(part in (".", "..") for part in repo_id.split("/")):
            raise HubError(400, f"Invalid repository id {repo_id!r}")
        kind, url = f"{repo_type}s", self._repo_url(f"{repo_type}s", repo_id)
        folder = self.root / kind / repo_id
        if folder.is_dir():
            raise HubError(409, f"You already created this {repo_type} repo", body={"url": url})
        folder.mkdir(parents=True)
        self.created[repo_id] = payload
        return {"url": url, "name": repo_id, "id": repo_id}

    def validate_yaml(self, request: Request):
        content = request.json().get("content", "")
        match = re.match(r"---\r?\n(.*?)\r?\n---", content, re.DOTALL)
        if match:
            try:
                metadata = yaml.safe_load(match.group(1))
            except yaml.YAMLError as error:
                raise HubError(400, "Invalid YAML metadata", body={"errors": [{"message": str(error)}]}) from None
            if metadata is not None and not isinstance(metadata, dict):
                raise HubError(400, "Invalid YAML metadata", body={"errors": [{"message": "not a mapping"}]})
        return {"errors": [], "warnings": []}

    def repo_info(self, request: Request, kind: str, repo_id: str, rev: str | None = None):
        _, files, sha = self._open(kind, repo_id, rev)
        return {"_id": sha[:24], "id": repo_id, "author": repo_id.split("/")[0], "sha": sha, "private": False,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
                "siblings": [{"rfilename": path, "size": len(content), "blobId": git_blob_oid(content)}
                             for path, content in files.items()]}  # fmt: skip

    def tree(self, request: Request, kind: str, repo_id: str, rev: str, path: str = ""):
        _, files, sha = self._open(kind, repo_id, rev)
        entries = self._entries(files, sha, request.flag("expand"))
        prefix = path.strip("/")
        if prefix and entries.get(prefix, {}).get("type") != "directory":
            raise HubError(404, f"{path} is not a folder of {repo_id}", "EntryNotFound", {"X-Repo-Commit": sha})
        below = [p for p in entries if not prefix or p.startswith(prefix + "/")]
        if not request.flag("recursive"):
            depth = prefix.count("/") + 1 if prefix else 0
            below = [p for p in below if p.count("/") == depth]
        return [entries[p] for p in sorted(below)]

    def refs(self, request: Request, kind: str, repo_id: str):
        _, _, sha = self._open(kind, repo_id)
        main = {"name": "main", "ref": "refs/heads/main", "targetCommit": sha}
        return {"branches": [main], "converts": [], "tags": [], "pullRequests": []}

    def paths_info(self, request: Request, kind: str, repo_id: str, rev: str):
        _, files, sha = self._open(kind, repo_id, rev)
        if request.headers.get("Content-Type", "").startswith("application/json"):
            form = {key: value if isinstance(value, list) else [str(value)] for key, value in request.json().items()}
        else:
            form = parse_qs(request.body.decode())
        entries = self._entries(files, sha, form.get("expand", ["false"])[-1].lower() == "true")
        return [entries[p.strip("/")] for p in form.get("paths", []) if p.strip("/") in entries]

    def preupload(self, request: Request, kind: str, repo_id: str, rev: str):
        self._check_token(request)
        _, files, sha = self._open(kind, repo_id, rev)
        return {"commitOid": sha, "files": [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": git_blob_oid(files[f["path"]]) if f["path"] in files else None}
            for f in request.json()["files"]
        ]}  # fmt: skip

    def commit(self, request: Request, kind: str, repo_id: str, rev: str):
        self._check_token(request)
        if request.flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by the local hub")
        if rev not in ("main", "refs/heads/main"):
            raise HubError(404, f"Branch {rev} not found (this hub keeps main only)", "RevisionNotFound")
        folder, files, sha = self._open(kind, repo_id, rev)
        lines = [json.loads(line) for line in request.body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "A commit starts with a header line")
        parent = lines[0]["value"].get("parentCommit")
        if parent and not sha.startswith(parent):
            raise HubError(412, f"Parent commit {parent} is not the head of main ({sha})")
        writes, deletions = {}, []  # validated first, applied together
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = self._safe_path(value["path"])
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, f"Unsupported encoding {value['encoding']!r} for {path}")
                writes[path] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                if not (folder / path).exists():
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                deletions.append(folder / path)
            else:  # lfsFile: this hub never asks for LFS uploads
                raise HubError(400, f"Commit operation {key!r} is not supported by the local hub")
        for target in deletions:
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        for path, content in writes.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(content)
        _, _, new_sha = self._open(kind, repo_id)
        return {"success": True, "commitOid": new_sha, "commitUrl": f"{self._repo_url(kind, repo_id)}/commit/{new_sha}",
                "hookOutput": "", "pullRequestUrl": None}  # fmt: skip

    def resolve(self, request: Request, repo_id: str, rev: str, path: str, kind: str | None = None):
        _, files, sha = self._open(kind or "models", repo_id, rev)
        if path not in files:
            raise HubError(404, f"Entry {path} not found in {repo_id}", "EntryNotFound", {"X-Repo-Commit": sha})
        content, status = files[path], 200
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_oid(content)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        byte_range = re.fullmatch(r"bytes=(\d*)-(\d*)", request.headers.get("Range", ""))
        if byte_range and byte_range.group(0) != "bytes=-":
            first, last = byte_range.groups()
            start = int(first) if first else max(len(content) - int(last), 0)
            end = min(int(last), len(content) - 1) if first and last else len(content) - 1
            if start >= len(content):
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{len(content)}"})
            content, status = content[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(files[path])}"
        return status, content, headers


def _route(method: str, path: str) -> tuple[str, re.Match] | None:
    """The LocalHub method serving a request, and the match of its path; None when no route matches."""
    for route_method, pattern, name in ROUTES:
        match = re.fullmatch(pattern, path)
        if match and route_method == ("GET" if method == "HEAD" else method):
            return name, match
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every answer carries Content-Length

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):  # no route: answered 501
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def log_message(self, format, *args):  # quiet: requests are recorded in LocalHub.requests
        pass

    def _dispatch(self, method: str) -> None:
        hub: LocalHub = self.server.hub
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = Request(method, parse_qs(url.query), self.headers, body)
        status, headers = 200, {"Content-Type": "application/json"}
        try:
            with hub._lock:
                hub.requests.append(f"{method} {url.path}")
                route = _route(method, url.path)
                if route is None:
                    hub.unhandled.append(f"{method} {self.path}")
                    print(f"local hub: no route for {method} {self.path}", file=sys.stderr)
                    raise HubError(501, f"{method} {url.path} is not implemented by tests/hub_server.py")
                name, match = route
                kwargs = {key: unquote(value) for key, value in match.groupdict().items() if value is not None}
                answer = getattr(hub, name)(request, **kwargs)
            if isinstance(answer, tuple):  # (status, raw bytes, headers) from resolve
                status, payload, extra = answer
                headers.update(extra)
            else:
                payload = json.dumps(answer).encode()
        except HubError as error:
            status = error.status
            headers.update(error.headers)
            headers["X-Error-Message"] = str(error).encode("ascii", "replace").decode()
            if error.code:
                headers["X-Error-Code"] = error.code
            payload = json.dumps({"error": str(error), **error.body}).encode()
        except Exception:  # a bug of this server: answer 500, keep the traceback for the test to show
            hub.errors.append(traceback.format_exc())
            status, payload = 500, json.dumps({"error": hub.errors[-1]}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload)
