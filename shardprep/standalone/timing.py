"""Timing work on one device: CUDA events on the current stream, or wall time on the CPU.

`DeviceClock.beside` runs one piece of work while another runs next to it (on a side stream on CUDA,
in a thread on the CPU) and times the first: how `shardprep profile` measures what a gather costs the
compute it overlaps, and the reverse.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Mark = Any
"""A point in a device's timeline: a recorded CUDA event, or a perf_counter() value on the CPU."""


class DeviceClock:
    """Marks and times on one device.

    >>> clock = DeviceClock(torch.device("cuda", 0))  # doctest: +SKIP
    >>> clock.time_ms(lambda: x @ w)  # doctest: +SKIP
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # side: where `beside` runs the background work, so it overlaps the current stream's.
        self.side = torch.cuda.Stream(self.device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Mark:
        """A mark at this point of the current stream (CUDA) or of the wall clock (CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds between two marks; on CUDA, call after `sync()`."""
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3

    def time_ms(self, work: Callable[[], Any]) -> float:
        """Milliseconds of one call of `work`, from an idle device to its last kernel.

        >>> DeviceClock(torch.device("cpu")).time_ms(lambda: None) >= 0
        True
        """
        self.sync()
        start = self.mark()
        work()
        end = self.mark()
        self.sync()
        return self.elapsed_ms(start, end)

    def beside(self, foreground: Callable[[], Any], background: Callable[[], Any], count: int) -> float:
        """Milliseconds of `foreground` while `background` runs `count` times next to it.

        The background is issued first (CUDA: on a side stream, which then is the current stream inside
        it; CPU: in a thread), so it is under way when the foreground starts.

        >>> DeviceClock(torch.device("cpu")).beside(lambda: None, lambda: None, count=2) >= 0
        True
        """
        self.sync()
        if self.side is not None:
            side = self.side
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(count):
                    background()
            start = self.mark()  # no sync here: the background must still be running
            foreground()
            end = self.mark()
            self.sync()
            return self.elapsed_ms(start, end)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with torch.inference_mode():
                    for _ in range(count):
                        background()
            except BaseException as exc:  # re-raised in the caller's thread below
                failure.append(exc)

        thread = threading.Thread(target=run, name="shardprep-profile-background")
        thread.start()
        try:
            ms = self.time_ms(foreground)
        finally:
            thread.join()
        if failure:
            raise failure[0]
        return ms


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def slowest(values: Sequence[float], group: dist.ProcessGroup) -> list[float]:
    """Each value's maximum over the ranks of `group` (a CPU group): ranks step together, so the
    slowest rank's time is the step's. Every rank gets the same list.

    >>> slowest([1.2, 3.4], cpu_group)  # doctest: +SKIP
    """
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]
