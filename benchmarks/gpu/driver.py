"""GPU checks of ``sglang_bastion.kernels``: each kernel against its reference, timed.

Imports only torch, triton and this repository's ``kernels/`` and ``sglang_bastion/tree`` (no
SGLang, no FlashInfer), so it runs on a bare CUDA machine from a plain checkout. For every
kernel and shape it records whether the kernel matches its torch reference, both times, the
memory-traffic floor (bytes moved / measured copy bandwidth) and the ratio kernel / floor;
then tree preparation (draft head + tree + verify inputs) against chain preparation (draft
head argmax + positions), and masked vs split vs causal verification attention at equal
token counts. Results: ``<out>/kernels_<device>_<date>.json`` and ``.md``.

``--dry-run``: tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (seconds; CI runs it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shapes:
    """Everything a run's sizes follow from."""

    device: str
    hidden: int
    vocab: int
    batches: tuple[int, ...]
    depth: int  # D draft positions
    top_k: int
    nodes: tuple[int, ...]  # N tree sizes
    prefix: int  # context tokens per request in the attention checks
    heads: int
    kv_heads: int
    head_dim: int
    repeats: int


# Qwen3-8B: hidden 4096, vocabulary 151,936, 32 query / 8 KV heads of 128.
FULL = Shapes("cuda", 4096, 151_936, (1, 8, 36, 64), 15, 8, (16, 64), 2048, 32, 8, 128, 20)
DRY = Shapes("cpu", 32, 300, (2,), 4, 4, (8,), 24, 4, 2, 16, 1)

COLUMNS = ["check", "shape", "ok", "kernel_us", "reference_us", "floor_us", "ratio", "note"]


def import_kernels() -> None:
    """Make ``sglang_bastion.kernels`` importable from a checkout that was never installed."""
    try:
        import sglang_bastion.kernels
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import sglang_bastion

        sglang_bastion.__path__.append(str(ROOT))  # kernels/ installs as sglang_bastion.kernels


class Timer:
    """Median time of a callable: CUDA events on a GPU, wall clock (one run) on the CPU."""

    def __init__(self, torch_module, shapes: Shapes):
        self.torch = torch_module
        self.shapes = shapes
        self.cuda = shapes.device == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        """Microseconds per call."""
        torch = self.torch
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.shapes.repeats):
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3)
        return statistics.median(times)


