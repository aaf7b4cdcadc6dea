"""``atomtool serve``: load a model into the engine and serve it with uvicorn (vLLM's ``vllm serve`` flags).

Shutdown follows vLLM/uvicorn: SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight
requests (streams included) finish, stops the engine thread, and returns exit code 0. A second Ctrl-C
while draining forces the exit: the requests still in flight are cancelled, one line says how many,
and the exit code is 130 (as for SIGINT).
:class:`ServerThread` runs the same app in a background thread on a loopback port (tests and
``atomtool demo``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any

from atomtool.errors import AtomtoolError, ConfigError


def _check_flags(*, port: int, max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float,
                 max_model_len: int | None, tensor_parallel_size: int, kv_cache_memory: int | None = None,
                 served_model_name: str | None = None, api_key: str | None = None,
                 max_request_bytes: int | None = None) -> None:
    """Reject flag values that cannot work before spending time loading the model.

    Raises:
        AtomtoolError: ``--tensor-parallel-size`` other than 1.
        ConfigError: an out-of-range number, a non-positive ``--kv-cache-memory`` or
            ``--max-request-bytes``, an empty (or blank) ``--served-model-name`` (it would silently fall
            back to the model path) or ``--api-key`` (an empty key would look like auth but accept
            ``Bearer `` with nothing after it; leave the flag out to serve without auth).
    """
    if tensor_parallel_size != 1:
        raise AtomtoolError(f"--tensor-parallel-size {tensor_parallel_size} is not supported yet: atomtool "
                            "serves a model on one device (use --tensor-parallel-size 1)")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {port}")
    if max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"--max-model-len must be >= 1, got {max_model_len}")
    if kv_cache_memory is not None and kv_cache_memory < 1:
        raise ConfigError(f"--kv-cache-memory must be a positive number of bytes, got {kv_cache_memory}")
    if served_model_name is not None and not served_model_name.strip():
        raise ConfigError("--served-model-name must not be empty (leave it out to serve under the model path)")
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key (or ATOMTOOL_API_KEY) must not be empty; leave it unset to serve "
                          "without authentication")
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be a positive number of bytes, got {max_request_bytes}")


def cors_policy(allowed_origins: str | None = None, allowed_methods: str | None = None,
                allowed_headers: str | None = None, allow_credentials: bool = False):
    """The :class:`~atomtool.serve.api.middleware.CorsPolicy` of ``serve``'s CORS flags, each a JSON list of
    strings as vLLM takes them (``--allowed-origins '["https://app.example"]'``); None: vLLM's default ``["*"]``.

    Raises:
        ConfigError: a flag that is not a JSON list of strings.
    """
    from atomtool.serve.api.middleware import CorsPolicy

    def strings(flag: str, text: str | None) -> tuple[str, ...]:
        if text is None:
            return ("*",)
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]'; got {text!r} ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]'; got {text!r}")
        return tuple(value)

    return CorsPolicy(strings("--allowed-origins", allowed_origins), strings("--allowed-methods", allowed_methods),
                      strings("--allowed-headers", allowed_headers), allow_credentials)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (port 0: any free port).

    Raises:
        AtomtoolError: the address cannot be bound (port in use, unknown host, no permission).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        raise AtomtoolError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: Any, sock: socket.socket, log_level: str) -> Any:
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=None)
    return uvicorn.Server(config)


class ServerThread:
    """Serve ``app`` with uvicorn in a daemon thread (no signal handling); for tests and the demo.

    ``with ServerThread(app) as base_url:`` yields ``http://127.0.0.1:<port>`` once the server accepts
    connections and shuts it down gracefully (in-flight requests finish) on exit.

    Raises:
        AtomtoolError: the server did not start within ``startup_timeout`` seconds.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 60.0) -> None:
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.host = host
        self.server = _uvicorn_server(app, self.sock, log_level)
        self.startup_timeout = startup_timeout
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="atomtool-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise AtomtoolError("the API server did not start")
            time.sleep(0.01)
        return self.base_url

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_serve(model: str | None, *, host: str = "127.0.0.1", port: int = 8000,
              served_model_name: str | None = None, api_key: str | None = None,
              max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
              gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None, dtype: str = "auto",
              device: str = "auto", enforce_eager: bool = False, chat_template: str | None = None,
              tensor_parallel_size: int = 1, max_request_bytes: int | None = None,
              fp8_activations: str = "auto", trust_request_chat_template: bool = False,
              enable_prefix_caching: bool = True, generation_config: str = "auto",
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              allowed_origins: str | None = None, allowed_methods: str | None = None,
              allowed_headers: str | None = None, allow_credentials: bool = False,
              uvicorn_log_level: str = "info") -> int:
    """Serve ``model`` (a layout or raw HF checkpoint; None: the built-in demo model) until SIGTERM/SIGINT.

    Flags mirror ``vllm serve``. The served model name defaults to ``model`` as given (vLLM does the
    same) or ``atomtool-demo``. Returns 0 after a graceful shutdown, 130 after a forced one (a second
    Ctrl-C while requests were still draining). ``api_key``: required as ``Authorization: Bearer <key>``
    on ``/v1`` routes; None serves without auth, an empty string is refused. ``max_request_bytes``: the
    request-body limit (default :data:`~atomtool.serve.api.middleware.DEFAULT_MAX_BODY_BYTES`).
    ``trust_request_chat_template``: accept a chat request's own ``chat_template`` (vLLM's flag of that
    name); off, such a request gets a 400 before its template is compiled, since one Jinja expression
    can allocate gigabytes before the render bounds apply (see :func:`~atomtool.serve.api.app.create_app`).
    ``enable_prefix_caching``: reuse cached KV blocks of a shared prompt prefix (vLLM's
    ``--enable-prefix-caching``, on by default as there). ``generation_config``: ``auto`` takes the default
    sampling parameters of requests that leave them unset from the model's generation_config.json (vLLM's
    ``--generation-config auto``; :mod:`atomtool.serve.generation_defaults`), ``none`` ignores the file.
    ``tool_call_parser``: parse the tool calls a chat response writes into OpenAI's ``tool_calls`` with that
    :data:`~atomtool.serve.api.tool_parsers.TOOL_PARSERS` format (vLLM's ``--tool-call-parser``); None: the
    text stays ``content``. ``enable_auto_tool_choice``: vLLM's flag, accepted so vLLM command lines work;
    it changes nothing here (``tool_choice`` ``"auto"`` is served either way) but, as in vLLM, needs
    ``tool_call_parser``. ``allowed_origins`` / ``allowed_methods`` / ``allowed_headers`` (JSON lists of
    strings, default ``["*"]``) and ``allow_credentials``: the CORS policy (:func:`cors_policy`, vLLM's flags).
    ``uvicorn_log_level``: the HTTP server's log level (vLLM's ``--uvicorn-log-level``).

    Raises:
        AtomtoolError: bad flags (``--tensor-parallel-size`` > 1, out-of-range values), a chat template
            path that does not exist, an address that cannot be bound, or engine load errors.
    """
    if model is not None:  # an empty MODEL fails before the port is bound and the 'loading' line
        from atomtool.serve.loader import check_model_argument

        check_model_argument(model)
    _check_flags(port=port, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                 tensor_parallel_size=tensor_parallel_size, kv_cache_memory=kv_cache_memory,
                 served_model_name=served_model_name, api_key=api_key, max_request_bytes=max_request_bytes)
    from atomtool.serve.api.chat import load_chat_template

    template = load_chat_template(chat_template)  # fail fast, before the model loads
    cors = cors_policy(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
    from atomtool.serve.generation_defaults import load_generation_defaults

    load_generation_defaults(None, generation_config)  # an unknown mode fails before the model loads
    if enable_auto_tool_choice and tool_call_parser is None:
        raise AtomtoolError("--enable-auto-tool-choice requires --tool-call-parser (the format the model writes "
                            "its tool calls in)")
    if tool_call_parser is not None:
        from atomtool.serve.api.tool_parsers import get_tool_parser

        get_tool_parser(tool_call_parser)  # an unknown name fails before the model loads
    if model is None:
        try:
            from atomtool.serve.demo import demo_model_path
        except ImportError as exc:
            raise AtomtoolError(f"no MODEL given and the built-in demo model is unavailable: {exc}") from exc
        model = str(demo_model_path())
        served_model_name = served_model_name or "atomtool-demo"
    name = served_model_name or model
    sock = bind_socket(host, port)  # before loading: a busy port fails in a second, not after the load

    from atomtool.serve.api.app import create_app
    from atomtool.serve.api.middleware import DEFAULT_MAX_BODY_BYTES
    from atomtool.serve.commands import engine_summary
    from atomtool.serve.engine.llm_engine import LLMEngine

    print(f"atomtool serve: loading {model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine.from_model(model, dtype=dtype, device=device, max_model_len=max_model_len,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                                  enforce_eager=enforce_eager, fp8_activations=fp8_activations,
                                  enable_prefix_caching=enable_prefix_caching)
    generation_defaults = load_generation_defaults(engine.model_dir, generation_config)
    app = create_app(engine, name, api_key=api_key, chat_template=template, model_root=model,
                     max_body_bytes=max_request_bytes or DEFAULT_MAX_BODY_BYTES,
                     trust_request_chat_template=trust_request_chat_template,
                     generation_defaults=generation_defaults, tool_call_parser=tool_call_parser, cors=cors)
    server = _uvicorn_server(app, sock, uvicorn_log_level)
    bound_host, bound_port = sock.getsockname()[:2]
    if engine.max_model_len_note:
        print(f"atomtool serve: warning: {engine.max_model_len_note}", file=sys.stderr, flush=True)
    if engine.act_quant_note:
        print(f"atomtool serve: note: {engine.act_quant_note}", file=sys.stderr, flush=True)
    if note := generation_defaults.describe():
        print(f"atomtool serve: note: {note}", file=sys.stderr, flush=True)
    print(f"atomtool serve: model {name!r} ({engine_summary(engine)}) on http://{bound_host}:{bound_port}",
          file=sys.stderr, flush=True)

    # uvicorn re-raises the signal that stopped it once it has shut down; with the default handlers
    # that would kill the process (exit -15) after a clean drain. Make the re-raise a no-op instead. Until
    # uvicorn installs its own handlers (while it sets up its event loop) a signal must not be lost either:
    # it then asks the server to stop as soon as it has started.
    def before_uvicorn(*_: object) -> None:
        if not server.started:
            server.should_exit = True

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, before_uvicorn) for sig in (signal.SIGTERM, signal.SIGINT)}
    quiet = _QuietCancelled()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    serve_log, handler = logging.getLogger("atomtool.serve"), serve_log_handler()
    serve_log.addHandler(handler)
    try:
        server.run(sockets=[sock])
    finally:
        serve_log.removeHandler(handler)
        uvicorn_log.removeFilter(quiet)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            sock.close()
    if not server.started:
        raise AtomtoolError("the API server failed to start (see the log above)")
    if server.force_exit:
        # uvicorn skipped the lifespan shutdown: stop the engine thread here (bounded; it is a daemon).
        app.state.async_engine.shutdown(timeout=5.0)
        n = app.state.traffic.cancelled
        print(f"atomtool serve: forced shutdown (second Ctrl-C): aborted {n} in-flight "
              f"request{'s' if n != 1 else ''}", file=sys.stderr, flush=True)
        return 130
    print("atomtool serve: shut down cleanly", file=sys.stderr, flush=True)
    return 0


class ServeLogFormatter(logging.Formatter):
    """``atomtool serve: warning: <message>``: the server's log records (logger ``atomtool.serve``: requests
    cut at the context limit, tools a chat template ignores, failed requests) in the same form as the lines
    ``run_serve`` prints itself (``atomtool serve: warning: ...``), level in lower case."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"atomtool serve: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def serve_log_handler(stream: Any = None) -> logging.Handler:
    """A stderr handler (``stream`` for tests) for the ``atomtool.serve`` logger, formatted by
    :class:`ServeLogFormatter`, level WARNING. Without one, Python's last-resort handler prints bare
    messages."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(ServeLogFormatter())
    return handler


class _QuietCancelled(logging.Filter):
    """Drop uvicorn's tracebacks of tasks cancelled by a forced shutdown: "Exception in ASGI application"
    for each request still in flight, and the lifespan's shutdown-failed text (Starlette's formatted
    traceback ending in CancelledError). Cancellation is the expected end of both; run_serve reports the
    number of aborted requests in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        text = str(record.msg)
        return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))
