"""Timing the calibration grid on the live workers, with a progress bar; Ctrl-C keeps the rest.

The grid is timed in rounds: each round visits every (batch size, context length) set-up and
times L_AR and one BASTION step at every width once (the first round after ``grid.warmup``
untimed calls of each); a step gives its verify time, and T_aux as the rest of its cycle.
Spreading the repeats of a shape over the whole run, instead of timing them back to back,
makes a burst of load from other processes slow every shape alike rather than a few, so it
cannot tilt the fit. A shape's latency is the median (or the minimum) of its rounds; after
Ctrl-C, of the rounds it got.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from sglang_bastion.budget import GridPoint
from sglang_bastion.calibration.grid import Grid
from sglang_bastion.calibration.passes import StepShapes
from sglang_bastion.calibration.runtime import Runtime
from sglang_bastion.calibration.timing import summarize, timed_ms

Key = tuple[int, ...]  # (batch, context) for T_aux and L_AR; (batch, tokens, context) for verify


@dataclass
class Measurements:
    """Every timing taken: verify shapes, and T_aux / L_AR per batch size and context."""

    verify: dict[Key, list[float]] = field(default_factory=lambda: defaultdict(list))
    aux: dict[Key, list[float]] = field(default_factory=lambda: defaultdict(list))
    ar: dict[Key, list[float]] = field(default_factory=lambda: defaultdict(list))
    statistic: str = "median"
    skipped: list[str] = field(default_factory=list)  # set-ups that did not fit in memory
    interrupted: bool = False  # stopped by Ctrl-C before the last round was done
    rounds: int = 0  # rounds completed over the whole grid

    def grid(self) -> list[GridPoint]:
        """One point per timed verify shape: its latency summarised over its rounds."""
        return [
            GridPoint(batch, tokens, context, summarize(ms, self.statistic))
            for (batch, tokens, context), ms in sorted(self.verify.items())
            if ms
        ]

    def t_aux_table(self) -> list[tuple[int, float]]:
        """[(batch size, T_aux ms)]: per context over all widths, then the mean over contexts."""
        return self._by_batch(self.aux)

    def l_ar_table(self) -> list[tuple[int, float]]:
        """[(batch size, L_AR ms)]: the mean over the measured context lengths."""
        return self._by_batch(self.ar)

    def _by_batch(self, timings: dict[Key, list[float]]) -> list[tuple[int, float]]:
        """Per batch size, the mean over contexts of each context's summarised latency."""
        per_batch: dict[int, list[float]] = defaultdict(list)
        for (batch, _), ms in sorted(timings.items()):
            if ms:
                per_batch[batch].append(summarize(ms, self.statistic))
        return [(batch, sum(v) / len(v)) for batch, v in sorted(per_batch.items())]


class _Interrupted(Exception):
    """Ctrl-C arrived: stop after the pass under way."""


@contextlib.contextmanager
def _stop_on_ctrl_c() -> Iterator[threading.Event]:
    """An event set by the first Ctrl-C (a second one raises KeyboardInterrupt as usual).

    The first Ctrl-C only asks the grid to stop between passes, so it never lands inside
    SGLang or torch, where an exception could leave the runners half-way or be swallowed.
    """
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    def handler(signum: int, frame: object) -> None:
        del signum, frame
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


def measure(
    runtime: Runtime, grid: Grid, *, statistic: str = "median", progress: bool = True
) -> Measurements:
    """Time the grid on ``runtime``; on Ctrl-C stop and return what was measured so far."""
    with _stop_on_ctrl_c() as stop:
        return _measure(runtime, grid, statistic, progress, stop)


def _measure(
    runtime: Runtime, grid: Grid, statistic: str, progress: bool, stop: threading.Event
) -> Measurements:
    """`measure`, stopping between passes once ``stop`` is set."""
    result = Measurements(statistic=statistic)
    per_setup = len(grid.tokens) + 1
    bar = tqdm(
        total=grid.num_timings * grid.repeats,
        desc="bastion-calibrate",
        unit="pass",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    unusable: set[tuple[int, int]] = set()
    try:
        for round_ in range(grid.repeats):
            for batch, context in grid.points():
                bar.set_postfix_str(f"round {round_ + 1}, batch {batch}, context {context}")
                if (batch, context) in unusable:
                    bar.update(per_setup)
                    continue
                try:
                    shapes = StepShapes(runtime, batch, context)
                except MemoryError as err:
                    result.skipped.append(f"batch {batch} at context {context}: {err}")
                    unusable.add((batch, context))
                    bar.update(per_setup)
                    continue
                try:
                    warmup = grid.warmup if round_ == 0 else 0
                    _time_setup(shapes, grid.tokens, warmup, result, bar, stop)
                finally:
                    shapes.release()
            result.rounds = round_ + 1
    except (KeyboardInterrupt, _Interrupted):
        result.interrupted = True
    finally:
        bar.close()
    return result


def _time_setup(
    shapes: StepShapes,
    widths: tuple[int, ...],
    warmup: int,
    result: Measurements,
    bar: tqdm,
    stop: threading.Event,
) -> None:
    """L_AR, then one BASTION step per verify width (its verify and the rest, T_aux)."""
    device, batch, context = shapes.runtime.device, shapes.batch_size, shapes.context_len
    with torch.inference_mode():
        if stop.is_set():
            raise _Interrupted
        result.ar[batch, context].append(timed_ms(shapes.decode_pass(), device, warmup=warmup))
        bar.update()
        for tokens in widths:
            if stop.is_set():
                raise _Interrupted
            for _ in range(warmup):
                shapes.step(tokens)
            width, cycle_ms, verify_ms = shapes.step(tokens)
            result.verify[batch, width, context].append(verify_ms)
            result.aux[batch, context].append(cycle_ms - verify_ms)
            bar.update()
