"""`bastion_cpu` serves BASTION's greedy tokens exactly as SGLang's Triton backend does.

Triton runs interpreted on a CPU and its interpreter is wrong in bfloat16, so both serve the
trained pair in float32 here (a test stand-in lets the DFlash draft block follow the model's
dtype, see sglang_standins/README.md): BASTION on `bastion_cpu` against the plain target on
Triton. A BASTION server runs every attention mode the other methods use but decode and
DFLASH's chain verify (prefill, the drafter's non-causal block, the tree verify); those two
are compared with Triton in float32 op by op in `test_cpu_attention.py`, and BASTION's tree
verify on Triton, eager and in graphs, in `test_server_verify_graphs.py`.
"""

from __future__ import annotations

import pytest
from server_utils import SERVER_ENV, TRAINED_PAIR, bastion_args, run_all, sglang_server

pytestmark = pytest.mark.slow

PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):")
BATCH = [{"prompt": prompt, "max_tokens": 12} for prompt in PROMPTS]


def test_greedy_tokens_equal_the_triton_backends_in_float32(tmp_path, triton_plain_url):
    args = ["--attention-backend", "bastion_cpu", "--dtype", "float32"]
    args += bastion_args(TRAINED_PAIR / "drafter", 8)
    with sglang_server(
        TRAINED_PAIR / "target", args, tmp_path / "bastion.log", env=SERVER_ENV
    ) as url:
        got = run_all(url, BATCH)
    want = run_all(triton_plain_url, BATCH)
    assert got == want
    assert all(len(set(tokens)) > 2 for tokens, _ in want)  # real text, not a loop