def copy_bandwidth(torch, device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    size = (1 << 28) if device == "cuda" else (1 << 22)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer_shapes = FULL if device == "cuda" else DRY
    seconds = Timer(torch, timer_shapes)(lambda: dst.copy_(src)) / 1e6
    return 2 * size / seconds


class Checks:
    """Runs every check and collects one row per (check, shape)."""

    def __init__(self, shapes: Shapes):
        import torch

        self.torch = torch
        self.shapes = shapes
        self.device = shapes.device
        self.time = Timer(torch, shapes)
        self.bandwidth = copy_bandwidth(torch, shapes.device)
        self.rows: list[dict[str, object]] = []
        self.generator = torch.Generator(device="cpu").manual_seed(0)  # small host-side draws
        self.device_generator = torch.Generator(device=self.device).manual_seed(0)
        self._weight = None

    # ------------------------------------------------------------------ helpers

    def row(self, check: str, shape: str, ok: bool, kernel_us: float, reference_us: float,
            floor_bytes: float, note: str = "") -> None:  # fmt: skip
        """Record one result; the floor is ``floor_bytes`` at the measured copy bandwidth."""
        floor_us = floor_bytes / self.bandwidth * 1e6
        self.rows.append(
            {
                "check": check,
                "shape": shape,
                "ok": bool(ok),
                "kernel_us": round(kernel_us, 2),
                "reference_us": round(reference_us, 2),
                "floor_us": round(floor_us, 3),
                "ratio": round(kernel_us / floor_us, 2) if floor_us > 0 else None,
                "note": note,
            }
        )
        print(" | ".join(str(self.rows[-1][c]) for c in COLUMNS), flush=True)

    def guarded(self, name: str, fn: Callable[[], None]) -> None:
        """Run one check; a crash becomes a failed row instead of ending the run."""
        try:
            fn()
        except Exception as error:  # recorded as a failed row; the other checks still run
            traceback.print_exc()
            self.rows.append(
                {c: None for c in COLUMNS} | {"check": name, "ok": False, "note": repr(error)}
            )

    def randn(self, *shape: int, dtype=None, scale: float = 1.0):
        """Seeded normal draws, made on the run's device."""
        torch = self.torch
        x = torch.randn(*shape, generator=self.device_generator, device=self.device) * scale
        return x.to(dtype or torch.float32)

    def lm_head(self):
        """The [V, H] bf16 LM-head weight every draft-head check shares (1.2 GB at Qwen3-8B)."""
        if self._weight is None:
            s = self.shapes
            self._weight = self.randn(s.vocab, s.hidden, dtype=self.torch.bfloat16, scale=0.02)
        return self._weight

    def trees(self, batch: int, nodes: int):
        """Random best-first trees of N nodes (and their top-K) from smooth marginals."""
        from sglang_bastion.tree.builder import build_trees_reference

        torch = self.torch
        s = self.shapes
        probs = torch.softmax(self.randn(batch, s.depth, 1000, scale=2.0), dim=-1)
        top_q, top_ids = probs.topk(s.top_k, dim=-1)
        roots = torch.randint(0, 1000, (batch,), generator=self.generator).to(self.device)
        trees = build_trees_reference(top_q, top_ids, roots, max_nodes=nodes)
        return trees, top_q, top_ids, roots

    # ------------------------------------------------------------------ checks

    def draft_head(self) -> None:
        """Top-K + full-vocabulary softmax over bf16 logits; the GEMM and the old path too."""
        from sglang_bastion.kernels import (
            draft_logits,
            topk_softmax_reference,
            topk_softmax_triton,
        )

        torch = self.torch
        s = self.shapes
        weight = self.lm_head()
        for batch in s.batches:
            rows = batch * s.depth
            hidden = self.randn(rows, s.hidden, dtype=torch.bfloat16)
            logits = draft_logits(hidden, weight, s.vocab)  # [R, V]
            probs, ids = topk_softmax_triton(logits, s.top_k)
            ref_probs, ref_ids = topk_softmax_reference(logits, s.top_k)
            x = logits.float()
            same_values = torch.equal(x.gather(1, ids), x.gather(1, ref_ids))  # ties may swap
            close = torch.allclose(probs, ref_probs, rtol=1e-4, atol=1e-6)
            shape = f"R={rows} V={s.vocab} K={s.top_k}"
            self.row(
                "draft_head_topk",
                shape,
                same_values and close,
                self.time(lambda logits=logits: topk_softmax_triton(logits, s.top_k)),
                self.time(lambda logits=logits: topk_softmax_reference(logits, s.top_k)),
                logits.numel() * logits.element_size(),
                f"ids equal to reference: {torch.equal(ids, ref_ids)}",
            )
            gemm_bytes = (weight.numel() + hidden.numel() + logits.numel()) * 2
            self.row(
                "draft_head_gemm",
                f"R={rows} H={s.hidden} V={s.vocab}",
                True,
                self.time(lambda hidden=hidden: draft_logits(hidden, weight, s.vocab)),
                self.time(lambda hidden=hidden: _old_draft_head(torch, hidden, weight, s.top_k)),
                gemm_bytes,
                "reference = old worker path: fp32 GEMM + softmax + topk",
            )

    def tree_build(self) -> None:
        """One-launch best-first build against the heap reference, exact."""
        from sglang_bastion.tree.builder import build_trees_reference as reference
        from sglang_bastion.tree.builder import build_trees_triton as build

        s = self.shapes
        for nodes in s.nodes:
            for batch in s.batches:
                ref, top_q, top_ids, roots = self.trees(batch, nodes)
                out = build(top_q, top_ids, roots, max_nodes=nodes)
                fields = ("token_ids", "parents", "depths", "log_scores", "num_nodes")
                ok = all(self.torch.equal(getattr(out, f), getattr(ref, f)) for f in fields)
                floor = batch * s.depth * s.top_k * (4 + 8) + batch * nodes * 28
                self.row(
                    "tree_build",
                    f"B={batch} D={s.depth} K={s.top_k} N={nodes}",
                    ok,
                    self.time(partial(build, top_q, top_ids, roots, max_nodes=nodes)),
                    self.time(partial(reference, top_q, top_ids, roots, max_nodes=nodes)),
                    floor,
                )

    def verify_and_accept(self) -> None:
        """Verify inputs and acceptance + KV moves against their torch references, exact."""
        from sglang_bastion.tree.acceptance import accept_reference, accept_triton
        from sglang_bastion.tree.verify_inputs import verify_inputs_reference, verify_inputs_triton

        torch = self.torch
        s = self.shapes
        for nodes in s.nodes:
            for batch in s.batches:
                trees, *_ = self.trees(batch, nodes)
                low = s.prefix // 2
                prefix_cpu = torch.randint(low, s.prefix + 1, (batch,), generator=self.generator)
                prefix = prefix_cpu.to(self.device)
                out = verify_inputs_triton(trees, prefix, prefix_cpu)
                ref = verify_inputs_reference(trees, prefix)
                ok = all(
                    torch.equal(getattr(out, f), getattr(ref, f))
                    for f in ("input_ids", "positions", "custom_mask", "retrieve_index",
                              "retrieve_next_token", "retrieve_next_sibling")
                )  # fmt: skip
                floor = out.custom_mask.numel() + batch * nodes * 8 * 8
                shape = f"B={batch} N={nodes} prefix<={s.prefix}"
                self.row(
                    "verify_inputs",
                    shape,
                    ok,
                    self.time(partial(verify_inputs_triton, trees, prefix, prefix_cpu)),
                    self.time(partial(verify_inputs_reference, trees, prefix)),
                    floor,
                    f"mask {out.custom_mask.numel() / 1e6:.2f} MB",
                )
                targets = _planted_targets(torch, trees, self.generator)
                window = torch.randperm(batch * nodes * 4, generator=self.generator)
                window = window[: batch * nodes].view(batch, nodes).to(self.device)
                got = accept_triton(trees, targets, window, max_depth=s.depth)
                want = accept_reference(trees, targets, window, max_depth=s.depth)
                fields = ("path", "num_accepted", "bonus_tokens", "kv_source", "kv_target")
                self.row(
                    "accept",
                    f"B={batch} N={nodes} D={s.depth}",
                    all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields),
                    self.time(partial(accept_triton, trees, targets, window, max_depth=s.depth)),
                    self.time(partial(accept_reference, trees, targets, window, max_depth=s.depth)),
                    batch * nodes * 8 * 5 + batch * (s.depth + 1) * 8 * 3,
                    f"mean accepted {float(want.num_accepted.float().mean()):.1f}",
                )

    def ladder(self) -> None:
        """Verify inputs and acceptance at every adaptive verify width, int64 prefixes, exact.

        Both ops specialise on W, so each ladder width is its own compile (the worker warms
        them at start-up); SGLang's sequence lengths are int64.
        """
        from sglang_bastion.controller import width_ladder
        from sglang_bastion.tree.acceptance import accept_reference, accept_triton
        from sglang_bastion.tree.verify_inputs import verify_inputs_reference, verify_inputs_triton

        torch = self.torch
        s = self.shapes
        batch, nodes = s.batches[-1], max(s.nodes)
        trees, *_ = self.trees(batch, nodes)
        prefix_cpu = torch.randint(s.prefix // 2, s.prefix + 1, (batch,), dtype=torch.int64,
                                   generator=self.generator)  # fmt: skip
        prefix = prefix_cpu.to(self.device)
        for width in width_ladder(nodes):
            narrow = trees.narrow(width)
            out = verify_inputs_triton(narrow, prefix, prefix_cpu)
            ref = verify_inputs_reference(narrow, prefix)
            fields = ("input_ids", "positions", "custom_mask", "retrieve_index")
            ok = all(torch.equal(getattr(out, f), getattr(ref, f)) for f in fields)
            targets = _planted_targets(torch, narrow, self.generator)
            window = torch.arange(batch * nodes, device=self.device).view(batch, nodes)
            got = accept_triton(narrow, targets, window, max_depth=s.depth)
            want = accept_reference(narrow, targets, window, max_depth=s.depth)
            moves = ("path", "num_accepted", "bonus_tokens", "kv_source", "kv_target")
            ok = ok and all(torch.equal(getattr(got, f), getattr(want, f)) for f in moves)
            self.row(
                "ladder",
                f"B={batch} W={width} int64 prefixes",
                ok,
                self.time(partial(verify_inputs_triton, narrow, prefix, prefix_cpu)),
                self.time(partial(verify_inputs_reference, narrow, prefix)),
                out.custom_mask.numel() + batch * width * 8 * 8,
                "verify inputs + accept compiled at this width",
            )

    def preparation(self) -> None:
        """Tree preparation (kernels, and the old torch path) against chain preparation."""
        from sglang_bastion.kernels import draft_logits, topk_softmax_triton
        from sglang_bastion.tree.builder import build_trees, build_trees_triton
        from sglang_bastion.tree.verify_inputs import verify_inputs_reference, verify_inputs_triton

        torch = self.torch
        s = self.shapes
        weight = self.lm_head()
        for nodes in s.nodes:
            for batch in s.batches:
                hidden = self.randn(batch * s.depth, s.hidden, dtype=torch.bfloat16)
                roots = torch.zeros(batch, dtype=torch.long, device=self.device)
                prefix_cpu = torch.full((batch,), s.prefix, dtype=torch.long)
                prefix = prefix_cpu.to(self.device)

                def chain(hidden=hidden, prefix=prefix, batch=batch, roots=roots):
                    tokens = draft_logits(hidden, weight, s.vocab).argmax(dim=-1)  # [R]
                    ids = torch.cat([roots.view(batch, 1), tokens.view(batch, -1)], dim=1)
                    steps = torch.arange(s.depth + 1, device=hidden.device)
                    return ids, prefix.unsqueeze(1) + steps

                def tree(hidden=hidden, prefix=prefix, prefix_cpu=prefix_cpu, batch=batch,
                         nodes=nodes, roots=roots):  # fmt: skip
                    logits = draft_logits(hidden, weight, s.vocab)
                    probs, ids = topk_softmax_triton(logits, s.top_k)
                    q = probs.view(batch, s.depth, -1)
                    trees = build_trees_triton(
                        q, ids.view(batch, s.depth, -1), roots, max_nodes=nodes
                    )
                    return verify_inputs_triton(trees, prefix, prefix_cpu)

                def old_tree(hidden=hidden, prefix=prefix, batch=batch, nodes=nodes, roots=roots):
                    logits = hidden.float() @ weight.float().T
                    probs = torch.softmax(logits, dim=-1).view(batch, s.depth, -1)
                    trees = build_trees(probs, roots, top_k=s.top_k, max_nodes=nodes)
                    return verify_inputs_reference(trees, prefix)

                chain_us = self.time(chain)
                tree_us = self.time(tree)
                old_us = self.time(old_tree)
                self.row(
                    "prep_tree_vs_chain",
                    f"B={batch} N={nodes}",
                    True,
                    tree_us,
                    chain_us,
                    (weight.numel() + hidden.numel()) * 2,
                    f"tree/chain {tree_us / chain_us:.3f}; old torch tree/chain "
                    f"{old_us / chain_us:.3f} ({old_us:.0f} us)",
                )

    def attention(self) -> None:
        """Split (Triton) vs full-mask SDPA vs causal SDPA over the same B x N tokens."""
        from sglang_bastion.kernels import split_tree_attention_triton
        from sglang_bastion.tree import ancestor_mask

        torch = self.torch
        s = self.shapes
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        scale = s.head_dim**-0.5
        for nodes in s.nodes:
            for batch in s.batches:
                trees, *_ = self.trees(batch, nodes)
                tree_mask = ancestor_mask(trees)  # [B, N, N]
                columns = s.prefix + nodes
                slots = batch * columns
                k_buf = self.randn(slots, s.kv_heads, s.head_dim, dtype=dtype)
                v_buf = self.randn(slots, s.kv_heads, s.head_dim, dtype=dtype)
                table = torch.arange(slots, device=self.device).view(batch, columns)
                prefix_slots, tree_slots = table[:, : s.prefix], table[:, s.prefix :]
                prefix_lens = torch.full((batch,), s.prefix, device=self.device)
                tree_lens = torch.full((batch,), nodes, device=self.device)
                q = self.randn(batch, nodes, s.heads, s.head_dim, dtype=dtype)
                causal_mask = torch.ones(nodes, nodes, dtype=torch.bool, device=self.device)
                causal_mask = causal_mask.tril().expand(batch, nodes, nodes)

                def split(mask=tree_mask, q=q, k=k_buf, v=v_buf, p=prefix_slots, pl=prefix_lens,
                          t=tree_slots, tl_=tree_lens):  # fmt: skip
                    return split_tree_attention_triton(q, k, v, p, pl, t, mask, tl_, scale)

                # Dense [B, Hkv, S, D] keys/values as a dense kernel reads them.
                k = k_buf.view(batch, columns, s.kv_heads, s.head_dim).transpose(1, 2)
                v = v_buf.view(batch, columns, s.kv_heads, s.head_dim).transpose(1, 2)
                qt = q.transpose(1, 2)  # [B, H, N, D]
                full = torch.ones(batch, 1, nodes, columns, dtype=torch.bool, device=self.device)
                full[:, 0, :, s.prefix :] = tree_mask
                masked, masked_note = _sdpa(torch, qt, k, v, full, scale)
                causal, causal_note = _sdpa(torch, qt, k, v, "causal", scale)
                out = split()
                want = masked().transpose(1, 2).float()
                err = float((out - want).abs().max())
                ok = err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
                kv_bytes = 2 * slots * s.kv_heads * s.head_dim * k_buf.element_size()
                floor = kv_bytes + q.numel() * (q.element_size() + 4)
                shape = f"B={batch} N={nodes} P={s.prefix} H={s.heads}/{s.kv_heads}"
                split_us = self.time(split)
                causal_us = self.time(causal)
                self.row(
                    "attn_split_vs_masked",
                    shape,
                    ok,
                    split_us,
                    self.time(masked),
                    floor,
                    f"max err {err:.1e}; masked: {masked_note}; mask {full.numel() / 1e6:.1f} MB "
                    f"vs tree block {tree_mask.numel() / 1e6:.3f} MB",
                )
                self.row(
                    "attn_split_vs_causal",
                    shape,
                    True,
                    split_us,
                    causal_us,
                    floor,
                    f"split/causal {split_us / causal_us:.3f}; causal: {causal_note}; "
                    f"split with a causal block {self.time(lambda m=causal_mask: split(m)):.1f} us",
                )


