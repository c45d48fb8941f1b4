"""Serving speed on CPU: SGLang servers with `bastion_cpu` vs the interpreted `triton` backend.

    python benchmarks/bench_cpu_attention.py [--output-json PATH]

Starts real servers (no speculation, DFLASH, BASTION) on the tests' tiny random pair, sends
the same greedy requests to each and reports wall time and tokens per second side by side.
Triton's interpreter is wrong in bfloat16 (its outputs are junk), so only its cost is meant
here; the token-level comparisons live in the test suite on `bastion_cpu`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import markdown_table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_utils import SERVER_ENV, bastion_args, dflash_args, run_all, sglang_server
from tiny_models import write_drafter, write_target

REQUESTS = [{"prompt": f"def h{i}(z):", "max_tokens": 24} for i in range(4)]


def measure(target: Path, args: list[str], log: Path) -> tuple[float, int]:
    """Seconds to serve REQUESTS (4 at once) after one warm-up request, and tokens made."""
    with sglang_server(target, args, log, env=SERVER_ENV) as url:
        run_all(url, REQUESTS[:1])
        start = time.perf_counter()
        results = run_all(url, REQUESTS)
        return time.perf_counter() - start, sum(len(ids) for ids, _ in results)


def main() -> None:
    """Serve with each method on both backends and record the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cpu-attn-"))
    target = write_target(root / "target", few_tokens=(300, 301, 302, 303))
    drafter = write_drafter(root / "drafter", target)
    methods = {"none": [], "DFLASH": dflash_args(drafter), "BASTION": bastion_args(drafter, 16)}
    rows = []
    for method, method_args in methods.items():
        seconds = {}
        for backend in ("bastion_cpu", "triton"):
            cli = ["--attention-backend", backend, *method_args]
            elapsed, tokens = measure(target, cli, root / f"{method}-{backend}.log")
            seconds[backend] = elapsed
            print(f"{method:8s} {backend:12s} {elapsed:7.2f} s  {tokens / elapsed:7.1f} tok/s")
        rows.append(
            {
                "method": method,
                "bastion_cpu_s": seconds["bastion_cpu"],
                "triton_interpreted_s": seconds["triton"],
                "speedup": seconds["triton"] / seconds["bastion_cpu"],
            }
        )
    columns = ["method", "bastion_cpu_s", "triton_interpreted_s", "speedup"]
    print(markdown_table(rows, columns))
    path = write_results(
        "cpu_attention_serving",
        rows,
        columns,
        "Serving 4 x 24 greedy tokens on CPU: bastion_cpu vs interpreted triton",
        args.output_json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
