"""Repetition / frequency / presence penalties and min-p (vLLM's semantics) in SamplingParams, the batched
sampler, the engine, the server and ``atomtool generate``.

Oracles, written independently of atomtool's sampler:

- repetition_penalty: transformers' own ``RepetitionPenaltyLogitsProcessor`` over the prompt + output ids
  (vLLM applies the penalty to every token seen in the prompt or the output, which is what the processor does
  with the whole sequence as ``input_ids``);
- frequency / presence: OpenAI's documented formula, ``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
  alpha_presence`` with ``c[j]`` the count of token j in the output so far, written here as a Python loop;
- min_p: transformers' ``TemperatureLogitsWarper`` then ``MinPLogitsWarper`` (the kept set is the tokens it
  leaves finite);
- whole engine: the HF model's own forward pass step by step, each step's logits penalised by the oracles
  above and argmax-ed (greedy).
"""

from __future__ import annotations

import collections
import json

import httpx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)
from typer.testing import CliRunner

import atomtool.serve.engine.sampler as sampler_mod
from atomtool.cli import app as cli_app
from atomtool.errors import InvalidRequestError
from atomtool.serve.api.app import create_app
from atomtool.serve.api.server import ServerThread
from atomtool.serve.engine.sampler import Sampler, apply_min_p, apply_penalties
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.generation_defaults import GenerationDefaults
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import load_hf, make_engine, run_to_completion
from tests.test_server_support import ScriptedEngine, byte_level_tokenizer

V = 64


def seq_with(prompt: list[int], output: list[int], **kw) -> Sequence:
    """A Sequence whose prompt is ``prompt`` and that has generated ``output`` so far."""
    s = Sequence("r", prompt, SamplingParams(**kw).validate())
    for t in output:
        s.append_token(t)
    return s


def ref_repetition(logits: torch.Tensor, prompt: list[int], output: list[int], penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output (one row [V])."""
    ids = torch.tensor([prompt + output], dtype=torch.long)
    return RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.unsqueeze(0).clone())[0]


def ref_openai(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's presence/frequency formula, token by token."""
    counts = collections.Counter(output)
    out = logits.clone()
    for j in range(logits.shape[0]):
        c = counts.get(j, 0)
        out[j] = float(logits[j]) - c * frequency - float(c > 0) * presence
    return out


def random_case(g: torch.Generator, vocab: int = V) -> tuple[torch.Tensor, list[int], list[int]]:
    logits = torch.randn(vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (), generator=g)),), generator=g).tolist()
    output = torch.randint(0, vocab, (int(torch.randint(0, 15, (), generator=g)),), generator=g).tolist()
    return logits, prompt, output


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("field, bad, message", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2], got -2.01"),
    ("presence_penalty", True, "presence_penalty must be in [-2, 2], got True"),
    ("presence_penalty", "1", "presence_penalty must be in [-2, 2], got '1'"),
    ("presence_penalty", float("nan"), "presence_penalty must be in [-2, 2], got nan"),
    ("frequency_penalty", 3, "frequency_penalty must be in [-2, 2], got 3"),
    ("frequency_penalty", False, "frequency_penalty must be in [-2, 2], got False"),
    ("frequency_penalty", None, "frequency_penalty must be in [-2, 2], got None"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0 and finite, got 0.0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0 and finite, got -1.0"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be > 0 and finite, got inf"),
    ("repetition_penalty", float("nan"), "repetition_penalty must be > 0 and finite, got nan"),
    ("repetition_penalty", True, "repetition_penalty must be > 0 and finite, got True"),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", float("nan"), "min_p must be in [0, 1], got nan"),
    ("min_p", True, "min_p must be in [0, 1], got True"),
])
def test_validation_errors_name_the_field(field, bad, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: bad}).validate()
    assert str(info.value) == message
    assert info.value.param == field


