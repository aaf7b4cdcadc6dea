"""Fork/join of an independent branch of a layer onto a second CUDA stream.

At decode batch sizes a DSA/MoE layer is a chain of small kernels, most of them latency-bound (a few
microseconds of launch, ramp and tail each). Two branches of a layer do not depend on each other until a
join point: the DSA indexer's query half (``wq_b``, scoring with the query rope, top-k; its key store and head
weights run on the main stream first, :meth:`Forked.then`) and MLA's own query path (``q_b_proj``, rope + latent
store, the W_UK absorption) meet only at sparse attention; the shared expert and
the routed experts (router, grouped top-k, fused MoE) meet only at the sum. Running one branch on a side
stream lets the GPU overlap their latencies; inside a CUDA graph the two streams become parallel branches of
the graph (the fork/join pattern CUDA stream capture records as graph edges). SGLang overlaps the same two
pairs in its DeepSeek model for the same reason.

The result is bitwise the same as running the branches one after the other: the same kernels read the same
inputs; only their scheduling changes (``tests/gpu/test_models_gpu.py`` checks it).

Memory safety with the caching allocator: a branch's tensors are allocated from the side stream's pool, and
the caller must keep every tensor the branch reads alive until :meth:`Forked.join` returns (locals of the
calling ``forward`` are); the side stream waits for the main stream's earlier work at every fork, so a block
freed after a join is never reused before its last reader ran.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def aux_stream_for(device: torch.device | str) -> torch.cuda.Stream | None:
    """The side stream a model on ``device`` forks independent branches onto, or None to run them in order.

    None on CPU, with the torch reference op backend (it synchronises with the host anyway), and with
    ``ATOMTOOL_DUAL_STREAM=0`` (for A/B measurements). Read once when the model is built.
    """
    from atomtool.serve.ops import backend_for

    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("ATOMTOOL_DUAL_STREAM", "1") == "0":
        return None
    if backend_for(device) == "torch":
        return None
    return torch.cuda.Stream(device)


@dataclass
class Forked:
    """A branch started by :func:`fork`: ``join()`` makes the current stream wait for it and returns its result."""

    result: Any
    main: torch.cuda.Stream | None = None
    side: torch.cuda.Stream | None = None

    def join(self) -> Any:
        if self.main is not None:
            self.main.wait_stream(self.side)
        return self.result

    def then(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Forked:
        """Continue the branch with ``fn(result, *args, **kwargs)`` on the side stream, after everything queued
        on the main stream so far (what the branch's next step reads from it); returns the continued branch.
        Without a side stream ``fn`` runs now, in order."""
        if self.main is None:
            return Forked(fn(self.result, *args, **kwargs))
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            out = fn(self.result, *args, **kwargs)
        return Forked(out, self.main, self.side)


def fork(stream: torch.cuda.Stream | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Forked:
    """Run ``fn(*args, **kwargs)`` on ``stream`` after everything already queued on the current stream.

    The host runs ``fn`` now (its kernels are queued on ``stream``); the caller then queues the other branch
    on the current stream and calls ``.join()`` before it uses the result. ``stream`` None: ``fn`` runs on
    the current stream and ``join`` is a no-op (CPU, or dual streams turned off).
    """
    if stream is None:
        return Forked(fn(*args, **kwargs))
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        out = fn(*args, **kwargs)
    return Forked(out, main, stream)
