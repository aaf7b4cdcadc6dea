"""``atomtool inspect``: classify a checkpoint from config.json and safetensors headers, print the report."""

from __future__ import annotations

import json
import sys

#: largest --gpu-memory accepted, in GB (10^9 bytes): a petabyte, far beyond any node
MAX_GPU_MEMORY_GB = 1e6


def run_inspect(source: str, *, revision: str | None = None, json_out: bool = False, show_tensors: bool = False,
                gpu_memory_gb: float | None = None) -> int:
    """Inspect ``source`` (local directory or Hub repo id) and print the report to stdout: rich tables, or
    with ``json_out`` one JSON object (docs/INSPECT_SCHEMA.md).

    Returns the exit code: 1 when any finding has severity ``error`` (printed after the report), else 0.
    Raises AtomtoolError subclasses (SourceError, ConfigError, HeaderError) for unreadable input; the CLI
    prints them as one line and exits 1.
    """
    from atomtool.errors import AtomtoolError
    from atomtool.inspect.classify import inspect_checkpoint
    from atomtool.inspect.report import make_console, render, to_json

    # the one validation of --gpu-memory: nan, 0, negatives, inf and absurd sizes (int(inf * 1e9) raises)
    if gpu_memory_gb is not None and not 0 < gpu_memory_gb <= MAX_GPU_MEMORY_GB:
        limit = f" (at most {MAX_GPU_MEMORY_GB:g})" if gpu_memory_gb > 0 else ""  # inf, 1e300
        raise AtomtoolError(f"--gpu-memory must be a positive number of GB{limit}, got {gpu_memory_gb}")
    report = inspect_checkpoint(source, revision, gpu_memory_gb=gpu_memory_gb)
    if json_out:
        sys.stdout.write(json.dumps(to_json(report, show_tensors=show_tensors), indent=2) + "\n")
    else:
        render(report, make_console(), show_tensors=show_tensors)
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        print(f"error: {len(errors)} error finding(s); first: {errors[0].message}", file=sys.stderr)
        return 1
    return 0
