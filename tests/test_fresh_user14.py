"""Defects found by a fresh user (round 14, session 13): each test reproduces one, now fixed.

Oracles:
- OpenAI's legacy completions ``logprobs``: ``text_offset[i]`` is where token i starts in ``text``; the tokens
  are the text's pieces. A token whose bytes never form a character shows as its own U+FFFD in the text and
  starts there; a token inside a character that spans several tokens starts at that character (as before).
- README (inspect): with ``--gpu-memory`` the longest context counts the weights serve loads, "MTP layers not
  counted"; a directory holding only config.json is estimated from the config.
- transformers: ``architectures`` is a list of class names (a string fails its config validation).
- README: every command ends a Ctrl-C with ``error: interrupted`` and exit status 130.
- vLLM's offline ``LLM.chat`` (a conversation, or a list of them, rendered by the chat template; here as the
  server renders a chat request, so the prompt ids equal transformers' ``apply_chat_template``).
- vLLM's ``stream_options.continuous_usage_stats`` (the README claims vLLM's serve behaviour): with
  ``include_usage``, every chunk carries the usage so far.
"""

from __future__ import annotations

import importlib.abc
import sys

import httpx
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.api.text_output import TextOffsets
from atomtool.serve.demo import demo_model_path
from tests.inspect_cli import config_only, inspect_json
from tests.test_fresh_user7b import streamed_completion
from tests.test_server_support import ScriptedEngine, sse_events

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(demo_model_path()))


def byte_token(tok, b: int) -> int:
    """The demo (byte-level BPE) tokenizer's token for the single byte ``b``."""
    return tok.convert_tokens_to_ids(bytes_to_unicode()[b])


# ---------------------------------------------------------------- completions text_offset after invalid bytes
@pytest.mark.parametrize("pieces, text, offsets", [
    # two bytes that never form a character (each its own U+FFFD), a word, a lone lead byte at the end
    (["*", 0x80, 0x80, "way", 0xE2], "*\ufffd\ufffdway\ufffd", [0, 1, 2, 3, 6]),
    # a truncated 3-byte sequence (one U+FFFD for both bytes), then a word
    (["x", 0xE2, 0x82, "ok"], "x\ufffdok", [0, 1, 1, 2, 3]),  # "ok" is two tokens
    # a character split over two byte tokens: both start at it (unchanged behaviour)
    (["a", 0xC3, 0xA9, "b"], "aéb", [0, 1, 1, 2]),
])
def test_text_offsets_after_bytes_that_are_not_characters(tok, pieces, text, offsets):
    ids = [i for p in pieces for i in (tok.encode(p, add_special_tokens=False) if isinstance(p, str)
                                       else [byte_token(tok, p)])]
    assert tok.decode(ids) == text
    assert TextOffsets(tok, []).next(ids) == offsets  # observed for the first: [0, 1, 1, 1, 6]
    streamed = TextOffsets(tok, [])
    for t in ids:  # one token at a time, as a stream feeds it: earlier offsets are revised in place
        streamed.next([t])
    assert streamed.offsets == offsets


def test_text_offset_of_a_special_token_among_held_back_bytes_never_goes_backwards(tok):
    special = tok.all_special_ids[-1]  # skipped in the text
    ids = ([tok.encode("*", add_special_tokens=False)[0], byte_token(tok, 0x80), special, byte_token(tok, 0x80)]
           + tok.encode("way", add_special_tokens=False))
    assert tok.decode(ids, skip_special_tokens=True) == "*\ufffd\ufffdway"
    # the special token starts where the text after it does, after the first U+FFFD (before the fix: 1, not
    # revised with the bytes around it, so in other cases below the offset of the token before it)
    assert TextOffsets(tok, []).next(ids) == [0, 1, 2, 2, 3]


