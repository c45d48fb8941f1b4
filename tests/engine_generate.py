"""Run in a subprocess by test_entrypoints.py: greedy outputs of SGLang's offline Engine.

python tests/engine_generate.py TARGET DRAFTER OUT.json

Generates the same prompts with a plain Engine and with ``speculative_algorithm="BASTION"``
(one after the other, each shut down before the next) and writes their output ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n"]


def main() -> None:
    """Generate with both engines and write {"plain": [...], "bastion": [...]}."""
    import sglang as sgl

    target, drafter, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    common = {
        "model_path": target, "device": "cpu", "dtype": "bfloat16",
        "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
        "attention_backend": "bastion_cpu", "mem_fraction_static": 0.1,
        "max_total_tokens": 4096, "skip_server_warmup": True,
    }  # fmt: skip
    bastion = {
        "speculative_algorithm": "BASTION", "speculative_draft_model_path": drafter,
        "speculative_num_draft_tokens": 16,
    }  # fmt: skip
    outputs = {}
    for name, extra in (("plain", {}), ("bastion", bastion)):
        engine = sgl.Engine(**common, **extra)
        replies = engine.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0})
        outputs[name] = [reply["output_ids"] for reply in replies]
        engine.shutdown()
    out.write_text(json.dumps(outputs))


if __name__ == "__main__":
    main()
