"""CPU proxy for the number of GPU kernels one decode step launches (issue 7: kernel count per step).

On an H200 a batch-1 decode step replayed from a CUDA graph is bound by hundreds of tiny kernels (1-3 us
each even inside a graph): copies, fills, aranges, casts, adds. Most of them are the *glue* torch code of
the model and layer modules around the named ops (``rms_norm``, ``linear``, ``mla_attention``, ...), which
is backend independent. This script counts, for one decode step of a tiny DeepSeek-V3.2-shaped model on
CPU (torch reference backend):

- ``glue``: aten ops executed by the model/layer code *outside* the named ops, seen through a
  :class:`torch.utils._python_dispatch.TorchDispatchMode`, split into ops that launch a kernel on a GPU
  (copies, casts, elementwise, fills, GEMMs, ...) and ops that do not (views, ``empty`` allocations);
- ``op calls``: calls of the dispatch's named ops (each is at least one kernel on the Triton backend; what
  happens inside them is the backend's business, so the reference's internals are not counted);
- ``host syncs``: ``.item()``-like ops in the glue (must stay 0: decode is captured in a CUDA graph).

Counts are attributed to the innermost tracked module (embedding, per-layer attention by DSA role,
dense MLP / MoE, the layer norms, the final norm, lm_head) or to ``model`` for code in the model's own
forward (residual adds, rotary tables).

The step: every sequence has more cached tokens than ``index_topk`` (the path decode CUDA graphs capture:
indexer + sparse MLA). Run: ``python -m benchmarks.op_count [--model dsv32|small_dsa|qwen3] [--batch N]``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import common as C

#: (glue kernel ops, named-op calls) per batch-1 decode step before the issue-7 kernel-count work (commit
#: 095726f), for the before/after line
BEFORE = {"dsv32": (92, 102), "small_dsa": (46, 41), "qwen3": (16, 27)}
#: aten ops that launch no GPU kernel: views / metadata and uninitialised allocations
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "permute", "transpose", "t",
    "expand", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "empty", "empty_strided",
    "empty_like", "new_empty", "new_empty_strided", "split", "split_with_sizes", "unbind", "view_as_real",
    "view_as_complex", "narrow", "lift_fresh", "diagonal", "unfold", "chunk", "_neg_view", "_conj",
}
#: aten ops that read a device value on the host (forbidden in a captured decode step)
HOST_SYNC = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


@dataclass
class StepCounts:
    """Counts of one decode step. ``glue[(scope, aten op)]``: kernel-launching aten ops outside the named
    ops; ``views[scope]``: kernel-free aten ops; ``ops[(scope, op name)]``: named-op calls;
    ``syncs``: host-syncing aten ops outside the named ops; ``layers``: scope -> number of layers in it."""

    glue: Counter = field(default_factory=Counter)
    views: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    layers: Counter = field(default_factory=Counter)

    def total_glue(self) -> int:
        return sum(self.glue.values())

    def total_ops(self) -> int:
        return sum(self.ops.values())

    def total_kernels(self) -> int:
        """Kernel-launching glue ops + named-op calls: the proxy for GPU kernels per step."""
        return self.total_glue() + self.total_ops()

    def by_scope(self) -> dict[str, tuple[int, int, int]]:
        """scope -> (glue kernels, op calls, views) per step."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for (scope, _), n in self.glue.items():
            out[scope][0] += n
        for (scope, _), n in self.ops.items():
            out[scope][1] += n
        for scope, n in self.views.items():
            out[scope][2] += n
        return {k: tuple(v) for k, v in sorted(out.items())}


class _Counter(TorchDispatchMode):
    def __init__(self, counts: StepCounts, scope: list[str], inside_op: list[int]):
        super().__init__()
        self.counts, self.scope, self.inside_op = counts, scope, inside_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # composite ops (to, einsum, linear, cat of views, ...): count what they run, not the op itself
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not self.inside_op[0]:
            name = func.overloadpacket.__name__
            scope = self.scope[-1]
            if name in HOST_SYNC:
                self.counts.syncs[(scope, name)] += 1
            if name in NO_KERNEL:
                self.counts.views[scope] += 1
            else:
                self.counts.glue[(scope, name)] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_ops(counts: StepCounts, scope: list[str], inside_op: list[int]) -> Iterator[None]:
    """Wrap every registered op of the dispatch (and the reference fallbacks) so that its calls are counted
    under the current scope and its internals are not. Must wrap *model construction* too: layers keep the
    functions ``get_op`` returned."""
    from atomtool.serve import ops
    from atomtool.serve.ops import torch_ref, torch_ref_mla  # noqa: F401  (registers the MLA ops)

    saved = dict(ops._REGISTRY)

    def wrap(name, fn):
        def counted(*a, **k):
            if not inside_op[0]:
                counts.ops[(scope[-1], name)] += 1
            inside_op[0] += 1
            try:
                return fn(*a, **k)
            finally:
                inside_op[0] -= 1
        return counted

    names = set(ops.OP_NAMES) | {n for n, _ in saved}
    for name in names:
        fn = saved.get((name, "torch")) or getattr(torch_ref, name)
        ops._REGISTRY[(name, "torch")] = wrap(name, fn)
    try:
        yield
    finally:
        ops._REGISTRY.clear()
        ops._REGISTRY.update(saved)


