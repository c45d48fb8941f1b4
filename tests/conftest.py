"""Shared fixtures; the tests' helper modules are importable as plain modules."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# SGLang's Triton kernels can only be interpreted on a CPU; the flag must precede their import.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

FEW_TOKENS = (300, 301, 302, 303)


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 target that emits one of four tokens, and a DFlash drafter for it."""
    from tiny_models import write_drafter, write_target

    root = tmp_path_factory.mktemp("pair")
    target = write_target(root / "target", few_tokens=FEW_TOKENS)
    return target, write_drafter(root / "drafter", target)


@pytest.fixture(scope="session")
def plain_url(tmp_path_factory) -> Iterator[str]:
    """The trained target without speculation on SGLang's synchronous schedule: the reference.

    Its default overlapped schedule counts each output token into the penalties one step late,
    and the prompt's last token at the first step (``ScheduleBatch.cumulate_penalty_output_tokens``
    reads ``req.output_ids[-1]`` before the previous step's result is processed); BASTION, like
    the synchronous plain server, penalises each token from the step after it was emitted.
    One server for the whole run: every module that compares with it sends its own prompts.
    """
    from server_utils import TRAINED_ARGS, TRAINED_ENV, TRAINED_PAIR, sglang_server

    log = tmp_path_factory.mktemp("plain") / "plain.log"
    args = [*TRAINED_ARGS, "--disable-overlap-schedule"]
    with sglang_server(TRAINED_PAIR / "target", args, log, env=TRAINED_ENV) as url:
        yield url


@pytest.fixture(scope="session")
def fixed_server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(URL, log) of BASTION on the trained pair with trees of 16 nodes, SGLang's defaults."""
    from server_utils import TRAINED_ARGS, TRAINED_ENV, TRAINED_PAIR, bastion_args, sglang_server

    log = tmp_path_factory.mktemp("fixed") / "bastion.log"
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 16)]
    with sglang_server(TRAINED_PAIR / "target", args, log, env=TRAINED_ENV) as url:
        yield url, log


@pytest.fixture(scope="session")
def triton_plain_url(tmp_path_factory) -> Iterator[str]:
    """The trained target without speculation on SGLang's Triton backend, in float32.

    Triton runs interpreted on a CPU and its interpreter is wrong in bfloat16, so the servers
    that run it (``test_server_cpu_backend``, ``test_server_verify_graphs``) serve float32.
    """
    from server_utils import SERVER_ENV, TRAINED_PAIR, sglang_server

    log = tmp_path_factory.mktemp("triton") / "plain.log"
    args = ["--attention-backend", "triton", "--dtype", "float32"]
    with sglang_server(TRAINED_PAIR / "target", args, log, env=SERVER_ENV) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_pair_profile(tmp_path_factory) -> Path:
    """A tiny-pair profile measured on this CPU kind: shipped, kept as test data, or fresh.

    A profile names the device it was measured on and the server refuses it elsewhere. The
    shipped one (calibration/profiles) and the quick ones in tests/data/profiles (one per CPU
    model CI has run on) are taken when their device is this host's; on any other CPU model
    the tests calibrate the trained pair here (the quick grid, with a KV pool that holds
    every grid point: a skipped point leaves no grid residual).
    """
    import json
    import shutil
    import subprocess

    import torch
    from server_utils import CPU_ARGS, SERVER_ENV, server_env

    from sglang_bastion.budget.identity import device_name

    root = Path(__file__).resolve().parent.parent
    shipped, pair = (
        root / "calibration" / "profiles" / "tiny-pair-cpu.json",
        root / "training" / "pair",
    )
    here = device_name(torch.device("cpu"))
    for known in (shipped, *sorted((root / "tests" / "data" / "profiles").glob("*.json"))):
        if json.loads(known.read_text())["hardware"]["device_name"] == here:
            return known
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    command = [
        shutil.which("bastion-calibrate") or "bastion-calibrate",
        "--quick",
        "--no-progress",
        "--model-path",
        str(pair / "target"),
        "--speculative-draft-model-path",
        str(pair / "drafter"),
        "--output",
        str(out),
        *CPU_ARGS,
        "--attention-backend",
        "bastion_cpu",
        "--max-total-tokens",
        "16384",  # room for every grid point
    ]
    env = server_env({**SERVER_ENV, "SGLANG_BASTION_TOPK": "8"})
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=900)
    return out
