"""A local HTTP server speaking the parts of the Hugging Face Hub's API that huggingface_hub uses to
download a model (repo info per revision, the recursive file tree, HEAD/GET on resolve URLs), so that
tests point HF_ENDPOINT at it and let huggingface_hub itself do the talking.

Repos: {repo_id: {revision: {path: bytes}}}; private repos answer 401 (as the Hub does, with
X-Error-Code: RepoNotFound) unless the request carries `Authorization: Bearer <token>`. Every GET of a
file is recorded in `downloads`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubServer:
    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]], private: dict[str, str] | None = None):
        self.repos, self.private = repos, private or {}
        self.downloads: list[tuple[str, str, str]] = []  # (repo, commit, path)
        self.commits = {(repo, rev): hashlib.sha1(f"{repo}@{rev}".encode()).hexdigest()
                        for repo, revs in repos.items() for rev in revs}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()

    def _files(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        for (r, name), commit in self.commits.items():
            if r == repo and rev in (name, commit):
                return commit, self.repos[repo][name]
        return None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, obj, status: int = 200) -> None:
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _denied(self, repo: str, head: bool) -> bool:
                token = hub.private.get(repo)
                if token is None or self.headers.get("authorization") == f"Bearer {token}":
                    return False
                self._send(401, b'{"error":"Invalid username or password."}',
                           {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid username or password.",
                            "Content-Type": "application/json"}, head)
                return True

            def _route(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m:
                    return self._info(m[1], m[2] or "main", head)
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m:
                    return self._tree(m[1], m[2], head)
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    return self._file(m[1], m[2], m[3], head)
                self._json({"error": "not found"}, 404)

            def _found(self, repo: str, rev: str, head: bool):
                if repo not in hub.repos:
                    self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
                    return None
                if self._denied(repo, head):
                    return None
                found = hub._files(repo, rev)
                if found is None:
                    self._send(404, b'{"error":"Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, head)
                return found

            def _info(self, repo: str, rev: str, head: bool) -> None:
                found = self._found(repo, rev, head)
                if found:
                    commit, files = found
                    self._json({"id": repo, "modelId": repo, "sha": commit, "private": repo in hub.private,
                                "siblings": [{"rfilename": p} for p in sorted(files)]})

            def _tree(self, repo: str, rev: str, head: bool) -> None:
                found = self._found(repo, rev, head)
                if found:
                    self._json([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                for p, b in sorted(found[1].items())])

            def _file(self, repo: str, rev: str, fpath: str, head: bool) -> None:
                found = self._found(repo, rev, head)
                if not found:
                    return
                commit, files = found
                if fpath not in files:
                    self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, head)
                    return
                body = files[fpath]
                if not head:
                    hub.downloads.append((repo, commit, fpath))
                self._send(200, body, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                                       "Content-Type": "application/octet-stream"}, head)

            def do_GET(self) -> None:
                self._route(head=False)

            def do_HEAD(self) -> None:
                self._route(head=True)

        return Handler