def test_validation_accepts_bounds_and_numpy_scalars():
    p = SamplingParams(presence_penalty=np.float32(-2.0), frequency_penalty=np.int64(2),
                       repetition_penalty=np.float64(1e-3), min_p=np.float16(1.0)).validate()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (-2.0, 2.0, 1e-3, 1.0)
    assert all(type(v) is float for v in (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p))
    d = SamplingParams().validate()
    assert (d.presence_penalty, d.frequency_penalty, d.repetition_penalty, d.min_p) == (0.0, 0.0, 1.0, 0.0)


# ------------------------------------------------------------------------------------------ penalties
def test_repetition_penalty_matches_transformers_processor():
    g = torch.Generator().manual_seed(0)
    for penalty in (1.3, 2.0, 0.6, 1.0):
        cases = [random_case(g) for _ in range(5)]
        got = apply_penalties(torch.stack([c[0] for c in cases]), [torch.tensor(c[1]) for c in cases],
                              [c[2] for c in cases], [penalty] * 5, [0.0] * 5, [0.0] * 5)
        for r, (logits, prompt, output) in enumerate(cases):
            assert torch.equal(got[r], ref_repetition(logits, prompt, output, penalty)), (penalty, r)


def test_frequency_presence_match_openai_formula_prompt_excluded():
    g = torch.Generator().manual_seed(1)
    cases = [random_case(g) for _ in range(6)]
    freq = [0.5, -0.7, 0.0, 2.0, 1.1, 0.0]
    pres = [0.0, 1.5, -2.0, 0.3, 0.9, 0.0]
    rep = [1.0, 1.0, 1.0, 1.0, 1.4, 1.7]  # the last two: repetition first, then frequency/presence
    got = apply_penalties(torch.stack([c[0] for c in cases]), [torch.tensor(c[1]) for c in cases],
                          [c[2] for c in cases], rep, freq, pres)
    for r, (logits, prompt, output) in enumerate(cases):
        want = ref_openai(ref_repetition(logits, prompt, output, rep[r]), output, freq[r], pres[r])
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-5)
    # the prompt does not count for frequency/presence: a token only in the prompt keeps its logit
    logits = torch.zeros(1, 8)
    out = apply_penalties(logits, [torch.tensor([3, 3, 3])], [[5, 5]], [1.0], [1.0], [0.5])
    assert out[0, 3] == 0.0 and out[0, 5] == -2.5


def test_greedy_with_penalties_picks_the_oracles_argmax():
    g = torch.Generator().manual_seed(2)
    rows, seqs, want = [], [], []
    changed = 0
    for r in range(12):
        logits, prompt, output = random_case(g)
        logits[prompt[0]] = float(logits.max()) + 0.5  # the raw argmax is a prompt token
        rep, freq, pres = 1.0 + 0.2 * (r % 5), 0.3 * (r % 3), 0.4 * (r % 2)
        output = output + [prompt[0]]
        rows.append(logits)
        seqs.append(seq_with(prompt, output, temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                             presence_penalty=pres, logprobs=2))
        ref = ref_openai(ref_repetition(logits, prompt, output, rep), output, freq, pres)
        want.append(int(torch.argmax(ref)))
        changed += want[-1] != int(torch.argmax(logits))
    raw = torch.stack(rows)
    out = Sampler()(raw, seqs)
    assert [t for t, _ in out] == want
    assert changed >= 6  # the penalties really moved the argmax in most rows
    for r, (tok, entry) in enumerate(out):  # log-probs stay those of the raw logits
        assert entry["logprob"] == pytest.approx(float(torch.log_softmax(raw[r], -1)[tok]), abs=1e-6)


def test_tiny_repetition_penalty_stays_finite_and_masked_tokens_stay_masked():
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits, [torch.tensor([0, 1, 3])], [[]], [1e-38], [0.0], [0.0])
    assert torch.isfinite(out).all() and int(out.argmax()) == 0
    masked = torch.tensor([[float("-inf"), 1.0, 2.0]])
    out = apply_penalties(masked, [torch.tensor([0, 1])], [[0]], [3.0], [1.0], [1.0])
    assert out[0, 0] == float("-inf")
    # through the Sampler: min_tokens bans the EOS even though the penalty rewards it (penalty < 1)
    s = seq_with([2, 2], [], temperature=0.0, repetition_penalty=0.01, min_tokens=1)
    s.eos_token_ids = frozenset({2})
    assert Sampler()(torch.tensor([[0.0, 0.1, 5.0]]), [s])[0][0] == 1


