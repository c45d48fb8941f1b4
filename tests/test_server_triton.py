"""BASTION on SGLang's Triton attention backend (interpreted on CPU): the layout reference.

FlashInfer on GPU consumes the same flat tree mask as the Triton backend, so a small lossless
check runs here too, although the interpreter makes it slow.
"""

from __future__ import annotations

import pytest
from server_utils import SERVER_ENV, bastion_args, run_all, sglang_server

pytestmark = pytest.mark.slow

BACKEND = ["--attention-backend", "triton", "--random-seed", "7"]
BATCH = [{"prompt": f"def g{i}(y):", "max_tokens": 14 + i} for i in range(4)]


def test_greedy_output_equals_the_plain_server_on_triton(pair, tmp_path):
    with sglang_server(pair[0], BACKEND, tmp_path / "plain.log", env=SERVER_ENV) as url:
        plain = run_all(url, BATCH)
    args = [*BACKEND, *bastion_args(pair[1], 8)]
    with sglang_server(pair[0], args, tmp_path / "bastion.log", env=SERVER_ENV) as url:
        assert run_all(url, BATCH) == plain
