"""A loopback HTTP server that serves local checkpoint directories the way the Hugging Face Hub does.

Enough of the Hub's file protocol for huggingface_hub's download and range-read paths:
``HEAD|GET /{repo_id}/resolve/{revision}/{filename}`` with ``ETag``, ``X-Repo-Commit``, ``Content-Length``,
``Accept-Ranges``; ``Range: bytes=a-b`` answered with 206 + ``Content-Range``; 404s carry the Hub's
``X-Error-Code`` (RepoNotFound / RevisionNotFound / EntryNotFound) so huggingface_hub raises its typed
errors. Every request is recorded (method, repo, file, range, bytes sent) for request-count tests and
benchmarks. Used by tests/test_inspect_remote.py and benchmarks/inspect_bench.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import threading
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Request:
    method: str
    repo: str
    revision: str
    file: str
    range: str | None
    status: int
    body_bytes: int
    authorization: str | None = None


class FakeHub:
    """Serve ``repos`` (repo id -> local directory) at ``endpoint`` (http://127.0.0.1:PORT).

    Each repo has one commit, ``commit`` (40 hex digits); revisions ``main`` and the commit resolve to it.
    Repos in ``gated`` answer 403 with the Hub's GatedRepo error code.
    Use as a context manager; ``requests`` lists every request served; ``reset()`` clears it.
    """

    def __init__(self, repos: dict[str, Path], commit: str = "a" * 40, gated: frozenset[str] = frozenset()):
        self.repos = {k: Path(v) for k, v in repos.items()}
        self.commit = commit
        self.gated = gated  # repo ids answered with 403 GatedRepo, as the Hub does without access
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def for_file(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.file == name]

    def _record(self, h, repo, rev, file, rng, status, n) -> None:
        with self._lock:
            self.requests.append(Request(h.command, repo, rev, file, rng, status, n,
                                         h.headers.get("Authorization")))

    def _send(self, h, status, headers, body=b"", head=False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(h.path.split("?", 1)[0])
        rng = h.headers.get("Range")
        if path == "/__log":  # control endpoints for FakeHubProcess (not recorded)
            with self._lock:
                body = json.dumps([asdict(r) for r in self.requests]).encode()
            return self._send(h, 200, {"Content-Type": "application/json"}, body, head)
        if path == "/__reset":
            self.reset()
            return self._send(h, 200, {}, b"ok", head)
        if "/resolve/" not in path:
            self._record(h, "", "", path, rng, 404, 0)
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"not found", head)
        repo, rest = path.lstrip("/").split("/resolve/", 1)
        rev, _, file = rest.partition("/")
        root = self.repos.get(repo)
        if root is None:
            self._record(h, repo, rev, file, rng, 404, 0)
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"repo not found", head)
        if repo in self.gated:
            self._record(h, repo, rev, file, rng, 403, 0)
            return self._send(h, 403, {"X-Error-Code": "GatedRepo"}, b"gated", head)
        if rev not in ("main", self.commit):
            self._record(h, repo, rev, file, rng, 404, 0)
            return self._send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b"revision not found", head)
        p = root / file
        if ".." in Path(file).parts or not p.is_file():
            self._record(h, repo, rev, file, rng, 404, 0)
            return self._send(h, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.commit},
                              b"entry not found", head)
        size = p.stat().st_size
        st = p.stat()
        etag = hashlib.sha256(f"{file}:{size}:{st.st_mtime_ns}".encode()).hexdigest()
        base = {"ETag": f'"{etag}"', "X-Repo-Commit": self.commit, "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream"}
        start, stop, status = 0, size, 200
        if rng is not None and not head:
            m = _RANGE.match(rng.strip())
            if m is None or int(m.group(1)) >= size:
                self._record(h, repo, rev, file, rng, 416, 0)
                return self._send(h, 416, {**base, "Content-Range": f"bytes */{size}"}, b"", head)
            start = int(m.group(1))
            stop = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
            base["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        if head:
            self._record(h, repo, rev, file, rng, 200, 0)
            return self._send(h, 200, {**base, "Content-Length": str(size)}, b"", head=True)
        with open(p, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start)
        self._record(h, repo, rev, file, rng, status, len(body))
        self._send(h, status, base, body)


def set_endpoint(monkeypatch, endpoint: str) -> None:
    """Point huggingface_hub at ``endpoint`` (its constants are read at import, so patch them too)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")



class FakeHubProcess:
    """The same server in a child process (``python tests/fake_hub.py``), so that benchmark timings do not
    share the GIL with the server. ``requests`` / ``reset()`` / ``for_file()`` as in :class:`FakeHub`."""

    def __init__(self, repos: dict[str, Path], commit: str = "a" * 40):
        args = [sys.executable, str(Path(__file__).resolve()), "--commit", commit]
        for repo, root in repos.items():
            args += ["--repo", f"{repo}={root}"]
        self._args = args
        self.endpoint = ""

    def __enter__(self) -> FakeHubProcess:
        self._proc = subprocess.Popen(self._args, stdout=subprocess.PIPE, text=True)
        self.endpoint = self._proc.stdout.readline().strip()
        return self

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)

    @property
    def requests(self) -> list[Request]:
        with urllib.request.urlopen(self.endpoint + "/__log") as r:
            return [Request(**d) for d in json.loads(r.read())]

    def reset(self) -> None:
        urllib.request.urlopen(self.endpoint + "/__reset").read()

    def for_file(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.file == name]


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="serve checkpoint directories like the Hugging Face Hub")
    ap.add_argument("--repo", action="append", default=[], help="REPO_ID=DIRECTORY (repeatable)")
    ap.add_argument("--commit", default="a" * 40)
    args = ap.parse_args()
    repos = dict(item.split("=", 1) for item in args.repo)
    hub = FakeHub({k: Path(v) for k, v in repos.items()}, commit=args.commit)
    print(hub.endpoint, flush=True)
    hub._server.serve_forever()


if __name__ == "__main__":
    _main()


def record_snapshot_downloads(monkeypatch, local_dir: Path) -> list[dict]:
    """Replace ``huggingface_hub.snapshot_download`` with a stub that answers ``local_dir`` and records each
    call's ``repo_id``, ``revision``, ``allow_patterns`` and ``ignore_patterns`` (a dict per call, in order)."""
    import huggingface_hub

    calls: list[dict] = []

    def fake(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        calls.append(dict(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns,
                          ignore_patterns=ignore_patterns))
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls
