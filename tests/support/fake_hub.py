"""A local stand-in for the Hub's HTTP API: just what ``create_repo``, ``create_branch`` and ``upload_folder`` call.

Every file is answered ``uploadMode: regular``, so huggingface_hub sends contents base64-encoded in the commit's
ndjson body and no LFS/Xet storage is involved. Requests and stored files are kept for the test to inspect.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

USER = "fake-user"


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[str] = field(default_factory=list)


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class FakeHub:
    """``with FakeHub(token) as hub:`` serves on ``hub.url`` (127.0.0.1, a free port) until the block ends."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id].branches[branch]

    # ------------------------------------------------------------------------------------------- routes
    # each returns (status, JSON body, extra headers)

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:  # noqa: PLR0911  (one return per Hub endpoint)
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "validate-yaml"] and method == "POST":
            return self._validate_yaml(json.loads(body))
        if parts[:3] == ["api", "repos", "create"] and method == "POST":
            return self._create(json.loads(body))
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id, action, rest = f"{parts[2]}/{parts[3]}", parts[4] if len(parts) > 4 else "", parts[5:]
            repo = self.repos.get(repo_id)
            if repo is None:
                return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
            rev = "/".join(rest) or "main"
            if action == "branch" and method == "POST":
                if rev in repo.branches:
                    return 409, {"error": "Reference already exists"}, {}
                repo.branches[rev] = dict(repo.branches["main"])
                return 200, {}, {}
            if rev not in repo.branches:
                return 404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"}
            if action == "preupload" and method == "POST":
                files = json.loads(body)["files"]
                return 200, {"files": [_regular(f["path"]) for f in files]}, {}
            if action == "commit" and method == "POST":
                return self._commit(repo_id, repo, rev, body)
        return 404, {"error": f"fake hub: no route for {method} {path}"}, {}

    def _validate_yaml(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        text = payload["content"]
        head, sep, _ = text.removeprefix("---\n").partition("\n---")
        try:
            ok = text.startswith("---\n") and bool(sep) and isinstance(yaml.safe_load(head), dict)
        except yaml.YAMLError:
            ok = False
        if not ok:
            return 400, {"errors": [{"message": "invalid metadata"}], "warnings": []}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def _create(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}, {}
        self.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}, {}

    def _commit(self, repo_id: str, repo: Repo, rev: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return 400, {"error": "commit must start with a header"}, {}
        for item in lines[1:]:
            if item["key"] != "file":  # only regular files were offered
                return 400, {"error": f"fake hub: unsupported operation {item['key']}"}, {}
            value = item["value"]
            repo.branches[rev][value["path"]] = base64.b64decode(value["content"])
        oid = hashlib.sha1(body).hexdigest()
        repo.commits.append(lines[0]["value"]["summary"])
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True}, {}


def _regular(path: str) -> dict[str, Any]:
    return {"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": None}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = urlsplit(self.path).path
            auth = self.headers.get("Authorization")
            with hub._lock:
                hub.requests.append(Request(self.command, path, auth))
                if auth != f"Bearer {hub.token}":
                    status, data, headers = 401, {"error": "Invalid credentials in Authorization header"}, {}
                else:
                    status, data, headers = hub.handle(self.command, path, body)
            out = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
            pass

    return Handler
