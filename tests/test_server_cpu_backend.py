"""`bastion_cpu` serves the same greedy tokens as SGLang's Triton backend, for every method.

Triton runs interpreted on a CPU and its interpreter is wrong in bfloat16, so both backends
serve the trained pair in float32 here (a test stand-in lets the DFlash draft block follow the
model's dtype, see sglang_standins/README.md); every attention mode is also compared with
Triton in float32 in `test_cpu_attention.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import SERVER_ENV, bastion_args, dflash_args, run_all, sglang_server

pytestmark = pytest.mark.slow

PAIR = Path(__file__).resolve().parent.parent / "training" / "pair"
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):")
BATCH = [{"prompt": prompt, "max_tokens": 12} for prompt in PROMPTS]
METHODS = {
    "none": [],
    "DFLASH": dflash_args(PAIR / "drafter"),
    "BASTION": bastion_args(PAIR / "drafter", 8),
}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_the_triton_backends_in_float32(method, tmp_path):
    outputs = {}
    for backend in ("bastion_cpu", "triton"):
        args = ["--attention-backend", backend, "--dtype", "float32", *METHODS[method]]
        log = tmp_path / f"{backend}.log"
        with sglang_server(PAIR / "target", args, log, env=SERVER_ENV) as url:
            outputs[backend] = run_all(url, BATCH)
    assert outputs["bastion_cpu"] == outputs["triton"]
    assert all(len(set(tokens)) > 2 for tokens, _ in outputs["triton"])  # real text, not a loop
