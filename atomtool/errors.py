"""Typed errors shared by every stage.

Every error a user can cause derives from :class:`AtomtoolError`; the CLI prints ``error: <message>``
on one line and exits with ``exit_code`` (1) without a traceback. Messages name the file, tensor,
layer or parameter at fault. Modelled on huggingface_hub's typed errors.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


class AtomtoolError(Exception):
    """Base class for every user-facing error. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class HeaderError(AtomtoolError):
    """A safetensors header is corrupt, hostile or inconsistent (names the file and the problem)."""


class SourceError(AtomtoolError):
    """A checkpoint source cannot be read: missing directory/shard, bad index.json, Hub failure."""


class ConfigError(AtomtoolError):
    """config.json is missing, not JSON, or holds inconsistent values (e.g. a bad DSA schedule)."""


class UnsupportedArchitectureError(AtomtoolError):
    """The architecture is unknown to the registry; the message lists the supported ones."""


class ConversionError(AtomtoolError):
    """convert refused or failed (OUT inside SRC, non-empty OUT, no disk space, overflowing cast, ...)."""


class LayoutError(AtomtoolError):
    """An atomtool layout is missing, incomplete or does not match its manifest."""


class EngineError(AtomtoolError):
    """The serving engine cannot load or run a model (missing tensors, KV pool too small, ...)."""


class InvalidArgumentError(ConfigError, EngineError, ValueError):
    """An engine or ``LLM()`` argument out of range or unsupported (dtype, max_model_len, max_num_seqs,
    gpu_memory_utilization, tensor_parallel_size, ...). Also a ValueError, which is what vLLM's ``LLM()`` raises
    for these, and a ConfigError / EngineError, what callers of ours caught before."""


class InvalidRequestError(AtomtoolError, ValueError):
    """A request is invalid: bad sampling parameters, prompt longer than max_model_len, ...

    ``param``: the request field at fault when there is one (the server's OpenAI-style error object names it);
    ``code``: OpenAI's error code when one applies (``context_length_exceeded``).
    """

    param: str | None = None  # a subclass may fix it (chat.TemplateBudgetExceeded)
    code: str | None = None

    def __init__(self, message: str = "", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception (a KeyboardInterrupt, so every Ctrl-C cleanup path runs) while a
    command that must clean up runs (convert). The CLI exits with ``exit_code``: 128 + SIGTERM = 143, the
    shell's convention, where Ctrl-C gives 130."""

    exit_code: int = 143


def one_line(text: object) -> str:
    """``text`` (a message, or a foreign exception whose text we embed in ours) squeezed onto one line:
    runs of whitespace, newlines included, become one space. The CLI prints ``error: <message>`` as one
    line, and e.g. pydantic-style validation errors from transformers span several."""
    return " ".join(str(text).split())


def clip(text: object, width: int = 200) -> str:
    """:func:`one_line` of ``text``, cut to at most ``width`` characters at a word boundary with `` ...``
    (``textwrap.shorten``): foreign error texts embedded in a message never end mid-word (a cut
    ``please unset the `HF_H`` reads like a different variable)."""
    import textwrap

    return textwrap.shorten(one_line(text), width, placeholder=" ...")


@contextmanager
def sigterm_as_interrupt():
    """Turn SIGTERM into :class:`Terminated` (a KeyboardInterrupt) inside the block, so cleanup runs and the CLI
    exits 143 with its error line (main thread only; elsewhere a no-op). A handler replaced inside the block
    (e.g. SIG_IGN once convert's layout is complete) is kept."""
    def handler(signum, frame):  # noqa: ARG001
        raise Terminated

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:  # keep SIG_IGN set once the layout is complete
            signal.signal(signal.SIGTERM, old)