# ------------------------------------------------------------------------------------------ min_p
def test_min_p_mask_matches_transformers_warper():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 100, generator=g) * 2
    for temp in (0.5, 1.0, 1.7):
        for mp in (0.05, 0.2, 0.9, 1.0):
            want = MinPLogitsWarper(mp)(None, TemperatureLogitsWarper(temp)(None, x.clone()))
            got = apply_min_p(x / temp, torch.full((6,), mp))
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (temp, mp)
            assert torch.equal(got[torch.isfinite(got)], (x / temp)[torch.isfinite(got)])


@pytest.mark.parametrize("extra", [dict(), dict(top_k=30), dict(top_p=0.999), dict(top_k=1500)],
                         ids=["full-softmax", "top-k", "vocab-sort", "wide-top-k"])
def test_min_p_samples_exactly_the_warpers_kept_set(extra):
    g = torch.Generator().manual_seed(4)
    vocab = 2048 if extra.get("top_k", 0) > 1024 else 200
    logits = torch.randn(vocab, generator=g) * 2
    temp, mp = 0.8, 0.08
    warped = MinPLogitsWarper(mp)(None, TemperatureLogitsWarper(temp)(None, logits.unsqueeze(0).clone()))[0]
    kept = set(torch.nonzero(torch.isfinite(warped)).flatten().tolist())
    assert 3 <= len(kept) <= 30
    n = 3000
    seqs = [seq_with([1], [], temperature=temp, min_p=mp, seed=1000 + i, **extra) for i in range(n)]
    drawn = [t for t, _ in Sampler()(logits.expand(n, -1).contiguous(), seqs)]
    assert set(drawn) == kept  # never outside the set, and every kept token comes up


def test_min_p_leaves_greedy_rows_alone():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert Sampler()(logits, [seq_with([0], [], temperature=0.0, min_p=1.0)])[0][0] == 1
    # min_p 1 keeps only the top token: a sampled row becomes deterministic
    assert {Sampler()(logits, [seq_with([0], [], temperature=1.0, min_p=1.0)])[0][0] for _ in range(20)} == {1}


# ------------------------------------------------------------------------------------------ batching
def test_rows_without_penalties_are_bitwise_unaffected_and_seeds_batch_invariant(monkeypatch):
    g = torch.Generator().manual_seed(5)
    plain = [dict(temperature=0.0), dict(temperature=1.0, seed=11), dict(temperature=0.7, top_k=5, seed=12),
             dict(temperature=1.2, top_p=0.8, seed=13), dict(temperature=0.9, seed=14, logprobs=3)]
    fancy = [dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=1.0, frequency_penalty=1.0, seed=21),
             dict(temperature=0.8, presence_penalty=-1.0, min_p=0.1, seed=22), dict(temperature=1.0, min_p=0.3)]
    seen = []
    real = sampler_mod.sample_rows

    def spy(x, *args, **kw):
        seen.append(x.clone())
        return real(x, *args, **kw)

    monkeypatch.setattr(sampler_mod, "sample_rows", spy)
    for _ in range(3):
        logits = torch.randn(len(plain) + len(fancy), 300, generator=g)
        prompt = torch.randint(0, 300, (9,), generator=g).tolist()
        output = torch.randint(0, 300, (6,), generator=g).tolist()
        alone = [seq_with(prompt, output, **p) for p in plain]
        mixed = [seq_with(prompt, output, **p) for p in fancy[:2] + plain + fancy[2:]]
        order = [len(plain), len(plain) + 1, *range(len(plain)), len(plain) + 2, len(plain) + 3]
        mixed_logits = logits[order]  # plain rows sit at 2..6 among the penalised ones
        a = Sampler()(logits[:len(plain)], alone)
        b = Sampler()(mixed_logits, mixed)
        assert b[2:2 + len(plain)] == a
        x_mixed = seen[-1]
        assert torch.equal(x_mixed[2:2 + len(plain)], logits[:len(plain)])  # bit for bit, untouched
        assert not torch.equal(x_mixed[:2], mixed_logits[:2])  # the penalised rows did change


