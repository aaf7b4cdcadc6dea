"""Fresh-user tester round 5: verify, convert's CLI and two benchmarks, each defect fed its bad input.

1. verify checks config.json (manifest ``config_sha256``; with ``--source`` against what convert writes) and
   each part's row range against its own recorded source shape.
2. ``convert --revision <sha>`` offline finds the cached snapshot (no Hub tree listing cached).
3. ``--overwrite``'s help says it only replaces atomtool layouts.
4. An OUT in /proc names the failed mkdir, not a bare "No such file or directory".
5. SIGTERM during convert exits 143 and leaves no OUT.
6. Top-level safetensors the conversion does not read are listed as not carried.
7. load_bench with a missing --dir, convert_bench below its minimum size.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import MANIFEST_NAME, is_layout
from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str):
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def glm_fp8(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("t5")
    write_hf_checkpoint(base / "glm", "glm_moe_dsa", dtype=torch.bfloat16, tokenizer=False)
    return write_fp8_block_checkpoint(base / "glm", base / "glm-fp8", block=24)


@pytest.fixture(scope="module")
def layout(glm_fp8, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("t5-layout") / "L"
    code, _, err = cli("convert", glm_fp8, out)
    assert code == 0, err
    return out


@pytest.fixture
def copy(layout, tmp_path) -> Path:
    dst = tmp_path / "L"
    shutil.copytree(layout, dst)
    return dst


def _edit_config(layout: Path, **changes) -> None:
    cfg = json.loads((layout / "config.json").read_text())
    cfg.update(changes)
    (layout / "config.json").write_text(json.dumps(cfg, indent=2))


def _edit_manifest(layout: Path, fn) -> None:
    m = json.loads((layout / MANIFEST_NAME).read_text())
    fn(m)
    (layout / MANIFEST_NAME).write_text(json.dumps(m, indent=1))


# ------------------------------------------------------------------------------- 1. config.json
def test_intact_layout_verifies(layout, glm_fp8):
    """Positive control for the checks below: the untouched layout passes, with and without --source."""
    m = json.loads((layout / MANIFEST_NAME).read_text())
    assert len(m["config_sha256"]) == 64
    for extra in ((), ("--source", str(glm_fp8))):
        code, out, err = cli("verify", layout, *extra)
        assert code == 0 and out.startswith("OK: "), (out, err)
        assert "problem" not in err and "note" not in err


def test_edited_config_fails_verify(copy, glm_fp8):
    _edit_config(copy, num_hidden_layers=3)
    code, out, err = cli("verify", copy)
    assert code == 1 and out.startswith("FAILED (1 problem): "), out
    assert "problem: config.json: sha256 " in err and "(edited after convert?)" in err
    code, out, err = cli("verify", copy, "--source", glm_fp8)
    assert code == 1 and out.startswith("FAILED (2 problems): "), out
    assert (f"problem: config.json: differs from what convert writes from {glm_fp8}'s config: "
            "num_hidden_layers is 3 (convert writes 4)\n") in err


def test_old_manifest_without_config_hash(copy, glm_fp8):
    """A manifest older than config_sha256 still verifies (with a note); --source still catches the edit."""
    _edit_manifest(copy, lambda m: m.pop("config_sha256"))
    code, out, err = cli("verify", copy)
    assert code == 0 and out.startswith("OK: "), (out, err)
    assert "note: the manifest has no config_sha256 (written by an older atomtool)" in err
    code, out, _ = cli("verify", copy, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["notes"][0].startswith("the manifest has no config_sha256")
    _edit_config(copy, num_hidden_layers=3)
    code, out, err = cli("verify", copy, "--source", glm_fp8)
    assert code == 1 and "num_hidden_layers is 3 (convert writes 4)" in err, err


def test_missing_config_fails_verify(copy):
    (copy / "config.json").unlink()
    code, out, err = cli("verify", copy)
    assert code == 1 and "problem: config.json: missing from the layout\n" in err


def _fused_qkv_a(m: dict) -> tuple[str, dict]:
    name = next(n for n in m["tensors"] if n.endswith("fused_qkv_a_proj.weight_scale_inv") is False
                and n.endswith("fused_qkv_a_proj.weight"))
    return name, m["tensors"][name]


def test_part_rows_contradicting_source_shape(copy):
    """The tester's edit: q_a's rows widened past its recorded source shape ([0, 36] for 32 rows), its padding
    shrunk so the parts still tile the output: the row span no longer matches the part's own source_shape."""
    m = json.loads((copy / MANIFEST_NAME).read_text())
    name, entry = _fused_qkv_a(m)
    q, kv = entry["parts"][0], entry["parts"][1]
    assert q["rows"] == [0, 32] and q["pad_rows"] == 16 and kv["rows"] == [48, 88]  # the fixture's layout
    assert q["source_shape"] == [32, 64]
    q["rows"], q["pad_rows"] = [0, 36], 12
    (copy / MANIFEST_NAME).write_text(json.dumps(m, indent=1))
    code, out, err = cli("verify", copy)
    assert code == 1 and out.startswith("FAILED (1 problem): "), (out, err)
    assert err == (f"problem: {name}: part {q['source']} rows [0, 36] span 36 rows, but the source's shape "
                   "[32, 64] has 32\n")
    # the same edit without padding to absorb it: kv_a moved to [36, 76] -> also a gap before the next part
    q["pad_rows"], kv["rows"] = 0, [36, 76]
    (copy / MANIFEST_NAME).write_text(json.dumps(m, indent=1))
    code, out, err = cli("verify", copy)
    assert code == 1
    assert f"problem: {name}: part {q['source']} rows [0, 36] span 36 rows" in err
    assert f"problem: {name}: part {q['source']} rows [0, 36] end inside a 24-row FP8 block but are not " \
           "padded to its end\n" in err


