"""convert carries every non-weight file of SRC into the layout (fresh-user defect: remote code,
DeepSeek-V3.2's ``encoding/`` folder, README, ``original/`` ... were dropped silently).

Expected: every file that is not a weight shard, the safetensors index or a pickle weight is copied with
its relative path (subfolders included, symlinks followed), listed in the manifest's ``carried_files``
(size + sha256 of the bytes written), summarised in one ``note: carried N other files`` line; pickle weights
are named in ``not_carried`` and a ``note: not carried`` line. SRC is never written to, an interrupted convert
leaves nothing, verify checks the carried files, and the layout still loads in generate and serve.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import atomtool.convert.extra_files as extra
from atomtool.cli import app
from atomtool.convert.layout import MANIFEST_NAME
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import make_engine
from tests.fake_hub import record_snapshot_downloads

runner = CliRunner()

CONFIGURATION_X = b'''from transformers import LlamaConfig


class XConfig(LlamaConfig):
    """remote config class a trust_remote_code load imports from the checkpoint directory"""

    marker = "configuration_x loaded"
'''
ENCODING = b"def encode_messages(messages):\n    return ''.join(m['content'] for m in messages)\n"
README = b"# tiny model\n\nsome model card text \xc3\xa9\n"
#: relative path -> bytes of the extra files the fixture adds (README.md is a symlink to docs/card.md)
EXTRAS = {
    "encoding/encoding_dsv32.py": ENCODING,
    "encoding/README.md": b"how to encode chats\n",
    "configuration_x.py": CONFIGURATION_X,
    "modeling_x.py": b"raise SystemExit('never executed by atomtool')\n",
    "hf_quant_config.json": b'{"producer": {"name": "modelopt"}}\n',
    "original/params.json": b'{"dim": 64}\n',
    "LICENSE": b"MIT\n",
    "docs/card.md": README,
    "README.md": README,
}
PICKLES = ("pytorch_model.bin", "original/consolidated.00.pth")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def tree(root: Path) -> dict[str, tuple[bool, bytes | str]]:
    """{relative path: (is_symlink, bytes or link target)} of every entry under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = (True, os.readlink(p))
        elif p.is_file():
            out[rel] = (False, p.read_bytes())
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """The shared tiny Llama fixture plus the extras: nested encoding/, remote code named by config.json's
    ``auto_map``, a symlinked README, a symlinked folder, pickle weights."""
    root = write_hf_checkpoint(tmp_path_factory.mktemp("extra") / "llama", "llama")
    for rel, data in EXTRAS.items():
        if rel == "README.md":
            continue
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "README.md").symlink_to("docs/card.md")
    (root / "linked").symlink_to("encoding", target_is_directory=True)  # a symlinked folder
    (root / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    (root / "original" / "consolidated.00.pth").write_bytes(b"\x80\x02pickle")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    cfg = json.loads((root / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    before = tree(src)
    out = tmp_path_factory.mktemp("extra_out") / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.output
    assert tree(src) == before  # SRC is never written to
    return out, r


def carried_expected(src: Path) -> dict[str, bytes]:
    """Every file convert must carry: the extras, the symlinked folder's files, and the fixture's own
    tokenizer / generation config (all non-weight files but config.json)."""
    want = {rel: data for rel, data in EXTRAS.items()}
    want.update({f"linked/{n}": EXTRAS[f"encoding/{n}"] for n in ("encoding_dsv32.py", "README.md")})
    for p in src.iterdir():
        if p.is_file() and p.name not in ("config.json", "pytorch_model.bin") and not p.name.startswith(".") \
                and not p.name.endswith(".safetensors") and p.name not in want:
            want[p.name] = p.read_bytes()
    return want


def test_every_non_weight_file_is_carried_byte_for_byte(src, converted):
    out, _ = converted
    want = carried_expected(src)
    assert {"generation_config.json", "tokenizer.json", "encoding/encoding_dsv32.py"} <= set(want)
    for rel, data in want.items():
        assert (out / rel).is_file() and not (out / rel).is_symlink(), rel  # symlinks read through
        assert (out / rel).read_bytes() == data, rel
    for rel in PICKLES + (".gitattributes",):
        assert not (out / rel).exists(), rel
    # config.json is the plan's config (still naming the carried remote code), not the source bytes
    assert json.loads((out / "config.json").read_text())["auto_map"] == {"AutoConfig": "configuration_x.XConfig"}


def test_manifest_lists_carried_and_not_carried_files(src, converted):
    out, _ = converted
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    want = carried_expected(src)
    entries = {e["path"]: e for e in manifest["carried_files"]}
    assert set(entries) == set(want)
    for rel, data in want.items():
        assert entries[rel]["size"] == len(data) and entries[rel]["sha256"] == hashlib.sha256(data).hexdigest()
    not_carried = {e["path"]: e["reason"] for e in manifest["not_carried"]}
    assert set(not_carried) == set(PICKLES)
    assert all("pickle weights" in r for r in not_carried.values())


def test_notes_say_what_was_carried_and_what_not(src, converted):
    _, r = converted
    usual = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json")
    others = {rel: d for rel, d in carried_expected(src).items() if rel not in usual}
    assert "tokenizer.json" not in others and "encoding/encoding_dsv32.py" in others
    n, size = len(others), sum(len(d) for d in others.values())
    from atomtool.inspect.report import human_bytes

    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("note: carried")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"note: carried {n} other files ({human_bytes(size)}): ")
    for top in ("encoding/", "configuration_x.py", "original/", "README.md", "linked/"):
        assert top in lines[0], lines[0]
    nc = [ln for ln in r.stderr.splitlines() if ln.startswith("note: not carried")]
    assert len(nc) == 1 and "pytorch_model.bin" in nc[0] and "original/consolidated.00.pth" in nc[0], r.stderr


def test_json_summary_lists_carried_files(src, tmp_path):
    r = run("convert", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert set(summary["carried_files"]) == set(carried_expected(src))
    assert {e["path"] for e in summary["not_carried"]} == set(PICKLES)


def test_verify_passes_and_catches_an_edited_or_missing_carried_file(src, converted, tmp_path):
    out, _ = converted
    r = run("verify", out)
    assert r.exit_code == 0 and r.stdout.startswith("OK"), r.output
    r = run("verify", out, "--source", src)
    assert r.exit_code == 0, r.output
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "encoding" / "encoding_dsv32.py").write_text("edited\n")
    (bad / "LICENSE").unlink()
    r = run("verify", bad)
    assert r.exit_code == 1
    assert "problem: encoding/encoding_dsv32.py: carried file's sha256" in r.stderr, r.stderr
    assert "problem: LICENSE: carried file listed in the manifest is missing" in r.stderr, r.stderr


def test_carried_remote_code_loads_with_trust_remote_code(converted, tmp_path):
    """The defect's symptom: config.json's auto_map names configuration_x.py, which must be in OUT."""
    out, _ = converted
    code = ("import sys; from transformers import AutoConfig; "
            "c = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True); print(type(c).marker)")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0 and "configuration_x loaded" in p.stdout, p.stderr[-2000:]


def test_generate_and_serve_still_load_the_layout(src, converted):
    out, _ = converted
    args = ("--prompt", "ab", "--max-tokens", "4", "--device", "cpu", "--json")
    a, b = run("generate", out, *args), run("generate", src, *args)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert json.loads(a.stdout)[0]["token_ids"] == json.loads(b.stdout)[0]["token_ids"]

    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.server import ServerThread

    engine = make_engine(out, dtype="float32", max_model_len=64)
    with ServerThread(create_app(engine, "tiny")) as url:
        resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4,
                                                         "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == json.loads(a.stdout)[0]["text"]


def test_interrupted_copy_of_extra_files_leaves_nothing(src, tmp_path, monkeypatch):
    real = shutil.copy2
    calls = []

    def copy_then_interrupt(a, b, **kw):
        calls.append(a)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(a, b, **kw)

    monkeypatch.setattr(extra.shutil, "copy2", copy_then_interrupt)
    before = tree(src)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code != 0 and len(calls) == 3
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no OUT, no hidden temp dir
    assert tree(src) == before


def test_unreadable_extra_file_is_one_error_line_and_leaves_nothing(src, tmp_path, monkeypatch):
    def fail(a, b, **kw):
        raise PermissionError(13, "Permission denied", str(a))

    monkeypatch.setattr(extra.shutil, "copy2", fail)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 1
    # the failing file is a source file: a read failure, named as such (fresh-user round 15b)
    assert "error: cannot read" in r.stderr and "Permission denied" in r.stderr and "nothing was written" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_dangling_symlink_is_named_not_carried(src, tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(src, copy, symlinks=True)
    (copy / "gone.md").symlink_to("nowhere.md")
    found = extra.extra_files(copy)
    assert {"path": "gone.md", "reason": "dangling symlink"} in found.not_carried
    assert "gone.md" not in {rel for rel, _ in found.carried}


def test_symlink_cycle_terminates(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.txt").write_text("x")
    (tmp_path / "a" / "loop").symlink_to("..", target_is_directory=True)
    found = extra.extra_files(tmp_path)
    assert [rel for rel, _ in found.carried] == ["a/f.txt"]


def test_hub_download_fetches_non_weight_files_but_never_pickles(src, tmp_path, monkeypatch):
    """The patterns go through huggingface_hub's own filter (what snapshot_download applies)."""
    from huggingface_hub.utils import filter_repo_objects

    calls = record_snapshot_downloads(monkeypatch, src)
    r = run("convert", "deepseek-ai/DeepSeek-V3.2", tmp_path / "out")
    assert r.exit_code == 0, r.output
    allow, ignore = calls[0]["allow_patterns"], calls[0]["ignore_patterns"]
    repo = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
            "encoding/encoding_dsv32.py", "configuration_deepseek.py", "modeling_deepseek.py", "README.md",
            "LICENSE", "original/params.json", "hf_quant_config.json", "tokenizer.json", "assets/fig.png",
            "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "original/consolidated.00.pth",
            "model.ckpt", "training_args.pt", "tf_model.h5", "flax_model.msgpack", "model.gguf"]
    fetched = set(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=ignore))
    assert fetched == set(repo[:12])
    assert (tmp_path / "out" / "encoding" / "encoding_dsv32.py").read_bytes() == ENCODING
