"""``bastion-calibrate``: measure a latency profile for BASTION's budget controller.

Usage::

    bastion-calibrate --model-path TARGET --speculative-draft-model-path DRAFTER
        [any sglang server flag: --dtype, --attention-backend, --tp-size, --device, ...]
        [--quick] [--output PATH] [--batch-sizes ...] [--tokens ...] [--context-lens ...]
        [--repeats R] [--warmup W] [--statistic median|min] [--no-progress]

Server flags are parsed by SGLang's own parser, so the profile is measured with exactly the
configuration the server will run. The tool stands up the target and BASTION workers in this
process, times the grid (measure.py), fits the roofline calibration (budget/profile.py) and
writes the profile JSON and its figure. Ctrl-C stops timing and fits what was measured.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sglang_bastion.calibration.grid import DEFAULT, QUICK, Grid
from sglang_bastion.calibration.timing import STATISTICS

PROFILE_ENV = "SGLANG_BASTION_PROFILE"
EXIT_INTERRUPTED = 130
# Settings that change the timed passes; a server should run with the values calibrated with.
TIMING_ENV = ("OMP_NUM_THREADS", "SGLANG_BASTION_TOPK")


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's own options, and the remaining arguments for SGLang's server parser."""
    parser = argparse.ArgumentParser(
        prog="bastion-calibrate",
        description="Time SGLang's BASTION verify pass on this hardware and write the latency "
        "profile the server's budget controller reads (any sglang server flag is accepted).",
        epilog="Server flags (--model-path, --speculative-draft-model-path, --dtype, "
        "--attention-backend, --tp-size, --device, ...) go to SGLang's own parser: pass the "
        f"ones the server will run with. Serve with {PROFILE_ENV}=<profile.json>. On a CPU "
        "the CPU serving recipe is filled in (bastion_cpu attention, no CUDA graphs, a KV pool "
        "for the grid); a CPU shared with other jobs times more reliably with "
        "OMP_NUM_THREADS=1 (then serve with it too) and --statistic min.",
    )
    parser.add_argument("--quick", action="store_true", help="small grid, for CI and CPUs")
    parser.add_argument("--output", type=Path, help="profile JSON path (figure: same name, .png)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes to time")
    parser.add_argument("--tokens", type=int, nargs="+", help="tokens per request (tree widths)")
    parser.add_argument("--context-lens", type=int, nargs="+", help="prefix lengths to time")
    parser.add_argument("--repeats", type=int, help="timed runs per shape, one per round")
    parser.add_argument("--warmup", type=int, help="untimed runs before each shape")
    parser.add_argument(
        "--statistic",
        choices=STATISTICS,
        default="median",
        help="summary of a shape's timed runs: median (default), or min on a host shared "
        "with other jobs",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_known_args(list(argv))


def choose_grid(args: argparse.Namespace) -> Grid:
    """The default or quick grid with any axis the command line overrides."""
    base = QUICK if args.quick else DEFAULT
    overrides = {
        "batch_sizes": tuple(args.batch_sizes) if args.batch_sizes else None,
        "tokens": tuple(args.tokens) if args.tokens else None,
        "context_lens": tuple(args.context_lens) if args.context_lens else None,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` (as ``--flag v`` or ``--flag=v``), else None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def server_argv(argv: Sequence[str], grid: Grid) -> list[str]:
    """SGLang server arguments: the user's, plus BASTION and the defaults calibration needs."""
    argv = list(argv)

    def default(flag: str, *value: str) -> None:
        if _flag_value(argv, flag) is None and flag not in argv:
            argv.extend([flag, *value])

    default("--speculative-algorithm", "BASTION")
    default("--speculative-num-draft-tokens", str(max(grid.tokens)))
    default("--log-level", "warning")
    if _flag_value(argv, "--device") == "cpu":
        # The CPU recipe of the server (README): a tree-mask backend, no CUDA graphs, and a KV
        # pool large enough for the largest batch at the longest context.
        from sglang_bastion.spec_algo import drafter_block_size

        drafter = _flag_value(argv, "--speculative-draft-model-path")
        tokens = int(_flag_value(argv, "--speculative-num-draft-tokens") or max(grid.tokens))
        window = max(tokens, drafter_block_size(drafter) if drafter else 16)
        kv_tokens = max(grid.batch_sizes) * (max(grid.context_lens) + window) + 1024
        default("--attention-backend", "bastion_cpu")
        if "--disable-cuda-graph" not in argv:  # SGLang's deprecated spelling of the two
            default("--cuda-graph-backend-decode", "disabled")
            default("--cuda-graph-backend-prefill", "disabled")
        default("--mem-fraction-static", "0.1")
        default("--max-total-tokens", str(kv_tokens))
    # Every grid batch must fit the request pool (BASTION's own default is at most 48).
    default("--max-running-requests", str(max(grid.batch_sizes)))
    return argv


def serve_command(user_argv: Sequence[str], used_argv: Sequence[str]) -> list[str]:
    """The user's server flags plus the defaults that the profile's identity depends on."""
    argv = list(user_argv)
    for flag in ("--speculative-algorithm", "--attention-backend"):
        value = _flag_value(used_argv, flag)
        if value is not None and _flag_value(argv, flag) is None:
            argv.extend([flag, value])
    return argv


def serve_env(profile: Path) -> str:
    """The environment assignments to serve with: the profile, and timing-relevant settings."""
    pairs = [(PROFILE_ENV, str(profile))]
    pairs += [(name, os.environ[name]) for name in TIMING_ENV if os.environ.get(name)]
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in pairs)


def default_output(config: object, device_name: str) -> Path:
    """bastion-profile-<target>-<device>.json in the working directory."""
    target = Path(str(config.model_path).rstrip("/")).name  # type: ignore[attr-defined]
    slug = re.sub(r"[^a-z0-9]+", "-", f"{target}-{device_name}".lower()).strip("-")
    return Path(f"bastion-profile-{slug}.json")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; 0 on success, 130 when Ctrl-C cut the grid short (profile kept)."""
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    grid = choose_grid(args)
    argv_server = server_argv(rest, grid)
    if _flag_value(argv_server, "--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before SGLang imports Triton
    started = time.perf_counter()
    # Heavy imports (SGLang, the workers) only now, so --help stays instant.
    import torch

    from sglang_bastion.calibration.report import measurement_table, write_profile
    from sglang_bastion.calibration.runtime import start_runtime

    runtime = start_runtime(argv_server)
    grid = grid.fitted_to(runtime.max_tokens, runtime.max_context)
    with torch.no_grad():  # verify graphs at the grid's widths, as a server at those widths runs
        runtime.worker.capture_tree_verify_graphs(grid.tokens)
    print(
        f"bastion-calibrate: timing {len(grid.batch_sizes)} batch sizes x {len(grid.tokens)} "
        f"widths x {len(grid.context_lens)} context lengths ({grid.num_timings} passes, "
        f"{grid.warmup} warm-up + {grid.repeats} timed runs each, in {grid.repeats} rounds over "
        "the grid); Ctrl-C stops and keeps what was measured",
        file=sys.stderr,
        flush=True,
    )
    from sglang_bastion.calibration.measure import measure

    measured = measure(runtime, grid, statistic=args.statistic, progress=not args.no_progress)
    try:
        outcome = write_profile(runtime, measured, args.output, default_output)
    except ValueError as err:  # the fit failed (e.g. latency flat in the grid): show the data
        print(measurement_table(measured), file=sys.stderr)
        print(f"bastion-calibrate: cannot fit a profile: {err}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    if outcome is None:
        print(
            "bastion-calibrate: interrupted before two verify widths, T_aux and L_AR were "
            "timed: nothing to fit, no profile written",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    profile, json_path, png_path = outcome
    cal = profile.calibration
    done = (
        f"{len(profile.grid)} verify shapes timed ({measured.rounds} full rounds, "
        f"{measured.statistic} kept) in {elapsed:.0f} s"
    )
    if measured.interrupted:
        done += " (interrupted by Ctrl-C: partial grid)"
    for skipped in measured.skipped:
        print(f"bastion-calibrate: skipped {skipped}", file=sys.stderr)
    print(
        f"bastion-calibrate: {done}\n"
        f"  fit: verify ms = {cal.slope:.4g} x roofline + {cal.intercept_ms:.4g}; RMSE "
        f"{profile.rmse_roofline_ms:.4g} ms (bare roofline) -> {profile.rmse_calibrated_ms:.4g} "
        "ms (calibrated)\n"
        f"  profile: {json_path}\n"
        f"  figure:  {png_path}\n"
        "Serve with it (the profile must match the target, drafter, dtype, attention backend "
        "and TP size):\n"
        f"  {serve_env(json_path)} python -m sglang.launch_server "
        f"{shlex.join(serve_command(rest, argv_server))}"
    )
    return EXIT_INTERRUPTED if measured.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
