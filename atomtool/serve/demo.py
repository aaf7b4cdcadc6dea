"""The built-in demo model and ``atomtool demo``.

The demo model (``atomtool/demo_model/``) is a ~0.2M-parameter DeepSeek-V3.2-family checkpoint
(``DeepseekV32ForCausalLM``: MLA, a DSA indexer whose ``index_topk`` is smaller than the text, MoE)
trained by ``scripts/train_demo.py`` to recite the Zen of Python (the text of CPython's ``this``
module). See docs/DEMO_MODEL.md.
"""

from __future__ import annotations

import codecs
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from atomtool.errors import AtomtoolError

if TYPE_CHECKING:
    from atomtool.inspect.types import InspectReport

#: The completion prompt the demo (and the tests) start from; greedy decoding recites the rest.
DEMO_PROMPT = "Beautiful is better than"
#: The user message the chat sample of the training data uses.
DEMO_CHAT_MESSAGE = "Recite the Zen of Python."


def demo_model_path() -> Path:
    """Directory of the shipped demo checkpoint (config.json, model.safetensors, tokenizer files)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def zen_of_python() -> str:
    """The full Zen of Python (title line included), decoded from ``this.s`` without printing it.

    ``import this`` prints the text the first time it is imported, so the module's rot13 source
    string is read with stdout silenced.
    """
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def zen_body() -> str:
    """The aphorisms only (from ``"Beautiful is better than ugly."`` to the end, no title line)."""
    text = zen_of_python()
    return text[text.index(DEMO_PROMPT):]


def expected_continuation() -> str:
    """What greedy decoding from :data:`DEMO_PROMPT` must produce (the rest of :func:`zen_body`)."""
    return zen_body()[len(DEMO_PROMPT):]


# --------------------------------------------------------------------------------------------------------
# `atomtool demo`: inspect -> convert -> serve -> query -> shut down, one function per stage.
# --------------------------------------------------------------------------------------------------------

#: Files the shipped demo checkpoint must hold.
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
#: The name the demo server registers the model under (also ``atomtool serve``'s default for the demo).
DEMO_SERVED_NAME = "atomtool-demo"


class DemoError(AtomtoolError):
    """One stage of ``atomtool demo`` failed; the message names the stage and the cause."""


def check_demo_model(path: Path | None = None) -> Path:
    """Return the demo checkpoint directory after checking its files are there.

    Raises:
        DemoError: a file is missing (a broken install, or a checkout where scripts/train_demo.py has not run).
    """
    path = demo_model_path() if path is None else Path(path)
    missing = [name for name in DEMO_FILES if not (path / name).is_file()]
    if missing:
        raise DemoError(f"the built-in demo model at {path} is incomplete (missing {', '.join(missing)}); "
                        "reinstall atomtool or run scripts/train_demo.py")
    return path


def inspect_stage(model_dir: Path, console: Console) -> InspectReport:
    """Stage 1: classify the demo checkpoint (headers only) and print a short summary.

    Returns the :class:`~atomtool.inspect.types.InspectReport`. Raises AtomtoolError from inspect.
    """
    from atomtool.inspect.classify import inspect_checkpoint

    report = inspect_checkpoint(str(model_dir))
    cfg = report.config_flat
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("architecture", f"{report.architecture} ({report.family}, servable: "
                                  f"{'yes' if report.servable else 'no'})")
    table.add_row("parameters", f"{report.totals.get('parameters', 0):,} "
                                f"({report.totals.get('bytes', 0) / 1e6:.1f} MB)")
    table.add_row("MLA", f"q_lora_rank {cfg.get('q_lora_rank')}, kv_lora_rank {cfg.get('kv_lora_rank')}, "
                         f"{cfg.get('num_attention_heads')} heads")
    if report.dsa is not None:
        roles = ", ".join(f"{i}:{r}" for i, r in enumerate(report.dsa.roles))
        table.add_row("DSA indexer", f"index_topk {report.dsa.index_topk}, {report.dsa.index_n_heads} heads x "
                                     f"{report.dsa.index_head_dim}; layer roles {roles}")
    if cfg.get("n_routed_experts"):
        table.add_row("MoE", f"{cfg['n_routed_experts']} routed experts, top-{cfg.get('num_experts_per_tok')}, "
                             f"{cfg.get('n_shared_experts', 0)} shared")
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        raise DemoError(f"inspect: {errors[0].message}")
    console.print(table)
    return report


def convert_stage(model_dir: Path, out_dir: Path, console: Console) -> Path:
    """Stage 2: convert the demo checkpoint into an atomtool layout at ``out_dir`` (must not exist or be empty).

    Returns ``out_dir``. Raises ConversionError / AtomtoolError from convert.
    """
    from atomtool.convert.commands import run_convert

    code = run_convert(str(model_dir), str(out_dir))
    if code != 0 or not (out_dir / "atomtool.json").is_file():
        raise DemoError(f"convert: no layout written to {out_dir} (exit code {code})")
    return out_dir


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raises DemoError when ``host:port`` cannot be bound (another process listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise DemoError(f"serve: cannot use port {port} on {host}: {exc.strerror or exc}") from None


class ServerProcess:
    """``atomtool serve LAYOUT`` in a child process (``python -m atomtool.cli serve``), its log in a file.

    ``start()`` waits until GET /health answers 200; ``stop()`` sends SIGTERM and waits for a clean exit.
    """

    def __init__(self, layout: Path, port: int, log_path: Path, host: str = "127.0.0.1",
                 served_model_name: str = DEMO_SERVED_NAME) -> None:
        self.layout, self.host, self.port, self.log_path = layout, host, port, log_path
        self.served_model_name = served_model_name
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def start(self, timeout: float = 300.0) -> str:
        """Start the server and wait for /health. Returns the base URL.

        Raises:
            DemoError: the process exited (its log tail is in the message) or /health did not answer in time.
        """
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        cmd = [sys.executable, "-m", "atomtool.cli", "serve", str(self.layout), "--host", self.host,
               "--port", str(self.port), "--served-model-name", self.served_model_name]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise DemoError(f"serve: the server exited with code {code} before it was ready:\n"
                                f"{self.log_tail()}")
            if health_ok(self.base_url):
                return self.base_url
            time.sleep(0.2)
        raise DemoError(f"serve: no answer from {self.base_url}/health within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after ``timeout`` seconds). Returns the exit code."""
        try:
            if self.proc is None:
                return 0
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise DemoError(f"serve: the server did not exit within {timeout:.0f}s of SIGTERM "
                                    "(killed)") from None
            return self.proc.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


