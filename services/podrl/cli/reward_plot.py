"""The reward curve of a run as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_reward_curve(steps: list[dict[str, Any]], out: Path, title: str) -> Path | None:
    """Write the PNG and return its path; None when matplotlib (the controller extra) is not
    installed: the run's table and records do not need it."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps if "reward_mean" in s["metrics"]]
    ys = [s["metrics"]["reward_mean"] for s in steps if "reward_mean" in s["metrics"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label="mean reward")
    if len(ys) >= 5:
        window = max(3, len(ys) // 10)
        smooth = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                  for i in range(len(ys))]  # fmt: skip
        ax.plot(xs, smooth, linewidth=2.5, alpha=0.7, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
