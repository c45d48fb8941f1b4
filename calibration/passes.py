"""The passes a BASTION decode step runs, set up for B requests at prefix length c, to be timed.

``StepShapes`` reserves KV slots for B requests (the prefix and the step's window, through the
target's req_to_token pool and KV allocator, as the scheduler does; the drafter's KV pool
shares those indices) and builds the decode ScheduleBatch the scheduler would hand the worker.
The KV contents are whatever the pools hold: the cost of a pass does not depend on them.
What is timed is the worker's own code (sglang_bastion/worker.py), not a copy of it:

- step(t): one whole BASTION decode step (``_tree_step``) with the worker's fixed budget set to
  t nodes per request. Inside it, everything the step's cost owes to its trees
  (``_verify_trees``: verify inputs, the target's TARGET_VERIFY forward over the B trees with
  the tree mask, the target's tokens, acceptance, KV moves) is timed on its own: that is
  T_verify(B, t, c), the span the worker itself times for its EMA. The rest of the cycle (the
  drafter's block pass and draft head, tree building, the decision, the draft KV write) is
  T_aux;
- decode: one plain autoregressive target step (DECODE forward mode), L_AR.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from sglang_bastion.calibration.runtime import Runtime
from sglang_bastion.calibration.timing import synchronize


class VerifyClock:
    """Adds up the worker's tree-dependent span while the context is open.

    The worker reports each step's span through its ``verify_listener`` hook (it synchronises
    the device around ``_verify_trees`` and times it, as it does for the EMA modes).
    """

    def __init__(self, worker: Any, device: torch.device) -> None:
        self.worker, self.device = worker, device
        self.verify_ms = 0.0
        self.width = 0  # tokens per request the step verified (W)

    def record(self, width: int, verify_ms: float) -> None:
        """The worker's hook: one step verified ``width`` tokens per request in ``verify_ms``."""
        self.width = width
        self.verify_ms += verify_ms

    def __enter__(self) -> VerifyClock:
        self.worker.verify_listener = self.record
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.verify_listener = None


class StepShapes:
    """KV slots and decode batches for B requests at prefix length c; ``release`` frees them."""

    def __init__(self, runtime: Runtime, batch_size: int, context_len: int) -> None:
        self.runtime = runtime
        self.worker = runtime.worker
        self.batch_size, self.context_len = batch_size, context_len
        runner = runtime.model_runner
        self._pool, self._allocator = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        span = context_len + runtime.window  # prefix, then the step's window
        self._rows = self._pool.alloc_rows(batch_size)
        if self._rows is None:
            raise MemoryError(f"no request slots for a batch of {batch_size}")
        self._locs = self._allocator.alloc(batch_size * span)
        if self._locs is None:
            self._pool.free_rows(self._rows)
            raise MemoryError(f"no KV room for {batch_size} x {span} tokens")
        device = runtime.device
        rows = torch.tensor(self._rows, dtype=torch.int64, device=device)  # [B]
        table = self._pool.req_to_token
        table[rows.unsqueeze(1), torch.arange(span, device=device)] = self._locs.view(
            batch_size, span
        ).to(table.dtype)
        self.window = table[rows.unsqueeze(1), context_len + torch.arange(runtime.window)].to(
            torch.int64
        )  # [B, window]: this step's slots
        vocab = int(runner.model_config.vocab_size)
        self._bonus = torch.randint(0, vocab, (batch_size,), device=device)  # [B]
        self.spec_batch = self._decode_batch(rows, spec=True)
        self.plain_batch = self._decode_batch(rows, spec=False)
        self._saved = dict(vars(self.spec_batch))  # what a step overwrites is put back

    def _decode_batch(self, rows: torch.Tensor, *, spec: bool) -> Any:
        """The ScheduleBatch of a decode step over these requests (BASTION's or plain)."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner, device = self.runtime.model_runner, self.runtime.device
        bs, c = self.batch_size, self.context_len
        reqs = []
        for i, row in enumerate(self._rows):
            req = Req(
                rid=f"calibration-{i}",
                origin_input_text="",
                origin_input_ids=array("q", [0] * max(c, 1)),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1 << 20),
            )
            req.kv.req_pool_idx = row
            reqs.append(req)
        tree_cache = SimpleNamespace(
            page_size=1, device=device, token_to_kv_pool_allocator=self._allocator
        )
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=self._pool,
            token_to_kv_pool_allocator=self._allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=runner.spec_algorithm if spec else SpeculativeAlgorithm.NONE,
        )
        committed = c if spec else c + 1  # a plain step writes its token before attending
        batch.forward_mode = ForwardMode.DECODE
        batch.req_pool_indices = rows
        batch.seq_lens = torch.full((bs,), committed, dtype=torch.int64, device=device)  # [B]
        batch.seq_lens_cpu = torch.full((bs,), committed, dtype=torch.int64)  # [B]
        batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        batch.seq_lens_sum = bs * committed
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
            batch, runner.model_config.vocab_size
        )
        if spec:
            batch.spec_info = make_draft_input_v2(
                bonus_tokens=self._bonus, new_seq_lens=batch.seq_lens
            )
        else:
            batch.input_ids = self._bonus.clone()
            batch.out_cache_loc = self.window[:, 0].clone()  # [B]: the new token's slot
        return batch

    def _fresh_spec_batch(self) -> Any:
        """The BASTION decode batch as the scheduler hands it over (undoing the step's edits)."""
        vars(self.spec_batch).update(self._saved)
        return self.spec_batch

    # --- the timed passes -----------------------------------------------------------------

    def step(self, width: int) -> tuple[int, float, float]:
        """(verified width, cycle ms, verify ms) of one BASTION step of up to ``width`` nodes.

        The worker's own step runs with its fixed budget set to ``width``; its tree-dependent
        span is timed by ``VerifyClock``, the rest of the cycle is T_aux. The verified
        width is smaller than asked when every tree is (e.g. a top-1 lattice is a chain).
        """
        self.worker.controller.max_nodes = width
        batch = self._fresh_spec_batch()
        device = self.runtime.device
        with VerifyClock(self.worker, device) as clock:
            synchronize(device)
            start = time.perf_counter()
            self.worker._tree_step(batch)
            synchronize(device)
            cycle_ms = (time.perf_counter() - start) * 1e3
        return clock.width, cycle_ms, clock.verify_ms

    def decode_pass(self) -> Callable[[], Any]:
        """One plain autoregressive target step over the batch (L_AR)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        runner = self.runtime.model_runner

        def run() -> Any:
            forward_batch = ForwardBatch.init_new(
                self.plain_batch, runner, return_hidden_states_before_norm=False
            )
            return runner.forward(forward_batch).logits_output

        return run

    def release(self) -> None:
        """Give the KV slots and request rows back to the pools."""
        self._allocator.free(self._locs)
        self._pool.free_rows(self._rows)
