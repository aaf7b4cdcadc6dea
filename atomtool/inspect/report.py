"""Render an :class:`~atomtool.inspect.types.InspectReport`: JSON (docs/INSPECT_SCHEMA.md) or rich tables.

Tables fit a screen: repeated modules collapse into name patterns with numeric ranges
(``model.layers.{3..60}.mlp.experts.{0..255}.down_proj``; ``{0..2,6..74:4}`` = 0,1,2 and 6 to 74 in steps
of 4), findings collapse per code and severity (each distinct message still printed).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from atomtool.inspect.types import Finding, InspectReport

SCHEMA_VERSION = 1
#: console width when stdout is not a terminal (pipe, file) and COLUMNS is unset: rich would use 80 and
#: wrap module names mid-word; tables still take only the width their content needs
PIPE_WIDTH = 200
_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


# ----------------------------------------------------------------------------- JSON


def to_json(report: InspectReport, *, show_tensors: bool = False) -> dict[str, Any]:
    """The ``--json`` object (schema: docs/INSPECT_SCHEMA.md). Keys: source, architecture, model_type,
    family, servable, config_flat, dsa, modules, totals, memory, findings (+ ``tensors`` with --tensors)."""
    dsa = None
    if report.dsa is not None:
        d = report.dsa
        dsa = {"index_topk": d.index_topk, "index_n_heads": d.index_n_heads, "index_head_dim": d.index_head_dim,
               "index_rope_dim": d.index_rope_dim,
               "layers": [{"layer": i, "role": r} for i, r in enumerate(d.roles)]}
    out: dict[str, Any] = {
        "source": report.source,
        "architecture": report.architecture,
        "model_type": report.model_type,
        "family": report.family,
        "servable": report.servable,
        "config_flat": report.config_flat,
        "dsa": dsa,
        "modules": [{"name": m.name, "scheme": m.scheme, "dtype": m.dtype, "shape": list(m.shape),
                     "declared_quantized": m.declared_quantized, "treated_as": m.treated_as}
                    for m in report.modules],
        "totals": {k: report.totals.get(k) for k in ("parameters", "bytes", "by_dtype", "by_scheme")},
        "memory": dict(report.memory),
        "findings": [{"code": f.code, "severity": f.severity, "module": f.module, "message": f.message}
                     for f in report.findings],
    }
    if show_tensors:
        out["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                           "file": t.file}
                          for t in sorted(report.tensors.values(), key=lambda t: _natural(t.name))]
    return out


# ----------------------------------------------------------------------------- patterns


def _natural(s: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def format_ints(values: list[int]) -> str:
    """Compress sorted distinct ints into runs: ``[0,1,2,6,10,14]`` -> ``0..2,6..14:4``; a single value
    stays bare. Arithmetic runs of >= 3 values collapse (``a..b`` for step 1, ``a..b:s`` otherwise)."""
    vals = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        if i + 1 < len(vals):
            step = vals[i + 1] - vals[i]
            while j + 1 < len(vals) and vals[j + 1] - vals[j] == step:
                j += 1
            if j - i >= 2:
                parts.append(f"{vals[i]}..{vals[j]}" + ("" if step == 1 else f":{step}"))
                i = j + 1
                continue
        parts.append(str(vals[i]))
        i += 1
    return ",".join(parts)


def collapse(names: list[str]) -> str:
    """One pattern for names that differ only in numeric path components:
    ``model.layers.{1..3}.mlp.experts.{0..7}.down_proj``."""
    if len(names) == 1:
        return names[0]
    template = _NUM.sub("#", names[0])
    cols: list[list[int]] = []
    for n in names:
        nums = [int(x) for x in _NUM.findall(n)]
        for i, v in enumerate(nums):
            if i == len(cols):
                cols.append([])
            cols[i].append(v)
    out = template
    for col in cols:
        vals = sorted(set(col))
        out = out.replace("#", vals[0].__str__() if len(vals) == 1 else "{" + format_ints(vals) + "}", 1)
    return out


def group_by_pattern(items: list[tuple[str, tuple]]) -> list[tuple[str, int, tuple]]:
    """Group ``(name, attrs)`` by (name template, attrs) -> [(pattern, count, attrs)] in natural order."""
    groups: dict[tuple[str, tuple], list[str]] = defaultdict(list)
    for name, attrs in items:
        groups[(_NUM.sub("#", name), attrs)].append(name)
    rows = [(collapse(sorted(ns, key=_natural)), len(ns), attrs, ns[0]) for (_, attrs), ns in groups.items()]
    rows.sort(key=lambda r: _natural(r[3]))
    return [(p, c, a) for p, c, a, _ in rows]


# ----------------------------------------------------------------------------- rich


def human_bytes(n: float | None) -> str:
    """``n`` bytes in binary units (``512 B``, ``117.74 KiB``, ``1.40 GiB``; ``?`` for None): the one size format
    every atomtool command prints."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


