"""What ``atomtool serve`` / ``generate`` tell the user at startup: the load line names the architecture, dtype,
device, context length and KV cache size, and a context length lowered to fit the KV cache is a warning
(vLLM does the same) instead of a silent change.

Expected sizes are derived here from the tiny Llama fixture's config (tests/checkpoints.py): per layer the
dense engine caches K and V, each ``num_key_value_heads x head_dim`` values per token.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import atomtool.serve.api.server as server_mod
from atomtool.cli import app
from atomtool.serve.commands import run_generate
from tests.checkpoints import write_hf_checkpoint

BLOCK = 16  # the engine's default block size (tokens per KV block)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="module")
def cfg(ckpt):
    return json.loads(open(f"{ckpt}/config.json").read())


def block_bytes(cfg: dict, itemsize: int) -> int:
    """Bytes of one KV block: K and V planes in every layer."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return BLOCK * 2 * cfg["num_key_value_heads"] * head_dim * itemsize * cfg["num_hidden_layers"]


class _NoServer:
    """Stands in for uvicorn.Server: the startup lines are printed before ``run``; nothing is served."""

    started = True
    force_exit = False

    def run(self, sockets) -> None:
        pass


def serve(monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(server_mod, "_uvicorn_server", lambda *a, **k: _NoServer())
    res = CliRunner().invoke(app, ["serve", *args, "--port", "0", "--device", "cpu"])
    return res.exit_code, res.stdout, res.stderr


def startup_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("atomtool serve: model "))


def test_reduced_context_is_a_warning_and_the_startup_line_says_what_runs(ckpt, cfg, monkeypatch):
    per_block = block_bytes(cfg, 4)  # --dtype auto on CPU is float32
    budget = 2 * per_block + per_block // 2  # room for 2 whole blocks
    code, out, err = serve(monkeypatch, ckpt, "--kv-cache-memory", str(budget))
    assert code == 0, err
    limit = cfg["max_position_embeddings"]
    assert limit > 2 * BLOCK  # the fixture's context is longer than the cache: the case under test
    warning = (f"atomtool serve: warning: max_model_len {limit} -> {2 * BLOCK}: the KV cache holds {2 * BLOCK} "
               f"tokens (2 blocks of {BLOCK}); raise --kv-cache-memory/--gpu-memory-utilization or pass "
               "--max-model-len")
    assert warning in err.splitlines(), err
    kib = 2 * per_block / 1024
    line = startup_line(err)
    assert line.startswith(f"atomtool serve: model '{ckpt}' ({cfg['architectures'][0]}, float32 on cpu, "
                           f"max_model_len {2 * BLOCK}, KV cache 2 blocks x {BLOCK} tokens = {kib:.2f} KiB) "
                           "on http://127.0.0.1:"), line
    assert err.index(warning) < err.index(line)
    assert out == ""
    assert "Traceback" not in err


def test_explicit_dtype_and_name_show_in_the_startup_line(ckpt, cfg, monkeypatch):
    per_block = block_bytes(cfg, 2)  # bfloat16
    code, _, err = serve(monkeypatch, ckpt, "--dtype", "bfloat16", "--served-model-name", "zen",
                         "--kv-cache-memory", str(5 * per_block), "--max-model-len", "64")
    assert code == 0, err
    assert "warning" not in err  # the user chose max_model_len: nothing was lowered behind their back
    assert (f"model 'zen' ({cfg['architectures'][0]}, bfloat16 on cpu, max_model_len 64, KV cache 5 blocks x "
            f"{BLOCK} tokens = {5 * per_block / 1024:.2f} KiB)") in startup_line(err)


def test_no_warning_when_the_cache_holds_the_whole_context(ckpt, cfg, monkeypatch):
    code, _, err = serve(monkeypatch, ckpt)  # default CPU KV budget: 1 GiB
    assert code == 0, err
    assert "warning" not in err
    assert f"max_model_len {cfg['max_position_embeddings']}," in startup_line(err)


def test_explicit_max_model_len_the_cache_cannot_hold_is_an_error(ckpt, cfg, monkeypatch):
    per_block = block_bytes(cfg, 4)
    code, _, err = serve(monkeypatch, ckpt, "--kv-cache-memory", str(2 * per_block),
                         "--max-model-len", str(cfg["max_position_embeddings"]))
    assert code == 1
    assert f"holds {2 * BLOCK} tokens, fewer than max_model_len {cfg['max_position_embeddings']}" in err


def test_generate_warns_on_stderr_and_keeps_stdout_for_completions(ckpt, cfg, capsys):
    per_block = block_bytes(cfg, 4)
    assert run_generate(ckpt, ["ab"], max_tokens=2, device="cpu", kv_cache_memory=2 * per_block) == 0
    captured = capsys.readouterr()
    assert (f"warning: max_model_len {cfg['max_position_embeddings']} -> {2 * BLOCK}: the KV cache holds "
            f"{2 * BLOCK} tokens (2 blocks of {BLOCK})") in captured.err
    assert "warning" not in captured.out and captured.out.startswith("ab")
