"""Concurrency sweep: one real SGLang server per method, driven by SGLang's own benchmark.

python benchmarks/sweep.py --model-path T --draft-model-path D \
    [--eagle-draft-model-path E] [--methods none,dflash,bastion-16,bastion-32,bastion-adaptive] \
    [--concurrency 1,4,16] [--num-prompts P] [--output-len L] [--temperature X] \
    [--dataset humaneval|prompts.jsonl] [--workload streaming|short] \
    [--profile latency_profile.json] [--out DIR] [--quick] \
    [--repeats R] [-- extra launch_server arguments]

For each method it starts ``python -m sglang.launch_server`` on a free 127.0.0.1 port, waits
for /health, runs ``sglang.bench_serving`` at each concurrency and stops the server's whole
process group, also on failure, Ctrl-C or SIGTERM. Each (method, concurrency) cell records output
tokens/s, requests/s, TTFT and inter-token latency (mean, p50, p99), the average acceptance
length and the mean tree size; ``--workload short`` sends the prompts' first 3 lines and takes
each reply whole (non-streaming) instead; results go to
benchmarks/results/sweeps/<date>_<hardware>_<model>/sweep.{json,csv,md,png}. A rerun with the
same folder skips the cells already measured with the same server setup. With ``--repeats R``
the whole sweep runs R times into <folder>/r1..rR, each round starting the methods at a
different point of the list (round i is rotated by i*M/R of M methods), so slow drift of a
shared host's load falls on every method alike; <folder>/medians.{md,png} then compare each
method's median with the best fixed tree size's (`sweep_medians.py`). ``bastion-adaptive`` runs
the worker's default controller mode (or ``--adaptive-mode``); ``bastion-adaptive-static``,
``-ema`` and ``-ema_calib`` name a mode each, so one sweep can compare them side by side, and a
``-sync`` suffix on any method runs it on SGLang's synchronous schedule
(``--disable-overlap-schedule``) beside the default overlapped one. With ``--interleave`` every
method's server starts once and the rounds are measured cell by cell: at each concurrency the
methods follow one another (in the round's rotated order), each server paused with SIGSTOP
while another is measured (an idle SGLang scheduler polls on a whole core), so a drift of the
host's speed falls on neighbouring cells of every method, not on one method's whole block.
Without a visible CUDA device every method runs with the CPU recipe (bastion_cpu attention,
bfloat16, TRITON_INTERPRET=1). Every server runs at one ``--max-running-requests`` (default 48),
so the methods compare at equal batch sizes; medians.md ends with the never-slower table
(`sweep_never_slower.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, machine
from sweep_bench import (
    BENCH_MODULE,
    bench_argv,
    load_prompts,
    run_bench,
    short_prompts,
    write_bench_dataset,
)
from sweep_methods import (
    Method,
    largest_window,
    parse_methods,
    pool_tokens,
    server_setup,
    trace_env,
)
from sweep_metrics import cell_metrics
from sweep_report import ResultStore, folder_name, model_name, write_reports
from sweep_server import (
    pause_group,
    reset_acceptance,
    resume_group,
    running_server,
    server_info,
    warm_up,
)
from tqdm import tqdm

SWEEPS = RESULTS / "sweeps"
WORKLOADS = RESULTS / "workloads"  # bench_serving datasets, named by their hash
DEFAULT_METHODS = "none,dflash,bastion-16,bastion-32,bastion-adaptive"
WORKLOADS_NAMED = ("streaming", "short")
# Every method serves at one --max-running-requests, so that at high concurrency the methods
# compare at the same batch size: SGLang caps DFLASH (and BASTION follows) at 48 while a server
# without speculation takes up to 2048, so at C=64 they would otherwise batch 48 against 64.
EQUAL_CAP = 48


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options; everything after ``--`` goes to every server unchanged."""
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="target model (path or hub id)")
    parser.add_argument("--draft-model-path", help="DFlash drafter (dflash, bastion-*)")
    parser.add_argument("--eagle-draft-model-path", help="EAGLE3 drafter (adds method eagle3)")
    parser.add_argument("--methods", default=None, help=f"comma list (default {DEFAULT_METHODS})")
    parser.add_argument("--concurrency", default="1,4,16", help="comma list of max concurrency")
    parser.add_argument("--num-prompts", type=int, help="per cell (default max(min, 2C))")
    parser.add_argument("--min-prompts", type=int, default=8, help="fewest prompts per cell")
    parser.add_argument("--output-len", type=int, default=None, help="tokens (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dataset", default="humaneval", help="humaneval or a JSONL of prompts")
    parser.add_argument(
        "--workload", choices=WORKLOADS_NAMED, default="streaming",
        help="streaming: whole prompts, replies streamed; short: their first 3 lines, "
        "whole replies (non-streaming)",
    )  # fmt: skip
    parser.add_argument("--profile", type=Path, help="latency profile for bastion-adaptive")
    parser.add_argument("--adaptive-max-nodes", type=int, help="N_max of bastion-adaptive")
    parser.add_argument("--adaptive-mode", help="controller mode of bastion-adaptive (static...)")
    parser.add_argument("--out", type=Path, help="results folder (default: dated, under sweeps/)")
    parser.add_argument("--quick", action="store_true", help="max(2, C) prompts of 32 tokens (CI)")
    parser.add_argument("--server-timeout", type=float, default=600.0, help="start-up limit, s")
    parser.add_argument("--repeats", type=int, default=1, help="rounds in rotated method orders")
    parser.add_argument(
        "--interleave", action="store_true",
        help="start every method's server once and measure the rounds cell by cell, method "
        "after method, each server paused (SIGSTOP) while another is measured",
    )  # fmt: skip
    parser.add_argument(
        "--trace-dir", type=Path, default=None,
        help="each BASTION server appends its step trace (SGLANG_BASTION_TRACE) to "
        "TRACE_DIR/<method>.jsonl; its host syncs slow the steps it times",
    )  # fmt: skip
    parser.add_argument(
        "--max-running-requests", type=int, default=EQUAL_CAP,
        help=f"one cap for every server (default {EQUAL_CAP}: SGLang's DFLASH default, which "
        "BASTION takes too); 0: each server its own default",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.extra = extra
    if args.methods is None:
        args.methods = DEFAULT_METHODS if args.profile else DEFAULT_METHODS.rsplit(",", 1)[0]
        if args.eagle_draft_model_path:
            args.methods += ",eagle3"
    return args


def prompts_per_cell(args: argparse.Namespace, concurrency: int) -> int:
    """Requests sent at ``concurrency``: --num-prompts, else enough to keep it busy."""
    if args.num_prompts:
        return args.num_prompts
    return max(2, concurrency) if args.quick else max(args.min_prompts, 2 * concurrency)


def cap_args(args: argparse.Namespace) -> list[str]:
    """The launcher arguments that give every server the sweep's one request cap (if any)."""
    cap = args.max_running_requests
    return ["--max-running-requests", str(cap)] if cap else []


def pool_args(
    args: argparse.Namespace, prompts: list[dict], methods: list[Method], on_cpu: bool
) -> list[str]:
    """On a CPU, the --max-total-tokens that lets every server batch the sweep's cap.

    The CPU recipe's pool (8192 tokens) holds about 38 HumanEval requests without speculation
    and 30 with a 32-token window, so at C=64 the pool, not the cap, would set each method's
    batch size, and the methods would again compare at different batch sizes.
    """
    if not on_cpu or not args.max_running_requests:
        return []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    longest = max(len(tokenizer(p["prompt"])["input_ids"]) for p in prompts)
    window = largest_window(methods)
    tokens = pool_tokens(args.max_running_requests, longest, args.output_len, window)
    return ["--max-total-tokens", str(tokens)]


def cuda_visible() -> bool:
    """Whether this machine has a CUDA device (else every server runs the CPU recipe)."""
    import torch

    return torch.cuda.is_available()


def hardware() -> str:
    """A short name of the accelerator the servers use: GPU model and count, or CPU cores."""
    if not cuda_visible():
        return f"cpu{len(os.sched_getaffinity(0))}"
    try:  # nvidia-smi, so this process never holds GPU memory the servers could use
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        names = subprocess.run(query, capture_output=True, text=True, check=True).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.CalledProcessError):
        names = ["GPU"]
    import torch

    count, name = torch.cuda.device_count(), names[0].replace("NVIDIA ", "")
    return f"{count}x{name}" if count > 1 else name


