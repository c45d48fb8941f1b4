"""Compile every Triton kernel of the package for an H100/H200 (sm_90) without a GPU.

The Triton interpreter runs kernels as NumPy and misses what only the compiler checks (types
of loop-carried values, unsupported ops, register spills). This compiles each kernel at the
realistic sizes of ``driver.py`` to SASS with Triton's bundled ptxas and reports registers and
spill bytes. Run it without ``TRITON_INTERPRET`` (the script refuses otherwise).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

I64, I32, F32, BF16, U8 = "*i64", "*i32", "*fp32", "*bf16", "*u8"


def kernel_specs() -> list[tuple[str, str, dict[str, str], dict[str, object], int]]:
    """(module under sglang_bastion, kernel, runtime signature, constexprs, num_warps)."""
    return [
        ("kernels.draft_head", "_span_kernel",
         {"logits_ptr": BF16, "stride_row": "i32", "inv_t_ptr": F32, "vocab": "i32",
          "span": "i32", "splits": "i32", "part_val_ptr": F32, "part_idx_ptr": I32,
          "part_m_ptr": F32, "part_l_ptr": F32},
         {"K": 8, "KP": 8, "BLOCK_V": 2048}, 4),
        ("kernels.draft_head", "_merge_kernel",
         {"part_val_ptr": F32, "part_idx_ptr": I32, "part_m_ptr": F32, "part_l_ptr": F32,
          "splits": "i32", "probs_ptr": F32, "ids_ptr": I64},
         {"K": 8, "KP": 8, "SP": 128}, 4),  # 151936 / 2048 = 75 chunks
        ("tree.builder", "_best_first_kernel",
         {"log_q_ptr": F32, "tokens_ptr": I64, "root_ptr": I64, "out_tok_ptr": I64,
          "out_par_ptr": I64, "out_dep_ptr": I64, "out_score_ptr": F32, "size": "i32"},
         {"DEPTH": 15, "K": 8, "N": 64, "NP": 64, "C": 128, "DK": 128}, 1),
        ("tree.verify_inputs", "_verify_inputs_kernel",
         {"tok_ptr": I64, "par_ptr": I64, "dep_ptr": I64, "prefix_ptr": I32, "batch": "i32",
          "ids_ptr": I64, "pos_ptr": I64, "mask_ptr": U8, "retrieve_ptr": I64},
         {"W": 64, "WP": 64, "BLOCK": 1024, "BLOCK_B": 128}, 4),
        ("tree.acceptance", "_accept_kernel",
         {"tok_ptr": I64, "par_ptr": I64, "num_ptr": I64, "target_ptr": I64,
          "window_ptr": I64, "window_stride": "i32", "window_width": "i32", "batch": "i32",
          "out_ptr": I64, "num_acc_ptr": I64, "bonus_ptr": I64},
         {"W": 64, "WP": 64, "DEPTH": 15, "DP": 16}, 1),
        ("kernels.split_attention", "_partial_kernel",
         {"q_ptr": BF16, "sq_b": "i32", "sq_n": "i32", "sq_h": "i32", "k_ptr": BF16,
          "sk_slot": "i32", "sk_h": "i32", "v_ptr": BF16, "sv_slot": "i32", "sv_h": "i32",
          "prefix_slots_ptr": I64, "sp_b": "i32", "prefix_lens_ptr": I64,
          "tree_slots_ptr": I64, "tree_mask_ptr": U8, "tree_lens_ptr": I64, "out_ptr": F32,
          "lse_ptr": F32, "scale": "fp32", "chunk": "i32", "splits": "i32",
          "kv_heads": "i32", "row_blocks": "i32"},
         {"N": 64, "NP": 64, "G": 4, "ROWS": 64, "DH": 128, "DV": 128, "BLOCK_S": 64,
          "BLOCK_T": 64, "PRECISION": "tf32"}, 8),
        ("kernels.split_attention", "_merge_kernel",
         {"part_out_ptr": F32, "part_lse_ptr": F32, "tree_lens_ptr": I64, "out_ptr": F32,
          "parts": "i32", "nodes": "i32", "heads": "i32"},
         {"PC": 8, "DV": 128}, 4),
    ]  # fmt: skip


def main() -> int:
    """Compile every kernel; print registers and spills; exit 1 if any fails or spills."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from driver import import_kernels

    import_kernels()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    target = GPUTarget("cuda", 90, 32)
    failed = []
    for module, name, signature, constants, warps in kernel_specs():
        fn = getattr(importlib.import_module(f"sglang_bastion.{module}"), name)
        source = ASTSource(
            fn=fn, signature=signature | dict.fromkeys(constants, "constexpr"), constexprs=constants
        )
        try:
            ptx = triton.compile(source, target=target, options={"num_warps": warps}).asm["ptx"]
        except Exception as error:  # reported; the other kernels still compile
            print(f"{module}.{name}: FAILED {error}")
            failed.append(name)
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
            handle.write(ptx)
        info = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", handle.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        ).stderr
        os.unlink(handle.name)
        usage = [line.split(":", 1)[-1].strip() for line in info.splitlines() if "Used" in line]
        spills = " 0 bytes spill stores" not in info
        print(f"{module}.{name}: ok; {'; '.join(usage)}{'; SPILLS' if spills else ''}")
        if spills:
            failed.append(name)
    print(f"failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
