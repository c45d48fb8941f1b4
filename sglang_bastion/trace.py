"""Step traces of a BASTION server, for replaying other controller policies offline.

With ``SGLANG_BASTION_TRACE=<file>`` the worker appends one JSON line per decode step (at most
``SGLANG_BASTION_TRACE_STEPS`` steps): the batch's request ids and context lengths, every
request's top-K drafter marginals (ids and float32 probabilities, exactly as the builder saw
them), the tree sizes and verify width chosen, the tokens each request emitted (accepted
drafts then the bonus) and how many it could still emit (max_new_tokens less its output so
far: the scheduler drops the rest), and the step's timings (its start on the server's
monotonic clock, the verify span, the whole cycle). At temperature 0 the emitted tokens of a
request's later steps are its committed continuation, which is what any other tree would
have been checked against: ``benchmarks/simulate.py`` replays traces under other policies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRACE_VERSION = 1


class TraceWriter:
    """Appends step records to a JSONL file until ``max_steps`` are written."""

    def __init__(self, path: str | Path, max_steps: int, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.max_steps = max_steps
        self.written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._write({"kind": "header", "version": TRACE_VERSION, **header})

    @property
    def active(self) -> bool:
        """Whether more steps will be recorded."""
        return self.written < self.max_steps

    def record(self, step: dict[str, Any]) -> None:
        """Append one step (dropped once ``max_steps`` are written)."""
        if not self.active:
            return
        self.written += 1
        self._write({"kind": "step", **step})
        if not self.active:
            self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        """One line of JSON, flushed so a killed server leaves a readable trace."""
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, steps) of a trace file; several headers (restarts) keep the first."""
    header: dict[str, Any] | None = None
    steps = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("kind") == "header":
            header = header or record
        else:
            steps.append(record)
    if header is None:
        raise ValueError(f"{path}: no trace header; is this a BASTION trace?")
    return header, steps
