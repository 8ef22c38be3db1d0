"""The picture of a speculation profile: goodput against batch size for every K, with the
chosen schedule drawn over it, and the measured acceptance per draft position.

matplotlib is optional (the `dev` extra installs it); without it the profiler says so and
writes the profile alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo.llm.speculation_profile import (
    SpeculationProfile,
    goodput,
    goodput_without_speculation,
    k_for_batch,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

log = logging.getLogger("dynamo.vllm.profile_spec")


def plot_profile(profile: SpeculationProfile, path: Path) -> bool:
    """Write the PNG; False (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[2.2, 1])
    _goodput_panel(left, profile)
    _acceptance_panel(right, profile)
    fig.suptitle(f"{profile.model}, {profile.method}: measured {profile.measured_at}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _goodput_panel(ax: Axes, profile: SpeculationProfile) -> None:
    """Goodput relative to an engine without speculation, so the crossovers show at every
    batch size (and K=0 below 1.0 where the drafter costs even when it drafts nothing)."""
    batches = list(range(1, profile.max_batch_size + 1))
    measured = [b for b in profile.batch_sizes if b <= profile.max_batch_size]

    def relative(k: int, batch: int) -> float:
        return goodput(profile, k, batch) / goodput_without_speculation(profile, batch)

    for times in profile.step_times:
        line = ax.plot(batches, [relative(times.k, b) for b in batches], linewidth=1.0,
                       label=f"K={times.k}")  # fmt: skip
        ax.scatter(measured, [relative(times.k, b) for b in measured], s=14,
                   color=line[0].get_color())  # fmt: skip
    chosen = [relative(k_for_batch(profile.schedule, b), b) for b in batches]
    ax.plot(batches, chosen, color="black", linewidth=3, alpha=0.35, label="chosen schedule")
    for first, last, k in profile.schedule:
        ax.axvspan(first - 0.5, last + 0.5, alpha=0.06 if k % 2 else 0.12, color="grey")
        ax.text(
            (first * last) ** 0.5, 0.02, f"K={k}", ha="center", va="bottom",
            transform=ax.get_xaxis_transform(), fontsize=8,
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlim(0.9, profile.max_batch_size * 1.1)
    ax.set_xlabel("running sequences (batch size); dots: measured")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("goodput vs an engine without speculation")
    ax.set_title("Expected tokens/s per K vs no speculation; the chosen schedule in bold")
    ax.legend(fontsize=8)


def _acceptance_panel(ax: Axes, profile: SpeculationProfile) -> None:
    positions = list(range(1, len(profile.acceptance_per_position) + 1))
    ax.bar(positions, profile.acceptance_per_position, color="tab:blue")
    ax.set_xticks(positions)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted")
    ax.set_title(f"Acceptance ({profile.prompts})", fontsize=9)