def _old_draft_head(torch, hidden, weight, top_k: int):
    """The worker's draft head before the kernels: fp32 GEMM, softmax, then top-K."""
    probs = torch.softmax(hidden.float() @ weight.float().T, dim=-1)
    return probs.topk(top_k, dim=-1)


def _planted_targets(torch, trees, generator):
    """Target tokens that accept a path: each parent's target is one child's token."""
    batch, nodes = trees.token_ids.shape
    targets = torch.randint(0, 1000, (batch, nodes + 1), generator=generator)
    targets = targets.to(trees.token_ids.device)
    parents = torch.where(trees.parents >= 0, trees.parents, nodes)  # padding -> spare column
    targets.scatter_(1, parents[:, 1:], trees.token_ids[:, 1:])
    return targets[:, :nodes].contiguous()


def _sdpa(torch, q, k, v, mask, scale: float):
    """(callable, note): SDPA with a boolean mask or bottom-right causal, GQA if supported."""
    import torch.nn.functional as F

    if isinstance(mask, str):
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[2], k.shape[2])
    group = q.shape[1] // k.shape[1]

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    try:
        gqa()
        return gqa, "SDPA enable_gqa"
    except (RuntimeError, TypeError, NotImplementedError):
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def expanded():
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, scale=scale)

        return expanded, "SDPA with KV heads repeated (no GQA support)"


