"""A small stand-in for the Hugging Face Hub, served on 127.0.0.1 from a thread.

It answers the routes huggingface_hub 2.x calls for a model pull and a search:

- ``GET /api/models`` (search) and ``GET /api/models/{repo}[/revision/{rev}]`` (model info);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``ETag``
  and ``Content-Length``; LFS files (weights) answer like the Hub does, with a
  302 to a CDN plus ``X-Linked-Etag`` (their sha256) and ``X-Linked-Size``;
- ``GET /cdn/{sha256}``, the "CDN": served on ``localhost`` rather than
  ``127.0.0.1``, so it is another origin, as the real CDN is; it honours Range.

A token starting with ``hf_expired`` is refused everywhere, as the Hub
refuses a revoked token. Every request is logged (`FakeHub.requests`) so tests can assert what was or
was never fetched; `interrupt()` makes the CDN drop a connection half-way.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str
    token: str | None = None  # private: only this bearer token may read it
    gated: bool = False  # gated: metadata is public, files need `token`
    info: dict[str, Any] = field(default_factory=dict)  # extra model-info fields (downloads, safetensors, gguf...)
    declared_sizes: dict[str, int] = field(default_factory=dict)  # sizes to claim in model info

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()

    def git_sha(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class _Interruption:
    filename: str
    after_bytes: int
    fail_next: int  # after the drop, answer this many further requests for the file with 503


class FakeHub:
    """Start with `with FakeHub() as hub:`; `hub.url` is the endpoint for HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self._interruptions: list[_Interruption] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn_url = f"http://localhost:{self.port}/cdn"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- set-up ---

    def add_repo(self, repo_id: str, files: dict[str, bytes], **kwargs: Any) -> FakeRepo:
        commit = hashlib.sha1(json.dumps([repo_id, sorted(files)]).encode()).hexdigest()
        repo = FakeRepo(repo_id, dict(files), commit, **kwargs)
        self.repos[repo_id] = repo
        return repo

    def add_model_dir(self, repo_id: str, path: Path, **kwargs: Any) -> FakeRepo:
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        return self.add_repo(repo_id, files, **kwargs)

    def interrupt(self, filename: str, after_bytes: int, *, fail_next: int = 0) -> None:
        """The next download of `filename` sends `after_bytes` bytes, then drops the connection."""
        self._interruptions.append(_Interruption(filename, after_bytes, fail_next))

    # --- what happened ---

    def served(self, filename: str, method: str = "GET") -> list[Request]:
        """Requests that fetched `filename`'s bytes (from the resolve route or the CDN)."""
        names = {f"/cdn/{repo.sha256(filename)}" for repo in self.repos.values() if filename in repo.files}
        return [
            r
            for r in self.requests
            if r.method == method
            and (r.path.rsplit("?", 1)[0] in names or (r.path.endswith(f"/{filename}") and "/resolve/" in r.path))
        ]

    def _take_interruption(self, filename: str) -> _Interruption | None:
        with self._lock:
            for item in self._interruptions:
                if item.filename == filename:
                    return item
        return None


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # --- routing ---

        def _route(self, head: bool) -> None:
            hub.requests.append(
                Request(self.command, self.path, self.headers.get("Range"), self.headers.get("Authorization"))
            )
            url = urlsplit(self.path)
            path = unquote(url.path)
            query = parse_qs(url.query)
            parts = path.strip("/").split("/")
            if path == "/api/models":
                return self._json(self._search(query))
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
                return self._model_info(repo_id, rev, "blobs" in query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
            if parts[0] == "cdn" and len(parts) == 2:
                return self._cdn(parts[1], head)
            self._error(404, "EntryNotFound", "no such route")

        def _repo_or_error(self, repo_id: str, files: bool) -> FakeRepo | None:
            if (self.headers.get("Authorization") or "").startswith("Bearer hf_expired"):
                self._error(401, None, "Invalid credentials in Authorization header")
                return None
            repo = hub.repos.get(repo_id)
            authorized = repo is not None and (
                repo.token is None or self.headers.get("Authorization") == f"Bearer {repo.token}"
            )
            if repo is None or (not authorized and not repo.gated):
                # The Hub answers 401 for missing and for private repos alike when not authenticated.
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if not authorized and files:
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted.")
                return None
            return repo

        # --- API ---

        def _model_info(self, repo_id: str, rev: str, blobs: bool) -> None:
            repo = self._repo_or_error(repo_id, files=False)
            if repo is None:
                return
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            siblings = []
            for name, data in sorted(repo.files.items()):
                sib: dict[str, Any] = {"rfilename": name}
                if blobs:
                    size = repo.declared_sizes.get(name, len(data))
                    sib.update(size=size, blobId=repo.git_sha(name))
                    if repo.is_lfs(name):
                        sib["lfs"] = {"size": size, "sha256": repo.sha256(name), "pointerSize": 134}
                siblings.append(sib)
            self._json(
                {
                    "_id": repo.commit[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "author": repo_id.split("/")[0],
                    "sha": repo.commit,
                    "private": repo.token is not None and not repo.gated,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "pipeline_tag": "text-generation",
                    "library_name": "transformers",
                    "lastModified": "2025-01-01T00:00:00.000Z",
                    "createdAt": "2025-01-01T00:00:00.000Z",
                    "siblings": siblings,
                    **repo.info,
                }
            )

        def _search(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
            search = (query.get("search") or [""])[0].lower()
            tag = (query.get("pipeline_tag") or [None])[0]
            limit = int((query.get("limit") or ["1000"])[0])
            items = []
            for repo in hub.repos.values():
                if repo.token is not None and not repo.gated:
                    continue
                pipeline = repo.info.get("pipeline_tag", "text-generation")
                if search not in repo.repo_id.lower() or (tag and tag != pipeline):
                    continue
                item = {
                    "_id": repo.commit[:24],
                    "id": repo.repo_id,
                    "downloads": 0,
                    "likes": 0,
                    "gated": "manual" if repo.gated else False,
                    "tags": [],
                    "pipeline_tag": pipeline,
                }
                item.update(
                    {
                        k: v
                        for k, v in repo.info.items()
                        if k in ("downloads", "likes", "config", "safetensors", "gguf", "tags")
                    }
                )
                items.append(item)
            items.sort(key=lambda i: -i["downloads"])
            return items[:limit]

        # --- files ---

        def _resolve(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
            repo = self._repo_or_error(repo_id, files=True)
            if repo is None:
                return
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if filename not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.commit})
            data = repo.files[filename]
            headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
            if repo.is_lfs(filename):
                sha = repo.sha256(filename)
                headers.update(
                    {
                        "Location": f"{hub.cdn_url}/{sha}",
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(data)),
                        "ETag": f'"{repo.git_sha(filename)}"',
                        "Content-Length": "0",
                    }
                )
                return self._send(302, headers, b"", head=True)
            headers["ETag"] = f'"{repo.git_sha(filename)}"'
            self._send_bytes(data, headers, head, filename)

        def _cdn(self, sha: str, head: bool) -> None:
            for repo in hub.repos.values():
                for name, data in repo.files.items():
                    if repo.is_lfs(name) and repo.sha256(name) == sha:
                        return self._send_bytes(data, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"}, head, name)
            self._error(404, None, "no such object")

        def _send_bytes(self, data: bytes, headers: dict[str, str], head: bool, filename: str) -> None:
            start = 0
            status = 200
            range_header = self.headers.get("Range")
            if range_header and not head:
                start = int(range_header.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    return self._error(416, None, "range not satisfiable")
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            interruption = None if head else hub._take_interruption(filename)
            if interruption is not None and interruption.after_bytes >= 0:
                # First hit: send part of the body, then drop the connection.
                headers["Content-Length"] = str(len(body))
                self._send(status, headers, b"", head=True)
                self.wfile.write(body[: interruption.after_bytes])
                self.wfile.flush()
                self.close_connection = True
                interruption.after_bytes = -1
                if interruption.fail_next == 0:
                    hub._interruptions.remove(interruption)
                return
            if interruption is not None:  # the network is still "down" for this file
                interruption.fail_next -= 1
                if interruption.fail_next <= 0:
                    hub._interruptions.remove(interruption)
                return self._error(503, None, "service unavailable")
            headers["Content-Length"] = str(len(body))
            self._send(status, headers, body, head)

        # --- plumbing ---

        def _json(self, payload: Any) -> None:
            self._send(200, {"Content-Type": "application/json"}, json.dumps(payload).encode(), head=False)

        def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
            headers = {"Content-Type": "application/json", **(extra or {})}
            if code:
                headers["X-Error-Code"] = code
            headers["X-Error-Message"] = message
            self._send(status, headers, json.dumps({"error": message}).encode(), head=self.command == "HEAD")

        def _send(self, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(body)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

    return Handler
