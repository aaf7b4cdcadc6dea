"""The OpenAI-compatible FastAPI application (``create_app``), modelled on vLLM's API server.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events ending with ``data: [DONE]``),
``GET /metrics``.

Robustness: chat-template rendering and prompt tokenization (blocking, CPU-bound, their cost chosen by
the client) run in daemon worker threads, never on the event loop, so /health, other requests and
shutdown signals stay responsive, and a render still running cannot keep the process alive at exit;
template rendering is bounded (:mod:`atomtool.serve.api.chat`); request bodies above ``max_body_bytes``
(default :data:`~atomtool.serve.api.middleware.DEFAULT_MAX_BODY_BYTES`) get a 413; a compressed body (any ``Content-Encoding`` but
``identity``) gets a 415 naming the coding; text that is not valid Unicode (a lone UTF-16 surrogate such
as ``"\\ud800"`` in the JSON) is a 400 naming the field; a body that is not strict JSON (malformed,
``NaN``/``Infinity``, nested deeper than :data:`~atomtool.serve.api.strict_json.MAX_JSON_DEPTH` -- named --,
not UTF-8, an object key holding a lone surrogate -- named --) is one "invalid JSON body: ..." 400; every
response, 500s included, is counted in ``atomtool:http_requests_total``.

Requests become one engine request per choice (``n`` x prompts, ids ``<response id>-<choice index>``)
submitted through :class:`~atomtool.serve.api.async_engine.AsyncEngine`; every error is OpenAI's JSON
error body. Completions' ``echo`` puts the prompt (as sent; token ids decoded) before the generated text and,
with ``logprobs``, the prompt's log-probs (the engine's ``prompt_logprobs``) before the generated ones;
``max_tokens`` 0 is allowed with ``echo`` only (the prompt alone: a one-token engine request whose token is
dropped, vLLM's "echo without generation"); a stream's first chunk of each choice carries the prompt part.
Text deltas are ``text[len(previous):]`` of the engine's stable incremental text, and a
trailing U+FFFD (an incomplete UTF-8 character) is held back until the request finishes, so no
streamed piece ever splits a multi-byte character and the pieces concatenate to the final text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from atomtool.errors import AtomtoolError, EngineError, InvalidRequestError
from atomtool.serve.api.async_engine import AsyncEngine, RequestGroup
from atomtool.serve.api.chat import (
    MAX_REQUEST_TEMPLATE_CHARS,
    load_chat_template,
    prompt_char_limit,
    render_chat,
)
from atomtool.serve.api.errors import APIError, BodyTooLarge, bad_request, unparsed_body, validation_error
from atomtool.serve.api.forced_tools import ForcedToolCalls, forced_choice_problem
from atomtool.serve.api.metrics import ServerMetrics
from atomtool.serve.api.middleware import DEFAULT_MAX_BODY_BYTES, AuthAndCount, CorsPolicy, Traffic
from atomtool.serve.api.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbEntry,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogProb,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    structured_outputs_of,
    tool_definition_problem,
    tool_message_problem,
    unsupported_fields,
)
from atomtool.serve.api.sse import EngineStream, sse_event, unless_disconnected
from atomtool.serve.api.strict_json import StrictJSONRoute, surrogate_problem
from atomtool.serve.api.text_output import (
    StreamedLogProbs,
    StreamText,
    TextOffsets,
    TokenText,
    delta_logprobs,
    join_logprobs,
    kept_at_stop,
    num_output_tokens,
    prompt_only_output,
    shift_offsets,
)
from atomtool.serve.api.tool_parsers import get_tool_parser
from atomtool.serve.api.tool_parsers.openai_output import ToolCallOutput
from atomtool.serve.generation_defaults import GenerationDefaults
from atomtool.serve.sampling_params import SamplingParams, StructuredOutputsParams, choice_seed

logger = logging.getLogger("atomtool.serve")

#: most stop strings per request (OpenAI allows 4; vLLM sets no limit): each is searched for after every
#: generated token inside the engine step every request shares, so an unbounded list slows everyone
MAX_STOP_SEQUENCES = 64





async def run_blocking(fn: Any, *args: Any) -> Any:
    """``await`` ``fn(*args)`` run in a new daemon thread (template rendering, tokenization).

    Not ``asyncio.to_thread``: its executor's threads are joined at interpreter exit, so one runaway
    render would keep a stopped server's process alive. A daemon thread dies with the process; if the
    awaiting request is cancelled the thread finishes on its own and its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="atomtool-prep", daemon=True).start()
    return await future