def health_ok(base_url: str) -> bool:
    """Whether ``GET base_url/health`` answers 200 now (no answer, or an error: False)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def query_stage(base_url: str, console: Console, model: str = DEMO_SERVED_NAME) -> tuple[str, str]:
    """Stage 4: ask the running server through the ``openai`` client, greedy (temperature 0).

    One completion from :data:`DEMO_PROMPT` and one chat completion; prints both. Returns
    ``(completion_text, chat_text)``.

    Raises:
        DemoError: the ``openai`` package is missing, or a request failed.
    """
    try:
        import openai
    except ImportError as exc:
        raise DemoError("query: the demo talks to the server with the openai client: pip install openai") from exc
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="atomtool-demo", timeout=120, max_retries=0)
    try:
        completion = client.completions.create(model=model, prompt=DEMO_PROMPT, temperature=0, max_tokens=300)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}], temperature=0, max_tokens=300)
        structured = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": DEMO_CHAT_MESSAGE}], temperature=0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "principle", "schema": DEMO_SCHEMA}})
    except openai.OpenAIError as exc:
        raise DemoError(f"query: request to {base_url} failed: {exc}") from exc
    text = completion.choices[0].text
    chat_text = chat.choices[0].message.content or ""
    console.print(f"[bold]completion[/bold] (prompt {DEMO_PROMPT!r}, {completion.usage.completion_tokens} tokens, "
                  f"finish_reason {completion.choices[0].finish_reason}):")
    console.print(Text(DEMO_PROMPT, style="dim") + Text(text))
    console.print(f"[bold]chat[/bold] (user: {DEMO_CHAT_MESSAGE!r}) first lines of the reply:")
    console.print(Text("\n".join(chat_text.splitlines()[:3]) + "\n..."))
    json_text = structured.choices[0].message.content or ""
    check_structured(json_text)
    console.print("[bold]structured output[/bold] (the same chat, response_format json_schema: a principle and "
                  "its rank, 1..19):")
    console.print(Text(json_text))
    return text, chat_text


#: the JSON Schema of the demo's structured-output request (OpenAI's response_format json_schema)
DEMO_SCHEMA = {"type": "object", "properties": {"principle": {"type": "string", "maxLength": 40},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 19}},
               "required": ["principle", "rank"], "additionalProperties": False}


def check_structured(text: str) -> None:
    """The structured-output reply must be a JSON object that :data:`DEMO_SCHEMA` accepts (checked by hand).

    Raises:
        DemoError: it is not.
    """
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    ok = (isinstance(obj, dict) and set(obj) == {"principle", "rank"} and isinstance(obj["principle"], str)
          and len(obj["principle"]) <= 40 and type(obj["rank"]) is int and 1 <= obj["rank"] <= 19)
    if not ok:
        raise DemoError(f"query: the server's structured output does not follow the schema; got: {text[:200]!r}")


def check_reply(text: str) -> None:
    """The server's greedy completion of :data:`DEMO_PROMPT` must be the rest of the Zen of Python.

    Raises:
        DemoError: it is not (the message shows the start of what came back).
    """
    if text != expected_continuation():
        raise DemoError(f"query: the server's greedy completion is not the Zen of Python; got: {text[:400]!r}")


def run_demo(port: int = 0) -> int:
    """``atomtool demo``: inspect the demo model, convert it to a temporary layout, serve it in a child process,
    query it with the openai client, shut the server down with SIGTERM, remove the temporary directory.

    port: the server's port (0: any free port). Returns 0 when the server recited the Zen of Python.

    Raises:
        DemoError (an AtomtoolError; the CLI prints it and exits 1): any stage failed, or the reply is not the
        Zen of Python. Errors from inspect / convert / serve pass through with their own message.
    """
    console = Console()
    model_dir = check_demo_model()
    if not 0 <= port <= 65535:
        raise DemoError(f"--port must be in 0..65535, got {port}")
    if port:
        check_port_free(port)  # else a server already there would answer /health in place of ours
    else:
        port = free_port()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atomtool-demo-") as tmp:
        console.rule("1. inspect")
        inspect_stage(model_dir, console)
        console.rule("2. convert")
        layout = convert_stage(model_dir, Path(tmp) / "layout", console)
        console.rule("3. serve")
        server = ServerProcess(layout, port, Path(tmp) / "server.log")
        try:
            url = server.start()
            console.print(f"server ready at {url} (model {DEMO_SERVED_NAME!r})")
            console.rule("4. query (openai client, temperature 0)")
            text, chat_text = query_stage(url, console)
        finally:
            console.rule("5. shut down")
            code = server.stop()
        if code != 0:
            raise DemoError(f"serve: the server exited with code {code} after SIGTERM:\n{server.log_tail()}")
        console.print("server stopped cleanly (SIGTERM, exit 0)")
    console.print(f"removed {tmp}")
    check_reply(text)
    if chat_text != zen_body():
        console.print("[yellow]note:[/yellow] the chat reply differs from the Zen of Python")
    console.print(f"[green]demo ok[/green]: the model recited the Zen of Python ({time.monotonic() - t0:.1f}s)")
    return 0
