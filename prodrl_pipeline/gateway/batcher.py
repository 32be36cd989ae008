"""Runs one engine on a worker thread and batches concurrent requests into its `generate` calls."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future

from prodrl_pipeline.engine.sampler import Completion, Request, TorchEngine


class BatchingEngine:
    """Collects up to `max_batch` requests, waiting at most `wait_ms` after the first, and runs
    them as one batch. Each batch gets the next seed of a counter; a call's recorded seed is its
    own `params.seed` when it has one, else its batch's."""

    def __init__(self, engine: TorchEngine, max_batch: int = 32, wait_ms: float = 5.0, seed: int = 0):
        self.engine, self.max_batch, self.wait = engine, max_batch, wait_ms / 1000
        self._queue: queue.Queue[tuple[Request, Future] | None] = queue.Queue()
        self._seeds = itertools.count(seed)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        """A future of (Completion, recorded seed)."""
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.wait
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            batch = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]  # drop cancelled ones
            if not batch:
                continue
            self._run(batch, next(self._seeds))

    def _run(self, batch: list[tuple[Request, Future]], seed: int) -> None:
        """One engine call for the batch; if it fails, each request alone, so that one bad request
        fails only itself."""
        try:
            completions: list[Completion] = self.engine.generate([r for r, _ in batch], seed=seed)
        except Exception as e:  # noqa: BLE001 - the worker lives on
            if len(batch) > 1:
                for item in batch:
                    self._run([item], seed)
                return
            batch[0][1].set_exception(e)
            return
        for (r, f), c in zip(batch, completions, strict=True):
            f.set_result((c, r.params.seed if r.params.seed is not None else seed))
