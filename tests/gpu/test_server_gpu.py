"""The demo model and the OpenAI-compatible server on a CUDA GPU (Triton backend).

- The shipped demo model (tiny DeepSeek-V3.2: MLA + DSA + MoE) recites the Zen of Python greedily on the
  GPU, in float32 and in bf16, offline and (float32) through the server.
- The server end to end with the ``openai`` client: completions (plain and streamed) and chat completions
  equal the offline engine's greedy output on the same GPU.
fastapi / uvicorn / openai are not in every GPU image: scripts/run_gpu_tests.py's doc says how to bring them.
"""

from __future__ import annotations

import pytest

from atomtool.serve.demo import DEMO_PROMPT, demo_model_path, expected_continuation
from atomtool.serve.llm import LLM
from atomtool.serve.sampling_params import SamplingParams

ENGINE_KW = dict(device="cuda", kv_cache_memory=1 << 27, max_model_len=1024, backend="triton")


def _recite_tokens(llm) -> int:
    return len(llm.tokenizer(expected_continuation(), add_special_tokens=False)["input_ids"]) + 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_model_recites_on_gpu(dtype, gpu_report):
    llm = LLM(str(demo_model_path()), dtype=dtype, **ENGINE_KW)
    out = llm.generate(DEMO_PROMPT, SamplingParams(max_tokens=_recite_tokens(llm), temperature=0.0))[0]
    want = expected_continuation()
    common = next((i for i, (a, b) in enumerate(zip(out.text, want, strict=False)) if a != b),
                  min(len(out.text), len(want)))
    gpu_report[f"demo_recital/{dtype}"] = {"chars_correct": common, "chars_expected": len(want)}
    assert out.text.strip() == want.strip()


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.server import ServerThread
    from atomtool.serve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_model(str(demo_model_path()), dtype="float32", **ENGINE_KW)
    with ServerThread(create_app(engine, "demo")) as url:
        yield url


def test_server_end_to_end_with_openai_client(server):
    openai = pytest.importorskip("openai")
    offline = LLM(str(demo_model_path()), dtype="float32", **ENGINE_KW)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    want = offline.generate(DEMO_PROMPT, SamplingParams(max_tokens=40, temperature=0.0))[0].text
    assert want and expected_continuation().startswith(want)

    resp = client.completions.create(model="demo", prompt=DEMO_PROMPT, max_tokens=40, temperature=0.0)
    assert resp.choices[0].text == want
    stream = client.completions.create(model="demo", prompt=DEMO_PROMPT, max_tokens=40, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want

    full = client.completions.create(model="demo", prompt=DEMO_PROMPT, max_tokens=_recite_tokens(offline),
                                     temperature=0.0)
    assert full.choices[0].text.strip() == expected_continuation().strip()

    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Recite"}],
                                          max_tokens=16, temperature=0.0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