def test_seeded_penalised_row_is_batch_invariant_over_steps():
    g = torch.Generator().manual_seed(6)
    p = dict(temperature=1.0, top_k=40, seed=99, repetition_penalty=1.3, frequency_penalty=0.5, min_p=0.02)
    alone, batched = seq_with([4, 5, 6], [], **p), seq_with([4, 5, 6], [], **p)
    others = [seq_with([7], [], temperature=1.0), seq_with([8, 8], [], temperature=0.0, presence_penalty=1.0)]
    s_alone, s_batched = Sampler(), Sampler()
    for _ in range(8):
        logits = torch.randn(3, 120, generator=g)
        (t, _), = s_alone(logits[1:2], [alone])
        assert s_batched(logits, [others[0], batched, others[1]])[1][0] == t
        for s, tok in ((alone, t), (batched, t), (others[0], 3), (others[1], 4)):
            s.append_token(tok)


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=11)
    return path, load_hf(path)


PROMPT = [5, 17, 40, 41, 42, 90, 33]


@torch.no_grad()
def hf_penalised_greedy(hf, prompt: list[int], n: int, rep: float = 1.0, freq: float = 0.0,
                        pres: float = 0.0) -> list[int]:
    """Greedy decoding with the HF model's own forward, each step's logits through the oracles."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        logits = ref_openai(ref_repetition(logits, list(prompt), out, rep), out, freq, pres)
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    return out


def test_engine_greedy_with_penalties_matches_the_hf_oracle(ckpt):
    path, hf = ckpt
    n = 12
    reqs = {"plain": dict(), "rep": dict(repetition_penalty=3.0), "freq": dict(frequency_penalty=2.0),
            "mix": dict(repetition_penalty=1.5, presence_penalty=1.5, frequency_penalty=0.5)}
    out = run_to_completion(make_engine(path), {
        k: (PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)) for k, kw in reqs.items()})
    plain = hf_penalised_greedy(hf, PROMPT, n)
    assert out["plain"].token_ids == plain
    assert out["rep"].token_ids == hf_penalised_greedy(hf, PROMPT, n, rep=3.0)
    assert out["freq"].token_ids == hf_penalised_greedy(hf, PROMPT, n, freq=2.0)
    assert out["mix"].token_ids == hf_penalised_greedy(hf, PROMPT, n, rep=1.5, freq=0.5, pres=1.5)
    assert out["rep"].token_ids != plain and out["freq"].token_ids != plain
    # a strong repetition penalty avoids repeating: the plain greedy run repeats tokens, the penalised one less
    assert len(set(out["rep"].token_ids)) > len(set(plain))


# ------------------------------------------------------------------------------------------ server
class RecordingEngine(ScriptedEngine):
    """ScriptedEngine that keeps the SamplingParams of every request it receives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params: dict[str, SamplingParams] = {}

    def add_request(self, request_id, prompt, params) -> None:
        self.params[request_id] = params
        super().add_request(request_id, prompt, params)


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def post(url: str, route: str, **fields) -> httpx.Response:
    body = {"model": "m", "max_tokens": 2, **fields}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    body["prompt"] = "hi"
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_server_passes_penalties_and_min_p_and_generation_defaults(route):
    tok = byte_level_tokenizer()
    engine = RecordingEngine(tok, [10])
    defaults = GenerationDefaults(values={"repetition_penalty": 1.2, "min_p": 0.05})
    with ServerThread(create_app(engine, "m", chat_template=TEMPLATE, generation_defaults=defaults)) as url:
        sent = dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.7, min_p=0.3)
        assert post(url, route, **sent).status_code == 200
        p = list(engine.params.values())[-1]
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -0.25, 1.7, 0.3)
        assert post(url, route).status_code == 200  # unset: the generation config's defaults
        p = list(engine.params.values())[-1]
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.2, 0.05)
        assert post(url, route, presence_penalty=None, repetition_penalty=None).status_code == 200  # null: unset
        p = list(engine.params.values())[-1]
        assert (p.presence_penalty, p.repetition_penalty) == (0.0, 1.2)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0 and finite, got 0"),
    ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
    ("min_p", "0.1", "min_p"),
    ("repetition_penalty", True, "repetition_penalty"),
])
def test_server_out_of_range_is_a_400_with_param(route, field, value, message):
    tok = byte_level_tokenizer()
    engine = RecordingEngine(tok, [10])
    with ServerThread(create_app(engine, "m", chat_template=TEMPLATE)) as url:
        for stream in (False, True):
            resp = post(url, route, stream=stream, **{field: value})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert message in err["message"] and err["param"] == field
            assert err["type"] == "invalid_request_error"
    assert not engine.params  # refused before reaching the engine


