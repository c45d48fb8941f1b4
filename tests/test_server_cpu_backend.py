"""`bastion_cpu` serves the same greedy tokens as SGLang's Triton backend (float32, no spec).

Triton runs interpreted on a CPU and its interpreter is wrong in bfloat16, so the server-level
comparison is made in float32 without speculation (the DFlash drafter needs bfloat16 on a CPU);
every attention mode is compared with Triton in float32 in `test_cpu_attention.py`.
"""

from __future__ import annotations

import pytest
from server_utils import SERVER_ENV, run_all, sglang_server

pytestmark = pytest.mark.slow

BATCH = [{"prompt": f"def k{i}(w):", "max_tokens": 10} for i in range(3)]


def test_plain_greedy_tokens_equal_the_triton_backends_in_float32(pair, tmp_path):
    outputs = {}
    for backend in ("bastion_cpu", "triton"):
        args = ["--attention-backend", backend, "--dtype", "float32"]
        with sglang_server(pair[0], args, tmp_path / f"{backend}.log", env=SERVER_ENV) as url:
            outputs[backend] = run_all(url, BATCH)
    assert outputs["bastion_cpu"] == outputs["triton"]