def measure_method(
    method: Method,
    concurrencies: list[int],
    args: argparse.Namespace,
    store: ResultStore,
    dataset: Path,
    warmup_prompts: list[str],
    progress: tqdm,
) -> None:
    """Start the method's server, measure every missing concurrency, stop the server."""
    with method_server(method, args, store.folder / "logs", progress) as url:
        for concurrency in concurrencies:
            measure_cell(method, url, concurrency, args, store, dataset, warmup_prompts, progress)
    progress.write(f"[{method.name}] server stopped")


@contextlib.contextmanager
def method_server(
    method: Method, args: argparse.Namespace, logs: Path, progress: tqdm,
    groups: list[int] | None = None,
) -> Iterator[str]:  # fmt: skip
    """The method's running server (its URL), with the sweep's cap, pool and extra arguments."""
    limits = cap_args(args) + args.pool
    server_args, env = server_setup(method, limits + args.extra, not cuda_visible())
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        env |= trace_env(method, args.trace_dir)
    started = time.monotonic()
    progress.write(f"[{method.name}] starting server ({' '.join(method.args) or 'no speculation'})")
    with running_server(
        Path(args.model_path), server_args, env, logs / f"{method.name}.server.log",
        args.server_timeout, groups=groups,
    ) as url:  # fmt: skip
        progress.write(f"[{method.name}] healthy after {time.monotonic() - started:.0f} s at {url}")
        yield url