def test_completion_text_offset_after_invalid_bytes_points_at_each_token_streamed_or_not(tok):
    ids = (tok.encode("*", add_special_tokens=False) + [byte_token(tok, 0x80)] * 2
           + tok.encode("way", add_special_tokens=False) + [byte_token(tok, 0xE2)])
    body = {"model": "m", "prompt": "x", "max_tokens": len(ids), "logprobs": 0}
    with ServerThread(create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE)) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, tokens, offsets = streamed_completion(url, body)
    lp = choice["logprobs"]
    assert choice["text"] == text == "*\ufffd\ufffdway\ufffd"
    assert lp["text_offset"] == [0, 1, 2, 3, 6]  # observed: [0, 1, 1, 1, 6]
    assert all(text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    assert (tokens, offsets) == (lp["tokens"], lp["text_offset"])


# ---------------------------------------------------------------- inspect: config-only MTP and --gpu-memory
def _mla_config(mtp: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
            "topk_group": 1, "max_position_embeddings": 512, "num_nextn_predict_layers": mtp,
            "torch_dtype": "bfloat16"}


def test_config_only_context_estimate_leaves_the_mtp_layers_out(tmp_path):
    with_mtp, code = inspect_json(config_only(tmp_path, _mla_config(1), "mtp"), "--gpu-memory", "0.001")
    without, code0 = inspect_json(config_only(tmp_path, _mla_config(0), "nomtp"), "--gpu-memory", "0.001")
    assert code == code0 == 0
    # the totals count the MTP layer (published checkpoints store it) ...
    assert with_mtp["totals"]["parameters"] > without["totals"]["parameters"]
    # ... the context that fits does not (serve does not load it); observed: 868 vs 2,083 tokens
    assert with_mtp["memory"]["max_context_tokens"] == without["memory"]["max_context_tokens"] > 0


# ---------------------------------------------------------------- a string 'architectures'
def test_string_architectures_is_named_as_such_by_inspect_and_convert(tmp_path):
    cfg = {"architectures": "LlamaForCausalLM", "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    src = config_only(tmp_path, cfg)
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out")]):
        res = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
        assert res.exit_code == 1, res.output
        assert ("'architectures' must be a list of model class names, got str 'LlamaForCausalLM'; write "
                '"architectures": ["LlamaForCausalLM"]') in res.output
        assert "has no 'architectures'" not in res.output  # observed: the field was reported missing
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- Ctrl-C while the command line loads
class _InterruptImport(importlib.abc.MetaPathFinder):
    """Raises KeyboardInterrupt when ``atomtool.cli`` is imported: a Ctrl-C during the ~0.3 s it takes."""

    def find_spec(self, name, path=None, target=None):
        if name == "atomtool.cli":
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_command_line_loads_is_one_error_line_and_130(monkeypatch, capsys):
    from atomtool import entry

    monkeypatch.delitem(sys.modules, "atomtool.cli")
    monkeypatch.setattr(sys, "meta_path", [_InterruptImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as exc:
        entry.main()  # observed: a 37-line traceback ending in KeyboardInterrupt
    assert exc.value.code == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_console_script_is_the_light_entry_point():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["atomtool"] == "atomtool.entry:main"



# ---------------------------------------------------------------- vLLM's stream_options.continuous_usage_stats
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(tok, path):
    ids = tok.encode(" ugly.\nExplicit", add_special_tokens=False)
    body = {"model": "m", "max_tokens": len(ids), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    with ServerThread(create_app(ScriptedEngine(tok, ids, max_model_len=128), "m", chat_template=TEMPLATE)) as url:
        events = sse_events(httpx.post(url + path, json=body, timeout=30).text.splitlines())
        plain = sse_events(httpx.post(url + path, json={**body, "stream_options": {"include_usage": True}},
                                      timeout=30).text.splitlines())
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    usages = [c["usage"] for c in chunks]  # observed: 400 "Unrecognized request argument supplied"
    prompt = last["usage"]["prompt_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(ids)
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == len(ids)
    assert done[0] == (0 if "chat" in path else 1)  # chat's role chunk precedes every token (vLLM: 0)
    assert all(c.get("usage") is None for c in plain[:-2]) and plain[-2]["usage"] == last["usage"]


# ---------------------------------------------------------------- LLM.chat (vLLM's offline chat API)
@pytest.fixture(scope="module")
def llm():
    from atomtool.serve.llm import LLM

    return LLM(str(demo_model_path()), device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=256)


def test_llm_chat_renders_like_the_server_and_generates(llm):
    from atomtool.errors import InvalidRequestError
    from atomtool.serve.demo import DEMO_CHAT_MESSAGE
    from atomtool.serve.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0)
    convo = [{"role": "user", "content": DEMO_CHAT_MESSAGE}]
    ids = llm.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(ids, add_special_tokens=False)
    (out,) = llm.chat(convo, greedy)  # observed: AttributeError, LLM had no chat
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], greedy)[0].token_ids
    other = [{"role": "user", "content": "Recite"}]
    both = llm.chat([convo, other], greedy)
    assert [o.token_ids for o in both] == [out.token_ids, llm.chat(other, greedy)[0].token_ids]
    with pytest.raises(InvalidRequestError, match=r"^conversation 1: messages\[0\]\.role: Field required"):
        llm.chat([convo, [{"content": "no role"}]], greedy)
    with pytest.raises(InvalidRequestError, match="a conversation is a non-empty list"):
        llm.chat([], greedy)


def test_llm_chat_without_a_template_says_what_to_pass(llm, monkeypatch):
    from atomtool.errors import InvalidRequestError

    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError, match="no chat template: pass chat_template="):
        llm.chat([{"role": "user", "content": "x"}])
    (out,) = llm.chat([{"role": "user", "content": "x"}], chat_template="{{ messages[0]['content'] }}!")
    assert llm.tokenizer.decode(out.prompt_token_ids) == "x!"


def test_ctrl_c_while_typer_builds_the_commands_is_one_error_line_and_130(monkeypatch, capsys):
    import atomtool.cli
    from atomtool import entry

    def interrupted() -> None:  # a Ctrl-C inside app(), before a command's own handler runs
        raise KeyboardInterrupt

    monkeypatch.setattr(atomtool.cli, "main", interrupted)
    with pytest.raises(SystemExit) as exc:
        entry.main()  # observed: a KeyboardInterrupt traceback from typer's get_command
    assert exc.value.code == 130
    assert capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.parametrize("kwargs, message", [
    (dict(messages=[{"role": "robot", "content": "x"}]), r"messages\[0\]\.role: unknown role 'robot'"),
    (dict(messages=[{"role": "user", "content": None}]), r"messages\[0\]: a 'user' message must have content"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=[1]), r"^tools\[0\]"),
    (dict(messages=[{"role": "user", "content": "x"}], tools={"type": "function"}), "tools must be a list"),
    (dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs=[1]), "chat_template_kwargs must be a dict"),
    (dict(messages=None), "a conversation .* or a list of conversations; got NoneType"),
])
def test_llm_chat_refuses_what_the_server_refuses(llm, kwargs, message):
    from atomtool.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=message):  # observed: rendered, AttributeError or TypeError
        llm.chat(**kwargs)


def test_serve_stops_on_a_ctrl_c_that_lands_before_uvicorn_takes_the_signals(tmp_path):
    """A SIGINT after the model loaded but before uvicorn installed its handlers used to be swallowed by the
    interim no-op handler: the server then served on. Here the signal is sent right there (a wrapped
    ``Server.run`` sends it before running); the server must start, stop and exit 0 as for any Ctrl-C."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import os, signal, sys
        import atomtool.serve.api.server as srv
        make = srv._uvicorn_server
        def wrapped(*a, **k):
            server = make(*a, **k)
            run = server.run
            def run_after_signal(*ra, **rk):
                os.kill(os.getpid(), signal.SIGINT)
                return run(*ra, **rk)
            server.run = run_after_signal
            return server
        srv._uvicorn_server = wrapped
        sys.exit(srv.run_serve(None, port=0, device="cpu"))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]  # before the fix: still serving when the timeout hit
    assert "shut down cleanly" in r.stderr
