"""The calibration figure: measured vs predicted verify latency per context length (Figure 7).

One panel per context length; x is the tokens in the pass (batch size x tokens per request),
y the latency. Measured points are dots, the calibrated prediction crosses and the bare
roofline small squares, coloured by batch size; the title gives both RMSEs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_bastion.budget import LatencyProfile, ModelShape, roofline_ms


def plot_profile(profile: LatencyProfile, shape: ModelShape, path: str | Path) -> Path:
    """Write the measured-vs-predicted figure of ``profile`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    contexts = sorted({p.context_len for p in profile.grid})
    batches = sorted({p.batch_size for p in profile.grid})
    colours = plt.get_cmap("viridis")(torch.linspace(0, 0.9, len(batches)).tolist())
    fig, axes = plt.subplots(
        1, len(contexts), figsize=(4.2 * len(contexts), 4), squeeze=False, sharey=True
    )
    cal = profile.calibration
    for ax, context in zip(axes[0], contexts, strict=True):
        for colour, batch in zip(colours, batches, strict=True):
            points = sorted(
                (p for p in profile.grid if p.context_len == context and p.batch_size == batch),
                key=lambda p: p.tokens_per_request,
            )
            if not points:
                continue
            tokens = torch.tensor([p.tokens_per_request for p in points], dtype=torch.float64)
            x = (batch * tokens).tolist()
            bare = roofline_ms(shape, profile.hardware, batch, tokens, context, cal.bytes_per_elem)
            ax.plot(x, [p.latency_ms for p in points], "o", color=colour, label=f"B={batch}")
            ax.plot(x, cal.apply(bare).tolist(), "x--", color=colour, linewidth=0.8)
            ax.plot(x, bare.tolist(), "s", color=colour, markersize=3, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"context {context}")
        ax.set_xlabel("tokens in the verify pass (B x t)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("verify latency (ms)")
    axes[0][0].legend(fontsize=7, title="o measured, x-- calibrated, s roofline", title_fontsize=7)
    fig.suptitle(
        f"{profile.identity.target.name} on {profile.device_name}\nRMSE bare roofline "
        f"{profile.rmse_roofline_ms:.3g} ms -> calibrated {profile.rmse_calibrated_ms:.3g} ms "
        f"(slope {cal.slope:.3g}, intercept {cal.intercept_ms:.3g} ms)",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