def measure_cell(
    method: Method, url: str, concurrency: int, args: argparse.Namespace, store: ResultStore,
    dataset: Path, warmup_prompts: list[str], progress: tqdm,
) -> None:  # fmt: skip
    """Warm the server up at ``concurrency``, measure the cell with bench_serving, store it."""
    logs = store.folder / "logs"
    progress.set_description(f"{method.name} C={concurrency}")
    num_prompts = prompts_per_cell(args, concurrency)
    # Requests at the cell's concurrency and length first: the batch sizes and tree
    # widths of the cell are then no longer new to the server when it is measured.
    warm_up(url, warmup_prompts, concurrency, args.output_len, args.temperature)
    reset_acceptance(url, server_info(url))
    before = server_info(url)
    argv = bench_argv(
        url, args.model_path, dataset, num_prompts, args.output_len, concurrency,
        args.temperature, logs / f"{method.name}.c{concurrency}.bench.jsonl",
        stream=args.workload == "streaming",
    )  # fmt: skip
    result = run_bench(argv, logs / f"{method.name}.c{concurrency}.bench.log")
    after = server_info(url)
    cell = cell_metrics(method.name, method.algorithm, concurrency, result, before, after)
    # On a shared machine other work skews throughput: keep its load with the cell.
    load = os.getloadavg()[0]
    cell |= {"num_prompts": num_prompts, "load_1m": load, "server": method.setup()}
    store.add(cell)
    progress.update(1)
    progress.write(
        f"[{method.name}] C={concurrency}: {cell['output_tok_s']:.1f} tok/s, "
        f"accept {cell['accept_len'] or float('nan'):.2f}, "
        f"tree {cell['tree_size'] or float('nan'):.1f} ({num_prompts} prompts)"
    )


