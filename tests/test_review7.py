"""Review of session 7: the fused split-K sum's per-weight tile counters and ``--trust-request-chat-template``.

Split-K (Triton, on CPU under the interpreter): a GEMM on one weight must not see another weight's tile counters
(two GEMMs may run at once on two streams), checked by the numbers a GEMM returns while another weight's call is
"in flight" (its counters mid-count); and a counters buffer once handed to a kernel must outlive any CUDA graph
that captured its address, i.e. stay allocated as long as its weight does. Oracle: ``torch_ref.linear``.

Request chat templates (scripted engine, real tokenizer): the client-facing edges the feature's own tests do not
pin: an API key is checked before the refusal, a non-string ``chat_template`` is a validation 400 naming it, and
a template smuggled through ``chat_template_kwargs`` is refused too. Oracle: OpenAI's error object and vLLM's
documented behaviour (auth first; chat_template only with the flag).
"""

from __future__ import annotations

import sys

from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import dataclasses  # noqa: E402
import gc  # noqa: E402
import weakref  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve.ops import torch_ref  # noqa: E402
from tests.kernel_inputs import assert_close_as as _close  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402

_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


# ------------------------------------------------------------------------------- fused split-K tile counters
def _fused_split_k(monkeypatch):
    """The linear module with fused_sum on and a split target that splits a [40, 256] weight's K."""
    lin = sys.modules["atomtool.serve.ops.triton.linear"]
    monkeypatch.setattr(lin, "FP8_LINEAR_CONFIG", dataclasses.replace(lin.FP8_LINEAR_CONFIG, split_target=64,
                                                                      fused_sum=True))
    assert lin.split_k_plan(40, 256, lin.FP8_LINEAR_CONFIG.block_n, 32)[0] > 1
    return lin


def test_gemm_ignores_another_weights_counters_mid_count(monkeypatch):
    """Weight A's GEMM is in flight on a side stream (each tile's counter at 1: one split has arrived) while
    weight B's GEMM runs: B's result must be exact. With one counters buffer per device B's programs count
    from A's 1s, so a tile's "last" program fires one split early and sums a missing partial."""
    lin = _fused_split_k(monkeypatch)
    seen: list[torch.Tensor] = []
    real = lin._fp8_block_gemm_kernel

    class Spy:  # records the counters argument each launch gets (position 6 of the kernel's signature)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw.get("FUSED_SUM"):
                    seen.append(args[6])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(lin, "_fp8_block_gemm_kernel", Spy())
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 256, generator=g)
    wa, wb = [(torch.randn(40, 256, generator=g) * 2).to(torch.float8_e4m3fn) for _ in range(2)]
    s = torch.rand(2, 8, generator=g) + 0.5
    _close(tri.linear(x, wa, None, s, (32, 32)), torch_ref.linear(x, wa, None, s, (32, 32)), 1e-4, 1e-5)
    assert len(seen) == 1
    a_counters = seen[0]
    a_counters.fill_(1)  # A "in flight": one split of each of its tiles has counted
    try:
        _close(tri.linear(x, wb, None, s, (32, 32)), torch_ref.linear(x, wb, None, s, (32, 32)), 1e-4, 1e-5)
    finally:
        a_counters.zero_()


def test_counters_outlive_a_regrow_while_their_weight_lives(monkeypatch):
    """A counters buffer that a kernel used (and a CUDA graph may have captured by address) stays allocated
    while its weight lives, even after a call needing more counters (another block_n, e.g. the W8A8
    config) made a larger one: freeing it would let the caching allocator hand its bytes to another tensor
    that the graph's replays then count into (and zero). It goes when the weight goes."""
    lin = _fused_split_k(monkeypatch)
    w = torch.zeros(40, 256).to(torch.float8_e4m3fn)
    small = weakref.ref(lin._tile_counters(w, 8))
    big = lin._tile_counters(w, 1024)
    assert big.numel() >= 1024 and int(big.abs().sum()) == 0
    gc.collect()
    assert small() is not None, "the superseded counters buffer was freed while its weight lives"
    assert lin._tile_counters(w, 8) is big  # the largest one serves every later call
    del w, big
    gc.collect()
    assert small() is None  # nothing kept past the weight


