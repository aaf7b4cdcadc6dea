"""The checkpoint's generation_config.json gives the default sampling parameters (vLLM's
``--generation-config auto``): requests that leave temperature / top_p / top_k / min_p / repetition_penalty /
max_tokens unset follow it, explicit values override it, ``none`` ignores it; the server (chat + completions), ``LLM`` and ``atomtool
generate`` share :mod:`atomtool.serve.generation_defaults`. A malformed file is a ConfigError naming it.

One tiny save_pretrained llama checkpoint; each variant is a directory of links to its files plus its own
generation_config.json. The config "greedy" sets temperature 0, top_k 1, max_new_tokens 6: followed, a request
without sampling fields gives the greedy tokens (the engine is exact against transformers in its own tests)
and exactly 6 of them (ignore_eos); ignored, it samples at temperature 1 (seeded, so deterministic) and gets
16 (completions) / 32 (generate) tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from atomtool.cli import app as cli_app
from atomtool.errors import AtomtoolError, ConfigError
from atomtool.serve import LLM, SamplingParams
from atomtool.serve.api.app import create_app
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.generation_defaults import GenerationDefaults, load_generation_defaults
from tests.checkpoints import CHAT_TEMPLATE, write_hf_checkpoint

ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_model_len=128)
GREEDY = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.0, "top_k": 1,
          "max_new_tokens": 6}
PROMPT = "hello world"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def variant(base: Path, where: Path, generation_config: dict | str | None) -> str:
    """``base`` with its generation_config.json replaced (a dict: as JSON; a str: raw text; None: none)."""
    where.mkdir()
    for f in base.iterdir():
        if f.name != "generation_config.json":
            (where / f.name).symlink_to(f)
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (where / "generation_config.json").write_text(text)
    return str(where)


@pytest.fixture(scope="module")
def greedy_dir(base, tmp_path_factory) -> str:
    return variant(base, tmp_path_factory.mktemp("g") / "greedy", GREEDY)


@pytest.fixture(scope="module")
def greedy_ids(base) -> list[int]:
    """The reference: greedy tokens with every field explicit, on the checkpoint without sampling defaults."""
    llm = LLM(str(base), **ENGINE_KW)
    return llm.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids


# ----------------------------------------------------------------------------------------- reading the file
def test_values_read_do_sample_ignored_penalty_and_min_p_applied(base, tmp_path):
    d = variant(base, tmp_path / "ds", {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                        "repetition_penalty": 1.1, "min_p": 0.05})
    defaults = load_generation_defaults(d)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
    assert defaults.unsupported == {}  # vLLM applies min_p and repetition_penalty, and so does atomtool
    note = defaults.describe()
    assert "temperature=0.6, top_p=0.95, min_p=0.05, repetition_penalty=1.1" in note
    assert "not supported" not in note and "--generation-config none" in note
    p = defaults.sampling_params({"temperature": None, "top_k": 5})  # None: unset
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_p, p.repetition_penalty) == (
        0.6, 0.95, 5, 16, 0.05, 1.1)
    p = defaults.sampling_params({"repetition_penalty": 1.0, "min_p": 0.0})  # explicit "off" wins
    assert (p.repetition_penalty, p.min_p) == (1.0, 0.0)
    # do_sample false does not switch a default temperature off (vLLM ignores do_sample)
    d2 = variant(base, tmp_path / "nods", {"do_sample": False, "temperature": 0.7})
    assert load_generation_defaults(d2).values == {"temperature": 0.7}


def test_no_file_none_mode_and_config_without_sampling_fields(base, tmp_path, greedy_dir):
    assert load_generation_defaults(variant(base, tmp_path / "nofile", None)).values == {}
    assert load_generation_defaults(greedy_dir, "none") == GenerationDefaults()
    assert load_generation_defaults(str(base)).describe() is None  # bos/eos/do_sample only: no defaults


@pytest.mark.parametrize("content, message", [
    ('{"temperature": 0.6,', "not a valid generation config"),
    ("[1, 2]", "must be a JSON object, got list"),
    ({"temperature": -1.0}, "temperature: temperature must be >= 0"),
    ({"top_p": 2}, "top_p: top_p must be in (0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens"),  # transformers refuses it itself
    ({"top_k": 1.5}, "top_k: top_k must be -1, 0 or a positive integer"),
    ({"repetition_penalty": 0.0}, "repetition_penalty: repetition_penalty must be > 0 and finite"),
    ({"min_p": 1.5}, "min_p: min_p must be in [0, 1]"),
])
def test_malformed_generation_config_is_a_config_error(base, tmp_path, content, message):
    d = variant(base, tmp_path / "bad", content)
    with pytest.raises(ConfigError) as info:
        load_generation_defaults(d)
    assert message in str(info.value)
    assert "generation_config.json" in str(info.value) and "--generation-config none" in str(info.value)
    # the same file under --generation-config none is not read
    assert load_generation_defaults(d, "none").values == {}


def test_unknown_mode_is_refused_before_loading(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the mode was checked")

    monkeypatch.setattr(LLMEngine, "from_model", no_load)
    with pytest.raises(ConfigError, match="--generation-config must be one of auto, none, got 'vllm'"):
        LLM("whatever", generation_config="vllm")


# ----------------------------------------------------------------------------------------- LLM
def test_llm_follows_overrides_and_ignores(greedy_dir, greedy_ids):
    llm = LLM(greedy_dir, **ENGINE_KW)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 1, 6)
    p.ignore_eos = True
    assert llm.generate(PROMPT, p)[0].token_ids == greedy_ids[:6]
    out = llm.generate(PROMPT)[0]  # no sampling_params at all: the defaults (EOS may end it earlier)
    assert out.token_ids == greedy_ids[:len(out.token_ids)] and len(out.token_ids) <= 6
    # an explicit SamplingParams is used as given (vLLM): temperature 1, top_k off, 16 tokens
    explicit = SamplingParams(temperature=1.0, seed=3, ignore_eos=True)
    sampled = llm.generate(PROMPT, explicit)[0].token_ids
    assert len(sampled) == 16 and sampled != greedy_ids[:16]

    plain = LLM(greedy_dir, generation_config="none", **ENGINE_KW)
    d = plain.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (1.0, 0, 16)
    assert plain.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, ignore_eos=True))[0].token_ids == sampled


def test_llm_applies_the_configs_repetition_penalty(base, tmp_path, greedy_ids):
    d = variant(base, tmp_path / "rep", {**GREEDY, "max_new_tokens": 32, "repetition_penalty": 3.0})
    llm = LLM(d, **ENGINE_KW)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.repetition_penalty, p.max_tokens) == (0.0, 3.0, 32)
    p.ignore_eos = True
    penalised = llm.generate(PROMPT, p)[0].token_ids
    assert len(set(greedy_ids)) < 32  # the plain greedy run repeats tokens ...
    assert penalised != greedy_ids  # ... and the penalty changes the greedy tokens ...
    explicit = SamplingParams(max_tokens=32, temperature=0, repetition_penalty=3.0, ignore_eos=True)
    plain = LLM(str(base), **ENGINE_KW)  # ... exactly as the same penalty sent explicitly does
    assert plain.generate(PROMPT, explicit)[0].token_ids == penalised


# ----------------------------------------------------------------------------------------- server
def _client(model_dir: str, mode: str) -> TestClient:
    engine = LLMEngine.from_model(model_dir, **ENGINE_KW)
    return TestClient(create_app(engine, "m", chat_template=CHAT_TEMPLATE,
                                 generation_defaults=load_generation_defaults(engine.model_dir, mode)))


@pytest.mark.parametrize("route, prompt", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_server_follows_overrides_and_ignores(greedy_dir, route, prompt):
    with _client(greedy_dir, "auto") as c:
        usage = c.post(route, json={"model": "m", "ignore_eos": True, **prompt}).json()["usage"]
        assert usage["completion_tokens"] == 6  # max_new_tokens
        greedy = c.post(route, json={"model": "m", "ignore_eos": True, "temperature": 0, "top_k": 0,
                                     "max_tokens": 6, **prompt}).json()
        followed = c.post(route, json={"model": "m", "ignore_eos": True, "seed": 3, **prompt}).json()
        assert _text(followed) == _text(greedy)
        override = {"model": "m", "ignore_eos": True, "seed": 3, "temperature": 1.0, "top_k": 0, "max_tokens": 12,
                    **prompt}
        overridden = c.post(route, json=override).json()
        assert overridden["usage"]["completion_tokens"] == 12
        assert _text(overridden)[:len(_text(greedy))] != _text(greedy)
    with _client(greedy_dir, "none") as c:
        sampled = c.post(route, json={"model": "m", "ignore_eos": True, "seed": 3, "max_tokens": 12, **prompt})
        assert _text(sampled.json()) == _text(overridden)  # the same sampling as the explicit override
        r = c.post(route, json={"model": "m", "ignore_eos": True, **prompt}).json()
        expected = 16 if route == "/v1/completions" else 128 - r["usage"]["prompt_tokens"]  # OpenAI's defaults
        assert r["usage"]["completion_tokens"] == expected


def test_server_default_max_tokens_is_cut_to_the_context(base, tmp_path):
    d = variant(base, tmp_path / "long", {"max_new_tokens": 1000})
    with _client(d, "auto") as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "ignore_eos": True, "messages": [
            {"role": "user", "content": PROMPT}]}).json()
        assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 128
        bad = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1000})
        assert bad.status_code == 400  # an explicit value that does not fit is still an error


def _text(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


class _Stop(AtomtoolError):
    """Raised by the fake create_app once it has recorded its arguments."""


@pytest.mark.parametrize("flags, expected", [([], {"temperature": 0.0, "top_k": 1, "max_tokens": 6}),
                                             (["--generation-config", "none"], {})])
def test_serve_cli_passes_the_defaults_and_logs_them(greedy_dir, monkeypatch, flags, expected):
    import atomtool.serve.api.app as app_module

    class FakeEngine:
        model_dir = Path(greedy_dir)

    seen = {}

    def fake_create_app(engine, name, **kwargs):
        seen.update(kwargs)
        raise _Stop("stopped at create_app")

    monkeypatch.setattr(LLMEngine, "from_model", lambda *a, **k: FakeEngine())
    monkeypatch.setattr(app_module, "create_app", fake_create_app)
    result = CliRunner().invoke(cli_app, ["serve", greedy_dir, "--port", "0", *flags])
    assert "stopped at create_app" in result.output
    assert seen["generation_defaults"].values == expected


def test_serve_cli_malformed_file_and_bad_mode(base, tmp_path, monkeypatch):
    class FakeEngine:
        model_dir = Path(variant(base, tmp_path / "bad", '{"top_k": '))

    monkeypatch.setattr(LLMEngine, "from_model", lambda *a, **k: FakeEngine())
    result = CliRunner().invoke(cli_app, ["serve", str(FakeEngine.model_dir), "--port", "0"])
    assert result.exit_code == 1
    assert "error: " in result.output and "generation_config.json: not a valid generation config" in result.output
    result = CliRunner().invoke(cli_app, ["serve", str(base), "--generation-config", "vllm"])
    assert result.exit_code == 2 and "--generation-config" in result.output


# ----------------------------------------------------------------------------------------- generate CLI
def _generate(model: str, *flags: str) -> tuple[list[int], str]:
    result = CliRunner().invoke(cli_app, ["generate", model, "--prompt", PROMPT, "--device", "cpu", "--ignore-eos",
                                          "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)[0]["token_ids"], result.stderr


def test_generate_cli_follows_overrides_and_ignores(greedy_dir, greedy_ids):
    ids, err = _generate(greedy_dir)
    assert ids == greedy_ids[:6]
    assert "note: default sampling parameters from the model's generation config" in err
    assert "temperature=0.0, top_k=1, max_tokens=6" in err
    overridden, _ = _generate(greedy_dir, "--temperature", "1", "--top-k", "0", "--seed", "3", "--max-tokens", "12")
    assert len(overridden) == 12 and overridden != greedy_ids[:12]
    ignored, err = _generate(greedy_dir, "--generation-config", "none", "--temperature", "1", "--seed", "3",
                             "--max-tokens", "12")
    assert ignored == overridden and "generation config" not in err
    plain, _ = _generate(greedy_dir, "--generation-config", "none")
    assert plain == greedy_ids  # atomtool generate's own defaults: greedy, 32 tokens


def test_generate_cli_malformed_file(base, tmp_path):
    d = variant(base, tmp_path / "bad", {"temperature": "hot"})
    result = CliRunner().invoke(cli_app, ["generate", d, "--prompt", PROMPT, "--device", "cpu"])
    assert result.exit_code == 1
    assert "error: " in result.output and "temperature: temperature must be >= 0 and finite, got 'hot'" in result.output