#: a layer/expert index in a message, as a path component (``model.layers.3:``, ``experts.7.w2``) or in prose
#: (``layer 3``): differs between findings of one group without changing what they say
_PATH_NUM = re.compile(r"(?<=\.)\d+\b")
_LAYER_WORD = re.compile(r"\b(layers?|experts?) \d+\b")
#: distinct warning/info messages printed per collapsed group (errors: all of them)
MAX_MESSAGES = 5


def _gist(message: str) -> str:
    """A finding message with its layer/expert numbers masked: two messages with the same gist say the same
    thing about different layers (``model.layers.3.mlp`` / ``model.layers.7.mlp``)."""
    return _LAYER_WORD.sub(r"\1 #", _PATH_NUM.sub("#", message))


def distinct_messages(findings: list[Finding]) -> list[str]:
    """The messages of ``findings`` that differ in substance, not just in a layer number: the first of each
    :func:`_gist`, in order."""
    seen: dict[str, str] = {}
    for f in findings:
        seen.setdefault(_gist(f.message), f.message)
    return list(seen.values())


def collapse_findings(findings: list[Finding]) -> list[tuple[str, str, int, str, list[str]]]:
    """Group findings by (severity, code, module pattern): [(severity, code, count, modules, messages)],
    where messages are the group's :func:`distinct_messages` (one when they differ only in a layer number,
    e.g. ``config-invalid`` for two fields gives two)."""
    groups: dict[tuple[str, str, str], list[Finding]] = defaultdict(list)
    for f in findings:
        groups[(f.severity, f.code, _NUM.sub("#", f.module or ""))].append(f)
    rows = []
    for (sev, code, _), fs in groups.items():
        mods = [f.module for f in fs if f.module]
        rows.append((sev, code, len(fs), collapse(sorted(set(mods), key=_natural)) if mods else "",
                     distinct_messages(fs)))
    order = {"error": 0, "warning": 1, "info": 2}
    rows.sort(key=lambda r: (order.get(r[0], 3), r[1]))
    return rows


def make_console(file: Any = None) -> Console:
    """A rich Console for the report: the terminal's width on a terminal (or ``COLUMNS``), else
    :data:`PIPE_WIDTH` so piped output does not wrap at 80 columns."""
    console = Console(file=file)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(file=file, width=PIPE_WIDTH)
    return console


#: printed under tables that use :func:`format_ints` ranges
LAYER_LEGEND = "layer ranges: a..b = a to b; a..b:s = a to b in steps of s (6..74:4 = 6, 10, ..., 74)"


def layer_list(layers: list[int]) -> str:
    """Layer indices as comma-and-space separated runs (``0..2, 6..74:4``; :func:`format_ints`), so a long
    list wraps between runs in a table cell instead of being cut off."""
    return format_ints(layers).replace(",", ", ")


def _heading(console: Console, text: str) -> None:
    """A table's title on its own line. Not ``Table(title=...)``: rich folds a title to the table's width
    (a long checkpoint path broke mid-word over a narrow table) and pads it with blanks to that width;
    soft_wrap leaves a line longer than the terminal to the terminal."""
    console.print(Text(text, style="italic"), soft_wrap=True)


#: indentation of finding messages under their code line
INDENT = 8


def _print_indented(console: Console, msg: str, style: str = "") -> None:
    """One finding message, indented by :data:`INDENT`. On a terminal it wraps at word boundaries with a
    hanging indent (rich Padding); piped (not a terminal) it is printed as one plain line: rich pads
    Padding lines with spaces to the console width, which leaves ~200 columns of trailing blanks in a file."""
    if console.is_terminal:
        console.print(Padding(Text(msg, style=style), (0, 0, 0, INDENT), expand=False))
    else:
        console.print(Text(" " * INDENT + msg, style=style), soft_wrap=True)


