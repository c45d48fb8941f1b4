"""Start and stop real SGLang servers on 127.0.0.1 for tests (the same launcher users run)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from sweep_server import LAUNCH_SERVER, free_port, running_server
from sweep_server import launch_command as sweep_launch_command

STANDINS = Path(__file__).resolve().parent / "sglang_standins"
# TRITON_INTERPRET: SGLang warms a Triton KV-copy kernel up for every speculative server.
# OMP_NUM_THREADS=1: two OpenMP threads on two shared cores stall whenever another job runs.
SERVER_ENV = {"TRITON_INTERPRET": "1", "SGLANG_BASTION_TOPK": "4", "OMP_NUM_THREADS": "1"}
CPU_ARGS = [
    "--device", "cpu",
    "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled",
    "--dtype", "bfloat16",
    "--max-total-tokens", "4096",
    "--mem-fraction-static", "0.1",
    "--skip-server-warmup",
    "--sleep-on-idle",  # an idle scheduler otherwise spins a whole core; a module keeps several
]  # fmt: skip


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a spawned server: the CPU stand-ins first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDINS), env.get("PYTHONPATH")) if p)
    env.setdefault("SGLANG_PLUGINS", "bastion")  # only this package's plugin, deterministically
    env.update(extra or {})
    return env


SGLANG_SERVE = (str(Path(sys.executable).with_name("sglang")), "serve")  # the console script

# The shipped trained pair and how its test servers are started (the tree lattice's top-8).
TRAINED_PAIR = Path(__file__).resolve().parent.parent / "training" / "pair"
TRAINED_ARGS = ["--attention-backend", "bastion_cpu", "--max-total-tokens", "8192"]
TRAINED_ENV = {**SERVER_ENV, "SGLANG_BASTION_TOPK": "8"}


def launch_command(
    model: Path, args: Sequence[str], port: int, launcher: Sequence[str] = LAUNCH_SERVER
) -> list[str]:
    """The launcher's command line for a CPU test server."""
    return sweep_launch_command(model, [*CPU_ARGS, *args], port, launcher)


@contextlib.contextmanager
def sglang_server(
    model: Path,
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 480.0,
    launcher: Sequence[str] = LAUNCH_SERVER,
) -> Iterator[str]:
    """A running CPU test server's base URL; its process group is killed on exit.

    No grace period: SGLang's launcher answers a SIGTERM to its group with five seconds of
    crash diagnostics, and a test server has nothing to flush.
    """
    with running_server(
        model, [*CPU_ARGS, *args], server_env(env), log_path, timeout_s, launcher, stop_grace_s=0
    ) as url:
        yield url


def run_to_exit(
    model: Path, args: Sequence[str], timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Start a server expected to refuse its arguments; its exit code and output."""
    proc = subprocess.run(
        launch_command(model, args, free_port()),
        capture_output=True,
        text=True,
        env=server_env(env),
        timeout=timeout_s,
        start_new_session=True,
    )
    return proc.returncode, proc.stdout + proc.stderr


def generate(url: str, prompt: str, max_tokens: int, **sampling: object) -> dict:
    """SGLang's native /generate for one prompt; the JSON reply."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, **sampling}}
    reply = requests.post(f"{url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()


def bastion_args(drafter: Path, max_nodes: int) -> list[str]:
    """Launcher arguments for BASTION with trees of up to ``max_nodes`` nodes."""
    return [
        "--speculative-algorithm", "BASTION",
        "--speculative-draft-model-path", str(drafter),
        "--speculative-num-draft-tokens", str(max_nodes),
    ]  # fmt: skip


def dflash_args(drafter: Path) -> list[str]:
    """Launcher arguments for SGLang's own DFLASH with the same drafter."""
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter)]


def complete(url: str, prompt: str, max_tokens: int, **sampling: object) -> tuple[list[int], str]:
    """Greedy generation: output token ids and finish reason."""
    body = generate(url, prompt, max_tokens, temperature=0, **sampling)
    return body["output_ids"], body["meta_info"]["finish_reason"]["type"]


def all_at_once(jobs: Sequence[Callable[[], object]], timeout_s: float = 600) -> list[object]:
    """Start every job in a thread of its own at the same moment; their results, in order."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return [future.result(timeout=timeout_s) for future in [pool.submit(j) for j in jobs]]


def run_all(url: str, requests_kwargs: list[dict], at_once: int = 8) -> list[tuple[list[int], str]]:
    """Send every request, ``at_once`` at a time, and return their results in order."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lambda kw: complete(url, **dict(kw)), requests_kwargs))


def top_tokens(url: str, prompt: str, generated: list[int], n: int = 4) -> list[tuple[float, int]]:
    """The target's ``n`` likeliest next tokens after ``prompt`` + ``generated``: (logprob, id)."""
    prompt_ids = requests.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=60).json()
    body = {
        "input_ids": prompt_ids["tokens"] + generated,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": n,
    }
    reply = requests.post(f"{url}/generate", json=body, timeout=600).json()
    return [(float(lp), int(tok)) for lp, tok, *_ in reply["meta_info"]["output_top_logprobs"][0]]


def tied_tokens(top: list[tuple[float, int]], tolerance: float) -> set[int]:
    """The tokens of (logprob, id) pairs, best first, within ``tolerance`` of the best."""
    return {tok for lp, tok in top if top[0][0] - lp < tolerance}


def assert_same_greedy(
    reference_url: str, prompt: str, got: tuple[list[int], str], want: tuple[list[int], str]
) -> None:
    """Equal greedy outputs, except after a numerical tie of the target's best tokens.

    In bfloat16 on a CPU, SGLang's plain decoding itself is not batch-invariant: when the
    target's best logits are within rounding of each other (two of them, or three), the batch
    a request shares decides the winner. Past such a tie the outputs may differ; anywhere else
    they must not.
    """
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got[0], want[0], strict=False)) if a != b)
    top = top_tokens(reference_url, prompt, want[0][:at])
    assert {got[0][at], want[0][at]} <= tied_tokens(top, 0.05), (
        f"outputs differ at token {at} where the target is not tied: "
        f"best {top}; got {got}, want {want}"
    )


def assert_all_same(reference_url: str, batch: list[dict], got: list, want: list) -> None:
    """`assert_same_greedy` for every request of a batch (``batch`` holds their prompts)."""
    assert len(got) == len(want) == len(batch)
    for request, one, other in zip(batch, got, want, strict=True):
        assert_same_greedy(reference_url, request["prompt"], one, other)


def used_tokens(url: str) -> int:
    """Tokens the server holds in its KV pool beyond the cached prefixes (0 when idle)."""
    requests.post(f"{url}/flush_cache", timeout=60)
    loads = requests.get(f"{url}/v1/loads", params={"include": "core"}, timeout=60).json()
    return int(loads["loads"][0]["num_used_tokens"])


def stream_then_abort(url: str, prompt: str, chunks: int) -> None:
    """Stream a completion and hang up after ``chunks`` chunks (the server aborts it)."""
    with requests.post(
        f"{url}/v1/completions",
        json={"model": "default", "prompt": prompt, "max_tokens": 40, "stream": True},
        stream=True,
        timeout=600,
    ) as reply:
        for i, _ in enumerate(reply.iter_lines()):
            if i >= chunks:
                break
