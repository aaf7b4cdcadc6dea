"""Hub download failures of ``convert`` and ``generate`` (serve loads through the same resolve_source) are one
line, worded like inspect's, exit 1: unknown repo, gated repo, missing revision, a file gone from the repo, the
Hub unreachable, HF_HUB_OFFLINE without a cache. The Hub is tests/fake_hub.py, extended here with the two API
routes ``snapshot_download`` needs (repo info, file tree); a successful download is the positive control.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.commands import resolve_source
from atomtool.errors import SourceError
from atomtool.inspect.source import CheckpointSource
from tests.checkpoints import write_hf_checkpoint
from tests.fake_hub import FakeHub, set_endpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
runner = CliRunner()


class ApiFakeHub(FakeHub):
    """FakeHub plus ``GET /api/models/{repo}[/revision/{rev}]`` and ``/api/models/{repo}/tree/{rev}``
    (the Hub's repo-info and file-listing routes, with its X-Error-Codes). ``vanished``: files listed in
    the tree whose download then 404s (a file removed between the listing and the download)."""

    def __init__(self, *args, vanished: tuple[str, ...] = (), **kw):
        super().__init__(*args, **kw)
        self.vanished = vanished

    def _serve(self, h, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        if not path.startswith("/api/models/"):
            return super()._serve(h, head)
        parts = path[len("/api/models/"):].split("/")
        repo, rest = "/".join(parts[:2]), parts[2:]
        rev = rest[1] if len(rest) >= 2 else "main"
        root = self.repos.get(repo)
        if root is None:
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"repo not found", head)
        if repo in self.gated:
            return self._send(h, 403, {"X-Error-Code": "GatedRepo"}, b"gated", head)
        if rev not in ("main", self.commit):
            return self._send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b"revision not found", head)
        files = sorted(p.name for p in root.iterdir() if p.is_file()) + list(self.vanished)
        if rest and rest[0] == "tree":
            body = [{"type": "file", "path": f, "oid": "0" * 40,
                     "size": (root / f).stat().st_size if (root / f).is_file() else 1} for f in files]
        else:
            body = {"id": repo, "sha": self.commit, "siblings": [{"rfilename": f} for f in files]}
        self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(body).encode(), head)


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("hub") / "qwen3", "qwen3", tokenizer=False)


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """An empty HF cache, online mode, no token."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")


def start_hub(monkeypatch, repo_dir, **kw) -> ApiFakeHub:
    hub = ApiFakeHub({"org/model": repo_dir, "org/gated": repo_dir}, commit=COMMIT,
                     gated=frozenset({"org/gated"}), **kw)
    set_endpoint(monkeypatch, hub.endpoint)
    return hub


@pytest.fixture
def hub(isolated, monkeypatch, repo_dir):
    with start_hub(monkeypatch, repo_dir) as server:
        yield server


@pytest.fixture
def dead_endpoint(isolated, monkeypatch) -> str:
    """An endpoint nothing listens on (a port we bound and released): connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    set_endpoint(monkeypatch, endpoint)
    return endpoint


def cli(*args: str):
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stderr


def generate(model: str):
    return cli("generate", model, "--prompt", "hi", "--device", "cpu")


def convert(tmp_path, src: str, *extra: str):
    return cli("convert", src, str(tmp_path / "out"), *extra)


def assert_one_line(stderr: str, expected: str) -> None:
    assert stderr == f"error: {expected}\n"


def test_fake_hub_download_works(hub, repo_dir, tmp_path):
    """Positive control: the fake serves a real snapshot_download, so the failures below are the Hub's."""
    local, meta = resolve_source("org/model")
    assert (local / "config.json").read_bytes() == (repo_dir / "config.json").read_bytes()
    assert meta["commit"] == COMMIT and (local / "model.safetensors").is_file()
    code, err = convert(tmp_path, "org/model", "--dry-run")
    assert code == 0, err


def test_unknown_repo(hub, tmp_path):
    expected = (f"org/nope: not a local directory, and no Hub repo of that name at {hub.endpoint} "
                "(private or gated? set HF_TOKEN)")
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/nope")  # inspect's message is the reference
    assert str(e.value) == expected
    for code, err in (convert(tmp_path, "org/nope"), generate("org/nope")):
        assert code == 1
        assert_one_line(err, expected)
    assert not (tmp_path / "out").exists()


def test_serve_unknown_repo(hub):
    """serve loads through the same resolve_source: the same line after its 'loading' line, exit 1."""
    code, err = cli("serve", "org/nope", "--port", "0", "--device", "cpu")
    assert code == 1
    assert err == ("atomtool serve: loading org/nope ...\nerror: org/nope: not a local directory, and no Hub "
                   f"repo of that name at {hub.endpoint} (private or gated? set HF_TOKEN)\n")


def test_gated_repo(hub, tmp_path):
    expected = "org/gated: gated repo; accept its terms on the Hub and set HF_TOKEN"
    for code, err in (convert(tmp_path, "org/gated"), generate("org/gated")):
        assert code == 1
        assert_one_line(err, expected)


def test_missing_revision(hub, tmp_path):
    code, err = convert(tmp_path, "org/model", "--revision", "v9")
    assert code == 1
    assert_one_line(err, "org/model: revision 'v9' not found")


def test_file_gone_from_repo(isolated, monkeypatch, repo_dir, tmp_path):
    with start_hub(monkeypatch, repo_dir, vanished=("extra.json",)):
        for code, err in (convert(tmp_path, "org/model"), generate("org/model")):
            assert code == 1  # the progress bar of the download that failed comes first
            assert err.endswith("\nerror: org/model: extra.json not found in the Hub repo (it may have changed "
                                "meanwhile)\n")
            assert err.count("error") == 1 and "Traceback" not in err


def test_hub_unreachable(dead_endpoint, tmp_path):
    cache = constants.HF_HUB_CACHE
    for code, err in (convert(tmp_path, "org/model"), generate("org/model")):
        assert code == 1
        assert err.startswith(f"error: org/model: cannot reach {dead_endpoint} (ConnectError: ")
        assert err.endswith(f"), and the repo is not in the local HF cache ({cache})\n")
        assert err.count("\n") == 1 and "Connection refused" in err


def test_hub_unreachable_uses_the_cache(hub, monkeypatch, repo_dir, tmp_path):
    """Once downloaded, the snapshot is used when the Hub is down (huggingface_hub's fallback is kept)."""
    local, _ = resolve_source("org/model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        set_endpoint(monkeypatch, f"http://127.0.0.1:{s.getsockname()[1]}")
    assert resolve_source("org/model")[0] == local


def test_offline_without_cache(isolated, monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for code, err in (convert(tmp_path, "org/model"), generate("org/model")):
        assert code == 1
        assert_one_line(err, "org/model: HF_HUB_OFFLINE is set, and the repo is not in the local HF cache "
                             f"({constants.HF_HUB_CACHE})")
