"""``atomtool generate``: one batch of prompts through the engine, printed as text or JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from atomtool.errors import InvalidRequestError
from atomtool.inspect.report import human_bytes
from atomtool.serve.generation_defaults import GenerationDefaults
from atomtool.serve.sampling_params import StructuredOutputsParams


def engine_summary(engine) -> str:
    """What a loaded :class:`~atomtool.serve.engine.llm_engine.LLMEngine` runs, for the startup line:
    ``LlamaForCausalLM, float32 on cpu, max_model_len 32, KV cache 2 blocks x 16 tokens = 16.00 KiB``
    (architecture from config.json, activation dtype, device with its index on CUDA, KV pool bytes), plus
    ``, FP8 W8A8 (dynamic)`` when FP8 block layers quantize their activations."""
    import torch

    archs = engine.config.get("architectures") or [type(engine.model).__name__]
    dtype = str(getattr(engine.model, "dtype", "")).replace("torch.", "") or "unknown dtype"
    device = engine.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pool = engine.kv_pool
    act = getattr(engine, "act_quant", None)
    w8a8 = f", FP8 W8A8 ({act.replace('_', ' ')})" if act else ""
    return (f"{archs[0]}, {dtype} on {device}{w8a8}, max_model_len {engine.max_model_len}, KV cache "
            f"{pool.num_blocks} blocks x {pool.block_size} tokens = {human_bytes(pool.nbytes)}")


def check_prompt_text(prompts: list[str]) -> None:
    """Refuse prompts that are not valid text before loading the model.

    Command-line arguments that are not valid UTF-8 (``$'\\xff'`` in bash) reach Python as lone
    surrogates (``surrogateescape``), which the tokenizer cannot encode.

    Raises:
        InvalidRequestError: names the prompt, the byte and its position.
    """
    for i, p in enumerate(prompts):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as exc:
            which = f" [{i}]" if len(prompts) > 1 else ""
            char = p[exc.start]
            what = (f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF
                    else f"lone surrogate \\u{ord(char):04x}")
            raise InvalidRequestError(f"--prompt{which} is not valid UTF-8 text: {what} at character "
                                      f"{exc.start}") from None


#: ``atomtool generate``'s own defaults, below the model's generation config (greedy, 32 tokens)
GENERATE_DEFAULTS = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def structured_outputs_option(json_schema: str | None, regex: str | None,
                              choice: list[str] | None) -> StructuredOutputsParams | None:
    """``atomtool generate``'s ``--json-schema`` (JSON text, or the path of a file holding it), ``--regex`` and
    ``--choice`` as one constraint (None when none is given).

    An empty value is given (and refused, as the Python API and the server refuse an empty regex), never taken
    for a missing one: the output would then be unconstrained.

    Raises:
        InvalidRequestError: more than one given, an empty one, an unreadable schema file, or a schema that is
            not JSON.
    """
    given = [n for n, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice))
             if v is not None and v != []]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"only one of {', '.join(given)} may constrain the output")
    if json_schema is None:
        return StructuredOutputsParams(regex=regex, choice=list(choice) if choice else None).validate()
    if not json_schema.strip():
        raise InvalidRequestError("--json-schema is empty: give a JSON Schema (as JSON text) or the path of a file "
                                  "holding one")
    text = json_schema
    if not json_schema.lstrip().startswith("{"):  # a path
        try:
            text = Path(json_schema).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"--json-schema {json_schema}: cannot read the schema file "
                                      f"({exc.strerror or exc})") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"--json-schema {json_schema[:60]}: not valid JSON ({exc})") from None
    return StructuredOutputsParams(json=schema).validate()


def run_generate(model: str, prompts: list[str], *, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 seed: int | None = None, ignore_eos: bool = False,
                 dtype: str = "auto", device: str = "auto", json_out: bool = False,
                 kv_cache_memory: int | None = None, fp8_activations: str = "auto",
                 generation_config: str = "auto", structured_outputs: StructuredOutputsParams | None = None) -> int:
    """Generate for every prompt (one continuous batch) and print the completions; returns the exit code.

    ``structured_outputs``: constrain every completion (``--json-schema`` / ``--regex`` / ``--choice``, see
    :func:`structured_outputs_option`).

    ``--json`` prints a list of ``{"prompt", "text", "token_ids", "finish_reason"}``, one per prompt in order.
    A completion cut by the context limit rather than ``max_tokens`` (both are finish_reason ``"length"``,
    as in OpenAI's API) gets a one-line note on stderr: ``note: stopped at the context limit (max_model_len
    N): prompt P + output K tokens`` (``[i]`` after ``note:`` when there are several prompts).

    Sampling fields left None take the model's generation_config.json defaults (``generation_config``
    ``auto``; :mod:`atomtool.serve.generation_defaults`), else :data:`GENERATE_DEFAULTS`; a note on stderr
    names the defaults taken from the file.

    Raises:
        AtomtoolError subclasses (the CLI prints them, exit 1): bad model directory, unsupported architecture,
        missing tensors, invalid sampling parameters, prompt longer than max_model_len, a prompt that is not
        valid UTF-8 text.
    """
    from atomtool.serve.llm import LLM
    from atomtool.serve.loader import check_model_argument

    check_model_argument(model)  # before the flag checks: "" is the current directory, not a model
    check_prompt_text(list(prompts))
    explicit = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                "ignore_eos": ignore_eos, "min_p": min_p, "repetition_penalty": repetition_penalty,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "structured_outputs": structured_outputs}
    GenerationDefaults().sampling_params(explicit, GENERATE_DEFAULTS)  # bad flags fail before the model loads
    llm = LLM(model, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory, fp8_activations=fp8_activations,
              generation_config=generation_config)
    params = llm.generation_defaults.sampling_params(explicit, GENERATE_DEFAULTS)
    if note := llm.generation_defaults.describe(overridden=[k for k, v in explicit.items() if v is not None]):
        print(f"note: {note}", file=sys.stderr)
    if llm.engine.max_model_len_note:  # stderr: stdout holds only the completions
        print(f"warning: {llm.engine.max_model_len_note}", file=sys.stderr)
    if llm.engine.act_quant_note:
        print(f"note: {llm.engine.act_quant_note}", file=sys.stderr)
    try:
        outputs = llm.generate(list(prompts), params)
    except InvalidRequestError as exc:  # xgrammar refused the constraint: name the flag it came from
        if exc.param != "structured_outputs" or structured_outputs is None:
            raise
        flag = ("--json-schema" if structured_outputs.json is not None
                else "--regex" if structured_outputs.regex is not None else "--choice")
        raise InvalidRequestError(f"{flag}: {exc}") from None
    if json_out:
        print(json.dumps([{"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                          for p, o in zip(prompts, outputs, strict=True)], ensure_ascii=False))
    else:
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
            if len(prompts) > 1:
                print(f"--- [{i}] {p!r} ({o.finish_reason})")
            print(p + o.text)
    for i, o in enumerate(outputs):
        if o.context_limit is not None:
            which = f"[{i}] " if len(prompts) > 1 else ""
            print(f"note: {which}stopped at the context limit (max_model_len {o.context_limit}): prompt "
                  f"{len(o.prompt_token_ids)} + output {len(o.token_ids)} tokens", file=sys.stderr)
    return 0
