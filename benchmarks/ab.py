"""A/B of engine constants: one benchmark run under several variants, alternating, each in a fresh process.

Most of issue 7's steps compare the tree with one constant changed (a launch configuration, a register cap, a
switch) inside one device call, because the same tree differs by ~1.5% from one call (machine) to the next.
This runs such a comparison from one command:

    python3 -m benchmarks.ab --variant base= \\
        --variant cap='atomtool.serve.ops.triton.mla.MLA_DECODE_CONFIG=MlaDecodeConfig(block_h=32)' \\
        --rounds 2 -- decode_bench --model dsv32 --batches 1,8 --contexts 4096 --moe-layers 8

A variant is ``NAME=SETTINGS``: ``SETTINGS`` is a ``;``-separated list of ``module.attribute=expression`` (the
expression is evaluated in that module's namespace, so its own classes and constants can be named; a Triton
``tl.constexpr`` global stays one), or empty for the tree as it is. Round 1 runs the variants in the order
given, round 2 in reverse, and so on (ABBA: a drift over the call charges both sides alike). Every run is its own
process (a kernel reads its module constants when it first compiles, so a setting must come before anything
runs) with ``$BENCH_OUT/ab/<name>_<round>/`` as its output directory; the first run's ceilings are copied to the
others (measured once). Then one table: per measurement point, each variant's median of ``--metric`` over the
rounds and its ratio to the first variant's. Exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from benchmarks import common as C


class AbError(ValueError):
    """A variant or setting that cannot be applied (bad syntax, unknown module or attribute)."""


@dataclass
class Variant:
    """One side of the comparison: its name and ``(module, attribute, expression)`` settings."""

    name: str
    settings: list[tuple[str, str, str]] = field(default_factory=list)
    spec: str = ""


def parse_settings(spec: str) -> list[tuple[str, str, str]]:
    """``"pkg.mod.ATTR=expr; pkg.mod2.B=expr2"`` -> [(module, attribute, expression)]. Raises AbError."""
    out = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        path, eq, expr = part.partition("=")
        module, dot, attr = path.strip().rpartition(".")
        if not eq or not dot or not module or not attr.isidentifier() or not expr.strip():
            raise AbError(f"setting {part!r}: expected module.attribute=expression")
        out.append((module, attr, expr.strip()))
    return out


def parse_variant(text: str) -> Variant:
    """``NAME=SETTINGS`` (SETTINGS may be empty) -> :class:`Variant`. Raises AbError."""
    name, eq, spec = text.partition("=")
    name = name.strip()
    if not eq or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise AbError(f"variant {text!r}: expected NAME=SETTINGS with a name of letters, digits, - _ .")
    return Variant(name, parse_settings(spec), spec)


def _target(module: str, attr: str):
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise AbError(f"setting {module}.{attr}: cannot import {module} ({exc})") from exc
    if not hasattr(mod, attr):
        raise AbError(f"setting {module}.{attr}: {module} has no attribute {attr!r}")
    return mod


def check_settings(settings: list[tuple[str, str, str]]) -> None:
    """Raise AbError unless every ``module.attribute`` exists and every expression parses (done before any run
    starts; the expression is evaluated in the child)."""
    for module, attr, expr in settings:
        _target(module, attr)
        try:
            compile(expr, f"<{module}.{attr}>", "eval")
        except SyntaxError as exc:
            raise AbError(f"setting {module}.{attr}={expr}: not a Python expression ({exc.msg})") from None


def apply_settings(settings: list[tuple[str, str, str]]) -> None:
    """Set each ``module.attribute`` to its expression's value (evaluated in the module's namespace); a
    ``tl.constexpr`` attribute gets its new value wrapped the same way. Raises AbError for an unknown module or
    attribute (a typo would otherwise measure the unchanged tree) or an expression that fails."""
    for module, attr, expr in settings:
        mod = _target(module, attr)
        try:
            value = eval(expr, vars(mod))  # noqa: S307  (a developer's command line, as python -c would be)
        except Exception as exc:
            raise AbError(f"setting {module}.{attr}={expr}: {type(exc).__name__}: {exc}") from exc
        old = getattr(mod, attr)
        if type(old).__name__ == "constexpr" and type(value).__name__ != "constexpr":
            value = type(old)(value)
        setattr(mod, attr, value)


def run_child(spec: str, bench: str, bench_args: list[str]) -> int:
    """In the child process: apply ``spec`` and run ``benchmarks.<bench>.main(bench_args)``."""
    apply_settings(parse_settings(spec))
    return importlib.import_module(f"benchmarks.{bench}").main(bench_args) or 0


def schedule(variants: list[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in run order: forward on odd rounds, reversed on even ones (ABBA)."""
    order = []
    for r in range(1, rounds + 1):
        order += [(r, v) for v in (variants if r % 2 else variants[::-1])]
    return order


