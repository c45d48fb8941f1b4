"""A device value read one step late: on a CPU it is there at once, and it is a snapshot."""

import torch

from sglang_bastion.late_read import LateRead


def test_a_cpu_value_is_read_at_once():
    assert LateRead(torch.tensor([2.5])).value() == 2.5


def test_the_read_is_the_value_when_it_was_taken():
    value = torch.tensor(3.0)
    late = LateRead(value)
    value.add_(1.0)  # the next step reuses the buffer
    assert late.value() == 3.0