def test_padding_where_the_block_rule_puts_none(copy):
    m = json.loads((copy / MANIFEST_NAME).read_text())
    name, entry = _fused_qkv_a(m)
    last = entry["parts"][-1]
    last["pad_rows"] = 3
    last["rows"][1] -= 3
    last["source_shape"][0] -= 3
    (copy / MANIFEST_NAME).write_text(json.dumps(m, indent=1))
    code, out, err = cli("verify", copy)
    assert code == 1
    assert (f"problem: {name}: part {last['source']} rows [{last['rows'][0]}, {last['rows'][1]}] are followed "
            "by 3 padding rows; padding only pads an FP8 block weight part up to the next multiple of the "
            "block's rows (24)\n") in err


def test_copy_shape_contradicting_source_shape(copy):
    m = json.loads((copy / MANIFEST_NAME).read_text())
    name = "model.norm.weight"
    m["tensors"][name]["parts"][0]["source_shape"] = [7]
    (copy / MANIFEST_NAME).write_text(json.dumps(m, indent=1))
    code, out, err = cli("verify", copy)
    assert code == 1
    shape = m["tensors"][name]["shape"]
    assert f"problem: {name}: shape {shape} != its source {name}'s [7]\n" in err


# ------------------------------------------------------------------------------- 2. offline --revision
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_offline_revision_uses_the_cached_snapshot(monkeypatch, tmp_path):
    """A snapshot cached without huggingface_hub's tree listing (as hf_hub_download or an older
    huggingface_hub leave it): offline, --revision <sha> converts from it, like inspect reads it."""
    from tests.fake_hub import set_endpoint
    from tests.test_hub_errors import ApiFakeHub

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    repo = write_hf_checkpoint(tmp_path / "src", "qwen3", tokenizer=False)
    with ApiFakeHub({"org/model": repo}, commit=COMMIT) as hub:
        set_endpoint(monkeypatch, hub.endpoint)
        code, _, err = cli("convert", "org/model", tmp_path / "online", "--revision", COMMIT)
        assert code == 0, err
    storage = Path(constants.HF_HUB_CACHE) / "models--org--model"
    shutil.rmtree(storage / "trees")  # no cached tree listing
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = cli("inspect", "org/model", "--revision", COMMIT)
    assert code == 0, err
    code, out, err = cli("convert", "org/model", tmp_path / "out", "--revision", COMMIT)
    assert code == 0, err
    assert is_layout(tmp_path / "out") and "wrote " in out
    # a revision the cache does not hold: one whole line naming what it holds
    other = "f" * 40
    code, _, err = cli("convert", "org/model", tmp_path / "out2", "--revision", other)
    assert code == 1
    assert err == (f"error: org/model: HF_HUB_OFFLINE is set, and revision '{other}' is not in the local HF "
                   f"cache ({constants.HF_HUB_CACHE}), which holds {COMMIT}\n")


# ------------------------------------------------------------------------------- 3. --overwrite help
def test_overwrite_help_says_layouts_only():
    r = runner.invoke(app, ["convert", "--help"])
    text = " ".join(r.stdout.split()).replace("non- empty", "non-empty")  # click wraps at the hyphen
    assert ("--overwrite / --no-overwrite Replace an existing OUT that is an atomtool layout (holds "
            "atomtool.json); any other non-empty directory is refused, never deleted.") in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`--overwrite` replaces an existing atomtool layout" in readme


def test_overwrite_refuses_a_non_layout(glm_fp8, tmp_path):
    out = tmp_path / "notalayout"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, _, err = cli("convert", glm_fp8, out, "--overwrite")
    assert code == 1 and err.startswith(f"error: refusing to --overwrite {out}: it is not an atomtool layout")
    assert (out / "keep.txt").read_text() == "x"