# ------------------------------------------------------------------------------ request chat templates
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_server():
    """A server with an API key and the default (no request templates)."""
    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.server import ServerThread
    from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.chat_template = "{% for m in messages %}<own>{{ m.content }}{% endfor %}"
    engine = ScriptedEngine(tok, tok.encode("ok", add_special_tokens=False), max_model_len=128)
    with ServerThread(create_app(engine, "m", api_key="sk-7")) as url:
        yield url


def _chat(url: str, key: str | None = "sk-7", **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "m", "messages": USER, "max_tokens": 1, **body})


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    return r.json()["error"]


@pytest.mark.parametrize("key", [None, "wrong"])
def test_api_key_is_checked_before_the_chat_template_refusal(chat_server, key):
    err = _error(_chat(chat_server, key, chat_template="{{ 'x' * 10**10 }}"), 401)
    assert err["code"] == "invalid_api_key" and "chat_template" not in err["message"]


@pytest.mark.parametrize("value", [5, 1.5, True, ["{{ 1 }}"], {"t": "{{ 1 }}"}])
def test_non_string_chat_template_is_a_400_naming_it(chat_server, value):
    err = _error(_chat(chat_server, chat_template=value), 400)
    assert err["param"] == "chat_template" and err["type"] == "invalid_request_error"
    assert "valid string" in err["message"]


def test_chat_template_inside_chat_template_kwargs_is_refused(chat_server):
    err = _error(_chat(chat_server, chat_template_kwargs={"chat_template": "{{ 'x' * 10**10 }}"}), 400)
    assert err["param"] == "chat_template_kwargs"
    assert "may not set 'chat_template'" in err["message"]
    assert _chat(chat_server).status_code == 200  # the server still serves


def test_trusted_request_chat_template_has_a_size_limit():
    """Even trusted, a request's template is compiled by Jinja's pure-Python parser before any render bound
    acts: about 5 s of CPU per MiB of template (holding the GIL the engine thread needs), and transformers keeps
    the last 128 compiled templates. So a request template longer than MAX_REQUEST_TEMPLATE_CHARS is a 400
    (param chat_template) that points to --chat-template; one at the limit is served. Real templates (Llama 3.1,
    DeepSeek-V3, Qwen3, gpt-oss) are 2-20 KB."""
    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.chat import MAX_REQUEST_TEMPLATE_CHARS
    from atomtool.serve.api.server import ServerThread
    from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

    tok = byte_level_tokenizer()
    engine = ScriptedEngine(tok, tok.encode("ok", add_special_tokens=False), max_model_len=128)

    def template(chars: int) -> str:  # renders the user's text, padded with a Jinja comment to ``chars``
        head, tail = "{{ messages[0].content }}{# ", " #}"
        return head + "x" * (chars - len(head) - len(tail)) + tail

    with ServerThread(create_app(engine, "m", api_key="sk-7", trust_request_chat_template=True)) as url:
        r = _chat(url, chat_template=template(MAX_REQUEST_TEMPLATE_CHARS))
        assert r.status_code == 200, r.text
        assert tok.decode(engine.prompts[r.json()["id"] + "-0"]) == "hi"
        err = _error(_chat(url, chat_template=template(MAX_REQUEST_TEMPLATE_CHARS + 1)), 400)
        assert err["param"] == "chat_template" and err["type"] == "invalid_request_error"
        assert f"{MAX_REQUEST_TEMPLATE_CHARS + 1} characters" in err["message"]
        assert "--chat-template" in err["message"]
        assert len(engine.prompts) == 1  # the long one never reached the engine
