"""The BASTION speculative worker inside SGLang: draft -> tree -> verify -> accept, per step.

It extends SGLang's DFlash worker, whose drafter loading, draft KV pool, hidden-state capture
and prefill it keeps, and replaces the decode step:

1. Draft: one non-causal pass of the DFlash drafter over its block [bonus, MASK x D] for the
   whole batch; the target's LM head turns the block's hidden states into marginals
   q_1..q_D (``draft_head_topk``: their top-K).
2. Tree: ``build_trees_from_top_k`` picks each request's best-first tree from its top-K
   marginals, the controller (``self.controller``) decides its size, and ``verify_inputs`` lays
   the trees out as SGLang verify inputs.
3. Verify: one target forward over every tree with the tree attention mask.
4. Accept: the target's own token at every node (argmax, or a sample from the request's
   processed distribution), ``accept`` walks the tree; the accepted path's target KV moves to
   the front of the request's window and its features go into the draft KV.

Letters: B requests, D draft positions (the drafter's block is D + 1 long), K top-K, N the
tree budget, W the verify width, V the vocabulary.

Grammar-constrained requests get SGLang's vocabulary mask at every tree node (its grammar
walked down the tree, as for EAGLE trees) before the target's tokens are drawn, and logprob
requests get the logprobs of the emitted tokens, from the rows of their tree nodes.

Slots the rejected nodes used stay in the request's reservation and are overwritten next
step, as in SGLang's DFlash worker; the scheduler cuts outputs at EOS, stop strings and
max_tokens and releases the rest when the request finishes.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.layers.sampler import SYNC_TOKEN_IDS_ACROSS_TP, apply_custom_logit_processor
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import build_speculative_verify_target_probs
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
)
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask
from sglang.srt.utils.common import get_device_memory_capacity

from sglang_bastion.acceptance_scale import (
    AcceptanceScale,
    accepting_kinds,
    host_request_kinds,
    new_acceptance_scale,
    observe,
    pool_index,
    request_kinds,
    scales,
    start_requests,
    step_evidence,
)
from sglang_bastion.controller import Controller, Decision, verifies_ragged
from sglang_bastion.draft_context import (
    DraftContext,
    full_step_mean,
    joiners_kept_whole,
    kept_rows,
    probe_rows,
    whole_count,
)
from sglang_bastion.draft_input import BastionDraftInput, make_draft_input
from sglang_bastion.held_draft_kv import HeldDraftKv, holding_allowed
from sglang_bastion.kernels import draft_head_topk, merge_shard_top_k, shard_top_k
from sglang_bastion.late_read import LateRead, SpanTimer, to_device
from sglang_bastion.memory import graph_widths_that_fit
from sglang_bastion.metrics import after_step, create_metrics
from sglang_bastion.node_sampling import (
    commit_emitted,
    penalize_tree_logits,
    penalizers_of,
    state_from_penalizers,
)
from sglang_bastion.options import published_options
from sglang_bastion.row_sampling import sample_rows
from sglang_bastion.stats import BastionStats
from sglang_bastion.trace import TraceWriter
from sglang_bastion.tree import Acceptance, TreeBatch, accept, build_trees_from_top_k, verify_inputs
from sglang_bastion.tree.acceptance import accept_roots
from sglang_bastion.tree.ragged import RaggedVerify, pack_ragged, packed_argmax, unpack_rows
from sglang_bastion.tree.warmup import warm_tree_ops
from sglang_bastion.verify_graphs import (
    TreeVerifyGraphRunner,
    capture_verify_graphs,
    decodes_eagerly,
    replaying,
    verify_graph_state_bytes,
    verify_graphs_unavailable,
)

logger = logging.getLogger(__name__)


def use_torch_qk_norm_rope(model: torch.nn.Module) -> None:
    """Run the drafter's fused q/k-norm + rotary step in torch (its Triton kernel needs a GPU)."""
    for module in model.modules():
        if getattr(module, "use_table_qk_norm_rope", False):
            module.use_table_qk_norm_rope = False


@dataclass(frozen=True)
class DecodeStep:
    """What every stage of one decode step reads about the batch's KV."""

    window: torch.Tensor  # [B, window] long: the KV slots each request reserved this step
    prefix: torch.Tensor  # [B]: committed tokens (the bonus is not in the KV yet)
    prefix_cpu: torch.Tensor  # [B]: their host copy (SGLang's seq_lens_cpu)
    grammar_barrier: Callable[[], None] | None = None  # overlap: settles the queued step's FSMs


@dataclass(frozen=True)
class Verified:
    """The tree-dependent span's results: what the rest of the step needs from it."""

    logits_output: Any  # SGLang's LogitsProcessorOutput of the verify pass
    hidden: torch.Tensor  # [B, W, H] target features captured at every node
    target_tokens: torch.Tensor  # [B, W] the target's token at every node
    accepted: Acceptance  # paths, bonus tokens, KV moves: what the step emits
    walked: torch.Tensor  # [B] tokens the walk accepted (+1), whether or not all are emitted


