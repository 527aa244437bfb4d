"""Training curves as one PNG: what a person looks at first after a run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from soarm.files import atomic_write  # noqa: E402

PANELS = (
    ("task/fingertip_error", "fingertip error at window end (mm)", 1000.0, True),
    ("task/success_1cm", "success @ 1 cm (%)", 100.0, False),
    ("episode/mean_return", "mean episode return", 1.0, False),
    ("policy/action_std", "action std", 1.0, False),
    ("policy/kl", "KL", 1.0, True),
    ("perf/total_steps_per_s", "env-steps/s (collection + update)", 1.0, False),
)


def plot_training(rows: list[dict], path: str | Path) -> None:
    if not rows:
        return
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    steps = [r["env_steps"] / 1e6 for r in rows]
    for ax, (key, title, scale, log) in zip(axes.flat, PANELS):
        pts = [(x, r[key] * scale) for x, r in zip(steps, rows) if key in r]
        if pts:
            ax.plot(*zip(*pts), lw=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("env steps (M)")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
