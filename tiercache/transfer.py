"""Asynchronous block moves: a bounded priority queue served by worker threads.

Demand reads go first, then prefetch reads, then write-backs. On CUDA the copies between
host and device run on a dedicated copy stream (non-blocking from pinned memory) and a
worker waits on the copy's event, so completion callbacks only run once bytes are there.
"""
from __future__ import annotations

import enum
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
    """Runs move jobs on ``num_workers`` threads; at most ``queue_depth`` jobs queued."""

    def __init__(self, num_workers: int, queue_depth: int, name: str = "tiercache-io",
                 on_wait: Optional[Callable[[float], None]] = None) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._room = threading.BoundedSemaphore(queue_depth)
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
        if not self._room.acquire(blocking=False):
            if not blocking:
                return None
            t0 = time.perf_counter()
            self._room.acquire()
        try:
            if t0 is not None and self._on_wait is not None and threading.current_thread() not in self._workers:
                self._on_wait(time.perf_counter() - t0)
            with self._closing:  # close() between the wait and here: behind the stop markers it never runs
                if self._closed:
                    raise RuntimeError("transfer engine is closed")
                self._queue.put((int(priority), next(self._seq), job, future))
        except BaseException:  # (Ctrl-C) the room goes back unless the job reached the queue:
            # a worker gives it back when it takes the job (twice: a worker killed by the semaphore)
            with self._queue.mutex:
                queued = any(entry[3] is future for entry in self._queue.queue)
            if not queued:
                self._room.release()
            raise
        return future

    def _run(self) -> None:
        # Copies run on these threads: one intra-op thread each (torch's pool started from a
        # worker thread made block copies ~3x slower) leaves the cores to the model.
        import torch

        torch.set_num_threads(1)
        while True:
            _, _, job, future = self._queue.get()
            if job is None:
                return
            self._room.release()
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
            for _ in self._threads:
                self._queue.put((99, next(self._seq), None, None))
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