def _scopes(model) -> dict[torch.nn.Module, str]:
    """Tracked module -> scope name (layer kinds, not layer indices, so layers of a kind aggregate)."""
    from atomtool.serve.layers.moe import DeepseekMoE

    out: dict[torch.nn.Module, str] = {}
    inner = model.model
    roles = getattr(model, "roles", None)
    for name in ("embed_tokens", "norm"):
        if hasattr(inner, name):
            out[getattr(inner, name)] = f"model.{name}"
    out[model.lm_head] = "lm_head"
    for i, layer in enumerate(inner.layers):
        attn_kind = f"attn[{roles[i]}]" if roles else "attn"
        mlp_kind = "mlp[moe]" if isinstance(layer.mlp, DeepseekMoE) else "mlp[dense]"
        out[layer.self_attn] = attn_kind
        out[layer.mlp] = mlp_kind
        out[layer.input_layernorm] = "layer norms"
        out[layer.post_attention_layernorm] = "layer norms"
    return out


def count_decode_step(model, batch, kv_caches, counts: StepCounts, scope: list[str],
                      inside_op: list[int]) -> torch.Tensor:
    """Run ``compute_logits(model(batch)[logits_indices])`` once, counting into ``counts``."""
    scopes = _scopes(model)
    for s in scopes.values():
        counts.layers[s] += 1
    hooks = []
    for mod, s in scopes.items():
        hooks.append(mod.register_forward_pre_hook(lambda m, a, s=s: scope.append(s) and None))
        hooks.append(mod.register_forward_hook(lambda m, a, o: scope.pop() and None))
    try:
        with torch.inference_mode(), _Counter(counts, scope, inside_op):
            hidden = model(batch, kv_caches)
            scope.append("logits")
            out = model.compute_logits(hidden[batch.logits_indices])
            scope.pop()
    finally:
        for h in hooks:
            h.remove()
    return out


def model_config(name: str) -> dict:
    """The raw config of a named proxy model (tiny widths, real structure)."""

    if name == "dsv32":  # the H200 benchmark's structure: dense layers, then MoE; DSA full on every layer
        return C.dsv32_config(5, first_dense=2, smoke=True)
    if name == "small_dsa":
        return C.small_dsa_config(smoke=True)
    if name == "qwen3":
        return C.qwen3_config(smoke=True)
    raise ValueError(f"unknown model {name!r}")


def measure(name: str = "dsv32", batch: int = 1, fp8: bool | None = None, seed: int = 0) -> StepCounts:
    """Counts of one decode step of model ``name`` (bfloat16; FP8 block linears for ``dsv32`` by default)
    at ``batch`` sequences, each with more cached tokens than ``index_topk``."""

    torch.manual_seed(seed)
    cfg = model_config(name)
    fp8 = (name == "dsv32") if fp8 is None else fp8
    counts, scope, inside_op = StepCounts(), ["model"], [0]
    with counting_ops(counts, scope, inside_op):
        model, flat = C.build_random_model(cfg, torch.device("cpu"), fp8=fp8, seed=seed)
        ctx = int(flat.get("index_topk", 32)) + 8
        block_size = 16
        runner, pool = C.make_runner(model, torch.device("cpu"), num_blocks=batch * (-(-ctx // block_size)) + 2,
                                     block_size=block_size, max_model_len=ctx + 16, graph_sizes=None)
        C.fill_cache_random_(pool, seed)
        seqs = C.fake_sequences(batch, ctx, block_size, int(flat["vocab_size"]), seed=seed)
        step = runner.prepare(C.scheduler_output(seqs))
        count_decode_step(model, step, pool.caches, counts, scope, inside_op)
    return counts


def report(counts: StepCounts, title: str) -> str:
    lines = [f"{title}: {counts.total_kernels()} kernels/step proxy = {counts.total_glue()} glue aten ops + "
             f"{counts.total_ops()} named-op calls (host syncs in glue: {sum(counts.syncs.values())})",
             f"  {'scope':<16}{'layers':>7}{'glue':>7}{'ops':>6}{'views':>7}{'glue/layer':>12}{'ops/layer':>11}"]
    for scope, (g, o, v) in counts.by_scope().items():
        n = counts.layers.get(scope, 0)
        per = (f"{g / n:>12.1f}{o / n:>11.1f}" if n > 1 and scope != "layer norms" else "")
        lines.append(f"  {scope:<16}{n or '':>7}{g:>7}{o:>6}{v:>7}{per}")
    agg: Counter = Counter()
    for (_, op), n in counts.glue.items():
        agg[op] += n
    lines.append("  glue aten ops: " + ", ".join(f"{op} {n}" for op, n in agg.most_common()))
    ops_agg: Counter = Counter()
    for (_, op), n in counts.ops.items():
        ops_agg[op] += n
    lines.append("  named ops: " + ", ".join(f"{op} {n}" for op, n in ops_agg.most_common()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all", choices=["all", "dsv32", "small_dsa", "qwen3"])
    p.add_argument("--batch", type=C.positive_int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = ["dsv32", "small_dsa", "qwen3"] if args.model == "all" else [args.model]
    for name in names:
        counts = measure(name, args.batch)
        print(report(counts, f"{name} decode step, batch {args.batch}"))
        glue, calls = BEFORE[name]
        print(f"  before -> now: {glue + calls} -> {counts.total_kernels()} kernels/step proxy "
              f"(glue {glue} -> {counts.total_glue()}, named-op calls {calls} -> {counts.total_ops()})")


if __name__ == "__main__":
    main()
