"""Defects found by a fresh user (round 16, session 15); each test reproduces one.

Oracles:
- README: ``--json`` is the machine-readable output; a script reading stdout must learn why there is no
  result, so a refusal or failure prints ``{"error": {"type", "message", "exit_code"}}`` there (the ``error:``
  line stays on stderr, the exit code is unchanged).
- ``convert``'s own rule (``--overwrite`` replaces only an atomtool layout): an OUT that is not a layout must
  not be answered with "pass --overwrite", which would only be refused next; and a layout is never replaced
  together with files a user put in it.
- vLLM's OpenAI server: an empty ``model`` means the served model (``_is_model_supported``); a
  ``truncate_prompt_tokens`` above max_model_len is a 400 ("greater than max_model_len").
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from tests.checkpoints import write_hf_checkpoint

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

runner = CliRunner()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("q") / "q", "qwen3")


def _json_error(r) -> dict:
    (line,) = r.stdout.strip().splitlines()
    return json.loads(line)["error"]


def test_convert_json_refusal_prints_a_json_error_on_stdout(qwen, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["convert", str(qwen), str(out), "--json"])
    assert r.exit_code == 1
    err = _json_error(r)
    assert err["type"] == "ConversionError" and err["exit_code"] == 1
    assert err["message"].startswith(f"OUT {out} is not empty and not an atomtool layout")
    assert f"error: {err['message']}" in r.stderr
    assert (out / "notes.txt").read_text() == "keep me"


def test_convert_into_a_non_layout_does_not_suggest_overwrite_first(qwen, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["convert", str(qwen), str(out)])
    assert r.exit_code == 1 and "pass --overwrite" not in r.stderr
    assert "--overwrite replaces only an atomtool layout" in r.stderr
    layout = tmp_path / "layout"
    assert runner.invoke(app, ["convert", str(qwen), str(layout)]).exit_code == 0
    r = runner.invoke(app, ["convert", str(qwen), str(layout)])
    assert r.exit_code == 1 and "is not empty (an atomtool layout); pass --overwrite to replace it" in r.stderr


@pytest.mark.parametrize("command,kind,message", [
    (["inspect", "{missing}", "--json"], "SourceError", "{missing}: no such directory"),
    (["verify", "{tmp}", "--json"], "LayoutError", "{tmp}: not an atomtool layout (atomtool.json missing)"),
    (["convert", "{missing}", "{tmp}/new", "--json"], "SourceError", "{missing}: no such directory"),
])
def test_json_commands_print_their_failure_as_json(tmp_path, command, kind, message):
    fill = {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path)}
    r = runner.invoke(app, [c.format(**fill) for c in command])
    assert r.exit_code == 1
    assert _json_error(r) == {"type": kind, "message": message.format(**fill), "exit_code": 1}


def test_without_json_stdout_stays_empty_on_failure(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("error: ")


def test_progress_in_a_log_ends_at_100_percent(qwen, tmp_path):
    """``convert --progress 2> log``: the log's last bar state is the finished one (it was the first, 0%, then
    erased: the bar was cleared for the summary line as on a terminal)."""
    r = runner.invoke(app, ["convert", str(qwen), str(tmp_path / "layout"), "--progress"])
    assert r.exit_code == 0, r.output
    states = [s for s in r.stderr.replace("\r", "\n").splitlines() if "convert shard" in s]
    assert states and "100%" in states[-1], r.stderr


def test_overwrite_refuses_a_layout_holding_files_a_user_added(qwen, tmp_path):
    """``convert --overwrite`` replaced a layout together with notes and results a user had put in it, without a
    word; it now refuses, naming them, and deletes nothing. A layout holding only its own files (shards,
    manifest, index, config, carried tokenizer files) is still replaced."""
    out = tmp_path / "L1"
    assert runner.invoke(app, ["convert", str(qwen), str(out)]).exit_code == 0
    assert runner.invoke(app, ["convert", str(qwen), str(out), "--overwrite", "--dtype", "float32"]).exit_code == 0
    (out / "MY_NOTES.md").write_text("important")
    (out / "results").mkdir()
    (out / "results" / "eval.json").write_text("{}")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    r = runner.invoke(app, ["convert", str(qwen), str(out), "--overwrite"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"error: refusing to --overwrite {out}: it holds 2 entries the layout does not "
                                "list (MY_NOTES.md, results/), which replacing it would delete; move them out first")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert (out / "MY_NOTES.md").read_text() == "important"
    (out / "MY_NOTES.md").unlink()
    (out / "results" / "eval.json").unlink()
    (out / "results").rmdir()
    assert runner.invoke(app, ["convert", str(qwen), str(out), "--overwrite"]).exit_code == 0


@pytest.fixture(scope="module")
def scripted_url():
    from transformers import AutoTokenizer

    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.server import ServerThread
    from atomtool.serve.demo import demo_model_path
    from tests.test_server_support import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    ids = tok.encode(" ugly", add_special_tokens=False)
    with ServerThread(create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE)) as url:
        yield url


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
])
def test_an_empty_model_name_means_the_served_model(scripted_url, path, body):
    import httpx

    r = httpx.post(scripted_url + path, json={"model": "", **body}, timeout=30)
    assert r.status_code == 200, r.text  # observed: 404 model_not_found
    assert r.json()["model"] == "m"
    other = httpx.post(scripted_url + path, json={"model": "gpt-4", **body}, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x y z"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_truncate_prompt_tokens_above_max_model_len_is_a_400(scripted_url, path, body):
    import httpx

    r = httpx.post(scripted_url + path, json={"model": "m", "max_tokens": 1, "truncate_prompt_tokens": 2000, **body},
                   timeout=30)
    assert r.status_code == 400, r.text  # observed: 200
    err = r.json()["error"]
    assert err["param"] == "truncate_prompt_tokens"
    assert err["message"].startswith("truncate_prompt_tokens value (2000) is greater than max_model_len (128)")
    ok = httpx.post(scripted_url + path, json={"model": "m", "max_tokens": 1, "truncate_prompt_tokens": 128, **body},
                    timeout=30)
    assert ok.status_code == 200, ok.text


def test_gpu_memory_table_shows_the_weight_bytes_its_context_is_computed_from(tmp_path):
    """``inspect --gpu-memory``: the longest context came from the weights as served (float32 stored, BF16 on the
    GPU) while the table showed only the stored size, so the figures did not add up; the GPU bytes are shown
    beside it and in the JSON, and the context is exactly what they leave."""
    import torch

    path = write_hf_checkpoint(tmp_path / "q32", "qwen3", dtype=torch.float32)
    r = runner.invoke(app, ["inspect", str(path), "--gpu-memory", "0.01", "--json"])
    m = json.loads(r.stdout)["memory"]
    assert m["gpu_weights_bytes"] * 2 == m["weights_bytes"]  # every stored float32 weight served in BF16
    assert m["max_context_tokens"] == (10_000_000 - m["gpu_weights_bytes"]) // m["kv_bytes_per_token"]
    table = runner.invoke(app, ["inspect", str(path), "--gpu-memory", "0.01"], terminal_width=200).stdout
    from atomtool.inspect.report import human_bytes

    assert f"(on the GPU: {human_bytes(m['gpu_weights_bytes'])}, as serve holds them)" in table


@pytest.mark.parametrize("kwargs,words", [
    ({"dtype": "int8"}, "unknown dtype 'int8'"),
    ({"max_model_len": 0}, "max_model_len must be a positive integer"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 2 is not supported yet"),
    ({"generation_config": "maybe"}, "--generation-config must be one of"),
])
def test_llm_argument_errors_are_value_errors(kwargs, words):
    """vLLM's ``LLM()`` raises ValueError for out-of-range arguments; ours raised EngineError / ConfigError,
    which ``except ValueError`` did not catch. Now InvalidArgumentError: a ValueError and still the old types."""
    from atomtool.errors import ConfigError, EngineError, InvalidArgumentError
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.llm import LLM

    with pytest.raises(ValueError, match=words) as info:
        LLM(str(demo_model_path()), device="cpu", **kwargs)
    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, EngineError)


def _serve_args(monkeypatch, *argv):
    """``atomtool serve ARGV`` with run_serve replaced: (exit code, output, run_serve's model and kwargs)."""
    import atomtool.serve.api.server as server

    seen: dict = {}
    monkeypatch.setattr(server, "run_serve", lambda model, **kw: seen.update(model=model, **kw) or 0)
    r = runner.invoke(app, ["serve", *argv])
    return r.exit_code, r.output, seen


def test_serve_accepts_vllms_common_flags(monkeypatch, tmp_path):
    """``vllm serve`` command lines with --trust-remote-code, --seed, --enable-chunked-prefill,
    --kv-cache-dtype auto, --swap-space, --disable-log-requests, --disable-log-stats, --uvicorn-log-level and
    --tokenizer (the model itself) were refused ("No such option"); they run now (no effect where atomtool
    already behaves that way), and the values atomtool cannot honour are refused by name."""
    import torch

    model = str(tmp_path)
    code, out, seen = _serve_args(monkeypatch, model, "--trust-remote-code", "--seed", "7", "--enable-chunked-prefill",
                                  "--kv-cache-dtype", "auto", "--swap-space", "4", "--disable-log-requests",
                                  "--disable-log-stats", "--uvicorn-log-level", "warning", "--tokenizer", model,
                                  "--tokenizer-mode", "auto", "--max-logprobs", "20")
    assert code == 0, out
    assert seen["model"] == model and seen["uvicorn_log_level"] == "warning"
    first = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3))  # --seed seeded torch's generator
    for argv, words in [(["--no-enable-chunked-prefill"], "chunked prefill is always on"),
                        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: only auto is supported"),
                        (["--tokenizer", "other/tok"], "--tokenizer other/tok: the model's own tokenizer files"),
                        (["--revision", "main"], "--revision applies to a Hub repo id"),
                        (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: only auto is supported"),
                        (["--max-logprobs", "50"], "--max-logprobs 50: only 20 is supported"),
                        (["--swap-space", "-4"], "--swap-space must be >= 0 GiB, got -4")]:
        code, out, seen = _serve_args(monkeypatch, model, *argv)
        assert code == 1 and words in out and not seen, out


def test_serve_revision_resolves_the_repo_at_that_revision(monkeypatch, tmp_path):
    import atomtool.convert.commands as commands

    calls = []
    monkeypatch.setattr(commands, "resolve_source", lambda src, revision=None: calls.append((src, revision))
                        or (tmp_path, {}))
    code, out, seen = _serve_args(monkeypatch, "org/model", "--revision", "v2")
    assert code == 0, out
    assert calls == [("org/model", "v2")] and seen["model"] == str(tmp_path)
    assert seen["served_model_name"] == "org/model"  # the repo id, not the snapshot directory


@pytest.mark.parametrize("kwargs", [{"enable_chunked_prefill": True}, {"kv_cache_dtype": "auto"},
                                    {"tokenizer_mode": "auto"}, {"max_logprobs": 20}])
def test_llm_accepts_vllms_knobs_at_the_value_atomtool_runs(kwargs):
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.llm import LLM

    llm = LLM(str(demo_model_path()), device="cpu", **kwargs)  # observed: TypeError
    assert llm.engine is not None
    name, value = next(iter(kwargs.items()))
    other = {"enable_chunked_prefill": False, "kv_cache_dtype": "fp8", "tokenizer_mode": "slow",
             "max_logprobs": 50}[name]
    with pytest.raises(ValueError, match=f"{name}: only {value!r} is supported"):
        LLM(str(demo_model_path()), device="cpu", **{name: other})


def test_llm_chat_outputs_carry_the_rendered_prompt():
    """vLLM's ``LLM.chat`` returns the conversation as the chat template rendered it in ``RequestOutput.prompt``
    (ours was None)."""
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.llm import LLM
    from atomtool.serve.sampling_params import SamplingParams

    llm = LLM(str(demo_model_path()), device="cpu")
    messages = [{"role": "user", "content": "Beautiful is"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0))
    rendered = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    assert llm.get_tokenizer().encode(out.prompt, add_special_tokens=False) == out.prompt_token_ids


def test_config_only_inspect_says_a_quantization_outside_config_json_is_not_seen(tmp_path):
    """NVIDIA's DeepSeek-V3.2-NVFP4 config.json alone (its quantization lives in hf_quant_config.json) read as
    a plain BF16 model with no caveat; the config-only note now says what it cannot see."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).resolve().parent / "data/realworld/configs/nvidia__DeepSeek-V3.2-NVFP4.json",
                tmp_path / "config.json")
    r = runner.invoke(app, ["inspect", str(tmp_path), "--json"])
    (note,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config-only"]
    assert "a quantization declared elsewhere, e.g. NVIDIA ModelOpt's hf_quant_config.json" in note["message"]


def test_convert_json_lists_the_leftover_cleanup_among_its_warnings(qwen, tmp_path, monkeypatch):
    """``convert --json`` after an interrupted run: the stale temporary directory's removal was said on stderr
    only; the JSON's warnings carry it too."""
    import atomtool.convert.commands as commands

    line = "removed the stale temporary directory .out.tmp-x of an interrupted conversion: 1.00 MiB reclaimed"
    monkeypatch.setattr(commands, "clean_leftover_tmp_dirs", lambda out, remove=True: [line])
    r = runner.invoke(app, ["convert", str(qwen), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["warnings"][0] == line and f"warning: {line}" in r.stderr


def test_an_infinite_quantization_bits_value_is_a_config_error(tmp_path):
    """Found by CI's property test: ``quantization_config: {"bits": Infinity}`` (Python's json reads it) crashed
    inspect with OverflowError; it is a malformed quantization_config like any other bad value."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
                                          '"quantization_config": {"quant_method": "gptq", "bits": Infinity}}')
    r = runner.invoke(app, ["inspect", str(tmp_path)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "quantization_config: malformed (OverflowError" in r.stderr


def test_overwrite_names_user_entries_with_the_staging_prefix_instead_of_deleting_them(qwen, tmp_path):
    """Round 16e: entries named ``.atomtool.tmp-*`` in a layout (not a mount point, so never convert's own
    staging) were reported as a live conversion's, "left alone", then deleted with the old layout."""
    out = tmp_path / "L"
    assert runner.invoke(app, ["convert", str(qwen), str(out)]).exit_code == 0
    (out / ".atomtool.tmp-keep").mkdir()
    (out / ".atomtool.tmp-keep" / "f").write_text("precious")
    r = runner.invoke(app, ["convert", str(qwen), str(out), "--overwrite"])
    assert r.exit_code == 1 and "(.atomtool.tmp-keep/)" in r.stderr, r.output
    assert (out / ".atomtool.tmp-keep" / "f").read_text() == "precious"


def test_overwrite_checks_again_for_files_added_while_converting(qwen, tmp_path, monkeypatch):
    """Round 16e: a file written into OUT while the conversion ran (hours, on a real checkpoint) was deleted by
    the final swap; the swap now checks OUT again and refuses, the new layout discarded, OUT untouched."""
    import atomtool.convert.writer as writer

    out = tmp_path / "L"
    assert runner.invoke(app, ["convert", str(qwen), str(out)]).exit_code == 0
    real = writer._write_shards

    def write_while_a_user_adds_notes(*args, **kwargs):
        (out / "MY_NOTES.md").write_text("written meanwhile")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "_write_shards", write_while_a_user_adds_notes)
    r = runner.invoke(app, ["convert", str(qwen), str(out), "--overwrite", "--json"])
    assert r.exit_code == 1
    assert "it holds 1 entry the layout does not list (MY_NOTES.md)" in json.loads(r.stdout)["error"]["message"]
    assert (out / "MY_NOTES.md").read_text() == "written meanwhile"
    assert not list(tmp_path.glob(".L.*"))  # the new layout's temporary directory is gone


@pytest.mark.parametrize("edit,words", [
    ({"carried_files": 5}, "'carried_files' is not a list"),
    ({"not_carried": {"a": 1}}, "'not_carried' is not a list"),
])
def test_a_hand_edited_manifest_is_a_layout_error_not_a_traceback(qwen, tmp_path, edit, words):
    out = tmp_path / "L"
    assert runner.invoke(app, ["convert", str(qwen), str(out)]).exit_code == 0
    manifest = json.loads((out / "atomtool.json").read_text())
    (out / "atomtool.json").write_text(json.dumps({**manifest, **edit}))
    for argv in (["verify", str(out), "--json"], ["convert", str(qwen), str(out), "--overwrite", "--json"]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit), r.output
        assert words in json.loads(r.stdout)["error"]["message"], r.stdout


def test_round_16e_argument_edges(monkeypatch, tmp_path):
    """An out-of-range --seed / seed= is named (was torch's "Overflow when unpacking long long" traceback); an
    unknown device is a ValueError naming the choices (was torch's RuntimeError); vLLM's default None for
    enable_chunked_prefill is accepted; --revision without MODEL and --tokenizer naming the demo model that
    serve runs without MODEL get the right answer."""
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.llm import LLM

    code, out, seen = _serve_args(monkeypatch, "--seed", "99999999999999999999999")
    assert code == 1 and "--seed must be an integer in the int64 / uint64 range" in out and not seen
    with pytest.raises(ValueError, match="seed must be an integer in the int64 / uint64 range"):
        LLM(str(demo_model_path()), device="cpu", seed=2 ** 70)
    with pytest.raises(ValueError, match="unknown device 'banana'; choose auto, cpu or cuda"):
        LLM(str(demo_model_path()), device="banana")
    assert LLM(str(demo_model_path()), device="cpu", enable_chunked_prefill=None).engine is not None
    code, out, seen = _serve_args(monkeypatch, "--revision", "main")
    assert code == 1 and "none was given" in out and not seen
    code, out, seen = _serve_args(monkeypatch, "--tokenizer", str(demo_model_path()))
    assert code == 0 and seen["model"] is None, out


def test_generate_json_killed_by_sigterm_says_so(tmp_path):
    """Round 16e: ``timeout 15 atomtool generate ... --json`` (SIGTERM) printed nothing and exited -15; like
    convert, it now exits 143 with the ``error:`` line and the JSON error object."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from atomtool.serve.demo import demo_model_path

    proc = subprocess.Popen([sys.executable, "-m", "atomtool", "generate", str(demo_model_path()), "--prompt", "hi",
                             "--max-tokens", "100000", "--ignore-eos", "--json", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)  # inside the command by then (load or generation: ~20-35 s in all on CPU)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    assert json.loads(out)["error"] == {"type": "Terminated", "message": "terminated (SIGTERM)", "exit_code": 143}
    assert "error: terminated (SIGTERM)" in err


@pytest.mark.parametrize("argv,message", [
    (["inspect", "x", "--json", "--gpu-memory", "abc"], "Invalid value for '--gpu-memory'"),
    (["inspect", "--json"], "Missing argument 'SOURCE'."),
    (["inspect", "x", "--json", "--bogus"], "No such option: --bogus"),
])
def test_usage_errors_with_json_print_the_json_error_too(argv, message):
    """Round 16e: click's usage errors (exit 2) ignored --json (empty stdout) while every other failure printed
    the JSON error object; now the same object, type UsageError, exit code 2, click's lines on stderr."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "atomtool", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    err = json.loads(proc.stdout)["error"]
    assert err["type"] == "UsageError" and err["exit_code"] == 2 and err["message"].startswith(message)
    assert "Error: " + err["message"] in proc.stderr
