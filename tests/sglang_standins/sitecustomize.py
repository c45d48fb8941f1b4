"""Test-only stand-ins for SGLang's built-in DFLASH on a CPU host (see README.md here).

Loaded by every Python process started with this folder on PYTHONPATH (the tests' SGLang
servers only). Each patch is applied right after its module is first imported, and each
replaces something that exists only on GPU hosts; none touches this project's code.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace


def _cache_locs_on_cpu(module: ModuleType) -> None:
    """`assign_extend_cache_locs_func` has no plain-CPU branch (it returns None there)."""
    original = module.assign_extend_cache_locs_func

    def assign(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
               draft_token_num, device):  # fmt: skip
        if req_to_token.device.type != "cpu":
            return original(
                req_pool_indices=req_pool_indices, req_to_token=req_to_token,
                start_offset=start_offset, end_offset=end_offset, batch_size=batch_size,
                draft_token_num=draft_token_num, device=device,
            )  # fmt: skip
        import torch

        cols = start_offset.view(-1, 1).long() + torch.arange(draft_token_num)
        return req_to_token[req_pool_indices.view(-1, 1).long(), cols].reshape(-1).long()

    module.assign_extend_cache_locs_func = assign
    worker = sys.modules.get("sglang.srt.speculative.dflash_worker_v2")
    if worker is not None:
        worker.assign_extend_cache_locs_func = assign


def _req_to_token_writes_on_cpu(module: ModuleType) -> None:
    """Decode steps write their new KV slots into `req_to_token` with a GPU Triton kernel.

    A CPU can only interpret it, one program per request and a Python-level loop per 32
    slots: a third of a speculative decode step at concurrency 4 on the development CPU. On
    CPU tensors the same writes are one indexed assignment.
    """
    original = module.assign_req_to_token_pool_func

    def assign(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
               batch_size):  # fmt: skip
        if req_to_token.device.type != "cpu":
            return original(req_pool_indices, req_to_token, start_offset, end_offset,
                            out_cache_loc, batch_size)  # fmt: skip
        import torch

        starts = start_offset[:batch_size].long()
        lengths = end_offset[:batch_size].long() - starts  # [bs]: slots each request gains
        before = torch.cumsum(lengths, 0) - lengths  # [bs]: where its slots start in the list
        rows = torch.repeat_interleave(req_pool_indices[:batch_size].long(), lengths)
        cols = torch.repeat_interleave(starts - before, lengths)
        cols += torch.arange(cols.numel())
        req_to_token[rows, cols] = out_cache_loc[: cols.numel()].to(req_to_token.dtype)
        return None

    module.assign_req_to_token_pool_func = assign


def _dflash_worker_on_cpu(module: ModuleType) -> None:
    """DFLASH calls `record_stream` unconditionally; CPU tensors have no streams."""
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_cpu_standin", False):
        return

    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._cpu_standin = True
    torch.Tensor.record_stream = record_stream

    # DFLASH's drafter runs its fused q/k-norm + rotary as a Triton kernel, which a CPU can
    # only interpret (slowly); run the torch path instead, as BASTION's worker does on CPU.
    original_init = module.DFlashWorkerV2.__init__

    def init(self, *args, **kwargs):
        from sglang_bastion.worker import use_torch_qk_norm_rope

        original_init(self, *args, **kwargs)
        if torch.device(self.device).type == "cpu":
            use_torch_qk_norm_rope(self.draft_model)

    module.DFlashWorkerV2.__init__ = init
    cache_locs = sys.modules.get("sglang.kernels.ops.speculative.cache_locs")
    if cache_locs is not None:
        module.assign_extend_cache_locs_func = cache_locs.assign_extend_cache_locs_func


class _DflashGatePlatform:
    """The CPU platform, presented as out-of-tree and DFLASH-capable for the gate's one check.

    The gate asks ``is_out_of_tree()`` then ``supports_speculative_algorithm()``; answering
    the second puts the real platform back, so everything after the gate sees it unchanged.
    """

    def __init__(self, module: ModuleType, real: object) -> None:
        self._module, self._real = module, real

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        self._module.current_platform = self._real
        return True

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def _dflash_gate_on_cpu(module: ModuleType) -> None:
    """SGLang's DFLASH start-up gate admits only cuda/npu/xpu devices."""
    original = module._handle_dflash

    def handle(server_args):
        real = module.current_platform
        module.current_platform = _DflashGatePlatform(module, real)
        try:
            return original(server_args)
        finally:
            module.current_platform = real

    module._handle_dflash = handle


