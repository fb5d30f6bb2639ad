"""A stand-in for the Hugging Face hub (as moto stands in for S3): serves model folders by
repo id over the routes huggingface_hub downloads through, and counts the bytes it sends, so
a test can tell a download from a cache hit. (Here, not in asyncgrpo.testing: it is the
e2e's, and code under operator/ is in the images, which a change would rebuild.)

Routes (what `hf_hub_download`, `snapshot_download` and `from_pretrained` use):
HEAD/GET /{repo}/resolve/{rev}/{file} (X-Repo-Commit, ETag, Content-Length; 404 with
X-Error-Code: EntryNotFound for a file the repo lacks), GET /api/models/{repo}[/revision/{rev}]
(sha, siblings) and GET /api/models/{repo}/tree/{rev}[/{path}] (files).

    with HubServer({"org/name": Path("model-folder")}, host="0.0.0.0") as hub:
        env HF_ENDPOINT=hub.endpoint ...; hub.bytes_sent
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit

#: the one revision every repo has (refs/main points at it)
REVISION = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self, repos: dict[str, Path], host: str = "127.0.0.1", port: int = 0):
        self.repos = {r: {p.name: p for p in sorted(d.iterdir()) if p.is_file()}
                      for r, d in repos.items()}
        self.bytes_sent = 0
        self.files_sent: list[str] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _find(self, path: str) -> tuple[str, str, str] | None:
        """/{org}/{name}/resolve/{rev}/{file} -> (repo, rev, file)."""
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        return None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None,
                      head: bool = False) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _json(self, obj) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _not_found(self, code: str, head: bool = False) -> None:
                self._send(404, b"{}", {"X-Error-Code": code, "X-Error-Message": code,
                                        "Content-Type": "application/json"}, head=head)

            def _file(self, head: bool) -> None:
                found = hub._find(unquote(urlsplit(self.path).path))
                if found is None or found[0] not in hub.repos:
                    return self._not_found("RepoNotFound", head)
                repo, _, name = found
                path = hub.repos[repo].get(name)
                if path is None:
                    return self._not_found("EntryNotFound", head)
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                self._send(200, data, {"X-Repo-Commit": REVISION, "ETag": f'"{etag}"',
                                       "Content-Type": "application/octet-stream"}, head=head)
                if not head:
                    with hub._lock:
                        hub.bytes_sent += len(data)
                        hub.files_sent.append(f"{repo}/{name}")

            def do_HEAD(self):
                self._file(head=True)

            def do_GET(self):
                path = unquote(urlsplit(self.path).path).strip("/").split("/")
                if path[:2] != ["api", "models"]:
                    return self._file(head=False)
                repo = "/".join(path[2:4])
                if repo not in hub.repos:
                    return self._not_found("RepoNotFound")
                files = hub.repos[repo]
                rest = path[4:]
                if rest[:1] == ["tree"]:
                    sub = "/".join(rest[2:])
                    if sub:   # no folders in these repos
                        return self._not_found("EntryNotFound")
                    return self._json([{"type": "file", "path": n, "size": p.stat().st_size,
                                        "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                                       for n, p in files.items()])
                return self._json({"id": repo, "modelId": repo, "sha": REVISION,
                                   "private": False, "gated": False, "disabled": False,
                                   "tags": [], "siblings": [{"rfilename": n} for n in files]})

        return Handler
