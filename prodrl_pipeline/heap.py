"""The Python heap of a process that does one job and exits (a run's step process, a benchmark).

What is alive once such a process has started (the imports of torch, transformers and Dagster:
~0.5M objects) is never freed, yet every full collection of the cyclic garbage collector walks it
again: 0.3 s each on 2 cores. Collecting and recording create many containers (episodes,
constraints, the recorded lists), which trigger such collections. `freeze_startup_heap` moves the
startup heap out of the collector's reach. Not for a process that swaps what it holds (the
gateway loads each new deployment): a frozen object in a reference cycle is never freed.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Once per process: a full collection, then `gc.freeze()` of every object still alive. What
    the freeze holds is never collected, so it is taken once, when the heap is smallest (at start);
    later calls do nothing."""
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()