def _input_embeds_in_model_dtype(module: ModuleType) -> None:
    """The runner casts draft-block `input_embeds` to bfloat16 whatever the model's dtype.

    Only float32 servers differ: Triton runs interpreted on a CPU and its interpreter is wrong
    in bfloat16, so the tests compare speculative serving against Triton in float32, where a
    bfloat16 block would meet float32 weights. The embeddings follow the model's dtype there.
    """
    import torch

    original = module.ModelRunner._extend_forward_kwargs

    def kwargs(self, forward_batch, pp_proxy_tensors):
        out = original(self, forward_batch, pp_proxy_tensors)
        embeds = forward_batch.input_embeds
        plain = embeds is not None and forward_batch.replace_embeds is None
        if plain and embeds.dtype == self.model_config.dtype == torch.float32:
            out["input_embeds"] = embeds  # as computed, not rounded through bfloat16
        return out

    module.ModelRunner._extend_forward_kwargs = kwargs


def _no_nccl_on_cpu(module: ModuleType) -> None:
    """Model-parallel groups ask for a PyNccl communicator on every in-tree platform, CPU too.

    A CPU host has no NCCL; without it the groups use torch.distributed (gloo), as SGLang's
    CPU all-reduce already falls back to. Only ``--tp-size`` above 1 on a CPU reaches this.
    """
    import torch

    original = module.init_model_parallel_group

    def init(*args, **kwargs):
        if not torch.cuda.is_available():
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    module.init_model_parallel_group = init


# --- device graphs, emulated (only with STANDIN_EMULATED_GRAPHS=1) ---------------------------
#
# A CPU host has no CUDA graphs. SGLang's decode graph runner hands each captured callable to
# a pluggable backend (``resolve_decode_backend``); the emulated backend records the callable
# at capture and re-runs it at replay over the runner's static buffers, with the attention
# metadata the capture built (a real graph bakes its kernel arguments in at capture). So what
# a replay does not copy into a captured buffer (the mask, positions, KV slots, lengths)
# shows up as wrong tokens, as on a GPU.


class _CpuGraphDeviceModule:
    """``torch.cpu`` plus the one capture query SGLang's runner asks of a graph device."""

    def __getattr__(self, name: str) -> object:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False


def _emulated_graph_backend(runner: object) -> object:
    """A capture/replay backend for ``runner`` that re-runs the captured forward at replay."""
    import contextlib
    import dataclasses

    import torch
    from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import (
        BaseCudaGraphBackend,
    )

    def leaves() -> list:
        backend = runner._replay_attn_backend()
        return [backend, *(getattr(backend, "attn_backend_list", None) or [])]

    def copy_into(static: object, new: object) -> None:
        if isinstance(static, torch.Tensor):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        elif dataclasses.is_dataclass(static):
            for field in dataclasses.fields(static):
                old = getattr(static, field.name)
                if isinstance(old, torch.Tensor) and getattr(new, field.name) is not None:
                    copy_into(old, getattr(new, field.name))

    class EmulatedGraphBackend(BaseCudaGraphBackend):
        def __init__(self) -> None:
            self.forwards, self.outputs, self.metadata = {}, {}, {}
            runner.device_module = _CpuGraphDeviceModule()

        @contextlib.contextmanager
        def capture_session(self, stream):
            yield

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            # The real backend's warm-up runs settle kernels and allocators; nothing to settle.
            if post_warmup_hook is not None:
                post_warmup_hook()
            self.metadata[shape_key] = [(b, b.forward_metadata) for b in leaves()]
            self.outputs[shape_key] = forward_fn()
            self.forwards[shape_key] = forward_fn

        def can_run(self, forward_batch, shape_key) -> bool:
            return shape_key in self.forwards

        @contextlib.contextmanager
        def replay_session(self):
            yield

        def replay(self, shape_key, static_forward_batch, **kwargs):
            current = [(b, b.forward_metadata) for b in leaves()]
            for backend, metadata in self.metadata[shape_key]:
                backend.forward_metadata = metadata
            try:
                new = self.forwards[shape_key]()
            finally:
                for backend, metadata in current:
                    backend.forward_metadata = metadata
            copy_into(self.outputs[shape_key], new)
            return self.outputs[shape_key]

        def cleanup(self) -> None:
            self.forwards.clear(), self.outputs.clear(), self.metadata.clear()

    return EmulatedGraphBackend()