def kv_detail(m: dict[str, Any]) -> str:
    """The breakdown of ``memory.kv_bytes_per_token``: full-attention layers x bytes per layer, plus index
    planes (DSA indexer keys and MiniMax-M3 sparse index keys, both in the KV dtype as the engine stores them)."""
    if not m["kv_layers"] and not m.get("index_layers"):  # Mistral-7B-v0.1: every layer sliding-window
        return "no full-attention layer"
    layers = "layer" if m["kv_layers"] == 1 else "layers"
    detail = f"{m['kv_layers']} {layers} x {m['kv_bytes_per_token_per_layer']} B ({m['kv_layout']}, {m['kv_dtype']})"
    if m.get("index_layers"):
        what = "indexer planes" if m["kv_layout"] == "mla" else "sparse index keys"
        detail += f" + {m['index_layers']} {what} x {m['index_bytes_per_token_per_layer']} B ({m['kv_dtype']})"
    return detail


def _window_cap_note(m: dict[str, Any], flat: dict[str, Any]) -> str:
    """``; sliding_window N exceeds max_position_embeddings`` when the config's window is longer than the
    model's context, so the sliding-window KV above is capped at ``max_position_embeddings`` tokens."""
    from atomtool.inspect.memory import effective_sliding_window

    window = effective_sliding_window(flat)
    if window is None or m.get("sliding_window") is None or window <= m["sliding_window"]:
        return ""
    return f"; sliding_window {window:,} exceeds max_position_embeddings {m['sliding_window']:,}"


def _module_patterns(r: InspectReport) -> list[str]:
    items = [(m.name, (m.scheme, m.dtype, m.shape, m.declared_quantized, m.treated_as)) for m in r.modules]
    return [p for p, _, _ in group_by_pattern(items)]