def _bad_text(value: Any, path: str) -> tuple[str, str] | None:
    """The first string in a request (walking models, dicts, lists) that cannot be encoded as UTF-8 (a
    lone surrogate), as (field path such as ``messages[0].content``, what is wrong: ``lone surrogate
    \\ud800 at character 3``).

    Iterative (an explicit stack, children visited in order), so no nesting depth can exhaust Python's
    recursion limit."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            problem = surrogate_problem(node)
            if problem is not None:
                return where, problem
            continue
        if isinstance(node, BaseModel):
            pairs: Any = [(k, getattr(node, k)) for k in type(node).model_fields]
        elif isinstance(node, dict):
            pairs = [(None, k) for k in node if isinstance(k, str)] + list(node.items())
        elif isinstance(node, list):
            pairs = [(i, v) for i, v in enumerate(node) if not isinstance(v, int | float | None)]
        else:
            continue
        children = []
        for k, v in pairs:
            if k is None:  # a dict key: reported at the dict's own path
                children.append((v, where))
            else:
                children.append((v, f"{where}[{k}]" if isinstance(k, int) else (f"{where}.{k}" if where else str(k))))
        stack.extend(reversed(children))
    return None


def check_unicode(req: Any) -> None:
    """Reject a request holding text that is not valid Unicode (the tokenizer would fail with a TypeError).

    Raises:
        APIError: 400 ``invalid_request_error`` naming the field, e.g. ``prompt: the text is not valid
            Unicode: lone surrogate \\ud800 at character 0``.
    """
    found = _bad_text(req, "")
    if found is not None:
        path, problem = found
        raise APIError(400, f"{path}: the text is not valid Unicode: {problem} (send well-formed UTF-8)",
                       param=path.split(".")[0].split("[")[0])



#: The 400 for a chat request carrying its own ``chat_template`` while the server does not accept one.
REQUEST_CHAT_TEMPLATE_REFUSED = (
    "this server does not accept a chat_template in requests (a client's Jinja template is code the server "
    "would run); leave chat_template out to use the server's template, or start the server with "
    "--trust-request-chat-template to allow request templates")


# -------------------------------------------------------------------------------------------- app
def create_app(engine: Any, served_model_name: str, api_key: str | None = None,
               chat_template: str | None = None, *, model_root: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               trust_request_chat_template: bool = False,
               generation_defaults: GenerationDefaults | None = None,
               tool_call_parser: str | None = None, cors: CorsPolicy | None = None) -> FastAPI:
    """Build the FastAPI app serving ``engine`` (an :class:`LLMEngine`) as ``served_model_name``.

    Args:
        engine: the engine; it is stepped in a background thread started by the app's lifespan.
        served_model_name: the model id clients must send (``/v1/models`` lists it).
        api_key: when set, every ``/v1`` route requires ``Authorization: Bearer <api_key>``.
        chat_template: a Jinja chat template file or string replacing the tokenizer's own.
        model_root: the model path shown as ``root`` in ``/v1/models``.
        max_body_bytes: the request-body limit in bytes; a larger body gets a 413.
        trust_request_chat_template: accept a chat request's own ``chat_template`` (vLLM's
            ``--trust-request-chat-template``). Off (the default), such a request gets a 400 (param
            ``chat_template``) before the template is compiled: a client's Jinja is code the server runs, and
            one expression (``{{ 'x' * 10**10 }}``) allocates gigabytes before the render bounds in
            :mod:`atomtool.serve.api.chat` can stop it. On, it is rendered within those bounds.
        generation_defaults: the model's generation-config sampling defaults
            (:func:`~atomtool.serve.generation_defaults.load_generation_defaults`): temperature, top_p, top_k,
            min_p, repetition_penalty and max_tokens of requests that do not send them (vLLM's
            ``--generation-config auto``); a default max_tokens is cut to the room left in the context. None:
            OpenAI's defaults.
        tool_call_parser: a :data:`~atomtool.serve.api.tool_parsers.TOOL_PARSERS` name (vLLM's
            ``--tool-call-parser``): chat requests with ``tools`` (and ``tool_choice`` not ``"none"``) get the
            calls the model writes as ``message.tool_calls`` / tool-call deltas, finish_reason
            ``"tool_calls"``. None: the generated text is always ``content``.
        cors: the cross-origin policy (:class:`~atomtool.serve.api.middleware.CorsPolicy`); None: vLLM's
            default (any origin, method and header; no credentials).

    Raises:
        ConfigError: ``chat_template`` looks like a path that does not exist, or ``tool_call_parser`` is not
            a registered parser.
    """
    template = load_chat_template(chat_template)
    defaults = generation_defaults or GenerationDefaults()
    tokenizer = engine.tokenizer
    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    if tool_parser is not None:
        ToolCallOutput.warn_if_tags_skipped(tool_parser, tokenizer)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.snapshot, served_model_name)

    #: engine requests behind echo requests with max_tokens 0: their one engine token is not the client's output
    scoring_ids: set[str] = set()

    def on_output(out: Any) -> None:
        """Metrics, and a log line when the context limit (not max_tokens) ended a request: OpenAI's API (and
        vLLM) report "length" for both; a client can tell them apart from usage vs /v1/models' max_model_len.
        A prompt-scoring request (echo, max_tokens 0) asked for no output, so nothing stopped it there."""
        metrics.observe(out)
        limit = getattr(out, "context_limit", None)
        scoring = out.finished and out.request_id in scoring_ids
        if out.finished:
            scoring_ids.discard(out.request_id)
        if out.finished and limit is not None and not scoring:
            logger.warning("request %s stopped at the context limit (max_model_len %d): prompt %d + output %d "
                           "tokens; finish_reason 'length'", out.request_id, limit, len(out.prompt_token_ids),
                           num_output_tokens(out))

    async_engine.on_output = on_output
    token_text = TokenText(tokenizer)
    max_model_len = int(engine.max_model_len)
    max_prompt_chars = prompt_char_limit(tokenizer, max_model_len) if tokenizer is not None else 1 << 62

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="atomtool", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = StrictJSONRoute  # bodies parsed as strict JSON, nesting bounded (strict_json)
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name

    # --------------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> Response:
        return bad_request(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        unparsed = unparsed_body(exc)
        if unparsed is not None:
            return unparsed.response()
        resp = APIError(exc.status_code, str(exc.detail),
                        type="invalid_request_error" if exc.status_code < 500 else "server_error",
                        code="request_too_large" if isinstance(exc, BodyTooLarge) else None).response()
        resp.headers.update(exc.headers or {})  # e.g. a 405's Allow (RFC 9110 requires it)
        return resp

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error").response()

    app.state.traffic = Traffic()
    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics, max_body_bytes=max_body_bytes,
                       traffic=app.state.traffic)
    cors = cors or CorsPolicy()
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),  # added last: outermost
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)

    # --------------------------------------------------------------------------------- shared
    def check_model(name: str | None) -> None:
        """404 for a model other than the served one; none or an empty name means the served one (vLLM)."""
        if name and name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_request(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
        """The checks both endpoints share (APIError / InvalidRequestError: a 400); returns the request's own
        output constraint and the field it came from (``structured_outputs_of``; ``(None, None)``: none)."""
        check_unicode(req)  # first: the model check quotes the client's text
        check_model(req.model)
        bad = unsupported_fields(req)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0])
        constraint = structured_outputs_of(req)  # the shape of response_format / structured_outputs / guided_*
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
        n_stop = len(req.stop_list())
        if n_stop > MAX_STOP_SEQUENCES:  # each is looked for after every token, inside the shared engine step
            raise APIError(400, f"stop has {n_stop} sequences; at most {MAX_STOP_SEQUENCES} are accepted",
                           param="stop")
        return constraint

    def check_length(prompt_len: int, max_tokens: int | None, prompt_param: str, *,
                     clamp: bool = False, max_tokens_param: str = "max_tokens") -> int:
        """Validate the context budget (vLLM's messages, naming the prompt for completions and the messages for
        chat); return max_tokens (None: the room left).

        ``clamp``: ``max_tokens`` is a server default the client did not send (completions' 16), so it is
        cut to the room left instead of failing the request over a parameter the client never set.
        ``max_tokens`` 0 (an echo request scoring its prompt, nothing generated): the prompt may fill the
        context. ``max_tokens_param``: the field the client sent max_tokens as (chat: ``max_completion_tokens``
        too), named in the 400 when it does not fit.
        """
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        what = "messages" if prompt_param == "messages" else "prompt"
        if prompt_len > max_model_len or (prompt_len == max_model_len and max_tokens != 0):
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"your request has {prompt_len} input tokens. Please reduce the length of the "
                           f"input {what}.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return max_model_len - prompt_len
        if clamp:
            return min(max_tokens, max_model_len - prompt_len)
        if prompt_len + max_tokens > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {what} or "
                           "completion.", param=max_tokens_param, code="context_length_exceeded")
        return max_tokens

    def sampling_params(req: Any, max_tokens: int, logprobs: int | None, choice: int, *,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's SamplingParams of one choice; ``structured``: the output constraint (the request's own,
        from ``check_request``, or a forced tool call's)."""
        seed = choice_seed(req.seed, choice)  # choice i samples with seed + i (README)
        explicit = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                    "top_k": req.top_k, "seed": seed, "logprobs": logprobs, "stop": req.stop_list(),
                    "stop_token_ids": list(req.stop_token_ids or []), "ignore_eos": req.ignore_eos,
                    "min_tokens": req.min_tokens, "include_stop_str_in_output": req.include_stop_str_in_output,
                    "skip_special_tokens": req.skip_special_tokens,
                    "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                    "repetition_penalty": req.repetition_penalty, "min_p": req.min_p,
                    "logit_bias": req.logit_bias, "allowed_token_ids": req.allowed_token_ids,
                    "structured_outputs": structured,
                    # each output adds this step's part only (not O(output length) per step); the server joins
                    # them (collect) or streams them (StreamText). Not final_only: metrics time every token
                    "output_kind": "delta"}
        explicit["prompt_logprobs"] = prompt_logprobs
        return defaults.sampling_params(explicit)

    async def compile_constraint(params: SamplingParams, field: str | None,
                                 forced: ForcedToolCalls | None = None) -> None:
        """Compile a request's structured-outputs constraint in a worker thread (cached by the engine's
        grammar backend), so the engine thread's ``add_request`` does not: a first constraint reads the
        vocabulary (seconds for a large one) and each new one takes ~0.1 s, which would stall every running
        request's decode. A compile error is a 400 naming ``field``; for a forced tool call (``forced``), one
        naming ``tools`` and the tool whose parameters schema fails on its own (OpenAI names
        ``tools[i].function.parameters`` and the function)."""
        so = params.structured_outputs
        backend_of = getattr(engine, "grammar_backend", None)
        if so is None or backend_of is None:
            return
        try:
            await run_blocking(lambda: backend_of().compile(so))
        except InvalidRequestError as exc:
            for label, constraint in forced.tool_constraints if forced is not None else ():
                try:
                    await run_blocking(lambda c=constraint: backend_of().compile(c))
                except InvalidRequestError as tool_exc:
                    raise InvalidRequestError(f"{label}: {tool_exc}", param="tools") from None
            raise InvalidRequestError(str(exc), param=field or exc.param) from None

    async def submit(response_id: str, prompts: list[Any], per_prompt: list[list[SamplingParams]], *,
                     scoring: bool = False, constraint_field: str | None = None,
                     forced: ForcedToolCalls | None = None) -> RequestGroup:
        """Add one engine request per prompt and choice. ``scoring``: they serve echo with max_tokens 0
        (see ``scoring_ids``). ``constraint_field``: the request field the structured-outputs constraint came
        from (``structured_outputs_of``), named in the 400 when the engine cannot compile it."""
        if per_prompt and per_prompt[0]:  # every choice of a request has the same constraint
            await compile_constraint(per_prompt[0][0], constraint_field, forced)
        reqs = []
        for p, (prompt, params_list) in enumerate(zip(prompts, per_prompt, strict=True)):
            for i, params in enumerate(params_list):
                reqs.append((f"{response_id}-{p * len(params_list) + i}", prompt, params))
        now = time.monotonic()
        for rid, _, _ in reqs:
            metrics.arrived(rid, now)
            if scoring:
                scoring_ids.add(rid)
        try:
            return await async_engine.submit(reqs)
        except InvalidRequestError as exc:
            for rid, _, _ in reqs:
                metrics.forget(rid)
                scoring_ids.discard(rid)
            if exc.param == "structured_outputs" and constraint_field not in (None, exc.param):
                raise InvalidRequestError(str(exc), param=constraint_field) from None
            raise
        except Exception as exc:  # the engine failed to take the request: an error for this request only
            for rid, _, _ in reqs:
                metrics.ended_early(rid, "error")
                scoring_ids.discard(rid)
            status = 503 if isinstance(exc, EngineError) else 500
            message = str(exc) if isinstance(exc, AtomtoolError) else f"{type(exc).__name__}: {exc}"
            raise APIError(status, message, type="server_error") from exc

    def choice_index(request_id: str) -> int:
        return int(request_id.rsplit("-", 1)[1])

    def close_group(group: RequestGroup) -> None:
        if group.unfinished:
            abort_group(group, "abort")

    def abort_group(group: RequestGroup, reason: str) -> None:
        for rid in list(group.unfinished):
            metrics.ended_early(rid, reason)
            scoring_ids.discard(rid)
        group.abort()

    def completion_logprobs(entries: list[dict], offsets: list[int]) -> CompletionLogProbs:
        lp = CompletionLogProbs()
        for e, offset in zip(entries, offsets, strict=True):
            tok = token_text(e["token_id"])
            lp.tokens.append(tok)
            lp.token_logprobs.append(float(e["logprob"]))
            top = {token_text(t): float(v) for t, v in (e.get("top") or {}).items()}
            top.setdefault(tok, float(e["logprob"]))
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
        return lp

    def echo_logprobs(ids: list[int], entries: list[dict | None], offsets: list[int], top_n: int
                      ) -> CompletionLogProbs:
        """The legacy log-probs of an echoed prompt: one entry per prompt token (``entries``: the engine's
        prompt log-probs, None where there is none: the first token gets null token_logprob and top_logprobs,
        as in OpenAI's and vLLM's echo), tops cut to the request's ``logprobs``."""
        lp = CompletionLogProbs()
        for t, e, offset in zip(ids, entries, offsets, strict=True):
            tok = token_text(t)
            lp.tokens.append(tok)
            lp.text_offset.append(offset)
            if e is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(float(e["logprob"]))
            top = {token_text(i): float(v) for i, v in list((e.get("top") or {}).items())[:top_n]}
            top.setdefault(tok, float(e["logprob"]))
            lp.top_logprobs.append(top)
        return lp

    def prompt_logprob_dict(entry: dict, top_n: int) -> dict[str, PromptLogprob]:
        """One prompt position in vLLM's ``prompt_logprobs`` format: the top ``top_n`` tokens (rank 1..) and
        the prompt token (with its rank in the vocabulary, as vLLM's, also when it is not among them)."""
        out = {str(i): PromptLogprob(logprob=float(v), rank=r + 1, decoded_token=token_text(i))
               for r, (i, v) in enumerate(list((entry.get("top") or {}).items())[:top_n])}
        t = entry["token_id"]
        out.setdefault(str(t), PromptLogprob(logprob=float(entry["logprob"]), rank=entry.get("rank"),
                                             decoded_token=token_text(t)))
        return out

    def chat_logprobs(entries: list[dict], top_n: int) -> ChatChoiceLogProbs:
        content = []
        for e in entries:
            tok = token_text(e["token_id"])
            tops = sorted((e.get("top") or {}).items(), key=lambda kv: -kv[1])[:top_n]
            content.append(ChatTokenLogProb(
                token=tok, logprob=float(e["logprob"]), bytes=list(token_text.raw_bytes(e["token_id"])),
                top_logprobs=[ChatLogProbEntry(token=token_text(t), logprob=float(v),
                                               bytes=list(token_text.raw_bytes(t))) for t, v in tops]))
        return ChatChoiceLogProbs(content=content)

    async def collect(group: RequestGroup, view: Any = None) -> tuple[dict[str, Any], dict[str, list[dict]]]:
        """Every choice's final output (cumulative: a delta request's outputs joined, its prompt log-probs kept)
        and log-prob entries. ``view``: applied to each engine output first (:func:`prompt_only_output`)."""
        finals: dict[str, Any] = {}
        lps: dict[str, list[dict]] = {rid: [] for rid in group.request_ids}
        texts: dict[str, list[str]] = {rid: [] for rid in group.request_ids}  # delta outputs' text pieces
        ids: dict[str, list[int]] = {rid: [] for rid in group.request_ids}  # delta outputs' token ids
        prompt_lps: dict[str, list] = {}  # delta requests' prompt log-probs (only their first output has them)
        try:
            async for out in group:
                if view is not None:
                    out = view(out)
                rid = out.request_id
                lps[rid].extend(delta_logprobs(out))
                if getattr(out, "prompt_logprobs", None) is not None:
                    prompt_lps[rid] = out.prompt_logprobs
                if getattr(out, "delta", False):
                    texts[rid].append(out.text)
                    ids[rid].extend(out.token_ids)
                    if out.finished:
                        out = dataclasses.replace(out, token_ids=ids[rid], text="".join(texts[rid]), delta=False,
                                                  logprobs=lps[rid] if out.logprobs is not None else None,
                                                  prompt_logprobs=prompt_lps.get(rid))
                if out.finished:
                    finals[rid] = out
        except EngineError as exc:
            abort_group(group, "error")
            raise APIError(500, str(exc), type="server_error") from exc
        finally:
            if group.unfinished:
                abort_group(group, "abort")
        return finals, lps

    def usage_of(finals: dict[str, Any], n: int) -> UsageInfo:
        prompt = sum(len(out.prompt_token_ids) for rid, out in finals.items() if choice_index(rid) % n == 0)
        completion = sum(num_output_tokens(out) for out in finals.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def usage_chunk_builder(req: Any, chunk_cls: Any, response_id: str, created: int) -> Any:
        """With ``stream_options.include_usage``, a function finals -> the stream's last chunk (a ``chunk_cls``
        with no choices and the usage of all choices, as OpenAI sends it); None otherwise."""
        if req.stream_options is None or not req.stream_options.include_usage:
            return None

        def usage(finals: dict[str, Any]) -> Any:
            return chunk_cls(id=response_id, created=created, model=served_model_name, choices=[],
                             usage=usage_of(finals, req.n))

        return usage

    async def final_response(raw: Request, group: RequestGroup, response_cls: Any, response_id: str,
                             created: int, n: int, make_choice: Any, view: Any = None) -> Response:
        """Non-streaming body shared by both endpoints: wait for every choice (cancelled if the client
        disconnects), then ``response_cls`` with ``make_choice(index, final output, log-prob entries)`` for
        each choice in index order and the usage of all of them. ``view``: see :func:`collect`."""
        finals, lps = await unless_disconnected(raw, collect(group, view))
        choices = [make_choice(choice_index(rid), out, lps[rid])
                   for rid, out in sorted(finals.items(), key=lambda kv: choice_index(kv[0]))]
        body = response_cls(id=response_id, created=created, model=served_model_name, choices=choices,
                            usage=usage_of(finals, n))
        return Response(body.model_dump_json(), media_type="application/json")

    def continuous_usage(req: Any) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): usage in every chunk."""
        opts = req.stream_options
        return bool(opts is not None and opts.include_usage and opts.continuous_usage_stats)

    async def stream_events(group: RequestGroup, make_chunks: Any, usage_chunk: Any,
                            view: Any = None, continuous: bool = False) -> AsyncIterator[str]:
        """SSE body shared by both endpoints: chunks per output, optional usage, ``[DONE]``. ``view``: see
        :func:`collect`. ``continuous``: each chunk also carries its choice's usage so far (the prompt's
        tokens and the tokens generated until that output), as vLLM's ``continuous_usage_stats`` does."""
        texts: dict[str, StreamText] = {rid: StreamText() for rid in group.request_ids}
        finals: dict[str, Any] = {}
        try:
            try:
                async for out in group:
                    if view is not None:
                        out = view(out)
                    delta = texts[out.request_id].next(out)
                    if out.finished:
                        finals[out.request_id] = out
                    for chunk in make_chunks(out, delta):
                        if continuous and chunk.usage is None:  # a chunk may carry its own (chat's role chunk)
                            prompt, done = len(out.prompt_token_ids), num_output_tokens(out)
                            chunk.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=done,
                                                    total_tokens=prompt + done)
                        yield sse_event(chunk)
            except EngineError as exc:
                abort_group(group, "error")
                yield sse_event(APIError(500, str(exc), type="server_error").body())
            else:
                if usage_chunk is not None:
                    yield sse_event(usage_chunk(finals))
            yield "data: [DONE]\n\n"
        finally:
            # Client disconnect cancels this generator: abort what is still running (frees KV blocks).
            if group.unfinished:
                abort_group(group, "abort")

    # --------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return APIError(503, "the engine is not running", type="server_error").response()
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route: the answer of /health."""
        return await health()

    @app.get("/version")
    async def version() -> Response:
        from atomtool import __version__

        return Response(json.dumps({"version": __version__}), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        """vLLM's /tokenize: the prompt ids a completions or chat request would get (not under /v1, so no API
        key, as in vLLM)."""
        check_unicode(req)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either 'prompt' (a text) or 'messages' (a chat), not both or neither",
                           param="prompt")
        if req.prompt is not None:  # as a completions request tokenizes it (its length check included)
            ids = (await run_blocking(completion_prompts, req.prompt, req.add_special_tokens is not False))[0][0]
        else:
            if req.add_special_tokens:
                raise APIError(400, "add_special_tokens must be false with messages: the chat template places "
                               "the special tokens itself", param="add_special_tokens")
            ids = await run_blocking(functools.partial(
                render_chat, tokenizer, req.messages, chat_template=template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs, tools=req.tools, max_chars=max_prompt_chars))
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        check_model(req.model)
        vocab = len(tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await run_blocking(tokenizer.decode, req.tokens)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> Response:
        card = ModelCard(id=served_model_name, root=model_root, max_model_len=max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        """OpenAI's "retrieve model": the served model's card, 404 ``model_not_found`` for any other id
        (``:path`` so an id with a slash, such as ``org/name``, reaches here)."""
        check_model(model)
        card = ModelCard(id=served_model_name, root=model_root, max_model_len=max_model_len)
        return Response(card.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        constraint, constraint_field = check_request(req)
        sent_max = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        # max_tokens 0 with echo scores the prompt (lm-evaluation-harness' loglikelihood requests): served as a
        # one-token request whose token is dropped (vLLM's "echo without generation")
        prompt_only = sent_max and req.max_tokens == 0
        if prompt_only and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo: the prompt alone is "
                           "returned, with its log-probs when logprobs is set)", param="max_tokens")
        if prompt_only and req.min_tokens > 0:
            raise APIError(400, f"min_tokens must be in [0, max_tokens] (max_tokens = 0), got {req.min_tokens}",
                           param="min_tokens")
        prompts, lengths, prompt_texts = await run_blocking(completion_prompts, req.prompt, req.add_special_tokens,
                                                            req.truncate_prompt_tokens)
        # engine prompt log-probs: echo with logprobs covers the prompt tokens; vLLM's prompt_logprobs asks directly
        wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        engine_prompt_lps = max(wanted) if wanted else None
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= 20:
            engine_prompt_lps = req.prompt_logprobs  # SamplingParams refuses it, naming prompt_logprobs
        per_prompt = []
        # null or unset: the generation config's max_new_tokens, else OpenAI's default
        requested = req.max_tokens if sent_max else defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        for n_tok in lengths:
            max_tokens = check_length(n_tok, requested, "prompt", clamp=not sent_max)
            per_prompt.append([sampling_params(req, max(max_tokens, 1), None if prompt_only else req.logprobs, i,
                                               prompt_logprobs=engine_prompt_lps, structured=constraint)
                               for i in range(req.n)])
        engine_id = f"cmpl-{uuid.uuid4().hex}"  # engine request ids stay unique whatever the client's request_id
        response_id = f"cmpl-{req.request_id}" if req.request_id else engine_id
        created = int(time.time())
        group = await submit(engine_id, prompts, per_prompt, scoring=prompt_only,
                             constraint_field=constraint_field)
        want_lp = req.logprobs is not None
        view = prompt_only_output if prompt_only else None

        echo_parts: dict[str, tuple[str, CompletionLogProbs | None]] = {}

        def echoed(out: Any) -> tuple[str, CompletionLogProbs | None]:
            """The prompt part of an echo choice: its text (the prompt as sent, or the decoded token ids) and,
            with logprobs, its log-probs (offsets from 0). Built from the choice's first output (the one that
            carries the prompt log-probs) and kept for its later ones."""
            if out.request_id not in echo_parts:
                echo_parts[out.request_id] = echo_part(out)
            return echo_parts[out.request_id]

        def echo_part(out: Any) -> tuple[str, CompletionLogProbs | None]:
            p = choice_index(out.request_id) // req.n
            ids = out.prompt_token_ids
            text = prompt_texts[p]
            if text is None:
                text = tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            if not want_lp:
                return text, None
            offsets = TextOffsets(tokenizer, [], req.skip_special_tokens).next(ids)
            return text, echo_logprobs(ids, getattr(out, "prompt_logprobs", None) or [None] * len(ids),
                                       offsets, req.logprobs)

        def vllm_prompt_logprobs(out: Any) -> list[dict[str, PromptLogprob] | None] | None:
            if req.prompt_logprobs is None or getattr(out, "prompt_logprobs", None) is None:
                return None
            return [None if e is None else prompt_logprob_dict(e, req.prompt_logprobs) for e in out.prompt_logprobs]

        if req.stream:
            trackers: dict[str, StreamedLogProbs] = {}
            started: set[str] = set()  # choices whose first chunk (the echoed prompt) went out

            def make_chunks(out: Any, delta: str) -> list[CompletionResponse]:
                lp = None
                if want_lp:
                    tracker = trackers.get(out.request_id)
                    if tracker is None:
                        tracker = trackers[out.request_id] = StreamedLogProbs(tokenizer, out.prompt_token_ids,
                                                                              req.skip_special_tokens)
                    lp = completion_logprobs(*tracker.next(out, delta_logprobs(out), delta))
                first = out.request_id not in started
                started.add(out.request_id)
                prompt_lps = vllm_prompt_logprobs(out) if first else None
                if req.echo:
                    prefix, prefix_lp = echoed(out)
                    if lp is not None:
                        shift_offsets(lp, len(prefix))
                    if first:  # vLLM's stream: the first chunk carries the prompt and the first generated text
                        delta = prefix + delta
                        if prefix_lp is not None:
                            lp = join_logprobs(prefix_lp, lp)
                if not delta and not (lp and lp.tokens) and not out.finished and prompt_lps is None:
                    return []
                choice = CompletionChoice(index=choice_index(out.request_id), text=delta, logprobs=lp,
                                          finish_reason=out.finish_reason if out.finished else None,
                                          stop_reason=out.stop_reason if out.finished else None,
                                          prompt_logprobs=prompt_lps)
                return [CompletionResponse(id=response_id, created=created, model=served_model_name,
                                           choices=[choice])]

            usage = usage_chunk_builder(req, CompletionResponse, response_id, created)
            return EngineStream(stream_events(group, make_chunks, usage, view, continuous_usage(req)),
                                lambda: close_group(group))

        def make_choice(index: int, out: Any, entries: list[dict]) -> CompletionChoice:
            lp = None
            if want_lp:
                offsets = TextOffsets(tokenizer, out.prompt_token_ids, req.skip_special_tokens).next(
                    [e["token_id"] for e in entries])
                if isinstance(out.stop_reason, str):  # a stop string cut the text: tokens starting past it go
                    keep = kept_at_stop(offsets, len(out.text))
                    entries, offsets = entries[:keep], offsets[:keep]
                lp = completion_logprobs(entries, offsets)
            text = out.text
            if req.echo:
                prefix, prefix_lp = echoed(out)
                text = prefix + text
                if lp is not None:
                    lp = join_logprobs(prefix_lp, shift_offsets(lp, len(prefix)))
            return CompletionChoice(index=index, text=text, finish_reason=out.finish_reason, logprobs=lp,
                                    stop_reason=out.stop_reason, prompt_logprobs=vllm_prompt_logprobs(out))

        return await final_response(raw, group, CompletionResponse, response_id, created, req.n, make_choice,
                                    view)

    def truncated(ids: list[int], k: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``k`` tokens (-1: max_model_len; the request model
        refuses 0). A ``k`` above max_model_len is a 400 naming both (vLLM's rule: such a prompt could not run)."""
        if k > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                                f"({max_model_len}); please request a smaller truncation size",
                           param="truncate_prompt_tokens")
        return ids[-(max_model_len if k == -1 else k):]

    def completion_prompts(prompt: Any, add_special_tokens: bool = True, truncate: int | None = None,
                           ) -> tuple[list[list[int]], list[int], list[str | None]]:
        """Normalise ``prompt`` to a list of engine prompts (token-id lists), their lengths and their text
        (None for a prompt sent as token ids).

        Strings are tokenized here (blocking: called in a worker thread) with the engine's own encoding
        (``tokenizer.encode``, special tokens added unless ``add_special_tokens`` is false), so the engine thread
        does not tokenize them again. ``truncate`` (vLLM's ``truncate_prompt_tokens``): keep each prompt's last
        ``truncate`` tokens (-1: max_model_len); a truncated text prompt's text is then unknown (None)."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        for item in items:  # refused before tokenizing: a text this long cannot fit (chat.prompt_char_limit)
            if isinstance(item, str) and len(item) > max_prompt_chars:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                               f"your prompt has {len(item)} characters, more than that many tokens can hold "
                               f"(at most {max_prompt_chars} characters). Please reduce the length of the input "
                               "prompt.", param="prompt", code="context_length_exceeded")
        ids = [list(tokenizer.encode(item, add_special_tokens=add_special_tokens)) if isinstance(item, str)
               else list(item) for item in items]
        texts = [item if isinstance(item, str) else None for item in items]
        if truncate is not None:
            cut = [truncated(x, truncate) for x in ids]
            texts = [t if len(c) == len(x) else None for t, c, x in zip(texts, cut, ids, strict=True)]
            ids = cut
        # ids outside the vocabulary: the engine's add_request rejects them
        return ids, [len(x) for x in ids], texts

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        constraint, constraint_field = check_request(req)
        if req.chat_template is not None and not trust_request_chat_template:  # before anything compiles it
            raise APIError(400, REQUEST_CHAT_TEMPLATE_REFUSED, param="chat_template")
        if req.chat_template is not None and len(req.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise APIError(400, f"chat_template has {len(req.chat_template)} characters; a request's template may "
                           f"have at most {MAX_REQUEST_TEMPLATE_CHARS} (compiling one costs seconds of CPU per "
                           "MiB): serve a longer one with --chat-template", param="chat_template")
        problem = tool_message_problem(req.messages, calls_may_end=not req.add_generation_prompt)
        if problem is not None:
            raise APIError(400, problem, param="messages")
        problem = tool_definition_problem(req.tools)
        if problem is not None:
            raise APIError(400, problem, param="tools")
        problem = forced_choice_problem(req)
        if problem is not None:
            raise APIError(400, problem, param="tool_choice")
        forced = ForcedToolCalls.for_request(req)  # None: tool_choice does not force a call
        if forced is not None and constraint_field is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} forces a tool call (its arguments are the "
                           f"output's constraint); it cannot be combined with {constraint_field}",
                           param=constraint_field)
        prompt_ids = await run_blocking(functools.partial(
            render_chat, tokenizer, req.messages, chat_template=req.chat_template or template,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs, tools=req.tools, max_chars=max_prompt_chars,
            add_special_tokens=req.add_special_tokens))
        if req.truncate_prompt_tokens is not None:
            prompt_ids = truncated(prompt_ids, req.truncate_prompt_tokens)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sent_max = requested is not None
        if not sent_max:  # the generation config's max_new_tokens (cut to the room left), else the room left
            requested = defaults.get("max_tokens")
        max_tokens = check_length(len(prompt_ids), requested, "messages", clamp=not sent_max,
                                  max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None
                                  else "max_tokens")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = [sampling_params(req, max_tokens, top_n, i,
                                  structured=forced.constraint if forced is not None else constraint)
                  for i in range(req.n)]
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"  # engine request ids stay unique whatever request_id says
        response_id = f"chatcmpl-{req.request_id}" if req.request_id else engine_id
        created = int(time.time())
        group = await submit(engine_id, [prompt_ids], [params],
                             constraint_field="tool_choice" if forced is not None else constraint_field,
                             forced=forced)
        # the text as tool calls: forced ones (any model, no parser needed) or those a --tool-call-parser finds;
        # None: the text is content
        tool_out = forced or ToolCallOutput.for_request(tool_parser, req)

        if req.stream:
            started: set[str] = set()

            def make_chunks(out: Any, delta: str) -> list[ChatCompletionChunk]:
                idx = choice_index(out.request_id)
                chunks = []
                if out.request_id not in started:
                    started.add(out.request_id)
                    prompt = len(out.prompt_token_ids)  # the role chunk precedes every token (vLLM's usage: 0)
                    chunks.append(ChatCompletionChunk(id=response_id, created=created, model=served_model_name,
                                                      choices=[ChatStreamChoice(index=idx, delta=DeltaMessage(
                                                          role="assistant", content=""))],
                                                      usage=UsageInfo(prompt_tokens=prompt, total_tokens=prompt)
                                                      if continuous_usage(req) else None))
                lp = chat_logprobs(delta_logprobs(out), top_n) if top_n is not None else None
                if tool_out is not None:
                    for delta_msg, reason, with_lp in tool_out.stream_deltas(out, delta, lp):
                        chunks.append(ChatCompletionChunk(
                            id=response_id, created=created, model=served_model_name,
                            choices=[ChatStreamChoice(index=idx, delta=delta_msg, logprobs=lp if with_lp else None,
                                                      finish_reason=reason,
                                                      stop_reason=out.stop_reason if reason else None)]))
                    return chunks
                if delta or out.finished or (lp is not None and lp.content):
                    chunks.append(ChatCompletionChunk(
                        id=response_id, created=created, model=served_model_name,
                        choices=[ChatStreamChoice(index=idx, delta=DeltaMessage(content=delta or None),
                                                  logprobs=lp,
                                                  finish_reason=out.finish_reason if out.finished else None,
                                                  stop_reason=out.stop_reason if out.finished else None)]))
                return chunks

            usage = usage_chunk_builder(req, ChatCompletionChunk, response_id, created)
            return EngineStream(stream_events(group, make_chunks, usage, continuous=continuous_usage(req)),
                                lambda: close_group(group))

        def make_choice(index: int, out: Any, entries: list[dict]) -> ChatCompletionChoice:
            message, reason = (ChatResponseMessage(content=out.text), out.finish_reason) if tool_out is None \
                else tool_out.message(out)
            return ChatCompletionChoice(index=index, message=message, finish_reason=reason,
                                        stop_reason=out.stop_reason,
                                        logprobs=chat_logprobs(entries, top_n) if top_n is not None else None)

        return await final_response(raw, group, ChatCompletionResponse, response_id, created, req.n, make_choice)

    return app