def markdown(rows: list[dict[str, object]], meta: dict[str, object]) -> str:
    """The results as a Markdown report."""
    lines = [
        "# sglang_bastion.kernels on GPU",
        "",
        f"Device: {meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}; "
        f"{meta['date']}; copy bandwidth {meta['copy_bandwidth_gb_s']:.0f} GB/s "
        "(the floor is bytes moved at that rate).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the checks; exit 1 when any kernel disagrees with its reference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
    import_kernels()
    import torch
    import triton

    shapes = DRY if args.dry_run else FULL
    if shapes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    checks = Checks(shapes)
    checked = (
        "draft_head",
        "tree_build",
        "verify_and_accept",
        "ladder",
        "preparation",
        "attention",
    )
    for name in checked:
        checks.guarded(name, getattr(checks, name))
    sglang_loaded = sorted(
        m for m in sys.modules if m.split(".")[0] in ("sglang", "flashinfer")
    )  # must stay empty: the GPU machine has neither
    device_name = torch.cuda.get_device_name() if shapes.device == "cuda" else platform.processor()
    now = dt.datetime.now(dt.UTC)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device_name": device_name or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": args.dry_run,
        "shapes": asdict(shapes),
        "copy_bandwidth_gb_s": checks.bandwidth / 1e9,
        "sglang_modules_loaded": sglang_loaded,
        "command": " ".join(["python", *sys.argv]),
    }
    slug = "".join(ch if ch.isalnum() else "-" for ch in meta["device_name"]).strip("-").lower()
    stem = f"kernels_{'dry-run_' if args.dry_run else ''}{slug}_{now:%Y-%m-%d}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "rows": checks.rows}, indent=2) + "\n"
    )
    (args.out / f"{stem}.md").write_text(markdown(checks.rows, meta))
    failed = [row["check"] for row in checks.rows if not row["ok"]]
    print(f"wrote {args.out / stem}.json/.md; failed: {failed or 'none'}")
    return 1 if failed or sglang_loaded else 0


if __name__ == "__main__":
    sys.exit(main())
