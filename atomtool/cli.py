"""The ``atomtool`` command line (typer): one thin function per command.

Each command parses flags and calls its stage's ``commands`` module; user errors
(:class:`atomtool.errors.AtomtoolError`) print ``error: <message>`` on one line to stderr and exit 1.
"""

from __future__ import annotations

import functools
import json
import sys
from enum import Enum
from typing import Annotated

import typer

from atomtool.errors import AtomtoolError, Terminated, sigterm_as_interrupt

app = typer.Typer(
    name="atomtool",
    help="Inspect, convert and serve LLM checkpoints (MLA + DSA + MoE, dense Llama/Qwen).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: rich's option panels cut long flag names at 80 columns ("--served-model-n…")
    # and show a "<bool>" placeholder for flags; click wraps the help text and keeps every flag whole.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from atomtool import __version__

        print(f"atomtool {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, convert and serve LLM checkpoints (MLA + DSA + MoE, dense Llama/Qwen)."""


class UvicornLogLevel(str, Enum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Fp8Activations(str, Enum):
    auto = "auto"
    dynamic = "dynamic"
    weight_only = "weight-only"


_FP8_ACT_HELP = ("FP8 block checkpoints: 'dynamic' quantizes each linear's input to FP8 per token and "
                 "group of weight_block_size[1] (32, 64 or 128; other blocks stay weight-only) columns (W8A8, "
                 "as DeepSeek's reference and transformers' FP8 kernels do; faster on GPU), "
                 "'weight-only' widens the FP8 weights and keeps the activations (the dequantized "
                 "reference's numerics). auto: dynamic when the checkpoint's activation_scheme is dynamic "
                 "or absent, the dtype is not float32 and the device is a GPU with FP8 tensor cores (sm89+); "
                 "weight-only on the CPU.")


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class GenerationConfigMode(str, Enum):
    auto = "auto"
    none = "none"


_GEN_CONFIG_HELP = ("auto: the model's generation_config.json gives the default temperature, top_p, top_k, "
                    "min_p, repetition_penalty and max tokens (max_new_tokens) of requests that do not set them, as vLLM's "
                    "--generation-config auto does (do_sample is ignored, as there); none: ignore the file.")

def _tool_parser_enum() -> type[Enum]:
    """The registered tool-call parser names as a typer choice (a bad name exits 2 listing them)."""
    from atomtool.serve.api.tool_parsers import TOOL_PARSERS

    return Enum("ToolCallParser", {name: name for name in TOOL_PARSERS}, type=str)


ToolCallParser = _tool_parser_enum()
_TOOL_PARSER_HELP = ("Parse the tool calls the model writes into OpenAI's message.tool_calls (streaming: tool-call "
                     "deltas) and finish_reason 'tool_calls', for chat requests that send tools (vLLM's flag): "
                     "hermes (Qwen2.5/Qwen3, Hermes), glm45/glm47 (GLM-4.5 to 4.7, GLM-5), deepseek_v31, "
                     "deepseek_v32. Default: none, the text is returned as content.")

_DTYPE_HELP = ("Activation / float-weight dtype. auto: float32 on CPU; on GPU the checkpoint's float16, "
               "else bfloat16.")
_DEVICE_HELP = "Where to run: auto = CUDA/ROCm GPU when available, else CPU."


def _print_json_error(kind: str, message: str, code: int) -> None:
    """The ``--json`` failure object on stdout: ``{"error": {"type", "message", "exit_code"}}``."""
    print(json.dumps({"error": {"type": kind, "message": message, "exit_code": code}}), flush=True)


def _user_errors(fn):
    """Turn AtomtoolError into a one-line message and exit code, never a traceback. A command run with
    ``--json`` also prints the failure on stdout as one JSON object, ``{"error": {"type", "message",
    "exit_code"}}``, so a script reading stdout sees why there is no result."""

    def fail(kwargs: dict, kind: str, message: str, code: int) -> typer.Exit:
        print(f"error: {message}", file=sys.stderr)
        if kwargs.get("json_out"):
            _print_json_error(kind, message, code)
        return typer.Exit(code)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AtomtoolError as exc:
            raise fail(kwargs, type(exc).__name__, str(exc), exc.exit_code) from None
        except Terminated:
            raise fail(kwargs, "Terminated", "terminated (SIGTERM)", Terminated.exit_code) from None
        except KeyboardInterrupt:
            raise fail(kwargs, "KeyboardInterrupt", "interrupted", 130) from None

    return wrapper


@app.command("inspect", short_help="Classify a checkpoint from config.json and safetensors headers.")
@_user_errors
def inspect_cmd(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Local checkpoint directory or Hugging Face Hub repo id.")],
    revision: Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables (on failure: "
                                                            '{"error": {type, message, exit_code}}).')] = False,
    tensors: Annotated[bool, typer.Option("--tensors", help="Also list every tensor.")] = False,
    gpu_memory: Annotated[float | None, typer.Option("--gpu-memory", help="GB of memory: report the longest context that fits.")] = None,
) -> None:
    """Classify a checkpoint from config.json and safetensors headers only (no tensor data is read)."""
    from atomtool.inspect.commands import run_inspect

    raise typer.Exit(run_inspect(source, revision=revision, json_out=json_out, show_tensors=tensors,
                                 gpu_memory_gb=gpu_memory))


@app.command("convert", short_help="Stream a checkpoint into the atomtool layout.")
@_user_errors
def convert_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Source checkpoint directory (or Hub repo id, downloaded first).")],
    out: Annotated[str, typer.Argument(metavar="OUT", help="Output layout directory (must not exist or be empty).")],
    dtype: Annotated[DType, typer.Option(help="Target dtype for plain-float tensors.")] = DType.auto,
    shard_size: Annotated[str, typer.Option(help="Maximum shard size, e.g. 5GB, 500MB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing OUT that is an atomtool layout (holds atomtool.json); any other non-empty "
             "directory is refused, never deleted.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and write nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output: one JSON object on stdout (on "
                                                            'a refusal or failure: {"error": {type, message, '
                                                            "exit_code}}).")] = False,
    revision: Annotated[str | None, typer.Option(help="Hub revision when SRC is a repo id.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Convert even when the layout would not be servable (inspect reports errors, a scheme "
                        "or architecture the engine does not run, missing tensors): warn instead of refusing.")
    ] = False,
    progress: Annotated[bool | None, typer.Option(
        "--progress/--no-progress", help="Progress bar on stderr (default: only when stderr is a terminal).",
        show_default=False)] = None,
) -> None:
    """Stream a checkpoint into the atomtool layout (fused projections, stacked experts, a manifest).

    Refuses (exit 1, before writing anything, with --dry-run too) a checkpoint the engine could not serve
    after conversion unless --force is given."""
    from atomtool.convert.commands import run_convert

    raise typer.Exit(run_convert(src, out, dtype=dtype.value, shard_size=shard_size, overwrite=overwrite,
                                 dry_run=dry_run, json_out=json_out, revision=revision, force=force,
                                 progress=progress, process_exit=_IN_PROCESS_MAIN))


@app.command("verify", short_help="Check a layout against its manifest (and its source).")
@_user_errors
def verify_cmd(
    layout: Annotated[str, typer.Argument(metavar="LAYOUT", help="An atomtool layout directory.")],
    source: Annotated[str | None, typer.Option("--source", help="Check every part reproduces this source.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object (every "
                                                            "problem listed) instead of text (when there is no "
                                                            'report: {"error": {...}}).')] = False,
) -> None:
    """Re-read a layout and check it against its manifest (and, with --source, against the source)."""
    from atomtool.convert.commands import run_verify

    raise typer.Exit(run_verify(layout, source=source, json_out=json_out))


@app.command("generate", short_help="Generate completions offline with the engine.")
@_user_errors
def generate_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="atomtool layout, raw HF checkpoint directory, or Hub repo id.")],
    prompt: Annotated[list[str], typer.Option("--prompt", help="Prompt text; repeat for a batch.")],
    max_tokens: Annotated[int | None, typer.Option(
        help="Most tokens to generate per prompt (fewer at EOS or at the context limit); default: the model's "
             "generation_config.json max_new_tokens (see --generation-config), else 32.",
        show_default=False)] = None,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature; 0 = greedy (argmax), as is any value below 1e-5; default: the model's "
             "generation_config.json temperature, else 0.", show_default=False)] = None,
    top_p: Annotated[float | None, typer.Option(
        help="Nucleus sampling: keep the smallest set of tokens whose probability sums to at least this; 1 = "
             "off; default: the model's generation_config.json top_p, else 1.", show_default=False)] = None,
    top_k: Annotated[int | None, typer.Option(
        help="Sample among the K most likely tokens; 0 or -1 = off (all tokens); default: the model's "
             "generation_config.json top_k, else 0.", show_default=False)] = None,
    min_p: Annotated[float | None, typer.Option(
        help="Drop tokens less likely than this fraction of the most likely token's probability (after "
             "temperature), in [0, 1]; 0 = off; default: the model's generation_config.json min_p, else 0.",
        show_default=False)] = None,
    repetition_penalty: Annotated[float | None, typer.Option(
        help="Penalise every token already in the prompt or the output (positive logits divided by it, "
             "others multiplied), > 0; 1 = off; default: the model's generation_config.json "
             "repetition_penalty, else 1.", show_default=False)] = None,
    presence_penalty: Annotated[float | None, typer.Option(
        help="Subtract this from the logit of every token already in the output, in [-2, 2]; default 0 "
             "(off).", show_default=False)] = None,
    frequency_penalty: Annotated[float | None, typer.Option(
        help="Subtract this times its count in the output so far from each token's logit, in [-2, 2]; "
             "default 0 (off).", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling (reproducible output); default: "
                                                  "unseeded.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past the end-of-sequence token, up to "
                                                  "--max-tokens.")] = False,
    dtype: Annotated[DType, typer.Option(help=_DTYPE_HELP)] = DType.auto,
    device: Annotated[Device, typer.Option(help=_DEVICE_HELP)] = Device.auto,
    fp8_activations: Annotated[Fp8Activations, typer.Option(help=_FP8_ACT_HELP)] = Fp8Activations.auto,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON list of {prompt, text, token_ids, "
                                                            "finish_reason} instead of text (on failure: "
                                                            '{"error": {...}}).')] = False,
    generation_config: Annotated[GenerationConfigMode, typer.Option(help=_GEN_CONFIG_HELP)] = (
        GenerationConfigMode.auto),
    json_schema: Annotated[str | None, typer.Option(
        help="Structured output: the completion is a JSON value this JSON Schema accepts (the schema as JSON "
             "text, or the path of a .json file holding it).", show_default=False)] = None,
    regex: Annotated[str | None, typer.Option(
        help="Structured output: the completion matches this regular expression.", show_default=False)] = None,
    choice: Annotated[list[str] | None, typer.Option(
        help="Structured output: the completion is exactly one of these strings; repeat for each.",
        show_default=False)] = None,
) -> None:
    """Generate completions for one batch of prompts with the engine (offline, no server)."""
    from atomtool.serve.commands import run_generate, structured_outputs_option

    with sigterm_as_interrupt():  # SIGTERM (timeout, a scheduler): exit 143 with the error line / JSON
        raise typer.Exit(run_generate(model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                      seed=seed, ignore_eos=ignore_eos, dtype=dtype.value,
                                      device=device.value, json_out=json_out,
                                      fp8_activations=fp8_activations.value,
                                      generation_config=generation_config.value,
                                      structured_outputs=structured_outputs_option(json_schema, regex, choice)))


