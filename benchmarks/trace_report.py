"""Where a profiled decode step's time goes, from a torch.profiler chrome trace (issue 7: find the gap).

``decode_bench --profile`` exports the trace of three CUDA-graph replays; this module reads it and writes a
report. Per-kernel *durations* mislead there: under programmatic dependent launch (PDL) a kernel starts while
its predecessor drains and its recorded duration includes the wait, and the side stream runs kernels
concurrently. So each instant of the step is charged to one kernel: of those running then, the one that ends
first (under PDL the kernel still working, not the next one waiting for it). A kernel's *exposed* time is what
it was charged; the exposed times of a step add up to its busy time (the union of all kernels' intervals).
Two streams' kernels that overlap split the overlap by that rule, so this is an attribution, not a critical
path. The report lists exposed time per kernel name, the idle time (no kernel on any stream), and one
layer's timeline, a layer being the span between two launches of a marker kernel (default
``_add_rms_norm_kernel``, the residual add + norm that opens every layer after the first).

    python -m benchmarks.trace_report TRACE.json[.gz] [--marker NAME] [--layer N]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

#: chrome-trace categories that are work on the GPU
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class TraceError(ValueError):
    """A trace file that cannot be read as a chrome trace, or a layer that is not in it."""


@dataclass(frozen=True)
class Kernel:
    """One GPU activity: name, start and end in microseconds (trace clock), stream (trace ``tid``)."""

    name: str
    start: float
    end: float
    stream: object


def load_kernels(path: str | Path) -> list[Kernel]:
    """GPU kernels / copies / sets of a chrome trace (plain or .gz JSON: ``{"traceEvents": [...]}`` or the
    bare event list), sorted by start. Raises TraceError for a missing, unreadable or malformed file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not a readable JSON trace ({type(exc).__name__}: {exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceError(f"{path}: not a chrome trace (expected {{\"traceEvents\": [event objects]}} or a list "
                         "of event objects)")
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            try:
                start = float(e["ts"])
                out.append(Kernel(str(e.get("name", "?")), start, start + float(e["dur"]), e.get("tid", 0)))
            except (KeyError, TypeError, ValueError):
                raise TraceError(f"{path}: GPU event without a numeric ts / dur: {json.dumps(e)[:200]}") from None
    return sorted(out, key=lambda k: k.start)


def split_steps(kernels: list[Kernel], gap_us: float = 200.0) -> list[list[Kernel]]:
    """Runs of kernels separated by more than ``gap_us`` with nothing running (one graph replay each)."""
    steps: list[list[Kernel]] = []
    frontier = None
    for k in kernels:
        if frontier is None or k.start - frontier > gap_us:
            steps.append([])
        steps[-1].append(k)
        frontier = k.end if frontier is None else max(frontier, k.end)
    return steps


def exposed_times(step: list[Kernel]) -> list[tuple[Kernel, float]]:
    """(kernel, exposed microseconds) for every kernel of ``step``, in its order: each interval between two
    consecutive start/end times is charged to the running kernel that ends first (see the module doc), so
    the values sum to the step's busy time. O(kernels x boundaries): a step has a few hundred kernels."""
    charged = [0.0] * len(step)
    times = sorted({t for k in step for t in (k.start, k.end)})
    for t0, t1 in zip(times, times[1:], strict=False):
        running = [i for i, k in enumerate(step) if k.start <= t0 and k.end >= t1]
        if running:
            charged[min(running, key=lambda i: (step[i].end, i))] += t1 - t0
    return list(zip(step, charged, strict=True))


def summarize(step: list[Kernel]) -> dict:
    """Span, busy (union) and idle microseconds of a step, and exposed microseconds per kernel name."""
    span = max(k.end for k in step) - min(k.start for k in step)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy = 0.0
    for k, t in exposed_times(step):
        per_name[k.name][0] += 1
        per_name[k.name][1] += t
        busy += t
    return {"kernels": len(step), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "per_name": {n: (int(c), t) for n, (c, t) in per_name.items()}}


def layer_spans(step: list[Kernel], marker: str, every: int = 1) -> list[tuple[float, float]]:
    """[start, end) of each layer: from one launch of ``marker`` to the ``every``-th next (the last ends at
    the step's end); ``every`` 2 where the marker runs twice per layer (the DSA models' two residual norms)."""
    starts = [k.start for k in step if k.name == marker][::every]
    end = max(k.end for k in step)
    return [(s, starts[i + 1] if i + 1 < len(starts) else end) for i, s in enumerate(starts)]


def _short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report(path: str | Path, marker: str = "_add_rms_norm_kernel", layer: int | None = None, top: int = 25,
           every: int = 1) -> str:
    """Text report of the fullest step (most kernels; the last of equals) of the trace at ``path`` (a graph
    replay; partial ones at the profile's edges have fewer kernels): totals, exposed time per kernel name (the
    ``top`` largest), and the timeline of layer ``layer`` (default: the middle one of those the marker
    delimits; "layer 0" is the span after the marker's first launch, i.e. the model's second layer) with each
    kernel's start, end and exposed time relative to the layer's start; ``every``: marker launches per layer
    (:func:`layer_spans`). Raises TraceError (see
    :func:`load_kernels`) and for a ``layer`` out of range."""
    steps = split_steps(load_kernels(path))
    if not steps:
        return f"{path}: no GPU kernels in the trace"
    step = max(reversed(steps), key=len)
    s = summarize(step)
    lines = [f"{path}: {len(steps)} step(s); the fullest: {s['kernels']} kernels, span {s['span_us']:.1f} us, "
             f"busy {s['busy_us']:.1f} us, idle {s['idle_us']:.1f} us (no kernel on any stream)",
             "", f"{'exposed us':>10} {'n':>4} {'per call':>8}  kernel"]
    for name, (n, t) in sorted(s["per_name"].items(), key=lambda x: -x[1][1])[:top]:
        lines.append(f"{t:10.1f} {n:4d} {t / n:8.1f}  {_short(name)}")
    spans = layer_spans(step, marker, every)
    if not spans:
        lines += ["", f"no kernel named {marker} in the step: no layer timeline (see --marker)"]
    else:
        i = len(spans) // 2 if layer is None else layer
        if not 0 <= i < len(spans):
            raise TraceError(f"layer {i} out of range: the step has {len(spans)} layers delimited by {marker} "
                             f"(0..{len(spans) - 1})")
        lo, hi = spans[i]
        lines += ["", f"layer {i} of {len(spans)} ({marker} to the next): {hi - lo:.1f} us",
                  f"{'start':>7} {'end':>7} {'exposed':>7}  kernel"]
        for k, t in exposed_times(step):
            if lo <= k.start < hi:
                lines.append(f"{k.start - lo:7.1f} {k.end - lo:7.1f} {t:7.1f}  {_short(k.name)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--marker", default="_add_rms_norm_kernel", help="the kernel that opens each layer")
    ap.add_argument("--layer", type=int, default=None, help="which layer's timeline (default: the middle one)")
    ap.add_argument("--every", type=int, default=1,
                    help="marker launches per layer (2 for a DSA model whose two residual norms are both the marker)")
    args = ap.parse_args(argv)
    try:
        print(report(args.trace, args.marker, args.layer, every=args.every))
    except TraceError as exc:
        raise SystemExit(f"error: {exc}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
