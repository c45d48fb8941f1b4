"""The CPU demo: the shipped trained pair under every serving method, as a concurrency sweep.

python benchmarks/demo.py [--quick] [--out DIR] [--target T --drafter D --profile P]

A preset of benchmarks/sweep.py (nothing else runs): real SGLang servers on 127.0.0.1 with
the pair in training/pair/ (no speculation, DFLASH, BASTION fixed N=16, BASTION adaptive with
calibration/profiles/tiny-pair-cpu.json), HumanEval prompts at concurrency 1, 4 and 16, then
the table of output tokens/s, acceptance length and tree size per method and concurrency, and
a PNG plot. About 10-15 minutes on 2 cores; ``--quick`` (DFLASH against BASTION adaptive at
concurrency 1 and 4, 32 tokens per request) takes under 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sweep
import torch

from sglang_bastion.budget.identity import device_name

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "training" / "pair"
PROFILE = ROOT / "calibration" / "profiles" / "tiny-pair-cpu.json"
FULL = {"methods": ["none", "dflash", "bastion-16", "bastion-adaptive"], "concurrency": "1,4,16"}
QUICK = {"methods": ["dflash", "bastion-adaptive"], "concurrency": "1,4"}
# The full demo's workload: 48 tokens per request, max(4, 2C) requests per concurrency C
# (the quick one uses the sweep's: 32 tokens, max(2, C) requests).
OUTPUT_LEN, MIN_PROMPTS = 48, 4
ADAPTIVE_MAX_NODES = 32


def profile_problem(profile: Path) -> str | None:
    """Why ``profile`` cannot price this CPU's trees, or None when it can."""
    if not profile.exists():
        return f"no latency profile at {profile}"
    measured_on = json.loads(profile.read_text()).get("hardware", {}).get("device_name")
    here = device_name(torch.device("cpu"))
    if measured_on != here:
        return f"{profile} was measured on {measured_on!r}, this host is {here!r}"
    return None


def sweep_argv(args: argparse.Namespace) -> list[str]:
    """The sweep command line this demo stands for."""
    preset = QUICK if args.quick else FULL
    methods = list(preset["methods"])
    problem = profile_problem(args.profile)
    if problem is not None:
        print(
            f"note: {problem}; BASTION runs fixed N=16 only "
            "(bastion-calibrate writes a profile for this host: calibration/profiles/README.md)"
        )
        methods = [m for m in methods if m != "bastion-adaptive"]
        if "bastion-16" not in methods:
            methods.append("bastion-16")
    argv = [
        "--model-path", str(args.target),
        "--draft-model-path", str(args.drafter),
        "--methods", ",".join(methods),
        "--concurrency", preset["concurrency"],
        "--dataset", "humaneval",
        "--adaptive-max-nodes", str(ADAPTIVE_MAX_NODES),
    ]  # fmt: skip
    if problem is None:
        argv += ["--profile", str(args.profile)]
    if args.quick:
        argv += ["--quick"]
    else:
        argv += ["--output-len", str(OUTPUT_LEN), "--min-prompts", str(MIN_PROMPTS)]
    if args.out:
        argv += ["--out", str(args.out)]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Run the demo sweep; its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI variant, under 3 minutes")
    parser.add_argument("--out", type=Path, help="results folder (default: dated, under sweeps/)")
    parser.add_argument("--target", type=Path, default=PAIR / "target")
    parser.add_argument("--drafter", type=Path, default=PAIR / "drafter")
    parser.add_argument("--profile", type=Path, default=PROFILE)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for path in (args.target, args.drafter):
        if not (path / "config.json").exists():
            parser.error(f"no model at {path} (the trained pair belongs in {PAIR})")
    return sweep.main(sweep_argv(args))


if __name__ == "__main__":
    sys.exit(main())
