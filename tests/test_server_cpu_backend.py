"""`bastion_cpu` serves BASTION's greedy tokens exactly as SGLang's Triton backend does.

Triton runs interpreted on a CPU and its interpreter is wrong in bfloat16, so both backends
serve the trained pair in float32 here (a test stand-in lets the DFlash draft block follow the
model's dtype, see sglang_standins/README.md). A BASTION server runs every attention mode the
other methods use but decode and DFLASH's chain verify (prefill, the drafter's non-causal
block, the tree verify); those two are compared with Triton in float32 op by op in
`test_cpu_attention.py`, and the plain server's decode is the reference every lossless
server test compares BASTION with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import SERVER_ENV, bastion_args, run_all, sglang_server

pytestmark = pytest.mark.slow

PAIR = Path(__file__).resolve().parent.parent / "training" / "pair"
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):")
BATCH = [{"prompt": prompt, "max_tokens": 12} for prompt in PROMPTS]
BASTION = bastion_args(PAIR / "drafter", 8)


def test_greedy_tokens_equal_the_triton_backends_in_float32(tmp_path):
    outputs = {}
    for backend in ("bastion_cpu", "triton"):
        args = ["--attention-backend", backend, "--dtype", "float32", *BASTION]
        log = tmp_path / f"{backend}.log"
        with sglang_server(PAIR / "target", args, log, env=SERVER_ENV) as url:
            outputs[backend] = run_all(url, BATCH)
    assert outputs["bastion_cpu"] == outputs["triton"]
    assert all(len(set(tokens)) > 2 for tokens, _ in outputs["triton"])  # real text, not a loop
