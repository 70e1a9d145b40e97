"""A local Hugging Face Hub for tests: the part of the hub's HTTP API huggingface_hub's snapshot_download
calls (GET /api/models/<id>/revision/<rev>, GET /api/models/<id>/tree/<sha>, HEAD and GET
/<id>/resolve/<sha>/<file>), serving repositories built from local directories. Reached through
HF_ENDPOINT, as a private mirror is. Records each request (method, path, Authorization)."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}        # id -> {"sha", "files": {name: bytes}, "token", "branches"}
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, directory: str, token: str | None = None) -> str:
        """Serve the files of `directory` as repo_id (branch main); returns its commit sha."""
        files = {}
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
        sha = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repos[repo_id] = {"sha": sha, "files": files, "token": token, "branches": {"main": sha}}
        return sha

    # ---- the API
    def _send(self, h, status, body: bytes = b"", headers: dict | None = None, head=False):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _json(self, h, obj, head=False):
        self._send(h, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _not_found(self, h, code: str, head=False):
        self._send(h, 404, json.dumps({"error": code}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": code}, head)

    def _repo(self, h, repo_id, head):
        repo = self.repos.get(repo_id)
        token = h.headers.get("Authorization")
        if repo is None or (repo["token"] and token != f"Bearer {repo['token']}"):
            self._send(h, 401 if repo is not None or token is None else 404,
                       json.dumps({"error": "Repository not found"}).encode(),
                       {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, head)
            return None
        return repo

    def _serve(self, h, head: bool):
        url = urllib.parse.urlparse(h.path)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        self.requests.append(("HEAD" if head else "GET", url.path, h.headers.get("Authorization")))
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self._repo(h, "/".join(parts[2:4]), head)
            if repo is None:
                return
            rev = "/".join(parts[5:])
            sha = repo["branches"].get(rev, rev if rev == repo["sha"] else None)
            if sha is None:
                return self._not_found(h, "RevisionNotFound", head)
            if parts[4] == "revision":
                return self._json(h, {"id": "/".join(parts[2:4]), "modelId": "/".join(parts[2:4]), "sha": sha,
                                      "private": bool(repo["token"]),
                                      "siblings": [{"rfilename": n} for n in repo["files"]]}, head)
            return self._json(h, [{"type": "file", "path": n, "size": len(b),
                                   "oid": hashlib.sha1(b"blob %d\0" % len(b) + b).hexdigest()}
                                  for n, b in repo["files"].items()], head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(h, "/".join(parts[:2]), head)
            if repo is None:
                return
            rev, name = parts[3], "/".join(parts[4:])
            sha = repo["branches"].get(rev, rev if rev == repo["sha"] else None)
            if sha is None:
                return self._not_found(h, "RevisionNotFound", head)
            if name not in repo["files"]:
                return self._not_found(h, "EntryNotFound", head)
            body = repo["files"][name]
            etag = hashlib.sha256(body).hexdigest()
            return self._send(h, 200, body, {"X-Repo-Commit": sha, "ETag": f'"{etag}"',
                                             "Content-Type": "application/octet-stream"}, head)
        self._send(h, 404, b"{}", {"Content-Type": "application/json"}, head)
