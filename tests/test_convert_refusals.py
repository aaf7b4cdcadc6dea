"""``atomtool convert`` refuses, up front and in one line, what the engine could not serve afterwards, unless
``--force``; ``--dry-run`` applies the same refusals; leftovers of crashed conversions are cleaned; verify
says once when ``--source`` is another checkpoint, caps its listing and says "no such directory".

Each test feeds the bad input (a fixture from tests/checkpoints.py, edited the way a user's checkpoint goes
wrong) through the CLI and checks the message, the exit code and that nothing was written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import is_layout
from atomtool.convert.plan import build_plan, missing_tensors
from atomtool.convert.writer import OWNER_NAME, UNOWNED_STALE_S, clean_leftover_tmp_dirs
from atomtool.errors import ConversionError
from atomtool.inspect.classify import inspect_checkpoint
from atomtool.inspect.families import supported_architectures
from tests.checkpoints import (
    load_state_dict,
    write_awq_checkpoint,
    write_ct_fp8_checkpoint,
    write_ct_int4_checkpoint,
    write_fp8_block_checkpoint,
    write_hf_checkpoint,
    write_mxfp4_checkpoint,
    write_nvfp4_checkpoint,
    write_state_dict,
)

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("refuse")
    return {"qwen3": write_hf_checkpoint(base / "qwen3", "qwen3", tokenizer=False),
            "glm": write_hf_checkpoint(base / "glm", "glm_moe_dsa", tokenizer=False),
            "dsv3": write_hf_checkpoint(base / "dsv3", "deepseek_v3", tokenizer=False)}


def edited_copy(src: Path, dst: Path, *, drop: tuple[str, ...] = (), config: dict | None = None,
                drop_config: tuple[str, ...] = ()) -> Path:
    """A copy of ``src`` without the tensors ``drop`` and with config.json updated."""
    shutil.copytree(src, dst)
    if drop:
        sd = load_state_dict(src)
        for n in drop:
            del sd[n]
        for f in dst.glob("*.safetensors"):
            f.unlink()
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)
        write_state_dict(dst, sd)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config or {})
    for k in drop_config:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_refused(src: Path, out: Path, *needles: str, dry_run: bool = True) -> str:
    """convert (and convert --dry-run) exit 1 with one ``error:`` line naming the problem, write nothing;
    --force warns and writes the layout. Returns the error line."""
    r = run("convert", src, out)
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "wrote" not in r.stdout, r.output
    assert f"{src} would not convert into a servable layout: " in lines[0] and "pass --force" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))
    if dry_run:
        d = run("convert", src, out, "--dry-run")
        assert d.exit_code == 1 and d.stderr.strip() == lines[0] and "dry run" not in d.stdout
    f = run("convert", src, out, "--force")
    assert f.exit_code == 0, f.output
    assert "warning: --force: converting although the layout will not be servable: " in f.stderr
    assert is_layout(out)
    v = run("verify", out)  # intact, but verify repeats why it is not servable
    assert v.exit_code == 0 and v.stdout.startswith("OK: ") and "warning: --force" in v.stderr, v.output
    return lines[0]


# ----------------------------------------------------------------------------- 1. unservable input


def test_inspect_error_fp8_weight_without_scale(ckpts, tmp_path):
    fp8 = write_fp8_block_checkpoint(ckpts["qwen3"], tmp_path / "fp8", block=(16, 16))
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    assert scale in load_state_dict(fp8)
    src = edited_copy(fp8, tmp_path / "src", drop=(scale,))
    assert_refused(src, tmp_path / "out", "fp8-without-scale")


def test_inspect_error_invalid_dsa_config(ckpts, tmp_path):
    src = edited_copy(ckpts["glm"], tmp_path / "src", config={"index_topk_freq": 0}, drop_config=("indexer_types",))
    assert_refused(src, tmp_path / "out", "config-invalid", "index_topk_freq must be an integer >= 1, got 0")


@pytest.mark.parametrize("fmt,scheme", [("nvfp4", "nvfp4"), ("awq", "awq"), ("ct_int4", "int4_pack"),
                                        ("ct_fp8", "fp8_channel"), ("mxfp4", "mxfp4")])
def test_schemes_the_engine_cannot_serve(ckpts, tmp_path, fmt, scheme):
    writer = {"nvfp4": write_nvfp4_checkpoint, "awq": write_awq_checkpoint, "ct_int4": write_ct_int4_checkpoint,
              "ct_fp8": write_ct_fp8_checkpoint, "mxfp4": write_mxfp4_checkpoint}[fmt]
    src = writer(ckpts["dsv3" if fmt == "mxfp4" else "qwen3"], tmp_path / "src")
    line = assert_refused(src, tmp_path / "out", "scheme-not-servable", f"stored as {scheme}",
                          dry_run=fmt == "nvfp4")
    assert "(and " not in line  # one problem


def test_architecture_the_engine_does_not_run(ckpts, tmp_path):
    src = edited_copy(ckpts["qwen3"], tmp_path / "src",
                      config={"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"})
    assert_refused(src, tmp_path / "out", "architecture-not-servable: Qwen3MoeForCausalLM (qwen3_moe family)",
                   "LlamaForCausalLM")


def test_architecture_only_transformers_knows(ckpts, tmp_path):
    """A Gemma2 checkpoint (transformers knows it, atomtool has no family for it): one error line naming the
    architecture and the ones convert supports, exit 1, nothing written."""
    src = edited_copy(ckpts["qwen3"], tmp_path / "src",
                      config={"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: unsupported architecture 'Gemma2ForCausalLM'; supported: "
                     f"{', '.join(sorted(supported_architectures()))}"], lines
    assert not (tmp_path / "out").exists()


def test_missing_required_tensors(ckpts, tmp_path):
    src = edited_copy(ckpts["qwen3"], tmp_path / "src",
                      drop=("model.norm.weight", "model.layers.1.mlp.down_proj.weight"))
    assert_refused(src, tmp_path / "out", "model.norm.weight", "model.layers.1.mlp.down_proj.weight")


def test_plan_names_missing_tensors_itself(ckpts, tmp_path):
    """The plan's own completeness check (independent of inspect's findings): modules a layer of one kind
    lacks while its siblings have them, and the model-level tensors; an error with ``require_complete``."""
    src = edited_copy(ckpts["glm"], tmp_path / "src",
                      drop=("model.norm.weight", "lm_head.weight", "model.layers.3.self_attn.o_proj.weight",
                            "model.layers.1.input_layernorm.weight"))
    report = inspect_checkpoint(str(src))
    expected = ["lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight",
                "model.layers.3.self_attn.o_proj.weight"]
    assert sorted(missing_tensors(report)) == sorted(expected)
    assert sorted(build_plan(report).missing) == sorted(expected)
    with pytest.raises(ConversionError, match=r"checkpoint lacks 4 tensor\(s\) the engine needs: .*o_proj"):
        build_plan(report, require_complete=True)
    # complete checkpoints: nothing missing (dense/MoE layers, DSA full/shared layers are different kinds)
    for name in ("qwen3", "glm", "dsv3"):
        assert missing_tensors(inspect_checkpoint(str(ckpts[name]))) == [], name
    # tied embeddings: no lm_head needed
    tied = edited_copy(ckpts["qwen3"], tmp_path / "tied", drop=("lm_head.weight",),
                       config={"tie_word_embeddings": True})
    assert missing_tensors(inspect_checkpoint(str(tied))) == []


# ----------------------------------------------------------------------------- 4. dry-run refusals


def test_dry_run_applies_the_destination_refusals(ckpts, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpts["qwen3"], src)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    for out in (full, src / "inside"):
        real = run("convert", src, out)
        dry = run("convert", src, out, "--dry-run")
        assert real.exit_code == dry.exit_code == 1
        assert dry.stderr == real.stderr and dry.stderr.startswith("error: OUT ") and "conversion plan" not in dry.stdout
    assert not (src / "inside").exists() and os.listdir(full) == ["keep.txt"]


# ----------------------------------------------------------------------------- 2. leftovers of crashes


def _fake_tmp(out: Path, token: str, owner: dict | None, age_s: float = 0.0, size: int = 3000) -> Path:
    d = out.parent / f".{out.name}.tmp-{token}"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\0" * size)
    if owner is not None:
        (d / OWNER_NAME).write_text(json.dumps(owner))
    if age_s:
        t = time.time() - age_s
        os.utime(d, (t, t))
    return d


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporary_dirs_are_removed_live_ones_kept(ckpts, tmp_path):
    import socket

    out = tmp_path / "out"
    host = socket.gethostname()
    dead = _fake_tmp(out, "dead0001", {"pid": _dead_pid(), "host": host, "start": None}, size=50_000)
    live = _fake_tmp(out, "live0001", {"pid": os.getpid(), "host": host, "start": None})
    old = _fake_tmp(out, "old00001", None, age_s=UNOWNED_STALE_S + 60)
    young = _fake_tmp(out, "new00001", None)
    other = _fake_tmp(tmp_path / "other", "dead0002", {"pid": _dead_pid(), "host": host, "start": None})
    r = run("convert", ckpts["qwen3"], out)
    assert r.exit_code == 0, r.output
    warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    removed = [w for w in warns if "removed the stale temporary directory" in w]
    assert len(removed) == 2 and any(dead.name in w for w in removed) and any(old.name in w for w in removed)
    assert re.search(rf"{dead.name} \(\d+\.\d\d KiB, PID \d+\) of an interrupted conversion: \d+\.\d\d KiB "
                     "reclaimed", "\n".join(removed))
    kept = [w for w in warns if "may still be running; left alone" in w]
    assert len(kept) == 2 and any(live.name in w for w in kept) and any(young.name in w for w in kept)
    assert not dead.exists() and not old.exists() and live.exists() and young.exists() and other.exists()
    assert is_layout(out) and not (out / OWNER_NAME).exists()  # the owner file never reaches the layout


def test_dry_run_reports_stale_dirs_without_removing(ckpts, tmp_path):
    out = tmp_path / "out"
    dead = _fake_tmp(out, "dead0001", {"pid": _dead_pid(), "host": None, "start": None})
    assert re.search(r"will be removed \(\d+\.\d\d KiB\)$", clean_leftover_tmp_dirs(out, remove=False)[0])
    r = run("convert", ckpts["qwen3"], out, "--dry-run")
    assert r.exit_code == 0 and dead.exists() and f"warning: the stale temporary directory {dead.name}" in r.stderr


def test_reused_pid_counts_as_stale(tmp_path):
    """A PID that runs again, but started at another time than recorded, is not the owner."""
    out = tmp_path / "out"
    d = _fake_tmp(out, "reuse001", {"pid": os.getpid(), "host": None, "start": "1"})
    if not Path(f"/proc/{os.getpid()}/stat").exists():
        pytest.skip("needs /proc to read process start times")  # Linux CI has it
    assert "removed the stale temporary directory" in clean_leftover_tmp_dirs(out)[0] and not d.exists()


def test_sigkilled_convert_leftovers_are_cleaned_by_the_next_run(ckpts, tmp_path):
    from atomtool.convert.writer import SLEEP_ENV

    out = tmp_path / "out"
    env = {**os.environ, SLEEP_ENV: "30"}
    proc = subprocess.Popen([sys.executable, "-m", "atomtool.cli", "convert", str(ckpts["qwen3"]), str(out),
                             "--shard-size", "16KB"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    tmp = None
    while time.monotonic() < deadline and proc.poll() is None and tmp is None:
        tmps = list(tmp_path.glob(".out.tmp-*"))
        if tmps and list(tmps[0].glob("model-*.safetensors")):
            tmp = tmps[0]
        time.sleep(0.05)
    assert tmp is not None, proc.communicate()
    owner = json.loads((tmp / OWNER_NAME).read_text())
    assert owner["pid"] == proc.pid
    proc.kill()
    proc.communicate(timeout=60)
    r = run("convert", ckpts["qwen3"], out)
    assert r.exit_code == 0, r.output
    assert f"removed the stale temporary directory {tmp.name}" in r.stderr and f"PID {proc.pid}" in r.stderr
    assert "reclaimed" in r.stderr and not tmp.exists() and is_layout(out)


# ----------------------------------------------------------------------------- 3. progress


def test_progress_bar_only_when_asked_or_on_a_terminal(ckpts, tmp_path, monkeypatch):
    import atomtool.convert.writer as writer

    monkeypatch.setattr(writer, "PROGRESS_INTERVAL_S", 0.0)  # a tiny model converts between two redraws
    quiet = run("convert", ckpts["qwen3"], tmp_path / "a", "--shard-size", "64KB")
    assert quiet.exit_code == 0 and quiet.stderr == ""  # not a terminal: no bar
    bar = run("convert", ckpts["qwen3"], tmp_path / "b", "--shard-size", "64KB", "--progress")
    assert bar.exit_code == 0, bar.output
    shards = int(re.search(r"in (\d+) shard", bar.stdout).group(1))
    assert shards > 1 and f"convert shard {shards}/{shards}" in bar.stderr and "B/s" in bar.stderr
    assert "model.layers.1.mlp.gate_up_proj.weight" in bar.stderr  # the tensor being written
    none = run("convert", ckpts["qwen3"], tmp_path / "c", "--no-progress")
    assert none.exit_code == 0 and none.stderr == ""


# ----------------------------------------------------------------------------- 5. verify


def test_verify_against_another_checkpoint_is_one_error(ckpts, tmp_path):
    out = tmp_path / "out"
    assert run("convert", ckpts["glm"], out).exit_code == 0
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(ckpts["glm"] / "config.json", empty / "config.json")
    r = run("verify", out, "--source", empty)
    assert r.exit_code == 1 and "problem:" not in r.stderr
    assert r.stderr.strip().startswith(f"error: {empty} is not the source of {out}: it holds no safetensors weights")
    r = run("verify", out, "--source", ckpts["qwen3"])
    assert r.exit_code == 1 and "problem:" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert re.search(rf"error: {ckpts['qwen3']} is not the source of {out}: only \d+ of the \d+ source "
                     r"tensors the manifest records are there with the recorded dtype and shape \(lacks e\.g\. "
                     rf".*\); converted from {ckpts['glm']}$", r.stderr.strip()), r.stderr
    assert run("verify", out, "--source", ckpts["glm"]).exit_code == 0  # the real source still verifies


def test_verify_caps_the_problem_listing_and_counts_right(ckpts, tmp_path):
    out = tmp_path / "out"
    assert run("convert", ckpts["glm"], out).exit_code == 0
    manifest = json.loads((out / "atomtool.json").read_text())
    for e in manifest["tensors"].values():
        e["sha256"] = "0" * 64
    (out / "atomtool.json").write_text(json.dumps(manifest))
    r = run("verify", out)
    n = len(manifest["tensors"])
    assert r.exit_code == 1 and n > 21
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 21 and lines[-1] == f"problem: ... and {n - 20} more (--json lists all)"
    assert r.stdout.startswith(f"FAILED ({n} problems): ")
    assert len(json.loads(run("verify", out, "--json").stdout)["problems"]) == n
    one = tmp_path / "one"
    assert run("convert", ckpts["qwen3"], one).exit_code == 0
    m = json.loads((one / "atomtool.json").read_text())
    m["tensors"]["model.norm.weight"]["sha256"] = "0" * 64
    (one / "atomtool.json").write_text(json.dumps(m))
    r = run("verify", one)
    assert r.exit_code == 1 and r.stdout.startswith("FAILED (1 problem): ")


def test_verify_nonexistent_and_file(tmp_path):
    r = run("verify", tmp_path / "nope")
    assert r.exit_code == 1 and r.stderr.strip() == f"error: {tmp_path / 'nope'}: no such directory"
    (tmp_path / "f").write_text("x")
    r = run("verify", tmp_path / "f")
    assert r.exit_code == 1 and "is a file; pass the layout directory" in r.stderr


# ----------------------------------------------------------------------------- 6. late signal


def test_signal_after_the_summary_exits_0(ckpts, tmp_path):
    """A SIGINT landing after ``wrote ...`` (the layout complete and reported) cannot fail the command: the
    CLI process ignores it until exit. The test hook holds the process after the summary, where the late
    signal would otherwise raise KeyboardInterrupt (exit 130)."""
    from atomtool.convert.commands import AFTER_SUMMARY_SLEEP_ENV

    out = tmp_path / "out"
    env = {**os.environ, AFTER_SUMMARY_SLEEP_ENV: "3"}
    proc = subprocess.Popen([sys.executable, "-m", "atomtool.cli", "convert", str(ckpts["qwen3"]), str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("wrote "), (line, proc.communicate())
    time.sleep(0.5)  # past the rename -> summary deferral: without the fix this SIGINT exits 130
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "interrupted" not in err and is_layout(out)


def test_hub_repo_refused_from_remote_headers_before_download(ckpts, tmp_path, monkeypatch):
    """An unservable Hub repo is refused from its remote headers: no weight is downloaded first."""
    import huggingface_hub
    from huggingface_hub import constants

    from tests.fake_hub import FakeHub, set_endpoint

    src = write_nvfp4_checkpoint(ckpts["qwen3"], tmp_path / "nvfp4")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail("downloaded before refusing"))
    with FakeHub({"org/nvfp4": src}) as server:
        set_endpoint(monkeypatch, server.endpoint)
        r = run("convert", "org/nvfp4", tmp_path / "out")
    assert r.exit_code == 1 and r.stderr.startswith("error: org/nvfp4 would not convert into a servable layout: "
                                                    "scheme-not-servable: "), r.output
    assert not (tmp_path / "out").exists()
