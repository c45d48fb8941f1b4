"""One SGLang server for a sweep: start on a free 127.0.0.1 port, wait for health, always stop."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

LOWEST_PORT = 20000


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, below the range the OS hands out for port-0 binds.

    A server binds its port tens of seconds after it is chosen; meanwhile any process's bind
    to port 0 (torch.distributed's gloo pairs, ZMQ, another server's internals) takes a port
    from the OS's ephemeral range, where a port chosen that way could be taken first.
    """
    for _ in range(200):
        port = random.randrange(LOWEST_PORT, ephemeral_ports_start())
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port between {LOWEST_PORT} and the ephemeral range")


def ephemeral_ports_start() -> int:
    """The first port of the OS's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


LAUNCH_SERVER = (sys.executable, "-m", "sglang.launch_server")


def launch_command(
    model: Path, args: Sequence[str], port: int, launcher: Sequence[str] = LAUNCH_SERVER
) -> list[str]:
    """The launcher's command line (default ``python -m sglang.launch_server``)."""
    return [
        *launcher,
        "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        *args,
    ]  # fmt: skip


@contextlib.contextmanager
def running_server(
    model: Path,
    args: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float = 600.0,
    launcher: Sequence[str] = LAUNCH_SERVER,
    stop_grace_s: float = 20.0,
    groups: list[int] | None = None,
) -> Iterator[str]:
    """A healthy server's base URL; its whole process group is stopped on exit, whatever happens.

    ``stop_grace_s``: how long the group may take to exit after SIGTERM before SIGKILL;
    ``groups``: where to append the server's process group id (to `pause_group` it).
    """
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # A new session: the launcher's scheduler and detokenizer children share its group.
        proc = subprocess.Popen(
            launch_command(model, args, port, launcher),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, timeout_s)
        if groups is not None:
            groups.append(proc.pid)  # start_new_session: the launcher leads its own group
        yield url
    finally:
        stop_group(proc, stop_grace_s)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Block until ``url`` answers /health, or raise with the tail of the server log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s:\n{log_tail(log_path)}")


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pause_group(pgid: int) -> None:
    """Stop (SIGSTOP) every process of a server's group: an idle SGLang scheduler polls for
    requests on a whole core, which a server measured beside it would lose."""
    os.killpg(pgid, signal.SIGSTOP)


def resume_group(pgid: int) -> None:
    """Continue (SIGCONT) a server's group that `pause_group` stopped."""
    os.killpg(pgid, signal.SIGCONT)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``; reap it."""
    pgid = proc.pid  # start_new_session: the launcher leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)  # a paused group handles its SIGTERM once continued
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def server_info(url: str) -> dict:
    """The server's /server_info reply: its arguments and ``internal_states``."""
    reply = requests.get(f"{url}/server_info", timeout=60)
    reply.raise_for_status()
    return reply.json()


def reset_acceptance(url: str, info: dict) -> None:
    """Zero SGLang's cumulative acceptance counters (``avg_spec_accept_length`` restarts).

    SGLang restarts those counters whenever an accept threshold is set; setting it to the
    value it already has changes nothing else.
    """
    value = info.get("speculative_accept_threshold_single", 1.0)
    body = {"server_args": {"speculative_accept_threshold_single": value}}
    requests.post(f"{url}/set_internal_state", json=body, timeout=60).raise_for_status()


def warm_up(
    url: str, prompts: Sequence[str], concurrency: int, max_tokens: int, temperature: float = 0.0
) -> None:
    """Two rounds of the cell's requests, ``concurrency`` at a time, so first-call costs stay
    out.

    A server pays once for every new pass shape (on CPU, a matmul primitive per token count;
    on GPU, kernel selection): the batch sizes and widths of a cell, met for the first time.
    Two rounds, as in a cell's own run, let requests join and leave at staggered times, so the
    smaller batches of a cell's tail are met too. They are sampled at the cell's
    ``temperature``: what the adaptive controller learned of the warm-up's requests then holds
    for the cell's, as it would for a server that serves such requests all day (greedy
    warm-up requests before a sampled cell would make every cell measure the controller's
    switch from one kind of request to the other).
    """
    body = {"sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}}

    def generate(prompt: str) -> None:
        reply = requests.post(f"{url}/generate", json={"text": prompt, **body}, timeout=600)
        reply.raise_for_status()

    chosen = [prompts[i % len(prompts)] for i in range(2 * concurrency)]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(generate, chosen))
