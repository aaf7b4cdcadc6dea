"""GPU test suite setup: skip everything here without CUDA; collect measured numbers into a JSON report.

Tests record numbers (tolerances met, agreement rates) with the ``gpu_report`` fixture; at the end of the
session they are written to ``$ATOMTOOL_GPU_REPORT`` (a file path) when that variable is set, which
scripts/run_gpu_tests.py does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
for p in (str(_ROOT), str(_ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

_REPORT: dict[str, object] = {}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_report():
    """A dict shared by the session: ``gpu_report["name"] = value`` lands in the JSON report."""
    return _REPORT


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("ATOMTOOL_GPU_REPORT")
    if out and _REPORT:
        Path(out).write_text(json.dumps(_REPORT, indent=2, default=str))