# ------------------------------------------------------------------------------------------ CLI
def test_generate_cli_flags(ckpt):
    path, hf = ckpt
    runner = CliRunner()
    res = runner.invoke(cli_app, ["generate", str(path), "--prompt", "x", "--min-p", "2"])
    assert res.exit_code == 1 and "error: min_p must be in [0, 1], got 2.0" in res.output
    res = runner.invoke(cli_app, ["generate", str(path), "--prompt", "x", "--repetition-penalty", "0"])
    assert res.exit_code == 1 and "error: repetition_penalty must be > 0 and finite, got 0.0" in res.output
    res = runner.invoke(cli_app, ["generate", str(path), "--prompt", "x", "--presence-penalty", "-2.5"])
    assert res.exit_code == 1 and "error: presence_penalty must be in [-2, 2], got -2.5" in res.output
    res = runner.invoke(cli_app, ["generate", str(path), "--prompt", "x", "--frequency-penalty", "9"])
    assert res.exit_code == 1 and "error: frequency_penalty must be in [-2, 2], got 9.0" in res.output
    args = ["generate", str(path), "--prompt", "hello", "--max-tokens", "8", "--ignore-eos", "--json",
            "--generation-config", "none", "--device", "cpu", "--dtype", "float32"]
    plain = json.loads(runner.invoke(cli_app, args).stdout)[0]["token_ids"]
    res = runner.invoke(cli_app, args + ["--repetition-penalty", "3", "--frequency-penalty", "1",
                                         "--presence-penalty", "0.5", "--min-p", "0.5"])
    assert res.exit_code == 0, res.output
    penalised = json.loads(res.stdout)[0]["token_ids"]
    prompt = hf_prompt_ids(path, "hello")
    assert plain == hf_penalised_greedy(hf, prompt, 8)
    assert penalised == hf_penalised_greedy(hf, prompt, 8, rep=3.0, freq=1.0, pres=0.5) != plain


def hf_prompt_ids(path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(path)).encode(text))


def test_penalty_index_reaches_the_device_as_a_python_list(monkeypatch):
    """_host_list's pinned CUDA copy needs a Python list: torch.tensor(ndarray, pin_memory=True) raises on a GPU
    ("Can't pin tensor constructed from numpy"; the numpy-built output-id index did, on the H200)."""
    from atomtool.serve.engine import sampler as S

    real = S._host_list

    def only_lists(values, *args, **kwargs):
        assert isinstance(values, list), type(values)
        return real(values, *args, **kwargs)

    monkeypatch.setattr(S, "_host_list", only_lists)
    logits = torch.randn(3, 50)
    out = S.apply_penalties(logits, [torch.tensor([1, 2]), None, None], [[3, 3, 4], [5], []],
                            [1.3, 1.0, 1.0], [0.5, 0.2, 0.0], [0.1, 0.0, 0.0])
    assert out.shape == logits.shape and torch.equal(out[2], logits[2])
