"""Training curves from run records: the lists of `metrics.jsonl` records a run writes
(`jaxpod.run.metrics`), each `{"step": ..., "loss": ...}` or `{"step": ..., "val_loss": ...}`."""

from __future__ import annotations


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """`(steps, values)` of every record that has `key`."""
    rows = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def draw_losses(ax, runs: dict[str, list[dict]]) -> None:
    """Training loss (lines) and validation loss (markers) of each run, one colour a run."""
    markers = "osD^v<>"
    for i, (name, records) in enumerate(runs.items()):
        colour = f"C{i}"
        ax.plot(*series(records, "loss"), color=colour, lw=1.2, alpha=0.8, label=f"{name} train")
        ax.plot(
            *series(records, "val_loss"),
            markers[i % len(markers)],
            color=colour,
            mfc="none",
            ms=7 + 2 * i,
            label=f"{name} validation",
        )
    ax.set(xlabel="step", ylabel="loss (nats per byte)")
    ax.legend(fontsize=7, ncol=2)


def draw_accuracy(ax, runs: dict[str, list[dict]]) -> None:
    """Training-batch accuracy (thin) and validation accuracy (markers) of each run."""
    for i, (name, records) in enumerate(runs.items()):
        colour = f"C{i}"
        ax.plot(
            *series(records, "accuracy"),
            color=colour,
            lw=1,
            alpha=0.6,
            label=f"{name}: training batch",
        )
        ax.plot(
            *series(records, "val_accuracy"), "o-", color=colour, lw=2, label=f"{name}: validation"
        )
    ax.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    ax.legend(fontsize=8, loc="lower right")