@app.command("serve", short_help="Serve a model over an OpenAI-compatible HTTP API.")
@_user_errors
def serve_cmd(
    model: Annotated[str | None, typer.Argument(metavar="MODEL",
        help="atomtool layout, raw HF checkpoint directory, or Hub repo id; default: the built-in demo "
             "model.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on (0 = any free port; the startup line "
                                           "shows it).")] = 8000,
    served_model_name: Annotated[str | None, typer.Option(
        help="Model name clients pass as 'model' and /v1/models lists; default: MODEL as given "
             "(atomtool-demo for the demo model).")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar="ATOMTOOL_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 routes. Unset: no authentication. An empty key "
             "(--api-key '' or ATOMTOOL_API_KEY set to '') is an error.")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        help="Context length in tokens (prompt + output). Default: the model's max_position_embeddings, "
             "lowered (with a warning) to what the KV cache holds; an explicit value the cache cannot hold "
             "is an error.")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences running in one batch.")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(
        help="Most tokens (prefill chunks + decodes) in one engine step; longer prompts are prefilled in "
             "chunks.")] = 8192,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="Fraction of the GPU's memory (0-1] atomtool may use; the KV cache gets what is left after "
             "weights and activations. Ignored on CPU and with --kv-cache-memory.")] = 0.9,
    kv_cache_memory: Annotated[int | None, typer.Option(
        help="KV cache size in bytes; overrides the GPU budget. Default on CPU: 1073741824 (1 GiB). Either way "
             "no more is allocated than --max-num-seqs sequences of the full context need (the startup line "
             "shows the size).")] = None,
    dtype: Annotated[DType, typer.Option(help=_DTYPE_HELP)] = DType.auto,
    device: Annotated[Device, typer.Option(help=_DEVICE_HELP)] = Device.auto,
    fp8_activations: Annotated[Fp8Activations, typer.Option(help=_FP8_ACT_HELP)] = Fp8Activations.auto,
    enforce_eager: Annotated[bool, typer.Option(help="Disable CUDA graphs (run every decode step "
                                                     "eagerly).")] = False,
    enable_prefix_caching: Annotated[bool, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV cache blocks of a prompt prefix already computed (vLLM's automatic prefix "
             "caching); --no-enable-prefix-caching recomputes every prompt in full.")] = True,
    chat_template: Annotated[str | None, typer.Option(
        help="Jinja chat template (file path or the template text) for /v1/chat/completions; default: "
             "the tokenizer's.")] = None,
    trust_request_chat_template: Annotated[bool, typer.Option(
        "--trust-request-chat-template",
        help="Accept a 'chat_template' sent in a /v1/chat/completions request. Off by default: a client's "
             "Jinja template is code the server runs, and one expression can allocate gigabytes (a denial of "
             "service); without this flag such a request gets HTTP 400. --chat-template is unaffected.")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(help="GPUs to shard the model over; only 1 is "
                                                           "supported yet.")] = 1,
    max_request_bytes: Annotated[int | None, typer.Option(
        help="Largest request body in bytes; bigger ones get HTTP 413. Default 16777216 (16 MiB).")] = None,
    generation_config: Annotated[GenerationConfigMode, typer.Option(help=_GEN_CONFIG_HELP)] = (
        GenerationConfigMode.auto),
    tool_call_parser: Annotated[ToolCallParser | None, typer.Option(  # type: ignore[valid-type]
        help=_TOOL_PARSER_HELP)] = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice",
        help="Accepted for vLLM command lines (tool_choice 'auto' is served either way); requires "
             "--tool-call-parser, as in vLLM.")] = False,
    allowed_origins: Annotated[str | None, typer.Option(
        help='CORS: origins browsers may call from, a JSON list (vLLM\'s flag), e.g. \'["https://app.example"]\'. '
             'Default: \'["*"]\' (any).', show_default=False)] = None,
    allowed_methods: Annotated[str | None, typer.Option(
        help='CORS: allowed methods, a JSON list. Default: \'["*"]\'.', show_default=False)] = None,
    allowed_headers: Annotated[str | None, typer.Option(
        help='CORS: allowed request headers, a JSON list. Default: \'["*"]\'.', show_default=False)] = None,
    allow_credentials: Annotated[bool, typer.Option(
        "--allow-credentials", help="CORS: allow cookies and HTTP auth on cross-origin requests.")] = False,
    model_option: Annotated[str | None, typer.Option(
        "--model", help="MODEL as an option (vLLM's older spelling); give it one way only.",
        show_default=False)] = None,
    revision: Annotated[str | None, typer.Option(
        help="Hub revision (branch, tag or commit) when MODEL is a repo id.", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        help="Seed Python's and torch's generators at startup (vLLM's --seed): requests without their own "
             "seed then sample the same from one run to the next.", show_default=False)] = None,
    uvicorn_log_level: Annotated[UvicornLogLevel, typer.Option(
        help="Log level of the HTTP server (uvicorn).")] = UvicornLogLevel.info,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Accepted for vLLM command lines; no effect: atomtool never runs a "
                                    "checkpoint's own Python code.")] = False,
    tokenizer: Annotated[str | None, typer.Option(
        help="vLLM's flag: only the model itself (its own tokenizer files are used).", show_default=False)] = None,
    enable_chunked_prefill: Annotated[bool | None, typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="Accepted for vLLM command lines: chunked prefill is always on here (--max-num-batched-tokens "
             "sets the chunk); turning it off is refused.", show_default=False)] = None,
    kv_cache_dtype: Annotated[str, typer.Option(
        help="vLLM's flag: only 'auto' (the KV cache is kept in the model's dtype).")] = "auto",
    tokenizer_mode: Annotated[str, typer.Option(
        help="vLLM's flag: only 'auto' (the model's fast tokenizer).")] = "auto",
    max_logprobs: Annotated[int, typer.Option(
        help="vLLM's flag: only 20, the most log-probs a request may ask for here.")] = 20,
    swap_space: Annotated[float | None, typer.Option(
        help="Accepted for vLLM command lines; no effect: preempted sequences are recomputed, never swapped "
             "to CPU memory.", show_default=False)] = None,
    disable_log_requests: Annotated[bool, typer.Option(
        "--disable-log-requests", help="Accepted for vLLM command lines; no effect: requests' contents are "
                                       "never logged.")] = False,
    disable_log_stats: Annotated[bool, typer.Option(
        "--disable-log-stats", help="Accepted for vLLM command lines; no effect: statistics are served on "
                                    "/metrics, not logged.")] = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    import os

    if model_option is not None:
        if model is not None and model != model_option:
            raise AtomtoolError(f"MODEL {model!r} and --model {model_option!r} disagree: give the model once")
        model = model_option
    if enable_chunked_prefill is False:
        raise AtomtoolError("--no-enable-chunked-prefill: chunked prefill is always on in atomtool (a long prompt "
                            "is prefilled --max-num-batched-tokens at a time); drop the flag")
    if tokenizer_mode != "auto":
        raise AtomtoolError(f"--tokenizer-mode {tokenizer_mode}: only auto is supported (the model's fast "
                            "tokenizer is used)")
    if max_logprobs != 20:
        raise AtomtoolError(f"--max-logprobs {max_logprobs}: only 20 is supported (requests may ask for up to 20 "
                            "log-probs)")
    if swap_space is not None and swap_space < 0:
        raise AtomtoolError(f"--swap-space must be >= 0 GiB, got {swap_space:g}")
    if kv_cache_dtype != "auto":
        raise AtomtoolError(f"--kv-cache-dtype {kv_cache_dtype}: only auto is supported (the KV cache is kept in "
                            "the model's dtype)")
    if seed is not None:
        from atomtool.serve.sampling_params import seed_generators

        seed_generators(seed, "--seed")
    if tokenizer is not None:
        from atomtool.serve.demo import demo_model_path

        served = model if model is not None else str(demo_model_path())
        if os.path.realpath(tokenizer) != os.path.realpath(served):
            raise AtomtoolError(f"--tokenizer {tokenizer}: the model's own tokenizer files are used; another "
                                "tokenizer is not supported (drop the flag)")
    if revision is not None:
        from atomtool.inspect.source import looks_like_path

        if model is None:
            raise AtomtoolError("--revision applies to a Hub repo id given as MODEL; none was given (the demo "
                                "model has no revisions)")
        if os.path.exists(model) or looks_like_path(model):
            raise AtomtoolError(f"--revision applies to a Hub repo id; MODEL {model!r} is a local path")
        from atomtool.convert.commands import resolve_source

        served_model_name = served_model_name or model  # the repo id, not the snapshot's directory
        model = str(resolve_source(model, revision)[0])
    from atomtool.serve.api.server import run_serve

    if api_key is None and os.environ.get("ATOMTOOL_API_KEY") is not None:
        api_key = os.environ["ATOMTOOL_API_KEY"]  # click ignores an empty env value; refuse it as --api-key ''

    raise typer.Exit(run_serve(
        model, host=host, port=port, served_model_name=served_model_name, api_key=api_key,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory, dtype=dtype.value,
        device=device.value, enforce_eager=enforce_eager, chat_template=chat_template,
        tensor_parallel_size=tensor_parallel_size, max_request_bytes=max_request_bytes,
        fp8_activations=fp8_activations.value, trust_request_chat_template=trust_request_chat_template,
        enable_prefix_caching=enable_prefix_caching, generation_config=generation_config.value,
        tool_call_parser=tool_call_parser.value if tool_call_parser is not None else None,
        enable_auto_tool_choice=enable_auto_tool_choice, allowed_origins=allowed_origins,
        allowed_methods=allowed_methods, allowed_headers=allowed_headers, allow_credentials=allow_credentials,
        uvicorn_log_level=uvicorn_log_level.value))


