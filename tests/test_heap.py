"""The startup heap is frozen once per process (prodrl_pipeline/heap.py)."""

import subprocess
import sys

SCRIPT = """
import gc
from prodrl_pipeline.heap import freeze_startup_heap
assert gc.get_freeze_count() == 0
freeze_startup_heap()
frozen = gc.get_freeze_count()
garbage = [[] for _ in range(1000)]
freeze_startup_heap()  # a second call freezes nothing more
print(frozen, gc.get_freeze_count())
"""


def test_the_startup_heap_is_frozen_once_per_process():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    frozen, after = map(int, done.stdout.split())
    assert frozen > 1000 and after == frozen