# ------------------------------------------------------------------------------- 4. OUT in /proc
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs procfs (Linux)")
def test_out_in_proc_names_the_failed_mkdir(glm_fp8):
    code, _, err = cli("convert", glm_fp8, "/proc/atomout")
    assert code == 1
    assert err.startswith("error: cannot write to /proc: creating /proc/.atomout.tmp-"), err
    assert err.rstrip().endswith("failed (No such file or directory) although /proc exists: its filesystem "
                                 "does not accept new directories (a virtual filesystem such as /proc or /sys?)")


# ------------------------------------------------------------------------------- 5. SIGTERM
def test_sigterm_exits_143_and_leaves_no_out(tmp_path):
    from tests.test_convert_interrupt import SLEEP_ENV

    src = write_hf_checkpoint(tmp_path / "src", "qwen3", tokenizer=False)
    out = tmp_path / "o" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "atomtool.cli", "convert", str(src), str(out),
                             "--shard-size", "16KB"], env={**os.environ, SLEEP_ENV: "0.5"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        tmps = list(out.parent.glob(".out.tmp-*")) if out.parent.is_dir() else []
        if tmps and list(tmps[0].glob("model-*.safetensors")):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"conversion never got mid-write: {proc.communicate()}")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert stderr.rstrip().endswith("error: terminated (SIGTERM)")
    assert not out.exists() and not (out.parent.exists() and list(out.parent.iterdir()))


# ------------------------------------------------------------------------------- 6. skipped weights
def test_unread_safetensors_are_reported_not_carried(tmp_path):
    src = write_hf_checkpoint(tmp_path / "single", "qwen3", tokenizer=False)
    save_file(load_file(src / "model.safetensors"), src / "consolidated.safetensors")
    code, out, err = cli("convert", src, tmp_path / "o1")
    assert code == 0, err
    reason = "safetensors next to model.safetensors, the file read (not converted)"
    assert f"note: not carried: consolidated.safetensors ({reason})\n" in err
    m = json.loads((tmp_path / "o1" / MANIFEST_NAME).read_text())
    assert m["not_carried"] == [{"path": "consolidated.safetensors", "reason": reason}]

    sharded = write_hf_checkpoint(tmp_path / "sharded", "qwen3", tokenizer=False, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(sharded / first, sharded / "model-extra.safetensors")
    code, out, err = cli("convert", sharded, tmp_path / "o2", "--json")
    assert code == 0, err
    reason = "safetensors that model.safetensors.index.json does not list (not converted)"
    assert json.loads(out)["not_carried"] == [{"path": "model-extra.safetensors", "reason": reason}]
    # the layout itself verifies (no stray shard carried in)
    assert cli("verify", tmp_path / "o2")[0] == 0


# ------------------------------------------------------------------------------- 7. benchmarks
def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_load_bench_missing_dir_is_an_argparse_error(tmp_path):
    missing = tmp_path / "does-not-exist"
    r = _bench("benchmarks.load_bench", "--model", "dsv32-fp8", "--smoke", "--dir", str(missing))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.rstrip().endswith(f"error: argument --dir: {missing}: no such directory "
                                      "(create it first; the benchmark writes its checkpoints there)")


def test_convert_bench_below_minimum_says_so(capsys):
    from benchmarks.convert_bench import MIN_LAYERS, checked_gb, checkpoint_gb, layer_count, min_gb

    assert layer_count(0.05) == MIN_LAYERS == 2
    assert 0.7 < min_gb() == checkpoint_gb(2) < 0.75  # the tester's 0.727 GB
    assert checked_gb(0.05) == min_gb()
    assert capsys.readouterr().err == (f"note: --gb 0.05 is below the smallest checkpoint this benchmark writes "
                                       f"(2 layers, {min_gb():.3f} GB); using {min_gb():.3f} GB\n")
    assert checked_gb(2.0) == 2.0 and capsys.readouterr().err == ""


def test_convert_bench_non_positive_gb_is_an_argparse_error():
    r = _bench("benchmarks.convert_bench", "--gb", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.rstrip().endswith("error: --gb must be a positive size in GB, not 0")


def test_clip_never_cuts_mid_word():
    """atomtool.errors.clip, for embedding huggingface_hub's error texts in one-line Hub messages: its
    offline text cut at 200 characters ended in "please unset the `HF_H"."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    from atomtool.errors import clip

    url = "https://huggingface.co/api/models/org/model/tree/" + COMMIT + "?recursive=true&expand=false"
    text = str(OfflineModeIsEnabled(f"Cannot reach {url}: offline mode is enabled. To disable it, please unset "
                                    "the `HF_HUB_OFFLINE` environment variable."))
    assert len(text) > 200
    cut = clip(text)
    assert len(cut) <= 200 and cut.endswith(" ...")
    assert text.startswith(cut[: -len(" ...")] + " ")  # ends on a whole word of the original
    assert clip("short\n  text") == "short text"
