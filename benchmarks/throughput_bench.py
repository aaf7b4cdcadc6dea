"""Offline throughput on nano-vllm's mixed workload, against transformers' own batched generate (benchmark 3).

Workload (nano-vllm ``bench.py``): 256 requests, prompt length and output length each uniform in
[100, 1024], prompt tokens uniform in [0, 10000), ``ignore_eos`` (every request produces exactly its output
length), temperature 0.6. Models: Qwen3-0.6B-shaped and a small DeepSeek-V3.2-style model (MLA + DSA + MoE),
random weights written once with transformers' ``save_pretrained`` to a temporary directory, so both engines
load the same checkpoint.

- ours: ``load_model`` + ``LLMEngine`` (continuous batching, chunked prefill, decode CUDA graphs), all 256
  requests queued at once, ``step()`` until done. Output tokens/s = sum of output lengths / wall time.
  TTFT / TPOT per request are taken from the same offline run (request queued at t0).
- transformers: ``generate`` on a subset (the first ``--hf-requests`` requests of the same list, so the same
  length distribution), one left-padded batch, ``max_new_tokens = min_new_tokens =`` the subset's longest
  output. Its useful output tokens/s counts each request's own output length only; the raw rate (batch x
  steps) is reported beside it.

Run: ``python -m benchmarks.throughput_bench [--model qwen3|dsa|all] [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common as C


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs, lengths uniform in [lo, hi], ids uniform in [0, min(vocab, 10000))."""
    rng = random.Random(seed)
    top = min(vocab, 10000) - 1
    return [([rng.randint(0, top) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)]


def write_checkpoint(raw_config: dict, path: Path, device: torch.device, seed: int = 0) -> int:
    """A random transformers model of ``raw_config`` written with ``save_pretrained``; returns its bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in raw_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_cfg = AutoConfig.for_model(raw_config["model_type"], **cfg)
    hf_cfg.architectures = raw_config["architectures"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return n


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}

    def q(p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {"p50": q(50), "p90": q(90), "p99": q(99), "mean": statistics.fmean(xs)}


def run_ours(path: Path, work, device: torch.device, *, max_model_len: int, enforce_eager: bool,
             max_num_batched_tokens: int) -> dict:
    from atomtool.serve.engine.llm_engine import LLMEngine
    from atomtool.serve.loader import load_model
    from atomtool.serve.sampling_params import SamplingParams

    t_load = time.perf_counter()
    loaded = load_model(path, dtype="bfloat16", device=device)
    engine = LLMEngine(loaded.model, None, loaded.config, device=loaded.device, model_dir=loaded.model_dir,
                       max_model_len=max_model_len, max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens,
                       gpu_memory_utilization=0.85, enforce_eager=enforce_eager)
    C.sync(device)
    ready_s = time.perf_counter() - t_load
    graphs = engine.runner.graphs is not None
    # warm-up, untimed (nano-vllm does one short request): the first 16 prompts of the workload, 4 tokens each,
    # so Triton compiles the prefill kernels for batched prompts of these lengths before the clock starts
    # (session 4 measured the small DSA model at 7,795 tok/s with that compile inside the timed run, 31,259
    # tok/s with a warm kernel cache)
    for i, (ids, _n) in enumerate(work[:16]):
        engine.add_request(f"warm{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    C.sync(device)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    ntok: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, (ids, n) in enumerate(work):
        # delta outputs, as the server streams them: a step builds only its new tokens' output
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.6,
                                                       output_kind="delta"))
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
                ntok[o.request_id] = o.num_output_tokens
    C.sync(device)
    wall = time.perf_counter() - t0
    out_tokens = sum(ntok.values())
    expected = sum(n for _, n in work)
    ttft = [first[r] - t0 for r in first]
    tpot = [(done[r] - first[r]) / (ntok[r] - 1) for r in done if ntok[r] > 1]
    stats = engine.stats()
    del engine, loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"wall_s": wall, "output_tokens": out_tokens, "expected_tokens": expected, "tok_s": out_tokens / wall,
            "steps": steps, "ready_s": ready_s, "cuda_graphs": graphs, "preemptions": stats["num_preemptions"],
            "ttft_s": percentiles(ttft), "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpot).items()}}


def run_hf(path: Path, work, device: torch.device, max_time: float | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
    longest = max(len(ids) for ids, _ in work)
    max_new = max(n for _, n in work)
    pad = 0
    ids = torch.full((len(work), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(work), longest), dtype=torch.long)
    for i, (p, _) in enumerate(work):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, min_new_tokens=4, **kw)
        C.sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             max_time=max_time, **kw)
        C.sync(device)
        wall = time.perf_counter() - t0
    generated = out.shape[1] - longest
    # each request's own output length, or what was generated before max_time stopped the batch
    useful = sum(min(n, generated) for _, n in work)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"wall_s": wall, "requests": len(work), "max_new_tokens": max_new, "generated_steps": generated,
            "stopped_by_max_time": generated < max_new,
            "useful_tokens": useful, "tok_s": useful / wall, "raw_tok_s": len(work) * generated / wall}


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` ids (``w0`` .. ``w{vocab-1}``) saved beside the checkpoint, so
    ``atomtool serve`` can start and every sampled id detokenizes to a non-empty piece (one stream chunk per
    token). Prompts are sent as token ids, so its vocabulary never has to mean anything."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(path))


def run_http(path: Path, work, device: torch.device, *, clients: int, max_model_len: int, smoke: bool,
             startup_timeout: float = 300.0) -> dict:
    """TTFT / TPOT / throughput through ``atomtool serve`` (a child process) with ``clients`` concurrent
    streaming OpenAI clients taking requests from the workload in order (``/v1/completions``, token-id prompts,
    ``ignore_eos``). TTFT = first streamed chunk - request sent; TPOT = (last - first chunk) / (tokens - 1)."""
    import asyncio
    import socket
    import subprocess
    import sys
    import urllib.request

    import openai

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-c", "from atomtool.cli import main; main()", "serve", str(path), "--port", str(port),
           "--max-model-len", str(max_model_len), "--max-num-batched-tokens", "16384", "--dtype", "bfloat16"]
    if smoke:
        cmd += ["--device", "cpu", "--kv-cache-memory", str(256 << 20)]
    proc = subprocess.Popen(cmd)
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"atomtool serve exited with {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > startup_timeout:
                raise RuntimeError("atomtool serve did not become ready in time")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t0
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                    timeout=3600)
        queue = list(range(len(work)))
        ttft: list[float] = []
        tpot: list[float] = []
        tokens = [0]

        async def one(i: int, cap: int | None = None) -> None:
            ids, n = work[i]
            t_send = time.perf_counter()
            first = last = None
            chunks = 0
            stream = await client.completions.create(
                model=str(path), prompt=ids, max_tokens=n if cap is None else min(n, cap), temperature=0.6,
                stream=True,
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
            if first is not None:
                ttft.append(first - t_send)
                if chunks > 1:
                    tpot.append((last - first) / (chunks - 1))
            tokens[0] += chunks

        async def worker() -> None:
            while queue:
                await one(queue.pop(0))

        async def main() -> float:
            # warm-up (not counted): 16 concurrent requests, so the server's first batched prefills compile
            # Triton's kernels before the clock starts; then the first request alone
            await asyncio.gather(*(one(i, cap=4) for i in range(min(16, len(work)))))
            await one(0)
            ttft.clear()
            tpot.clear()
            tokens[0] = 0
            queue.remove(0)
            t = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            return time.perf_counter() - t

        wall = asyncio.run(main())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"clients": clients, "requests": len(work) - 1, "wall_s": wall, "streamed_chunks": tokens[0],
            "expected_tokens": sum(n for _, n in work[1:]),
            "tok_s": tokens[0] / wall, "server_ready_s": ready_s, "ttft_s": percentiles(ttft),
            "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpot).items()}}


def run_model(name: str, args, device: torch.device) -> dict:
    smoke = args.smoke
    raw = {"qwen3": C.qwen3_config, "dsa": C.small_dsa_config}[name](smoke=smoke)
    n_req = 8 if smoke else args.requests
    lo, hi = (10, 40) if smoke else (100, 1024)
    work = make_workload(n_req, lo, hi, raw["vocab_size"])
    hf_n = min(n_req, 4 if smoke else (args.hf_requests if name == "qwen3" else args.hf_requests_dsa))
    with tempfile.TemporaryDirectory(prefix=f"atomtool-{name}-") as tmp:
        nbytes = write_checkpoint(raw, Path(tmp), device)
        if args.http:
            write_tokenizer(Path(tmp), raw["vocab_size"])
            http = run_http(Path(tmp), work, device, clients=min(args.clients, n_req), max_model_len=2 * hi + 16,
                            smoke=smoke)
            print(f"[{name}] http: {http}", flush=True)
            return C.record("throughput_http", model=name, lengths=[lo, hi], **http)
        if args.skip_ours:
            ours = {"tok_s": float("nan"), "ttft_s": {}, "tpot_ms": {}, "skipped": True}
        else:
            ours = run_ours(Path(tmp), work, device, max_model_len=2 * hi + 16, enforce_eager=smoke or args.eager,
                            max_num_batched_tokens=16384)
            print(f"[{name}] ours: {ours['tok_s']:.0f} output tok/s ({ours['output_tokens']} tokens, "
                  f"{ours['wall_s']:.1f} s, {ours['steps']} steps)", flush=True)
            C.record("throughput_ours", model=name, requests=n_req, lengths=[lo, hi], **ours)  # kept if HF hangs
        try:
            hf = run_hf(Path(tmp), work[:hf_n], device, args.hf_max_time)
        except Exception as exc:  # the baseline failing must not lose our numbers; the row says why
            hf = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print(f"[{name}] transformers: {hf}", flush=True)
    ratio = ours["tok_s"] / hf["tok_s"] if "tok_s" in hf else None
    return C.record("throughput", model=name, checkpoint_GB=nbytes / 1e9, requests=n_req, lengths=[lo, hi],
                    ours=ours, transformers=hf, speedup=ratio, goal_10x_met=(ratio or 0) >= 10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["qwen3", "dsa", "all"])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="transformers subset (Qwen3)")
    ap.add_argument("--hf-requests-dsa", type=int, default=16, help="transformers subset (DSA model)")
    ap.add_argument("--hf-max-time", type=float, default=None,
                    help="stop transformers' generate after this many seconds (its tokens/s counts what it made)")
    ap.add_argument("--skip-ours", action="store_true", help="only the transformers baseline")
    ap.add_argument("--http", action="store_true",
                    help="only TTFT/TPOT through `atomtool serve` under --clients streaming OpenAI clients")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="ours without CUDA graphs")
    args = ap.parse_args(argv)
    device = C.pick_device(args.smoke)
    print("env", C.env_info(device), flush=True)
    rows = []
    for name in (["qwen3", "dsa"] if args.model == "all" else [args.model]):
        r = run_model(name, args, device)
        if args.http:
            rows.append({"model": name, "ours_tok_s": r["tok_s"], "ttft_p50_s": r["ttft_s"].get("p50"),
                         "ttft_p99_s": r["ttft_s"].get("p99"), "tpot_p50_ms": r["tpot_ms"].get("p50"),
                         "tpot_p99_ms": r["tpot_ms"].get("p99")})
            continue
        hf = r["transformers"]
        rows.append({"model": name, "ours_tok_s": r["ours"]["tok_s"], "hf_tok_s": hf.get("tok_s"),
                     "hf_subset": hf.get("requests"), "speedup": r["speedup"],
                     "ttft_p50_s": r["ours"]["ttft_s"].get("p50"), "ttft_p99_s": r["ours"]["ttft_s"].get("p99"),
                     "tpot_p50_ms": r["ours"]["tpot_ms"].get("p50"), "tpot_p99_ms": r["ours"]["tpot_ms"].get("p99")})
    C.print_table("throughput (output tokens/s)", rows, ["model", "ours_tok_s", "hf_tok_s", "hf_subset", "speedup",
                                                         "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
