import subprocess
import sys

import pytest


@pytest.mark.gpu
def test_vllm_backend_records_what_the_trainer_scores():
    """Runs bench/vllm_check.py (vLLM server + gateway + trainer comparison) on a GPU machine."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.vllm_check"], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "top-k supports within the head: True" in line
    mean = float(line.split("mean ")[1].split()[0])
    assert mean < 0.05, line  # BF16 vs fp32 on the same weights: typically 0.01-0.03 nats
