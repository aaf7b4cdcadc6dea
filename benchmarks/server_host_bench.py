"""Host cost of the HTTP server per streamed token: how many tokens/s ``atomtool serve``'s process can push.

Issue 7 ("TTFT / TPOT through the HTTP server under 64 concurrent clients"): on the H200 the server streamed
4,526 tok/s to 64 clients while the engine alone runs ~9,000 tok/s, so the question is whether the server's
own Python (engine thread: scheduler, detokenizer, outputs; event loop: one pydantic chunk, SSE framing and a
socket write per token) caps it. Measured without a model: the server runs in a child process with a real
:class:`LLMEngine` over a scripted stand-in model (:func:`benchmarks.engine_host_bench.scripted_engine`: no
logits, one scripted token per sequence per step), so every CPU second that process spends is serving
overhead. ``--clients`` streaming clients (raw httpx, counting SSE events; in this process) each run
requests of ``--tokens`` tokens (``ignore_eos``) for ``--seconds``. Reported: streamed tokens/s, the server
process's CPU seconds (user + system, from /proc) per streamed token, and the tokens/s that CPU cost allows
per core (1 / cost): the ceiling this process's Python puts on streaming, whatever the GPU does.

Run: ``python -m benchmarks.server_host_bench [--clients 64] [--tokens 256] [--seconds 20] [--endpoint chat]``
(Linux: reads /proc/PID/stat).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

from benchmarks import common as C


def serve_child(port: int, max_num_seqs: int) -> None:
    """Child process: the server app over a scripted engine, on ``port`` (uvicorn, 127.0.0.1)."""
    import torch
    import uvicorn

    from atomtool.serve.api.app import create_app
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.engine.llm_engine import load_tokenizer
    from benchmarks.engine_host_bench import scripted_engine

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(demo_model_path())
    text_ids = tokenizer.encode(" Beautiful is better than ugly. Explicit is better than implicit.")
    engine = scripted_engine(tokenizer, lambda seq: text_ids[seq.num_output_tokens % len(text_ids)],
                             vocab_size=len(tokenizer), max_model_len=2048, max_num_seqs=max_num_seqs)
    profile = os.environ.get("SERVER_HOST_BENCH_PROFILE")  # a path: cProfile every thread, dump at exit
    if profile:
        import cProfile

        prof = cProfile.Profile()
        import atomtool.serve.api.async_engine as ae

        run = ae.AsyncEngine._run

        def profiled_run(self):
            p2 = cProfile.Profile()
            p2.enable()
            try:
                run(self)
            finally:
                p2.disable()
                p2.dump_stats(profile + ".engine")

        ae.AsyncEngine._run = profiled_run
        prof.enable()
    try:
        uvicorn.run(create_app(engine, "m"), host="127.0.0.1", port=port, log_level="warning")
    finally:
        if profile:
            prof.disable()
            prof.dump_stats(profile + ".loop")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client_loop(url: str, endpoint: str, tokens: int, deadline: float, counts: list[int]) -> None:
    import httpx

    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Recite."}]}
    else:
        path, body = "/v1/completions", {"prompt": "Beautiful is better than"}
    body |= {"model": "m", "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            async with client.stream("POST", path, json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        counts[0] += 1


async def drive(url: str, a: argparse.Namespace, pid: int) -> dict:
    counts = [0]
    warm_deadline = time.monotonic() + 2.0
    await asyncio.gather(*(client_loop(url, a.endpoint, 16, warm_deadline, [0]) for _ in range(4)))
    c0, t0 = cpu_seconds(pid), time.monotonic()
    deadline = t0 + a.seconds
    await asyncio.gather(*(client_loop(url, a.endpoint, a.tokens, deadline, counts) for _ in range(a.clients)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
    per_token = cpu / max(counts[0], 1)
    return {"endpoint": a.endpoint, "clients": a.clients, "streamed chunks": counts[0], "wall s": wall,
            "tok/s": counts[0] / wall, "server cpu s": cpu, "server cpu us/token": 1e6 * per_token,
            "tok/s per server core": 1 / per_token if per_token else float("inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=C.positive_int, default=64)
    ap.add_argument("--tokens", type=C.positive_int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        serve_child(a.child, max(a.clients, 1))
        return
    from atomtool.serve.api.server import bind_socket
    from atomtool.serve.demo import health_ok

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.server_host_bench", "--child", str(port),
                              "--clients", str(a.clients)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if child.poll() is not None:
                raise SystemExit(f"the server exited with code {child.returncode} before it was ready")
            if health_ok(url):
                break
            time.sleep(0.1)
        else:
            raise SystemExit("the server did not answer /health within 60 s")
        row = asyncio.run(drive(url, a, child.pid))
    finally:
        child.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown (a profile, if any, is written)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    C.print_table("HTTP server host cost per streamed token (scripted model, no GPU work)", [row], list(row))


if __name__ == "__main__":
    main()