@app.command("demo", short_help="Inspect, convert, serve and query the built-in demo model.")
@_user_errors
def demo_cmd(
    port: Annotated[int, typer.Option(help="Port for the temporary server (0 = any free port).")] = 0,
) -> None:
    """Inspect, convert, serve and query the built-in demo model end to end."""
    from atomtool.serve.demo import run_demo

    raise typer.Exit(run_demo(port=port))


#: True when the CLI runs as its own process (:func:`main`), not inside a test runner or a library caller:
#: convert may then ignore late signals until the process exits (see run_convert's ``process_exit``)
_IN_PROCESS_MAIN = False


def main() -> None:
    """Console-script entry point. With ``--json`` on the command line, a usage error (unknown option, bad or
    missing value: exit 2) is also printed as the JSON error object on stdout, as every other failure is."""
    global _IN_PROCESS_MAIN
    _IN_PROCESS_MAIN = True
    if "--json" not in sys.argv[1:]:
        app()
        return
    # click's UsageError as this typer has it (typer >= 0.2x vendors click): BadParameter's base class
    usage_error = typer.BadParameter.__mro__[1]
    try:
        code = app(standalone_mode=False)
    except usage_error as exc:
        exc.show()
        _print_json_error("UsageError", exc.format_message(), exc.exit_code)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
