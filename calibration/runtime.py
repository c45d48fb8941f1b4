"""SGLang's target and BASTION draft workers, stood up in this process as a scheduler would.

The calibration times the passes the server runs, so it builds what SGLang's scheduler builds
from the same server arguments (parsed by SGLang's own parser, so every server flag is
accepted): the target's ``TpModelWorker`` with its ``ModelRunner``, the BASTION worker with
the drafter's runner, the shared KV pools and the attention backends. No HTTP server, tokenizer
manager or scheduler loop is started.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


class CalibrationSetupError(SystemExit):
    """A configuration the calibration cannot run: printed as one line, exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(f"bastion-calibrate: {message}")


@dataclass
class Runtime:
    """The live workers and the resolved server configuration."""

    server_args: Any  # sglang ServerArgs, resolved
    config: Any  # its resolving view: the values the server would run with
    target_worker: Any  # sglang TpModelWorker
    worker: Any  # sglang_bastion.worker.BastionWorker

    @property
    def model_runner(self) -> Any:
        """The target's ModelRunner."""
        return self.target_worker.model_runner

    @property
    def device(self) -> torch.device:
        """The device the target runs on."""
        return torch.device(self.model_runner.device)

    @property
    def dtype(self) -> torch.dtype:
        """The target's compute dtype."""
        return self.model_runner.model_config.dtype

    @property
    def max_tokens(self) -> int:
        """Widest verify pass the server can run: its tree budget N (window slots per request)."""
        return int(self.worker.max_nodes)

    @property
    def window(self) -> int:
        """KV slots reserved per request and step (at least N and the drafter's block)."""
        return int(self.worker.window)

    @property
    def max_context(self) -> int:
        """Longest prefix that leaves room for the window in the model's context and KV row."""
        row = int(self.model_runner.req_to_token_pool.req_to_token.shape[1])
        return min(row, int(self.model_runner.model_config.context_len)) - self.window


def start_runtime(server_argv: list[str]) -> Runtime:
    """Parse SGLang server arguments and build the target and BASTION workers in-process."""
    from sglang.srt.plugins import load_plugins

    from sglang_bastion.options import ENV_MODE, ENV_PROFILE, ENV_TRACE
    from sglang_bastion.plugin import register

    # The passes are timed with a fixed tree size: no profile (possibly the one being
    # replaced) is loaded and no per-step trace is written while calibrating.
    os.environ[ENV_MODE] = "fixed"
    os.environ.pop(ENV_PROFILE, None)
    os.environ.pop(ENV_TRACE, None)
    register()  # BASTION and the bastion_cpu attention backend
    load_plugins()  # applies the plugin's hooks: the target is timed as the server runs it
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_device,
        get_spec,
        publish,
        spawn_world_rank,
    )
    from sglang.srt.server_args import PortArgs, prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    server_args = prepare_server_args(server_argv)
    server_args.resolve_once()
    config = resolving_view(server_args)
    if config.tp_size != 1 or config.pp_size != 1 or config.dp_size != 1:
        raise CalibrationSetupError(
            f"tp/pp/dp sizes {config.tp_size}/{config.pp_size}/{config.dp_size}: in-process "
            "calibration runs one rank; calibrate with --tp-size 1 (multi-rank timing is not "
            "implemented yet)"
        )
    _set_envs_and_config(server_args)
    server_args.check_server_args()
    port_args = PortArgs.init_new(server_args)
    ranks = SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), dp_rank=None, gpu_id=0
    )
    publish(server_args, role="scheduler", ranks=ranks)

    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(
        server_args=server_args, device=get_device().device, dist_port=port_args.nccl_port
    )
    bootstrap.init_layer_runtime(model_config=model_config)
    _init_gemm_configs()

    gpu_id = get_device().gpu_id
    target = TpModelWorker(server_args=server_args, gpu_id=gpu_id, nccl_port=port_args.nccl_port)
    algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    worker_class = algorithm.create_worker(server_args)
    worker = worker_class(
        server_args=server_args, gpu_id=gpu_id, nccl_port=port_args.nccl_port, target_worker=target
    )
    _init_pools_and_backends(target, worker)
    return Runtime(server_args=server_args, config=config, target_worker=target, worker=worker)


def _init_gemm_configs() -> None:
    """The process-wide MoE and GEMM settings a scheduler sets before loading the model."""
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config

    initialize_moe_config()
    initialize_fp8_gemm_config()
    initialize_fp4_gemm_config()
    initialize_bf16_gemm_config()


def _init_pools_and_backends(target: Any, worker: Any) -> None:
    """KV pools, attention backends and graphs, in the scheduler's order."""
    runner = target.model_runner
    runner.account_preloaded_weights(
        target.preloaded_weights_bytes + worker.preloaded_weights_bytes
    )
    target.alloc_memory_pool(draft_parallel_layout=worker.draft_parallel_layout)
    pool, allocator = target.get_memory_pool()
    worker.alloc_memory_pool(
        memory_pool_config=runner.memory_pool_config,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
    )
    worker.init_hicache_draft_plan()
    target.init_attention_backends()
    worker.init_attention_backends()
    with torch.no_grad():
        target.init_cuda_graphs()
        worker.init_cuda_graphs()