def render(report: InspectReport, console: Console | None = None, *, show_tensors: bool = False) -> None:
    """Print the report as rich tables: summary, DSA schedule, modules (collapsed), totals, memory, findings,
    and with ``show_tensors`` every tensor (one row each)."""
    console = console or Console()
    r = report
    _heading(console, f"atomtool inspect: {r.source}")
    summary = Table(show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("architecture", r.architecture)
    summary.add_row("model_type", r.model_type)
    summary.add_row("family", r.family)
    summary.add_row("servable", "yes" if r.servable else "no")
    cfg = r.config_flat
    summary.add_row("layers", str(cfg.get("num_hidden_layers", "?")))
    # the spec classification used (top level, text_config or hf_quant_config.json), not a second lookup
    quant = "none" if r.quant_method is None else r.quant_method + (f" ({r.quant_scheme})" if r.quant_scheme else "")
    summary.add_row("quantization_config", quant)
    summary.add_row("dtype", str(cfg.get("dtype") or cfg.get("torch_dtype") or "?"))
    summary.add_row("tensors", f"{len(r.tensors)} in {len({t.file for t in r.tensors.values()})} file(s)"
                    if r.tensors else "none (config only)")
    console.print(summary)

    if r.dsa is not None:
        d = r.dsa
        _heading(console, "DeepSeek Sparse Attention")
        t = Table(show_header=False)
        t.add_column(style="bold")
        t.add_column(overflow="fold")  # never '…': the full layer list is the point of this table
        t.add_row("index_topk / n_heads / head_dim / rope_dim",
                  f"{d.index_topk} / {d.index_n_heads} / {d.index_head_dim} / {d.index_rope_dim}")
        for role in ("full", "shared", "dense"):
            layers = [i for i, x in enumerate(d.roles) if x == role]
            if layers:
                t.add_row(f"{role} layers ({len(layers)})", layer_list(layers))
        console.print(t)

    if r.modules:
        _heading(console, f"Linear modules ({len(r.modules)})")
        t = Table()
        items = [(m.name, (m.scheme, m.dtype, m.shape, m.declared_quantized, m.treated_as)) for m in r.modules]
        rows = group_by_pattern(items)
        widest = max(len(p) for p, _, _ in rows)
        t.add_column("module", overflow="fold", min_width=max(12, min(widest, console.width - 70)))
        for col in ("n", "scheme", "dtype"):
            t.add_column(col, no_wrap=True)
        t.add_column("shape")
        t.add_column("config", no_wrap=True)  # does quantization_config quantize it?
        t.add_column("treated as", no_wrap=True)
        for pattern, n, (scheme, dtype, shape, declared, treated) in rows:
            t.add_row(pattern, str(n), scheme, dtype, _shape(shape), "quant" if declared else "-", treated)
        console.print(t)
    if r.dsa is not None or any(".." in m for m in _module_patterns(r)):
        console.print(Text(LAYER_LEGEND, style="dim"), soft_wrap=True)

    tot = r.totals
    _heading(console, "Totals" + (" (estimated from config.json)" if tot.get("estimated") else ""))
    t = Table()
    for col in ("", "parameters", "bytes"):
        t.add_column(col, justify="right" if col else "left")
    pad = f" (+{tot['padding_rows']:,} padding rows)" if tot.get("padding_rows") else ""  # atomtool layout
    t.add_row("all", _count(tot.get("parameters")) + pad, human_bytes(tot.get("bytes")))
    for dt, v in (tot.get("by_dtype") or {}).items():
        t.add_row(f"dtype {dt}", _count(v["elements"]) + " el", human_bytes(v["bytes"]))
    for sc, v in (tot.get("by_scheme") or {}).items():
        t.add_row(f"scheme {sc}", _count(v["parameters"]), human_bytes(v["bytes"]))
    console.print(t)

    m = r.memory
    if m.get("kv_bytes_per_token") is not None:
        _heading(console, "Memory")
        t = Table(show_header=False)
        t.add_column(style="bold")
        t.add_column()
        weights = human_bytes(m.get("weights_bytes"))
        gpu_w = m.get("gpu_weights_bytes")
        if gpu_w is not None and gpu_w != m.get("weights_bytes"):  # the context below is computed from these
            weights += f" (on the GPU: {human_bytes(gpu_w)}, as serve holds them)"
        t.add_row("weights", weights)
        t.add_row("KV cache / token", f"{human_bytes(m['kv_bytes_per_token'])} = {kv_detail(m)}")
        if m.get("swa_layers"):
            t.add_row("sliding-window KV",
                      f"{m['swa_layers']} {'layer' if m['swa_layers'] == 1 else 'layers'} x "
                      f"{m['swa_bytes_per_token_per_layer']} B/token, at most "
                      f"{m['sliding_window']:,} tokens each = "
                      f"{human_bytes(m['swa_layers'] * m['swa_bytes_per_token_per_layer'] * m['sliding_window'])}"
                      " (not per token)" + _window_cap_note(m, cfg))
        if m.get("linear_layers"):
            t.add_row("linear-attention layers", f"{m['linear_layers']} (fixed-size state, no KV cache; not counted)")
        if "max_context_tokens" in m:
            gb = f"{m['gpu_memory_gb']:g}"
            if m.get("weights_exceed_gpu_memory"):
                value = f"none: weights alone ({human_bytes(m.get('weights_bytes'))}) exceed {gb} GB"
            elif m.get("context_capped_at_window") and m["max_context_tokens"] == m["context_capped_at_window"]:
                # atomtool serves at most the window (context-capped-at-window), whatever memory would allow
                value = f"{m['max_context_tokens']:,} tokens (capped by the sliding window" + (
                    f"; model max {m['max_position_embeddings']:,})" if m.get("max_position_embeddings") else ")")
            elif m["max_context_tokens"] is None and m.get("weights_bytes") is not None and not m["kv_bytes_per_token"]:
                # only sliding-window / linear-attention layers: the cache stops growing after one window
                value = "not limited by the KV cache (no full-attention layer)" + (
                    f"; model max {m['max_position_embeddings']:,}" if m.get("max_position_embeddings") else "")
            elif m["max_context_tokens"] is None:
                value = "?"
            else:
                value = f"{m['max_context_tokens']:,} tokens" + (
                    f" (model max {m['max_position_embeddings']:,})" if m.get("max_position_embeddings") else "")
            t.add_row(f"longest context in {gb} GB", value)
        console.print(t)

    if r.findings:
        console.print(f"[bold]Findings ({len(r.findings)})[/]")
        style = {"error": "bold red", "warning": "yellow", "info": "dim"}
        for sev, code, n, where, msgs in collapse_findings(r.findings):
            head = f"[{style.get(sev, '')}]{sev:7}[/] {code}" + (f" x{n}" if n > 1 else "")
            head += f"  {where}" if where and n > 1 else ""
            console.print(head, highlight=False)
            shown = msgs if sev == "error" else msgs[:MAX_MESSAGES]  # every distinct error is shown
            for msg in shown:
                _print_indented(console, msg)
            if len(shown) < len(msgs):
                _print_indented(console, f"(+{len(msgs) - len(shown)} more distinct messages; --json lists all)",
                                style="dim")
    else:
        console.print("No findings.")

    if show_tensors and r.tensors:
        _heading(console, f"Tensors ({len(r.tensors)})")
        t = Table()
        for col in ("tensor", "dtype", "shape", "bytes", "file"):
            t.add_column(col, overflow="fold")
        for x in sorted(r.tensors.values(), key=lambda x: _natural(x.name)):
            t.add_row(x.name, x.dtype, _shape(x.shape), str(x.nbytes), x.file)
        console.print(t)