def round_orders(names: list[str], repeats: int) -> list[list[str]]:
    """The method order of each round: round i starts i * M / R methods into the list."""
    starts = [i * len(names) // repeats for i in range(repeats)]
    return [names[k:] + names[:k] for k in starts]


def run_rounds(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """Run the sweep ``args.repeats`` times in rotated orders; write the medians beside them."""
    from sweep_medians import write_medians

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    accelerator = hardware()
    folder = args.out or SWEEPS / (default_folder_name(args, accelerator) + f"_x{args.repeats}")
    failed: list[str] = []
    rounds = []
    if args.interleave:
        rounds, failed = run_interleaved(args, folder, names)
    else:
        for i, order in enumerate(round_orders(names, args.repeats), start=1):
            print(f"round {i} of {args.repeats}: {', '.join(order)}", file=sys.stderr)
            done, failed_here = run_sweep(round_namespace(args, folder, i), order)
            rounds.append(done)
            failed += [m for m in failed_here if m not in failed]
    title = f"Medians of {args.repeats} sweeps: {model_name(args.model_path)} on {accelerator}"
    print(write_medians(rounds, folder, title, machine()["command"]))
    print(f"medians: {folder / 'medians.md'}")
    return folder, failed


def round_namespace(args: argparse.Namespace, folder: Path, index: int) -> argparse.Namespace:
    """A copy of ``args`` writing round ``index`` into ``folder``/r<index>."""
    round_args = argparse.Namespace(**vars(args))
    round_args.out = folder / f"r{index}"
    return round_args


def default_folder_name(args: argparse.Namespace, accelerator: str) -> str:
    """The dated results folder name for this accelerator and model (``_quick`` when quick)."""
    return folder_name(accelerator, args.model_path) + ("_quick" if args.quick else "")


@dataclass
class SweepSetup:
    """What a sweep's measurement needs, read once from its arguments."""

    names: list[str]  # the methods as the command line lists them
    methods: list[Method]  # in the order they run
    concurrencies: list[int]
    prompts: list[dict]
    store: ResultStore
    dataset: Path  # bench_serving's dataset file
    title: str


def sweep_setup(args: argparse.Namespace, order: list[str] | None = None) -> SweepSetup:
    """Parse the methods (in ``order``, if given), the prompts and the results folder."""
    if args.quick:
        args.output_len = args.output_len or 32
    args.output_len = args.output_len or 128
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    drafter = Path(args.draft_model_path) if args.draft_model_path else None
    eagle = Path(args.eagle_draft_model_path) if args.eagle_draft_model_path else None
    methods = parse_methods(
        order or names, drafter, eagle, args.profile, args.adaptive_max_nodes, args.adaptive_mode
    )

    meta = machine() | {"hardware": hardware()}
    folder = args.out or SWEEPS / default_folder_name(args, meta["hardware"])
    num_prompts_text = str(args.num_prompts) if args.num_prompts else (
        "max(2, C)" if args.quick else f"max({args.min_prompts}, 2C)"
    )  # fmt: skip
    config = {
        "model": args.model_path,
        "drafter": args.draft_model_path,
        "eagle_drafter": args.eagle_draft_model_path,
        "profile": str(args.profile) if args.profile else None,
        "dataset": args.dataset,
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "num_prompts_text": num_prompts_text,
        "quick": args.quick,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "extra": args.extra,
        "max_running_requests": args.max_running_requests or "each server's default",
        "on_cpu": not cuda_visible(),
        "methods": names,
        "concurrency": concurrencies,
    }
    prompts = load_prompts(args.dataset)
    if args.workload == "short":
        prompts = short_prompts(prompts)
    args.pool = pool_args(args, prompts, methods, not cuda_visible())
    config["max_total_tokens"] = int(args.pool[1]) if args.pool else "each server's default"
    store = ResultStore(folder, config, meta)
    # Under the results folder the workload is stored once for every sweep (by its hash).
    workloads = WORKLOADS if folder.resolve().is_relative_to(SWEEPS.resolve()) else folder
    dataset = write_bench_dataset(prompts, workloads)
    title = f"Concurrency sweep: {model_name(args.model_path)} on {meta['hardware']}"
    return SweepSetup(names, methods, concurrencies, prompts, store, dataset, title)


def run_sweep(args: argparse.Namespace, order: list[str] | None = None) -> tuple[Path, list[str]]:
    """Measure every missing cell (methods in ``order``, if given); the folder and failures."""
    setup = sweep_setup(args, order)
    store, names, concurrencies = setup.store, setup.names, setup.concurrencies
    # bench_serving takes ~15 s to import on a small CPU: overlap that with the first start-up.
    threading.Thread(target=importlib.import_module, args=(BENCH_MODULE,), daemon=True).start()
    total = len(setup.methods) * len(concurrencies)
    done = sum(store.has(m.name, c, m.setup()) for m in setup.methods for c in concurrencies)
    failed: list[str] = []
    with tqdm(total=total, initial=done, unit="cell", file=sys.stderr) as progress:
        if done:
            progress.write(f"resuming {store.folder}: {done} of {total} cells already measured")
        for method in setup.methods:
            missing = [c for c in concurrencies if not store.has(method.name, c, method.setup())]
            if not missing:
                continue
            try:
                # Warm-up prompts from the end: the cells' own prompts start at the top.
                warm = [p["prompt"] for p in setup.prompts[-2 * max(missing) :]]
                measure_method(method, missing, args, store, setup.dataset, warm, progress)
            except Exception as error:  # one broken method must not lose the others
                progress.write(f"[{method.name}] FAILED: {error}")
                failed.append(method.name)
            finally:
                write_reports(store, names, setup.title)
    print(write_reports(store, names, setup.title))
    print(f"results: {store.folder}")
    return store.folder, failed


def run_interleaved(
    args: argparse.Namespace, folder: Path, names: list[str]
) -> tuple[list[Path], list[str]]:
    """Every method's server at once, each paused while another is measured; in each round
    every concurrency is measured method after method (rotated per round, as `round_orders`),
    so a drift of a shared host's speed falls between a cell and its neighbours, not between
    one method's cells and another's. The round folders and the failed methods."""
    orders = round_orders(names, args.repeats)
    # The servers and cells take the first round's arguments: sweep_setup adds the KV pool
    # and the output length to them.
    rounds = [round_namespace(args, folder, i) for i in range(1, len(orders) + 1)]
    setups = [sweep_setup(r, order) for r, order in zip(rounds, orders, strict=True)]
    args, first = rounds[0], setups[0]
    threading.Thread(target=importlib.import_module, args=(BENCH_MODULE,), daemon=True).start()
    failed: list[str] = []
    total = len(first.methods) * len(first.concurrencies) * len(setups)
    warm = [p["prompt"] for p in first.prompts[-2 * max(first.concurrencies) :]]
    with contextlib.ExitStack() as servers, tqdm(total=total, unit="cell", file=sys.stderr) as bar:
        running: dict[str, tuple[str, int]] = {}  # method name -> (URL, process group)
        for method in first.methods:
            groups: list[int] = []
            try:
                logs = folder / "logs"
                url = servers.enter_context(method_server(method, args, logs, bar, groups))
            except Exception as error:  # one broken method must not lose the others
                bar.write(f"[{method.name}] FAILED: {error}")
                failed.append(method.name)
                continue
            pause_group(groups[0])
            running[method.name] = (url, groups[0])
        for i, setup in enumerate(setups, start=1):
            bar.write(f"round {i} of {len(setups)}: {', '.join(orders[i - 1])}")
            for concurrency in setup.concurrencies:
                for method in setup.methods:
                    if method.name not in running or method.name in failed:
                        continue
                    if setup.store.has(method.name, concurrency, method.setup()):
                        bar.update(1)
                        continue
                    url, group = running[method.name]
                    resume_group(group)
                    try:
                        measure_cell(
                            method, url, concurrency, args, setup.store, setup.dataset, warm, bar
                        )  # fmt: skip
                    except Exception as error:
                        bar.write(f"[{method.name}] FAILED: {error}")
                        failed.append(method.name)
                    finally:
                        pause_group(group)
            print(write_reports(setup.store, setup.names, setup.title))
    return [setup.store.folder for setup in setups], failed


def main(argv: list[str] | None = None) -> int:
    """Run the sweep from the command line; non-zero exit when a method failed."""
    # A plain SIGTERM unwinds like Ctrl-C, so every running server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _, failed = run_rounds(args) if args.repeats > 1 or args.interleave else run_sweep(args)
    if failed:
        print(f"failed methods: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
