"""Values and span timings read late: on a CPU at once, on a GPU once their work is done."""

from __future__ import annotations

import torch

from sglang_bastion.late_read import LateRead, SpanTimer


def test_a_cpu_value_is_read_at_once():
    assert LateRead(torch.tensor([2.5])).value() == 2.5


def test_the_read_is_the_value_when_it_was_taken():
    value = torch.tensor(3.0)
    late = LateRead(value)
    value.add_(1.0)  # the next step reuses the buffer
    assert late.value() == 3.0


def test_a_vector_is_read_whole():
    assert LateRead(torch.tensor([[1, 2], [3, 4]])).values() == [1.0, 2.0, 3.0, 4.0]


def test_a_cpu_span_is_timed_at_once():
    timer = SpanTimer(torch.device("cpu"))
    assert timer.elapsed_ms() is None  # not stopped yet
    assert timer.stop().elapsed_ms() >= 0.0


class FakeEvent:
    """A CUDA event whose work finishes when the test says so."""

    done = False

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return FakeEvent.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert FakeEvent.done, "elapsed_time before the end event completed would synchronise"
        return 7.5


def test_a_device_span_answers_only_once_its_work_has_finished(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.done = False
    timer = SpanTimer(torch.device("cuda")).stop()
    assert timer.elapsed_ms() is None  # the step goes on; the next one asks again
    FakeEvent.done = True
    assert timer.elapsed_ms() == 7.5
