"""Asynchronous block moves: a bounded priority queue served by worker threads.

Demand reads go first, then prefetch reads, then write-backs. On CUDA the copies between
host and device run on a dedicated copy stream (non-blocking from pinned memory) and a
worker waits on the copy's event, so completion callbacks only run once bytes are there.
"""
from __future__ import annotations

import enum
import heapq
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional


class Priority(enum.IntEnum):
    DEMAND = 0
    PREFETCH = 1
    WRITEBACK = 2


class TransferEngine:
    """Runs move jobs on ``num_workers`` threads; at most ``queue_depth`` jobs queued.

    Ctrl-C lands on the model's thread, the one that queues most jobs, at any function call
    it makes. So ``submit`` touches only primitives written in C: a lock (``_thread``'s),
    ``heapq`` and ``queue.SimpleQueue``. With ``threading.BoundedSemaphore`` and
    ``queue.PriorityQueue``, both Python over a ``threading.Condition``, an interrupt on
    the entry of ``Condition.__exit__`` left the condition's lock held, and every worker
    that gave room back or took a job waited for it for good (a helper's random
    ``interrupt_main`` runs hung twice; ``test_ctrl_c_anywhere_in_submit_leaves_the_engine_working``).
    """

    def __init__(self, num_workers: int, queue_depth: int, name: str = "tiercache-io",
                 on_wait: Optional[Callable[[float], None]] = None) -> None:
        self._jobs: list = []  # heap of [priority, seq, job, future, taken]
        self._mutex = threading.Lock()  # guards _jobs and each entry's ``taken``
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # a token per job queued (or spare)
        self._room: queue.SimpleQueue = queue.SimpleQueue()  # queue_depth tokens; a queued job holds one
        for _ in range(queue_depth):
            self._room.put(None)
        self._seq = itertools.count()
        self._closed = False
        self._closing = threading.Lock()  # close() against a submit queueing its job
        self._on_wait = on_wait
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(num_workers)]
        self._workers = frozenset(self._threads)
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], object], priority: Priority, blocking: bool = True) -> Optional[Future]:
        """Queue ``job``; while the queue is full, wait (or return None when not ``blocking``).
        A caller other than the workers that waits for room is told how long (``on_wait``):
        the model's thread waiting to queue a prefetch waits for I/O as much as for a block."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        future: Future = Future()
        t0 = None
        try:
            self._room.get_nowait()
        except queue.Empty:
            if not blocking:
                return None
            t0 = time.perf_counter()
            self._room.get()  # interrupted, it took no room
        entry = [int(priority), next(self._seq), job, future, False]
        try:
            if t0 is not None and self._on_wait is not None and threading.current_thread() not in self._workers:
                self._on_wait(time.perf_counter() - t0)
            with self._closing:  # close() between the wait and here: behind the stop markers it never runs
                if self._closed:
                    raise RuntimeError("transfer engine is closed")
                with self._mutex:
                    heapq.heappush(self._jobs, entry)
            self._wake.put(None)
        except BaseException:  # (Ctrl-C) the room goes back unless the job reached the queue
            with self._mutex:  # (a worker gives it back when it takes the job)
                queued = entry[4] or any(e is entry for e in self._jobs)
            if queued:
                self._wake.put(None)  # its token may not have gone in: a spare one is harmless
            else:
                self._room.put(None)
            raise
        return future

    def queued(self) -> int:
        """Jobs waiting for a worker (tests)."""
        with self._mutex:
            return sum(entry[2] is not None for entry in self._jobs)

    def _run(self) -> None:
        # Copies run on these threads: one intra-op thread each (torch's pool started from a
        # worker thread made block copies ~3x slower) leaves the cores to the model.
        import torch

        torch.set_num_threads(1)
        while True:
            self._wake.get()  # one token per job (a spare one, from an interrupted submit, finds none)
            with self._mutex:
                entry = heapq.heappop(self._jobs) if self._jobs else None
                if entry is not None:
                    entry[4] = True
            if entry is None:
                continue
            _, _, job, future, _ = entry
            if job is None:
                return
            self._room.put(None)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # delivered to whoever waits on the move
                future.set_exception(exc)

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            with self._mutex:  # behind every job (priority 99), one per worker
                for _ in self._threads:
                    heapq.heappush(self._jobs, [99, next(self._seq), None, None, False])
            for _ in self._threads:
                self._wake.put(None)
        for t in self._threads:
            t.join()


def wait_all(futures, timeout: Optional[float] = None) -> list:
    """Wait for every future; return the exceptions raised (not re-raised)."""
    errors = []
    for f in futures:
        try:
            f.result(timeout)
        except Exception as exc:  # noqa: BLE001 - collected for the caller
            errors.append(exc)
    return errors