class BastionWorker(DFlashWorkerV2):
    """SGLang's DFlash worker with BASTION's tree drafting and verification in decode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # SGLang reserves speculative_num_draft_tokens KV slots per request and step (the
        # window, which holds both the tree's N and the drafter's block: spec_algo) and DFlash
        # drafts a block of that size; BASTION drafts the drafter's own block of D + 1.
        self.window = int(get_spec().speculative_num_draft_tokens)
        self.options = published_options()
        self.block_size = min(int(self.options.block_size), self.window)  # D + 1
        self.draft_model.set_block_size(self.block_size)
        self._block_pos_offsets = build_block_pos_offsets(
            length=self.block_size, device=self.device
        )
        self._draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device
        )
        self._draft_block_ids_buf = None  # re-sized for B on first use
        self._tp_group = get_parallel().tp_group
        # Called with (W, verify ms) after every step's tree-dependent span (bastion-calibrate).
        self.verify_listener: Callable[[int, float], None] | None = None
        if torch.device(self.device).type == "cpu":
            use_torch_qk_norm_rope(self.draft_model)
        self.max_nodes = min(self.options.max_nodes or self.window, self.window)
        self.top_k = self.options.top_k
        self.controller = Controller.for_worker(self, self.options, self.max_nodes)
        # Per request slot: what was predicted and accepted (made at the first prefill, once
        # SGLang has sized the request pool).
        self.acceptance: AcceptanceScale | None = None
        self.stats = BastionStats(max_accept=self.block_size)
        # The target's tree-verify graphs by width (captured in init_cuda_graphs, if they run).
        self.verify_graphs: dict[int, TreeVerifyGraphRunner] = {}
        # Whether plain steps run SGLang's decode forward (`_decode_roots`): settled with the
        # graphs, in init_cuda_graphs.
        self.decodes_roots = False
        self.draft_only_mask = False  # the verify mask holds the tree blocks alone
        self._roots_accepted: dict[tuple[int, torch.device], Acceptance] = {}  # by batch size
        self.metrics = None  # SGLang's Prometheus endpoint, under --enable-metrics
        if getattr(self.server_args, "enable_metrics", False) and get_parallel().tp_rank == 0:
            labels = {"model_name": self.server_args.served_model_name, "tp_rank": 0}
            interval = int(getattr(self.server_args, "decode_log_interval", 40) or 40)
            self.metrics = create_metrics(labels, interval)
        if torch.device(self.device).type == "cuda":  # Triton compiles here, not in a step
            warm_tree_ops(
                torch.device(self.device), self.controller.verify_widths(),
                depth=self.block_size - 1, top_k=self.top_k, max_nodes=self.max_nodes,
                window=self.window, kernels=self.options.kernels,
            )  # fmt: skip
        # (start, decision, batch size) of the last decode step, while no prefill has run since
        self._period: tuple[float, Decision, int] | None = None
        # that step's mean tokens per request (a plain step's is 1.0, known on the host)
        self._emitted: LateRead | float | None = None
        self._sampled: LateRead | None = None  # a sampled probe's mean over its drafting rows
        # whose drafter context dormant plain steps let fall behind; who drafts in a probe
        self.draft_context = DraftContext()
        self._kept_rows: tuple[tuple[int, ...], torch.Tensor] | None = None  # and on the device
        # The last decode step's requests (SGLang's Req objects) when it was dormant: a prefill
        # then writes the prompt context of the joiners a sample needs alone.
        self._dormant_reqs: tuple[Any, ...] | None = None
        # [T] the prefill's tokens whose drafter context is written (None: all of them)
        self._prefill_tokens: torch.Tensor | None = None
        # Verify spans still timing on the device (EMA modes on a GPU); the oldest is dropped
        # past 8, as a stalled device would otherwise grow the queue.
        self._late_timings: deque[tuple[Decision, SpanTimer]] = deque(maxlen=8)
        # Plain steps' draft-KV writes, made together (held_draft_kv); None: made at once.
        self.held_draft_kv: HeldDraftKv | None = None
        if (why := holding_allowed(self.server_args, self)) is None:
            self.held_draft_kv = HeldDraftKv()
        else:
            logger.info("BASTION: plain steps write the draft KV at once: %s", why)
        self.profile_info = self.controller.summary(self.options.profile)
        self.trace = None  # opened once the controller is settled (init_attention_backends)
        logger.info(
            "BASTION worker: drafter block %d, tree of up to %d nodes, top-%d lattice, "
            "controller %s",
            self.block_size, self.max_nodes, self.top_k, self.profile_info,
        )  # fmt: skip

    def init_attention_backends(self) -> None:
        """DFlash's drafter backends; then whether the target's verify packs trees unpadded."""
        super().init_attention_backends()  # the scheduler built the target's before
        backend = self.target_worker.model_runner.attn_backend
        self.controller.packs_ragged = verifies_ragged(backend)
        # A backend that reads the tree blocks alone is spared B * W * prefix True entries.
        self.draft_only_mask = bool(getattr(backend, "reads_draft_only_masks", False))
        self.profile_info = self.controller.summary(self.options.profile)
        if self.options.trace and get_parallel().tp_rank == 0:  # ranks step in lockstep
            header = {"top_k": self.top_k, "max_nodes": self.max_nodes,
                      "block_size": self.block_size, "controller": self.profile_info}  # fmt: skip
            self.trace = TraceWriter(self.options.trace, self.options.trace_steps, header)

    def init_cuda_graphs(self) -> None:
        """DFlash's drafter graphs, then the target's tree-verify graphs where they can run."""
        super().init_cuda_graphs()
        widths = self.controller.verify_widths()
        self.capture_tree_verify_graphs(widths)
        target = self.target_worker.model_runner
        self.decodes_roots = 1 not in self.verify_graphs and decodes_eagerly(target)
        captured = tuple(sorted(self.verify_graphs))
        if captured and captured != widths and self.controller.mode != "fixed":
            # Widths left eager for memory would run slower than the profile prices them.
            self.controller.use_widths(captured)
            self.profile_info = self.controller.summary(self.options.profile)
            logger.info("BASTION: the adaptive controller chooses among widths %s", captured)

    def capture_tree_verify_graphs(self, widths: tuple[int, ...]) -> None:
        """Capture the target's tree-verify graphs at ``widths`` that fit; the rest run eager."""
        target = self.target_worker.model_runner
        self.verify_graphs = {}
        if (reason := verify_graphs_unavailable(target)) is not None:
            logger.info("BASTION: the target verifies trees eagerly: %s", reason)
            return
        state = verify_graph_state_bytes(target, widths, self.window)
        device_mib = get_device_memory_capacity(torch.device(self.device).type)
        fitted = graph_widths_that_fit(widths, state, device_mib)
        self.verify_graphs = capture_verify_graphs(target, fitted)
        eager = [w for w in widths if w not in fitted]
        gib = sum(state[w] for w in fitted) / (1 << 30)
        sizes = list(next(iter(self.verify_graphs.values())).capture_bs) if fitted else []
        logger.info(
            "BASTION: the target verifies trees in graphs at widths %s (batch sizes %s, "
            "%.2f GiB of attention state)%s",
            list(fitted), sizes, gib, f"; widths {eager} verify eagerly" if eager else "",
        )  # fmt: skip

    def prewarm_sampling(self) -> Any:
        """DFLASH's sampling rehearsal at BASTION's verify width: bs x W rows, not bs x block."""
        block = self.block_size
        self.block_size = self.window
        try:
            return super().prewarm_sampling()
        finally:
            self.block_size = block

    def bastion_state(self) -> dict[str, Any]:
        """The controller's identity and running averages (SGLang's /server_info)."""

        def by_batch(table: dict[int, float], digits: int, scale: float = 1.0) -> dict:
            return {str(b): round(value * scale, digits) for b, value in sorted(table.items())}

        controller = {
            **self.profile_info,
            "gamma": by_batch(self.controller.gamma, 4),
            "overhead_ms": by_batch(self.controller.overhead_ms, 3),
            "plain_overhead_ms": by_batch(self.controller.plain_overhead_ms, 3),
            "width_offset_ms": {  # batch size -> verify width -> ms over overhead_ms
                str(b): by_batch(widths, 3)
                for b, widths in sorted(self.controller.width_offset_ms.items())
            },
            "width_slope": {  # batch size -> the overhead's learned slope inside a width
                str(b): round(slope, 3)
                for b in sorted(self.controller.width_slope_moments)
                if (slope := self.controller.width_slope(b)) is not None
            },
            # measured tokens per request per second: speculative and plain steps
            "speculative_rate": by_batch(self.controller.spec_rate, 2, 1e3),
            "plain_rate": by_batch(self.controller.plain_rate, 2, 1e3),
        }
        return {"controller": controller, "top_k": self.top_k, **self.stats.as_dict()}

    def _make_next_draft_input_prefill(
        self, *, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor
    ) -> BastionDraftInput:
        """The draft state a prefill hands the scheduler (`draft_input`)."""
        return make_draft_input(bonus_tokens, seq_lens)

    def _make_next_draft_input_decode(
        self, *, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor
    ) -> BastionDraftInput:
        """The draft state a decode step hands the scheduler (`draft_input`)."""
        return make_draft_input(bonus_tokens, new_seq_lens)

    def _maybe_build_draft_sampler(self, *args: Any, **kwargs: Any) -> None:
        """Keep the draft head eager: BASTION needs full marginals, not a greedy draft."""
        return None

    def forward_batch_generation(
        self,
        batch: Any,
        on_publish: Any = None,
        grammar_barrier: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> GenerationBatchResult:
        """Prefill as DFlash does; decode with one BASTION tree step."""
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            self._make_held_draft_kv()  # before DFlash's prefill writes the draft KV
            self._cut_period()  # the next decode period would include this prefill
            if self.controller.learns_acceptance:  # before the prefill: a new wave is whole
                accepting = frozenset() if self.acceptance is None else accepting_kinds(
                    self.acceptance
                )  # fmt: skip
                self.controller.requests_joined(
                    host_request_kinds(batch.reqs), len(batch.reqs), accepting
                )
            self._prefill_tokens = self._prefill_context_tokens(batch)
            try:
                result = super().forward_batch_generation(
                    batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                    pp_proxy_tensors=pp_proxy_tensors,
                )  # fmt: skip
            finally:
                self._prefill_tokens = None
            first = result.next_token_ids.view(-1, 1)  # [bs, 1]: each request's first token
            self._commit_penalties(batch, first, torch.ones_like(first[:, 0]))
            if self.controller.learns_acceptance:
                if self.acceptance is None:
                    slots = self.model_runner.req_to_token_pool.req_to_token.shape[0]
                    self.acceptance = new_acceptance_scale(int(slots), self.device)
                kinds = request_kinds(batch.sampling_info, len(first), first.device)
                start_requests(self.acceptance, batch.req_pool_indices, kinds, batch.seq_lens)
            return result
        if batch.forward_mode.is_idle() or batch.spec_info is None:
            self._make_held_draft_kv()
            self._cut_period()
            return super().forward_batch_generation(batch, on_publish=on_publish)
        return self._tree_step(batch, on_publish, grammar_barrier)

    def _prefill_context_tokens(self, batch: Any) -> torch.Tensor | None:
        """[T] the prefill's tokens whose drafter context is written: while dormant, those of
        the joiners a sample needs (`joiners_kept_whole`); None: every token."""
        running = self._dormant_reqs
        if running is None or self.held_draft_kv is None or batch.extend_lens is None:
            return None  # not dormant, or its draft KV is read as it is written (see holding)
        alive = [req for req in running if not req.finished()]
        joiners = tuple(req.rid for req in batch.reqs)
        if not joiners or not self.controller.dormant(len(alive) + len(joiners)):
            return None
        kept = self.draft_context.kept
        running_kept = sum(req.rid in kept for req in alive)
        self._dormant_reqs = (*alive, *batch.reqs)  # a second prefill before the next step
        rows = joiners_kept_whole(
            self.draft_context, joiners, running_kept, self.controller.probe_rows
        )
        lens = [int(n) for n in batch.extend_lens]
        starts = [0, *itertools.accumulate(lens)]
        self.stats.dormant_prompt_tokens += starts[-1] - sum(lens[i] for i in rows)
        picked = [torch.arange(starts[i], starts[i] + lens[i]) for i in rows]
        return to_device(torch.cat(picked) if picked else torch.empty(0, dtype=torch.long),
                         torch.device(self.device))  # fmt: skip

    def _append_target_hidden_to_draft_kv_by_loc(
        self, *, target_hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """DFlash's draft-KV write; in a dormant prefill, of the tokens kept whole alone."""
        tokens = self._prefill_tokens
        if tokens is not None:  # DFlash's prefill write: [T] tokens, F features each
            self._prefill_tokens = None
            if not len(tokens):
                return
            target_hidden = target_hidden.index_select(0, tokens)
            cache_loc = cache_loc.index_select(0, tokens)
            positions = positions.index_select(0, tokens)
            kwargs.pop("extend_lens", None)  # read by a LiLiCorr head alone, which never holds
        super()._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=target_hidden, cache_loc=cache_loc, positions=positions, **kwargs
        )

    def _cut_period(self) -> None:
        """End the decode period at a prefill or idle step, whose time is not a decode step's."""
        if self._period is not None and self._sampled is not None:
            _, decision, batch = self._period
            self.controller.observe_cut(decision, batch, self._sampled.value())
        self._period = None

    def _make_held_draft_kv(self, requests: tuple[str, ...] | None = None) -> None:
        """Write the held plain steps' draft KV, unless it belongs to ``requests``' batch."""
        held = self.held_draft_kv
        if held is None or (requests is not None and held.belongs_to(requests)):
            return
        if (taken := held.take()) is not None:
            features, cache_loc, positions = taken
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=features, cache_loc=cache_loc, positions=positions
            )

    # --- one decode step ------------------------------------------------------------------

    def _tree_step(
        self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None
    ) -> GenerationBatchResult:
        """Draft, build trees, verify them in one target pass, accept; the step's result.

        Under overlap scheduling ``on_publish`` hands the new lengths to SGLang's future map
        as soon as acceptance is known, for the next step's host lengths, and
        ``grammar_barrier`` advances the grammars over the step still queued, after the
        verify launch and before this step's grammar masks read them.
        """
        started = time.perf_counter()
        draft_input: DFlashDraftInputV2 = batch.spec_info
        bs = len(batch.seq_lens)
        prefix = batch.seq_lens  # [bs]: committed tokens; the bonus is not in the KV yet
        prefix_cpu = batch.seq_lens_cpu
        if prefix_cpu is None:
            raise RuntimeError(
                "BASTION needs the batch's host sequence lengths every step (its tree mask is "
                "laid out from them); SGLang's future map was created without them"
            )
        if prefix.is_cuda:  # read on the forward stream, allocated on the schedule stream
            prefix.record_stream(torch.cuda.current_stream())
        slots = torch.arange(self.window, device=self.device)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        window = req_to_token[batch.req_pool_indices.unsqueeze(1), prefix.unsqueeze(1) + slots]
        step = DecodeStep(window.to(torch.int64), prefix, prefix_cpu, grammar_barrier)
        requests = tuple(req.rid for req in batch.reqs)
        while self._late_timings:  # earlier steps' verify times, oldest first, once done
            if (ms := self._late_timings[0][1].elapsed_ms()) is None:
                break
            self._observe_timing(self._late_timings.popleft()[0], ms)
        if self._period is not None:  # the previous decode step's full period ends here
            last_start, last_decision, last_bs = self._period
            period_ms = (started - last_start) * 1e3
            emitted = self._emitted
            if isinstance(emitted, LateRead):
                emitted = emitted.value()
            sampled = self._sampled.value() if self._sampled is not None else None
            self.controller.observe_period(last_decision, last_bs, period_ms, emitted, sampled)
        # After the last period is folded in: the measured rates may make this step plain.
        drafts = self.controller.drafts_this_step(bs)
        # The draft pass reads the contexts' draft KV; a changed batch may hand its slots on.
        self._make_held_draft_kv(None if drafts else requests)
        roots = draft_input.bonus_tokens.to(torch.long)  # [bs]
        sample = sample_cpu = None  # the drafting rows, when not all: [R] on each side
        sampling = False  # a sampled probe; else the rows are every request still whole
        if drafts:
            rows = self.controller.draft_rows(bs)
            chosen, sampling = probe_rows(self.draft_context, requests, rows)
            if chosen is not None:
                sample_cpu = torch.tensor(chosen)
                sample = to_device(sample_cpu, roots.device)
            top_q, top_ids, whole = self._draft_trees(batch, step, roots, sample, sample_cpu)
        else:  # a plain step: the root alone, no draft pass
            top_q = top_ids = torch.empty(bs, 0, self.top_k, device=roots.device)
            whole = TreeBatch.roots(roots)
        scale = pool = None  # [bs] each: the requests' acceptance calibration and pool
        if not drafts:
            decision = self.controller.plain_decision(bs, prefix_cpu, roots.device)
        else:  # the host copy of the contexts: no sync
            if self.acceptance is not None:
                pool = pool_index(self.acceptance, batch.req_pool_indices, prefix)
                scale = scales(self.acceptance, batch.req_pool_indices, prefix, pool)
            at = sample if sampling else None  # a full probe is priced as the step it is
            decision = self.controller.decide(whole, prefix_cpu, scale, at)
        self._period = (started, decision, bs)
        # A plain step's trees are the roots already.
        trees = decision.cut(whole) if drafts else whole
        width = decision.width
        listener = self.verify_listener
        # The trace, bastion-calibrate and the debug log take this step's own time (a host
        # sync on a GPU); the EMA modes alone read it from events, one step late.
        synced = (
            self.trace is not None or listener is not None or logger.isEnabledFor(logging.DEBUG)
        )
        timer = SpanTimer(roots.device) if self.controller.needs_timing and not synced else None
        verify_start = self._now(synced)
        # A sampled probe measures its sample's trees but emits the roots' tokens alone, as a
        # plain step does: the batch's requests stay in step (`Decision.sampled`).
        verified = self._verify_trees(
            batch, trees, step, width, decision.ragged, emit_roots=decision.sampled
        )  # fmt: skip
        verify_ms = (self._now(synced) - verify_start) * 1e3 if synced else None
        if timer is not None:
            verify_ms = timer.stop().elapsed_ms()  # on a CPU at once
            if verify_ms is None:
                self._late_timings.append((decision, timer))
        if listener is not None:
            listener(width, verify_ms)
        logits_output, target_tokens = verified.logits_output, verified.target_tokens
        path, bonus = verified.accepted.path, verified.accepted.bonus_tokens

        accept_lens = verified.accepted.num_accepted + 1  # [bs]: emitted drafts + the bonus
        walked = verified.walked  # [bs]: what the trees were worth (a sampled probe emits less)
        new_seq_lens = prefix + accept_lens.to(prefix.dtype)
        if on_publish is not None:  # overlap: the next step's lengths, as early as known
            on_publish(new_seq_lens)
        # A tree of width W emits at most W tokens: only those path columns need features.
        emitted_cols = path[:, : min(width, path.shape[1])]  # [bs, min(W, D+1)]
        hold = requests if width == 1 else None
        keep = None  # [R]: a dormant plain step writes these rows' drafter context alone
        dormant = self.controller.dormant(bs)
        self._dormant_reqs = tuple(batch.reqs) if dormant else None
        if width == 1 and dormant:
            kept = kept_rows(self.draft_context, requests, self.controller.probe_rows)
            keep = self._kept_index(kept, roots.device)
            self.stats.dormant_request_steps += bs - len(kept)
        self._write_draft_features(
            batch, verified.hidden, step, emitted_cols, accept_lens, hold, keep
        )  # fmt: skip
        if self.controller.learns_acceptance:  # tokens per request, read next step or later
            self._emitted = 1.0 if decision.plain else LateRead(accept_lens.float().mean())
            self._sampled = None  # a sampled probe: what its full probe would emit
            if decision.sampled:
                whole_rows = whole_count(self.draft_context, requests)
                self._sampled = LateRead(full_step_mean(walked[sample], whole_rows, bs))
        if drafts and self.acceptance is not None:  # what this step's drafts were worth
            predicted, realised = step_evidence(whole, decision.sizes, walked, target_tokens[:, 0])
            at = slice(None) if sample is None else sample  # only drafted requests are evidence
            observe(self.acceptance, batch.req_pool_indices[at], prefix[at], predicted[at],
                    realised[at], pool[at])  # fmt: skip

        out_tokens = target_tokens.gather(1, path.clamp(min=0))  # [bs, D+1]: emitted run first
        self._commit_penalties(batch, out_tokens, accept_lens)
        self._account(decision, accept_lens, verify_ms, decision.expected)
        if self.trace is not None and self.trace.active:
            cycle_ms = (self._now(True) - started) * 1e3
            draft = (top_q, top_ids, roots, prefix_cpu)
            timing = {"started_s": started, "verify_ms": verify_ms, "cycle_ms": cycle_ms}
            self._record(batch, draft, decision, out_tokens, accept_lens, timing, keep is not None)
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=accept_lens.to(torch.int32),
            can_run_cuda_graph=False,
            next_draft_input=self._make_next_draft_input_decode(
                bonus_tokens=bonus, new_seq_lens=new_seq_lens
            ),
            speculative_num_draft_tokens=int(self.block_size),
            new_seq_lens=new_seq_lens,
        )

    def _now(self, timed: bool) -> float:
        """Wall time after the device finished queued work (0.0 when not timing)."""
        if not timed:
            return 0.0
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _account(
        self, decision: Decision, accept_lens: torch.Tensor, verify_ms: float | None,
        priced: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Update the running stats, metrics and the controller's EMA; log at debug level."""
        self.stats.sampled_probes += decision.sampled
        if decision.plain:  # roots alone, one token each: counted on the host
            self.stats.add_plain_step(len(decision.sizes), decision.predicted_verify_ms)
        else:  # a drafted step whose trees were all cut to their roots (width 1) is plain too
            self.stats.add_step(
                decision.sizes, accept_lens, decision.width, decision.predicted_verify_ms,
                decision.width == 1, priced, decision.ragged,
            )  # fmt: skip
        if self.metrics is not None:
            after_step(self.metrics, self.stats)
        if verify_ms is not None:
            self._observe_timing(decision, verify_ms)

    def _observe_timing(self, decision: Decision, verify_ms: float) -> None:
        """Fold a step's measured verify time into the stats and the controller's EMA."""
        self.stats.add_timing(decision.predicted_verify_ms, verify_ms)
        self.controller.observe(decision, verify_ms)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "BASTION step: batch %d, width %d, sizes %s, verify predicted %s ms, observed "
                "%.2f ms, gamma %.3f, step overhead priced %.2f ms",
                len(decision.sizes), decision.width, decision.sizes.tolist(),
                _ms(decision.predicted_verify_ms), verify_ms,
                self.controller.gamma_at(len(decision.sizes)),
                decision.overhead_ms,
            )  # fmt: skip

    def _record(
        self, batch: Any, draft: tuple[torch.Tensor, ...], decision: Decision,
        out_tokens: torch.Tensor, accept_lens: torch.Tensor, timing: dict[str, float | None],
        dormant: bool = False,
    ) -> None:  # fmt: skip
        """Append this step to the trace (see trace.py); a failure stops tracing, not serving."""
        try:
            self._write_trace(batch, draft, decision, out_tokens, accept_lens, timing, dormant)
        except Exception:
            logger.exception("BASTION: tracing failed; serving goes on without a trace")
            self.trace = None

    def _write_trace(
        self, batch: Any, draft: tuple[torch.Tensor, ...], decision: Decision,
        out_tokens: torch.Tensor, accept_lens: torch.Tensor, timing: dict[str, float | None],
        dormant: bool = False,
    ) -> None:  # fmt: skip
        """One trace record: draft = (top-K q [bs, D, K], their ids, roots [bs], contexts [bs]).

        ``timing``: the step's start (``time.perf_counter`` seconds, for the gaps between
        steps), the verify span's and the whole cycle's milliseconds; ``dormant``: a plain step
        that wrote a sample's drafter context alone.
        """
        values, ids, roots, contexts = draft
        lens = accept_lens.tolist()
        self.trace.record({
            "step": self.stats.steps,
            "rids": [str(req.rid) for req in batch.reqs],
            "context_lens": contexts.tolist(),
            "temperatures": _temperatures(batch),
            "topk_ids": ids.tolist(),
            "topk_probs": values.float().tolist(),
            "root_tokens": roots.tolist(),
            "sizes": decision.sizes.tolist(),
            "width": decision.width,
            "plain": decision.plain,  # every request verified its root alone
            "drafted": decision.drafted,  # False: a plain step, topk_* are empty
            "sampled": decision.sampled,  # a sampled probe: the others' topk_* are zeros
            "dormant": dormant,  # a plain step that kept a sample's drafter context alone
            "emitted": [row[:n] for row, n in zip(out_tokens.tolist(), lens, strict=True)],
            "budgets": [_token_budget(req) for req in batch.reqs],
            "predicted_verify_ms": decision.predicted_verify_ms,
            "overhead_ms": decision.overhead_ms,
            **timing,
        })  # fmt: skip

    def _draft_trees(
        self, batch: Any, step: DecodeStep, roots: torch.Tensor,
        sample: torch.Tensor | None = None, sample_cpu: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, TreeBatch]:  # fmt: skip
        """[bs, D, K] top-K marginals, their tokens and every request's best-first tree.

        ``sample`` [R] (``sample_cpu``, its host copy): only these rows draft (a sampled
        probe); the others' marginals are zeros and their trees their roots alone.
        """
        rows = slice(None) if sample is None else sample
        part = step if sample is None else DecodeStep(step.window[sample], step.prefix[sample],
                                                      step.prefix_cpu[sample_cpu])  # fmt: skip
        q, ids = self._draft_marginals(batch.req_pool_indices[rows], roots[rows], part)
        drafted = build_trees_from_top_k(
            q, ids, roots[rows], max_nodes=self.max_nodes, kernels=self.options.kernels
        )
        if sample is None:
            return q, ids, drafted
        top_q = q.new_zeros(len(roots), *q.shape[1:])  # [bs, D, K]: the others' are zeros
        top_ids = ids.new_zeros(len(roots), *ids.shape[1:])
        top_q[sample], top_ids[sample] = q, ids
        return top_q, top_ids, TreeBatch.roots(roots).with_rows(sample, drafted)

    def _kept_index(self, kept: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """[R] the kept rows on the device, made once per batch of requests."""
        cached = self._kept_rows
        if cached is None or cached[0] is not kept:
            cached = self._kept_rows = (
                kept,
                to_device(torch.tensor(kept, dtype=torch.long), device),
            )
        return cached[1]

    def _draft_marginals(
        self, pool: torch.Tensor, roots: torch.Tensor, step: DecodeStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, D, K] top-K draft marginals (full-vocabulary probabilities) and their tokens
        for the requests in req-pool slots ``pool`` [bs], whose committed bonus is ``roots``."""
        prefix, prefix_cpu = step.prefix, step.prefix_cpu
        bs, block = step.window.shape[0], self.block_size
        target_model = self.target_worker.model_runner.model
        block_ids = torch.full((bs, block), int(self._mask_token_id), device=self.device)
        block_ids[:, 0] = roots  # [bs, D+1]: bonus, MASK x D
        if self._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            embed = unwrap_lora_layer(
                _resolve_dflash_embedding_module(self.draft_model, target_model)
            )
            embeds = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            embeds = embeds * self._noise_embed_scale
        positions = (prefix.unsqueeze(1) + self._block_pos_offsets).reshape(-1)  # [bs*(D+1)]
        out_cache_loc = step.window[:, :block].reshape(-1)
        plan = self._plan(pool, prefix, prefix_cpu, out_cache_loc, block)
        seq_lens_cpu = (prefix_cpu + block).to(torch.int32)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=pool,
            seq_lens=prefix,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions,
            input_embeds=embeds.reshape(bs * block, -1),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=False,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode():
            hidden = self.draft_model_runner.forward(forward_batch).logits_output.hidden_states
        hidden = hidden.view(bs, block, -1)[:, 1:]  # [bs, D, H]: the masked positions
        lm_head = unwrap_lora_layer(target_model.lm_head)
        vocab = int(self.model_runner.model_config.vocab_size)
        top_k = min(self.top_k, vocab)
        rows = hidden.reshape(-1, hidden.shape[-1])  # [B*D, H]
        top_q, top_ids = self._draft_head(rows, lm_head, vocab, top_k)  # [B*D, K] each
        return top_q.view(bs, block - 1, top_k), top_ids.view(bs, block - 1, top_k)

    def _draft_head(
        self, rows: torch.Tensor, lm_head: Any, vocab: int, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, K] full-vocabulary top-K probabilities and ids of the drafter's hidden rows.

        Under tensor parallelism each rank holds a vocabulary shard of the LM head: it takes
        its shard's top-K and log-sum-exp, one all-gather shares them, and every rank merges
        the same numbers into the same marginals, so every rank builds the same trees.
        """
        group = self._tp_group
        if group.world_size == 1:
            return draft_head_topk(rows, lm_head.weight, vocab, top_k, kernels=self.options.kernels)
        shard = lm_head.shard_indices
        values, ids, lse = shard_top_k(rows, lm_head.weight, shard.num_org_elements, top_k)
        ids = ids + shard.org_vocab_start_index  # global token ids
        packed = torch.cat([values, ids.float(), lse.unsqueeze(1)], dim=1)  # [R, 2K+1]: ids < 2^24
        gathered = group.all_gather(packed, dim=0).view(group.world_size, *packed.shape)
        k = values.shape[1]
        return merge_shard_top_k(
            gathered[..., :k], gathered[..., k : 2 * k].long(), gathered[..., 2 * k], top_k
        )

    def _plan(
        self, pool: torch.Tensor, prefix: torch.Tensor, prefix_cpu: torch.Tensor,
        write: torch.Tensor, extent: int,
    ) -> Any:  # fmt: skip
        """SGLang's KV location plan for a pass over the requests in req-pool slots ``pool``
        writing ``write`` and reading ``extent`` more."""
        return self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=pool,
            seq_lens=prefix,
            seq_lens_cpu=prefix_cpu,
            write_virtual=write,
            read_extent=extent,
        )

    def _verify_trees(
        self, batch: Any, trees: TreeBatch, step: DecodeStep, width: int,
        ragged: tuple[int, ...] | None = None, emit_roots: bool = False,
    ) -> Verified:  # fmt: skip
        """Everything a step's cost owes to its trees: verify, target tokens, acceptance, KV.

        ``ragged``: each request's size when the pass packs them unpadded (the batch-global
        budget on a backend that verifies ragged). ``emit_roots``: walk the trees, but emit
        each root's target token alone, as a plain step would. This span is T_verify(B, W, c)
        for the controller: the worker times it for the EMA modes, the trace and
        ``verify_listener`` (``bastion-calibrate``).
        """
        window, prefix, prefix_cpu = step.window, step.prefix, step.prefix_cpu
        bs = len(prefix)
        if ragged is not None and sum(ragged) == bs * width:  # nothing to pack: W each
            ragged = None
        packed, alone = None, False  # alone: the packed logits serve only their argmax
        if width == 1 and self.decodes_roots and not batch.has_grammar:
            logits_output, hidden = self._decode_roots(batch, trees, step)
        else:
            draft_only = self.draft_only_mask
            # SGLang's padded mask (verify_inputs); a draft-only one goes to bastion_cpu alone
            tail = 0 if ragged or draft_only else bs * width * width
            verify = verify_inputs(
                trees, prefix, prefix_cpu, kernels=self.options.kernels, mask_tail=tail,
                draft_only=draft_only,
            )  # fmt: skip
            packed = None
            if ragged:
                packed = pack_ragged(verify, ragged, prefix_cpu, width, draft_only)
            alone = packed is not None and argmax_alone(batch)
            grammar = None
            if batch.has_grammar:  # the host copy must start before the verify launch
                grammar = GrammarTree.from_device(
                    verify.retrieve_next_token, verify.retrieve_next_sibling,
                    verify.input_ids.view(bs, width),
                )  # fmt: skip
            logits_output, hidden = self._verify(
                batch, verify, window[:, :width], prefix_cpu, width, grammar, trees,
                step.grammar_barrier, packed, alone,
            )  # fmt: skip
        packed_rows = packed.rows if alone else None
        logits = logits_output.next_token_logits  # [bs * W, V], or [T, V] at packed_rows
        target_tokens = self._target_tokens(batch, logits, bs, width, packed_rows)
        # The whole window: the drafter's block may exceed W.
        depth, kernels = self.block_size - 1, self.options.kernels
        if width == 1:  # roots alone: the same paths every plain step
            accepted = self._root_acceptance(target_tokens)
        else:
            accepted = accept(trees, target_tokens, window, max_depth=depth, kernels=kernels)
        walked = accepted.num_accepted + 1  # [bs]
        if emit_roots:  # the roots' KV is in their slots already
            accepted = self._root_acceptance(target_tokens)
        elif width > 1:  # a width-1 pass verified the roots alone, already in their slots
            self._keep_accepted_kv(accepted.kv_source, accepted.kv_target)
        if batch.return_logprob:
            rows = torch.arange(bs, device=target_tokens.device).unsqueeze(1) * width
            compute_spec_logprobs(  # [bs, D+1]: the emitted tokens' rows, in emitted order
                batch, logits_output, target_tokens.reshape(-1),
                accept_index=rows + accepted.path.clamp(min=0),
            )  # fmt: skip
        return Verified(logits_output, hidden, target_tokens, accepted, walked)

    def _root_acceptance(self, target_tokens: torch.Tensor) -> Acceptance:
        """`accept_roots` of [bs, W] target tokens (a plain step's, or a sampled probe's that
        emits its roots); its constant paths and KV moves (read, never written) are made once
        per batch size."""
        key = (target_tokens.shape[0], target_tokens.device)
        if (made := self._roots_accepted.get(key)) is None:
            made = self._roots_accepted[key] = accept_roots(target_tokens, self.block_size - 1)
        return replace(made, bonus_tokens=target_tokens[:, 0].to(torch.long))

    def _verify(
        self, batch: Any, verify: Any, window: torch.Tensor, prefix_cpu: torch.Tensor, width: int,
        grammar: GrammarTree | None = None, trees: TreeBatch | None = None,
        grammar_barrier: Callable[[], None] | None = None, packed: RaggedVerify | None = None,
        argmax_only: bool = False,
    ) -> tuple[Any, torch.Tensor]:  # fmt: skip
        """One target forward over every tree with the tree mask: logits and captured features.

        ``packed``: the trees packed unpadded (`pack_ragged`); the pass verifies those tokens
        alone under SGLang's ragged verify layout, and its logits and features come back in
        the padded [bs * W] layout every later op reads; ``argmax_only`` (`argmax_alone`): the
        logits stay packed, [T, V], for `_target_tokens` to take their argmax on those rows.

        The logits come back processed as the requests' sampling asks at every node, as the
        plain server would process them after emitting that node's path (penalties with the
        path's tokens counted, min_new_tokens by the node's output length, biases) and, for
        grammar-constrained requests, masked at every node by the grammar's state there.
        """
        out_cache_loc = window.reshape(-1)
        inputs, extent = verify, prefix_cpu + width  # extent: the pass's host key lengths
        if packed is not None:
            out_cache_loc = out_cache_loc.index_select(0, packed.rows)
            inputs, extent = packed, prefix_cpu + torch.tensor(packed.lens_cpu)
        verify_input = DFlashVerifyInput(
            draft_token=inputs.input_ids,
            positions=inputs.positions,
            draft_token_num=width,
            custom_mask=inputs.custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=self._plan(
                batch.req_pool_indices, batch.seq_lens, prefix_cpu, out_cache_loc, width
            ),
            ragged_verify_layout=None if packed is None else ragged_layout(packed),
        )
        # SGLang builds the verify pass from a ScheduleBatch and writes its fields (the KV
        # slots, host lengths, input ids, mode): a shallow copy takes them, the scheduler's
        # batch is left as it came.
        view = copy.copy(batch)
        view.out_cache_loc = out_cache_loc
        view.seq_lens_cpu = extent  # host bound of the verify pass
        view.seq_lens_sum = int(view.seq_lens_cpu.sum())
        forward_batch, _ = verify_input.prepare_for_verify(
            view, self.target_worker, defer_metadata_init=True
        )
        target = self.target_worker.model_runner
        graph = self.verify_graphs.get(width) if packed is None else None
        if graph is not None and graph.can_run_graph(forward_batch):
            with replaying(target, graph):  # its replay plans the batch into its buffers
                out = self.target_worker.forward_batch_generation(
                    batch=None, forward_batch=forward_batch, is_verify=True
                )
            self.stats.graph_verifies += 1
        else:  # SGLang's eager runner plans every target-verify pass itself, from the batch
            out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        logits_output = out.logits_output
        logits = full_vocabulary(self._target_logits_processor, logits_output.next_token_logits)
        bs = len(batch.seq_lens)
        unpacked = packed is None or not argmax_only
        if packed is not None:  # [T, H] (and [T, V] unless argmax alone reads them) padded
            logits_output.hidden_states = unpack_rows(
                logits_output.hidden_states, packed.rows, bs * width
            )
            if unpacked:
                logits = unpack_rows(logits, packed.rows, bs * width)
        logits_output.next_token_logits = logits  # [bs * W, V], or [T, V] for argmax alone
        mask = None
        if grammar is not None:  # also clears the prefill's one-row mask, before it is applied
            mask = build_grammar_vocab_mask(
                reqs=batch.reqs, tree=grammar, sampling_info=batch.sampling_info,
                device=logits.device, barrier=grammar_barrier,
            )  # fmt: skip
        if batch.sampling_info is not None and unpacked:  # argmax alone: nothing to process
            self._process_logits(batch, logits, trees, width)
        if mask is not None:
            mask.apply(logits)
        hidden = logits_output.hidden_states  # consumed before the next target forward
        return logits_output, hidden.view(bs, width, -1)

    def _decode_roots(
        self, batch: Any, trees: TreeBatch, step: DecodeStep
    ) -> tuple[Any, torch.Tensor]:
        """A plain step's target pass: SGLang's decode forward of every root, as the plain
        server runs it; its logits, processed as ``_verify``'s, and the captured features.

        A root-only tree verify computes the same thing, but SGLang's verify forward and the
        tree inputs cost more host time than its plain decode (on a CPU, about a tenth of a
        plain step at one request). Used where the target decodes eagerly: a captured width-1
        verify graph replays cheaper still, and grammar batches verify their one-node trees.
        """
        # SGLang's decode forward reads the batch's fields: a shallow copy takes the roots,
        # their slots and lengths that count them, the scheduler's batch is left as it came.
        view = copy.copy(batch)
        view.forward_mode = ForwardMode.DECODE
        view.input_ids = trees.token_ids[:, 0]  # [bs]
        view.out_cache_loc = step.window[:, 0].contiguous()  # [bs]: each root's slot
        view.seq_lens = step.prefix + 1  # [bs]: the root counted, as SGLang's decode counts it
        view.seq_lens_cpu = step.prefix_cpu + 1
        view.seq_lens_sum = int(view.seq_lens_cpu.sum())
        view.spec_info = None
        target = self.target_worker.model_runner
        forward_batch = ForwardBatch.init_new(
            view, target, capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )  # fmt: skip
        out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True
        )
        self.stats.decoded_plain_steps += 1
        logits_output = out.logits_output
        logits = logits_output.next_token_logits  # [bs, V]
        if batch.sampling_info is not None:
            self._process_logits(batch, logits, trees, 1)
        bs = len(step.prefix)
        return logits_output, logits_output.hidden_states.view(bs, 1, -1)

    def _process_logits(
        self, batch: Any, logits: torch.Tensor, trees: TreeBatch | None, width: int
    ) -> None:
        """[bs*W, V] verify logits, in place, as the plain server processes each node's logits.

        Penalties first (per node: see ``node_sampling``), then the logit bias, then custom
        logit processors, in the plain server's order; grammar masks are applied by the caller.
        """
        info = batch.sampling_info
        orchestrator = penalizers_of(info)
        if orchestrator is not None and orchestrator.is_required and trees is not None:
            additive, scaling = info.acc_additive_penalties, info.acc_scaling_penalties
            if additive is None and scaling is None:  # not accumulated for this forward
                additive = torch.zeros(len(info), logits.shape[1], device=logits.device)
                orchestrator.accumulate_additive_penalties(additive)
                scaling = orchestrator.accumulate_scaling_penalties()
            state = state_from_penalizers(orchestrator.penalizers.values(), batch.reqs)
            penalize_tree_logits(
                logits, trees, self.block_size - 1, additive, scaling, state,
                apply_scaling_penalties,
            )  # fmt: skip
        if info.logit_bias is not None:
            logits.view(len(info), width, -1).add_(info.logit_bias.unsqueeze(1))
        if info.has_custom_logit_processor:  # sees the committed output, not each node's path
            apply_custom_logit_processor(logits, info, num_tokens_in_batch=width)

    def _commit_penalties(self, batch: Any, emitted: torch.Tensor, lens: torch.Tensor) -> None:
        """Count the step's emitted tokens into the requests' penalty state (SGLang's)."""
        orchestrator = penalizers_of(batch.sampling_info)
        if orchestrator is not None and orchestrator.is_required:
            state = state_from_penalizers(orchestrator.penalizers.values())
            commit_emitted(state, emitted, lens)

    def _target_tokens(
        self, batch: Any, logits: torch.Tensor, bs: int, width: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[bs, W] the target's token at every node: argmax, or a sample per request.

        ``rows`` [T]: ``logits`` are a packed pass's [T, V] (`argmax_alone`), at these rows.
        """
        info = batch.sampling_info
        if rows is not None:
            tokens = packed_argmax(logits, rows, bs * width).view(bs, width)
        elif info is None or info.is_all_greedy:
            tokens = logits.argmax(dim=-1).view(bs, width)
        else:
            max_top_k, uniform_top_k = host_top_k_bounds(batch.spec_info)
            probs = build_speculative_verify_target_probs(
                next_token_logits=logits, sampling_info=info, draft_token_num=width, bs=bs,
                max_top_k=max_top_k, uniform_top_k_value=uniform_top_k,
            )  # fmt: skip
            tokens = sample_rows(probs.view(bs * width, -1)).view(bs, width)
        group = self._tp_group
        if group.world_size > 1 and (SYNC_TOKEN_IDS_ACROSS_TP or batch.has_grammar):
            # Ranks draw alike from the same seeded state; SGLang's sampler syncs them anyway
            # under this flag or a grammar, and so do we.
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN,
                                         group=group.device_group)  # fmt: skip
        return tokens

    def _keep_accepted_kv(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Move the accepted nodes' target KV to the front slots of each request's window."""
        moved = target >= 0  # [bs, D+1]: -1 where the slot stays
        # A fixed-size copy, no host sync: entries that stay copy the pool's padding slot 0
        # (SGLang's dummy-output slot) onto itself.
        source = torch.where(moved, source, 0).reshape(-1)
        target = torch.where(moved, target, 0).reshape(-1)
        pool = self.model_runner.token_to_kv_pool_allocator.get_kvcache()
        if source.device.type == "cpu":
            pool.use_native_move_kv_cache = True  # the fused copy is a GPU kernel
        pool.move_kv_cache(target, source)

    def _write_draft_features(
        self, batch: Any, hidden: torch.Tensor, step: DecodeStep, path: torch.Tensor,
        accept_lens: torch.Tensor, hold: tuple[str, ...] | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Project the accepted path's target features into the draft KV at their slots.

        ``hold``: a plain step's batch (its request ids); its one token per request is held
        with the batch's earlier plain steps' and written with them (`HeldDraftKv`).
        ``keep`` [R]: a dormant plain step's rows whose context is written (`draft_context`).
        """
        prefix = step.prefix
        bs, depth = path.shape  # depth: path columns, at most D + 1
        # [bs, D+1]: each path node's row of the [bs * W, H] features (an index_select of
        # rows, where a gather of [bs, D+1, H] elements cost 17x as much on a CPU in bf16)
        nodes = path.clamp(min=0) + hidden.shape[1] * torch.arange(bs, device=path.device)[:, None]
        rows = step.window[:, :depth]  # [bs, D+1]: where the accepted path now lives
        plan = self._plan(batch.req_pool_indices, prefix, step.prefix_cpu, rows.reshape(-1), depth)
        cache_loc = self._draft_write_ids(plan).view(bs, depth)
        positions = prefix.unsqueeze(1) + torch.arange(depth, device=prefix.device)  # [bs, D+1]
        if keep is not None:
            nodes, cache_loc, positions = nodes[keep], cache_loc[keep], positions[keep]
            accept_lens = accept_lens[keep]
        flat = hidden.flatten(0, 1).index_select(0, nodes.reshape(-1))  # [R*(D+1), H]
        held = self.held_draft_kv
        if hold is not None and held is not None:  # fresh rows: graph buffers are not held
            if held.hold(hold, flat, cache_loc.reshape(-1), positions.reshape(-1)):
                self._make_held_draft_kv()
            return
        self._make_held_draft_kv()  # earlier writes first, in order
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=flat,
            cache_loc=cache_loc.reshape(-1),
            cache_loc_2d=cache_loc,
            positions=positions.reshape(-1),
            commit_lens=accept_lens,
        )


def ragged_layout(packed: RaggedVerify) -> RaggedVerifyLayout:
    """SGLang's ragged verify layout of a packed pass (per-request lengths, no padding)."""
    starts = torch.cumsum(packed.lens, 0, dtype=torch.int32)  # [B]
    return RaggedVerifyLayout(
        verify_lens=packed.lens,
        graph_num_tokens=packed.num_tokens,
        extend_start_loc=starts - packed.lens,
        qo_indptr_device=torch.cat([starts.new_zeros(1), starts]),
        verify_lens_cpu=list(packed.lens_cpu),
        total_verify_tokens=packed.num_tokens,
    )


def _token_budget(req: Any) -> int | None:
    """Tokens the request may still emit (max_new_tokens less its output so far), if known."""
    limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    return None if limit is None else int(limit) - len(req.output_ids)


def host_top_k_bounds(draft: Any) -> tuple[int | None, int | None]:
    """(largest top-k, the top-k every request shares or None) as host ints, when known.

    SGLang's DFlash draft input computes both on the host as it prepares each decode step;
    passing them spares the sampler a device read. (None, None) when the draft input was not
    prepared (its defaults, top-k 1 and no shared value, cannot come from real requests).
    """
    largest = getattr(draft, "max_top_k", None)
    shared = getattr(draft, "uniform_top_k_value", None)
    if largest is None or (largest == 1 and shared is None):
        return None, None
    return int(largest), shared


def argmax_alone(batch: Any) -> bool:
    """Whether a verify pass's logits serve only their argmax: every request greedy, with no
    penalty, bias, custom processor, grammar or logprobs that would read or change them."""
    info = batch.sampling_info
    if batch.return_logprob or batch.has_grammar:
        return False
    if info is None:
        return True
    orchestrator = penalizers_of(info)
    return (
        info.is_all_greedy and info.logit_bias is None and not info.has_custom_logit_processor
        and not (orchestrator is not None and orchestrator.is_required)
    )  # fmt: skip


def full_vocabulary(processor: Any, logits: torch.Tensor) -> torch.Tensor:
    """[bs*W, V] verify logits over the whole vocabulary, gathering a deferred TP shard.

    DFlash asks the target's logits processor to defer its tensor-parallel gather in verify
    passes (softcapped models on CUDA): each rank then holds only its vocabulary shard.
    """
    if processor is not None and processor.is_deferred_shard(logits):
        return processor.finish_deferred_gather(logits)
    return logits


def _ms(value: float | None) -> str:
    """A latency for the log, or '-' when there is none."""
    return "-" if value is None else f"{value:.2f}"


def _temperatures(batch: Any) -> list[float]:
    """Each request's sampling temperature (0 for greedy)."""
    info = batch.sampling_info
    if info is None or info.is_all_greedy:
        return [0.0] * len(batch.seq_lens)
    greedy = (info.top_ks.view(-1) == 1).tolist()
    temps = info.temperatures.view(-1).tolist()
    return [0.0 if g else float(t) for g, t in zip(greedy, temps, strict=True)]
