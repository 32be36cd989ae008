"""Runs one engine on a worker thread: continuous batching for the embedded engine (requests join
the running batch between decode steps and leave it as soon as they finish), whole batches for an
engine without a decoder (vLLM serves its own batching)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future

from prodrl_pipeline.engine.rows import Completion, Request
from prodrl_pipeline.engine.sampler import TorchEngine

Item = tuple[Request, Future]


class BatchingEngine:
    """Up to `max_batch` requests decode together. An idle engine waits at most `wait_ms` after
    a first request for others to start with it; a busy one admits whatever is queued at each
    step. Each busy period (or batch) gets the next seed of a counter; a call's recorded seed is
    its own `params.seed` when it has one, else that seed (which does not reproduce the call: its
    draws also depend on when it joined and on its neighbours)."""

    def __init__(self, engine: TorchEngine, max_batch: int = 32, wait_ms: float = 5.0, seed: int = 0):
        self.engine, self.max_batch, self.wait = engine, max_batch, wait_ms / 1000
        self._queue: queue.Queue[Item | None] = queue.Queue()
        self._seeds = itertools.count(seed)
        self._closing = False
        target = self._continuous if hasattr(engine, "decoder") else self._batches
        self._thread = threading.Thread(target=target, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        """A future of (Completion, recorded seed)."""
        future: Future = Future()
        if self._closing:
            future.set_exception(RuntimeError("the engine is shutting down"))
        else:
            self._queue.put((request, future))
        return future

    def close(self, wait: bool = True) -> None:
        """Finish what is running, then stop; `wait`: until then (else the worker stops by itself,
        as for an engine that may be stuck)."""
        self._queue.put(None)
        if wait:
            self._thread.join()

    def _take(self, limit: int, block: bool) -> list[Item]:
        """Up to `limit` queued requests: when `block`, wait for a first one and then `wait_ms`
        for more; otherwise only those already queued. Cancelled ones are dropped."""
        items: list[Item] = []
        deadline = None
        while len(items) < limit and not self._closing:
            try:
                if block and not items:
                    item = self._queue.get()
                    deadline = time.monotonic() + self.wait
                elif block and (left := deadline - time.monotonic()) > 0:
                    item = self._queue.get(timeout=left)
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._closing = True
                break
            items.append(item)
        return [(r, f) for r, f in items if f.set_running_or_notify_cancel()]

    def _continuous(self) -> None:
        decoder, futures, seed = None, {}, 0
        while True:
            live = len(decoder) if decoder is not None else 0
            if self._closing and not live:
                self._drain()
                return
            new = self._take(self.max_batch - live, block=not live)
            if decoder is None or not live:
                seed = next(self._seeds)
                decoder = self.engine.decoder(seed)
            self._admit(decoder, new, futures)
            if not len(decoder):
                continue
            try:
                decoder.step()
                released = decoder.release()
            except Exception as e:  # noqa: BLE001 - the batch itself failed: every live call gets it
                self._fail([(r, futures.pop(id(r))) for r in decoder.rows.requests], e)
                decoder = None
                continue
            for r, c, error in released:
                future = futures.pop(id(r))
                if error is None:
                    future.set_result((c, r.params.seed if r.params.seed is not None else seed))
                else:
                    future.set_exception(error)

    @staticmethod
    def _admit(decoder, items: list[Item], futures: dict[int, Future]) -> None:  # noqa: ANN001
        """Prefill `items` into the running batch; a request that cannot be prefilled fails alone
        (after an error, the others are admitted one by one)."""
        try:
            decoder.admit([r for r, _ in items])
            futures |= {id(r): f for r, f in items}
            return
        except Exception as e:  # noqa: BLE001
            if len(items) == 1:
                items[0][1].set_exception(e)
                return
        for item in items:
            BatchingEngine._admit(decoder, [item], futures)

    @staticmethod
    def _fail(items: list[Item], error: Exception) -> None:
        for _, f in items:
            if not f.done():
                f.set_exception(error)

    def _batches(self) -> None:
        while not self._closing:
            batch = self._take(self.max_batch, block=True)
            if batch:
                self._run(batch, next(self._seeds))
        self._drain()

    def _drain(self) -> None:
        """Fail what was queued behind the close."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError("the engine is shutting down"))

    def _run(self, batch: list[Item], seed: int) -> None:
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
