"""A tiny run of each side-by-side benchmark of `make bench` that prints issue 15's ratios: it
runs to the end and prints every ratio line (the figures themselves are not judged here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("command", "ratios"),
    [
        (["bench.engine", "--prompts", "4", "--new-tokens", "4", "--repeats", "1"], 1),
        (["bench.delta_io", "--batch", "4", "--rows", "40", "--repeats", "1"], 3),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else str(v),
)
def test_the_benchmark_runs_and_prints_its_ratios(command, ratios):
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"= (\d+\.\d\d) \(range (\d+\.\d\d)-(\d+\.\d\d)\); goal >= \d", done.stdout)
    assert len(lines) == ratios, done.stdout
    assert all(float(lo) <= float(mid) <= float(hi) for mid, lo, hi in lines)