def _graphs_on_this_platform(module: ModuleType) -> None:
    """The platform says it captures device graphs (they are emulated: see above)."""
    import msgspec

    platform = module.current_platform
    platform.capabilities = msgspec.structs.replace(platform.capabilities, graph_capture=True)


def _emulated_decode_graphs(module: ModuleType) -> None:
    """SGLang's decode graph runner captures and replays through the emulated backend."""

    @contextlib.contextmanager
    def graph_capture(stream=None):
        yield SimpleNamespace(stream=None)

    module.resolve_decode_backend = _emulated_graph_backend
    module.graph_capture = graph_capture
    module.get_or_create_global_graph_capture_stream = lambda: None


def _verify_graphs_on_cpu(module: ModuleType) -> None:
    """A CPU model runner replays verify graphs, as a GPU one does (not only decode)."""
    verify = (module.ForwardMode.DECODE, module.ForwardMode.TARGET_VERIFY)
    module.ForwardMode.is_cpu_graph = lambda self: self in verify


def _stale_verify_mask(module: ModuleType) -> None:
    """Negative control: while the flag file exists, replays keep the mask buffer's contents."""
    original = module.TritonAttnBackend._init_forward_metadata_out_graph
    flag = os.environ["STANDIN_STALE_VERIFY_MASK"]

    def init(self, forward_batch, in_capture):
        spec_info = forward_batch.spec_info
        mask = getattr(spec_info, "custom_mask", None)
        if in_capture or mask is None or not os.path.exists(flag):
            return original(self, forward_batch, in_capture)
        spec_info.custom_mask = None  # the replay then copies no mask in
        try:
            return original(self, forward_batch, in_capture)
        finally:
            spec_info.custom_mask = mask

    module.TritonAttnBackend._init_forward_metadata_out_graph = init


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.distributed.parallel_state": _no_nccl_on_cpu,
    "sglang.srt.model_executor.model_runner": _input_embeds_in_model_dtype,
    "sglang.kernels.ops.speculative.cache_locs": _cache_locs_on_cpu,
    "sglang.srt.mem_cache.allocation": _req_to_token_writes_on_cpu,
    "sglang.srt.speculative.dflash_worker_v2": _dflash_worker_on_cpu,
    "sglang.srt.arg_groups.speculative_hook": _dflash_gate_on_cpu,
}


if os.environ.get("STANDIN_EMULATED_GRAPHS") == "1":
    PATCHES |= {
        "sglang.srt.platforms": _graphs_on_this_platform,
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner": _emulated_decode_graphs,
        "sglang.srt.model_executor.forward_batch_info": _verify_graphs_on_cpu,
    }
    if os.environ.get("STANDIN_STALE_VERIFY_MASK"):  # a flag file's path
        PATCHES["sglang.srt.layers.attention.triton_backend"] = _stale_verify_mask


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a module's patch right after the module executes."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then applies the patch."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


sys.meta_path.insert(0, _PatchAfterImport())