def compare(rows: dict[str, list[dict[str, Any]]], names: list[str], row_bench: str, keys: list[str],
            metric: str) -> list[dict[str, Any]]:
    """One row per measurement point (the ``keys`` values of the ``row_bench`` rows): each variant's median
    ``metric`` over its runs and ``<name>/<first>`` ratios. ``rows``: variant name -> result rows."""
    points: dict[tuple, dict[str, list[float]]] = {}
    for name in names:
        for r in rows.get(name, []):
            if r.get("bench") == row_bench and isinstance(r.get(metric), (int, float)):
                points.setdefault(tuple(r.get(k) for k in keys), {}).setdefault(name, []).append(float(r[metric]))
    table = []
    for point, by_name in points.items():
        row: dict[str, Any] = dict(zip(keys, point, strict=True))
        med = {n: statistics.median(v) for n, v in by_name.items()}
        for n in names:
            row[n] = med.get(n)
            row[f"{n}_runs"] = " ".join(f"{x:.4g}" for x in by_name.get(n, []))
        for n in names[1:]:
            if med.get(n) is not None and med.get(names[0]):
                row[f"{n}/{names[0]}"] = med[n] / med[names[0]]
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, bench_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python -m benchmarks.ab --variant NAME=SETTINGS ... [options] -- BENCH ARGS")
    ap.add_argument("--variant", action="append", default=[], help="NAME=SETTINGS (repeat; the first is the base)")
    ap.add_argument("--rounds", type=C.positive_int, default=2, help="runs of each variant (alternating)")
    ap.add_argument("--row", default="decode", help="the result rows compared (their 'bench' field)")
    ap.add_argument("--keys", default="model,batch,ctx", help="fields naming a measurement point")
    ap.add_argument("--metric", default="gpu_ms", help="the field compared")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(ours)
    if not bench_argv:
        ap.error("name the benchmark after '--', e.g. -- decode_bench --model dsv32 --batches 1")
    bench, bench_args = bench_argv[0], bench_argv[1:]
    try:
        if args.child is not None:
            try:
                return run_child(args.child, bench, bench_args)
            except KeyboardInterrupt:  # the parent says so once
                return 130
        variants = [parse_variant(v) for v in args.variant]
        if len(variants) < 2:
            raise AbError("give at least two --variant (the first is the base; 'base=' is the tree as it is)")
        if len({v.name for v in variants}) != len(variants):
            raise AbError("variant names must differ")
        if not [k for k in args.keys.split(",") if k]:
            raise AbError("--keys names no field: give the fields that name a measurement point, e.g. model,batch,ctx")
        importlib.import_module(f"benchmarks.{bench}")  # a misspelt benchmark fails here, not once per run
        for v in variants:
            check_settings(v.settings)
    except (AbError, ImportError) as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    root = C.out_dir() / "ab"
    rows: dict[str, list[dict[str, Any]]] = {}
    failed: list[str] = []
    try:
        _run_all(variants, args, bench, bench_args, root, rows, failed)
    except KeyboardInterrupt:
        print("ab: interrupted", file=sys.stderr)
        return 130
    names = [v.name for v in variants]
    keys = [k for k in args.keys.split(",") if k]
    table = compare(rows, names, args.row, keys, args.metric)
    cols = keys + names + [f"{n}/{names[0]}" for n in names[1:]] + [f"{n}_runs" for n in names]
    C.print_table(f"ab: {args.metric} of '{args.row}' rows, median over {args.rounds} round(s)", table, cols)
    for row in table:
        C.record("ab", metric=args.metric, variants={v.name: v.spec for v in variants}, **row)
    if failed:
        print(f"ab: failed runs: {', '.join(failed)}", file=sys.stderr)
    if not table:
        print(f"ab: no '{args.row}' result row with a numeric '{args.metric}' field (see --row / --metric)",
              file=sys.stderr)
    return 1 if failed or not table else 0


def _run_all(variants: list[Variant], args: argparse.Namespace, bench: str, bench_args: list[str], root,
             rows: dict[str, list[dict[str, Any]]], failed: list[str]) -> None:
    """Every run of :func:`schedule`, each in its own process; their result rows into ``rows``."""
    ceilings = None
    for rnd, v in schedule(variants, args.rounds):
        out = root / f"{v.name}_{rnd}"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if ceilings is not None:
            shutil.copy(ceilings, out / "ceilings.json")
        print(f"\n== ab: {v.name} (round {rnd}): {v.spec or 'the tree as it is'}", flush=True)
        cmd = [sys.executable, "-m", "benchmarks.ab", "--child", v.spec, "--", bench, *bench_args]
        rc = subprocess.run(cmd, env={**os.environ, "BENCH_OUT": str(out)}).returncode
        if rc:
            failed.append(f"{v.name}_{rnd} (exit {rc})")
        results = out / "results.jsonl"
        if results.is_file():
            rows.setdefault(v.name, []).extend(json.loads(line) for line in results.read_text().splitlines() if line)
        if ceilings is None and (out / "ceilings.json").is_file():
            ceilings = out / "ceilings.json"


if __name__ == "__main__":
    raise SystemExit(main())
