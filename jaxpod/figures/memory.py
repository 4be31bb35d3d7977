"""Bytes per device, stacked by kind, from the planner (`jaxpod.planner.plan.plan`), with
XLA's compiled device total beside each bar when it is known, and the device limit drawn.

The planner's device total is the resident state (weights, optimizer state, the RTS-gathered
working copy, the step's inputs) plus the largest of three moments: the loss head
(activations), the backward pass (gradients and activations) or the optimizer update (the
gradients it reads and its working set). The stack shows the resident parts and the parts of
the largest moment, so it sums to the device total. Used by `jaxpod plan --chart` and by
`make figures`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from jaxpod.figures import save
from jaxpod.planner.report import format_bytes

KINDS = ("weights", "optimizer", "gathered", "inputs", "grads", "activations", "update")
COLOURS = dict(
    zip(
        KINDS,
        ("#4e79a7", "#f28e2b", "#b07aa1", "#9c755f", "#e15759", "#59a14f", "#edc948"),
        strict=True,
    )
)
LABELS = {"update": "update working set"}
XLA_COLOUR = "0.55"
XLA_LABEL = "XLA:CPU compiled total"


def stack(plan: dict) -> dict[str, int]:
    """The device total of `plan` split by kind (the parts sum to `device_total`)."""
    b = plan["bytes_per_device"]
    parts = {k: b[k] for k in ("weights", "optimizer", "gathered", "inputs")}
    peak = b["device_total"] - sum(parts.values())
    grads = 0 if b["peak"] == "head" else min(b["grads"], peak)  # at the head: activations
    parts["grads"] = grads
    rest = "update" if b["peak"] == "update" else "activations"
    parts[rest] = peak - grads
    return parts


def draw_bytes(
    ax,
    plans: dict[str, dict],
    beside: dict[str, int] | None = None,
    beside_label: str = XLA_LABEL,
    title: str = "",
    *,
    legend: bool = True,
    limits: bool = True,
) -> None:
    """One stacked bar per plan (labels are `plans`' keys), each plan's device limit as a red
    tick (`limits`; off where the memory dwarfs the bars), and a grey bar beside it where
    `beside` has that label: XLA's compiled device total (the default `beside_label`), or
    e.g. the plan's bytes in host memory. `legend=False` leaves it to the caller
    (`legend_entries`)."""
    beside = beside or {}
    width = 0.38 if beside else 0.6
    shift = width / 2 if beside else 0.0
    seen: set[str] = set()  # legend entries already drawn: each kind is labelled once
    tops = []
    for i, (name, p) in enumerate(plans.items()):
        bottom = _draw_stack(ax, i - shift, width, p, seen)
        tops.append(bottom)
        if limits:
            _draw_limit(ax, i, p["device_memory_bytes"], len(plans) == 1, seen)
            tops.append(p["device_memory_bytes"])
        if name in beside:
            _draw_beside(ax, i + shift, width, beside[name], beside_label, seen)
            tops.append(beside[name])
    ax.set_xticks(range(len(plans)), list(plans), fontsize=8)
    ax.set(ylabel="GB per device", ylim=(0, 1.12 * max(tops) / 1e9), xlim=(-0.6, len(plans) - 0.4))
    if title:
        ax.set_title(title, fontsize=10)
    if legend:
        ax.legend(*legend_entries([ax], beside_label), **LEGEND)


def _draw_stack(ax, x: float, width: float, plan: dict, seen: set[str]) -> int:
    """The plan's bar at `x`: its device total stacked by kind (`stack`), the total written on
    top in GB. Returns the total in bytes."""
    bottom = 0
    for kind, value in stack(plan).items():
        if value <= 0:
            continue
        label = None if kind in seen else LABELS.get(kind, kind)
        seen.add(kind)
        ax.bar(x, value / 1e9, width, bottom=bottom / 1e9, color=COLOURS[kind], label=label)
        bottom += value
    ax.text(x, bottom / 1e9, f"{bottom / 1e9:.2f}", ha="center", va="bottom", fontsize=7)
    return bottom


def _draw_limit(ax, i: int, limit: int, alone: bool, seen: set[str]) -> None:
    """The device limit as a red tick across slot `i`, labelled with its size when the chart
    has this plan alone."""
    ax.plot(
        [i - 0.48, i + 0.48],
        [limit / 1e9] * 2,
        color="red",
        lw=1.5,
        label=None if "limit" in seen else "device memory",
    )
    if alone:
        ax.text(
            i + 0.48,
            limit / 1e9,
            format_bytes(limit),
            color="red",
            ha="right",
            va="bottom",
            fontsize=7,
        )
    seen.add("limit")


def _draw_beside(ax, x: float, width: float, other: int, label: str, seen: set[str]) -> None:
    """The grey, hatched bar of `other` bytes at `x` (e.g. XLA's compiled total), its size in
    GB on top: the number the plan's stack is compared with."""
    ax.bar(
        x,
        other / 1e9,
        width,
        color=XLA_COLOUR,
        hatch="//",
        edgecolor="white",
        label=None if "beside" in seen else label,
    )
    seen.add("beside")
    ax.text(x, other / 1e9, f"{other / 1e9:.2f}", ha="center", va="bottom", fontsize=7, color="0.3")


LEGEND = dict(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def legend_entries(axes, beside_label: str = XLA_LABEL) -> tuple[list, list[str]]:
    """The handles and labels of `axes`' bars, each label once, in a fixed order (kinds from
    the bottom of the stack up, then the limit, then the bar beside) whatever order the bars
    came in."""
    found: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            found.setdefault(label, handle)
    order = [LABELS.get(k, k) for k in KINDS] + ["device memory", beside_label]
    labels = sorted(found, key=order.index)
    return [found[lab] for lab in labels], labels


def plan_label(plan: dict, name: str = "") -> str:
    """`name` (e.g. the config's), `model r x p x t` and the device profile, for a bar."""
    mesh = f"{plan['replica']}x{plan['pipeline']}x{plan['tensor']}"
    lines = [*textwrap.wrap(name, 40), f"{plan['model']} {mesh}, {plan['device_profile']}"]
    return "\n".join(lines)


def plan_chart(plan: dict, path: str | Path, name: str = "") -> Path:
    """`jaxpod plan --chart FILE.png`: the config's stacked bar against its device limit."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    verdict = "fits" if plan["fits"] else "does not fit"
    host = format_bytes(plan["bytes_per_device"]["host_total"])
    title = f"planned bytes per device: {verdict}\n(host / streaming memory: {host})"
    draw_bytes(ax, {plan_label(plan, name): plan}, title=title)
    fig.tight_layout()
    path = save(fig, path)
    plt.close(fig)
    return path
