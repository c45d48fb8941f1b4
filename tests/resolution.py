"""SGLang's argument resolution for a CPU BASTION server, in this process, as a launcher does it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_bastion.options import ENV_PUBLISHED

PAIR = Path(__file__).resolve().parent.parent / "training" / "pair"


def resolved_bastion_args(extra: Sequence[str] = ()) -> Any:
    """The resolving view of a CPU BASTION server's arguments for the trained pair and ``extra``.

    The resolution publishes BASTION's options into the environment, as a launcher does; the
    value published before is restored afterwards.
    """
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_bastion.plugin import register

    register()
    argv = ["--model-path", str(PAIR / "target"), "--device", "cpu",
            "--speculative-algorithm", "BASTION",
            "--speculative-draft-model-path", str(PAIR / "drafter"), *extra]  # fmt: skip
    published = os.environ.get(ENV_PUBLISHED)
    server_args = prepare_server_args(argv)
    try:
        server_args.resolve_once()
    finally:
        os.environ.pop(ENV_PUBLISHED, None)
        if published is not None:
            os.environ[ENV_PUBLISHED] = published
    return resolving_view(server_args)
