"""`jaxpod plan`'s human-readable report of a plan (the dict `jaxpod.planner.plan.plan` returns)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, like device data sheets)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _schedule_row(p: dict) -> list[tuple[str, str]]:
    """The pipeline schedule and its bubble (none without a pipeline)."""
    if not p.get("pipeline_schedule"):
        return []
    kind = p["pipeline_schedule"]
    virtual = f", {p['virtual_stages']} virtual stages" if p["virtual_stages"] > 1 else ""
    rows = [
        (
            "schedule",
            f"{kind}{virtual}: {p['pipeline']} stages x {p['pipeline_group']} micro-batches a "
            f"pass; bubble {p['bubble']:.1%} of the stage-ticks",
        )
    ]
    advice = p.get("schedule_advice")
    if advice:
        chunks = f" (train.virtual_stages={advice['virtual_stages']})"
        chunks = chunks if advice["virtual_stages"] > 1 else ""
        rows.append(
            ("advice", f"train.pipeline_schedule={advice['kind']}{chunks}: {advice['reason']}")
        )
    return rows


def _batch_text(p: dict) -> str:
    """The global batch as its factors, with its parts and pipeline passes where it has them."""
    text = (
        f"{p['global_batch']} = micro_batch {p['micro_batch']} x replica {p['replica']} "
        f"x grad_accum {p['grad_accum']}"
    )
    if p["batch_parts"] > 1:
        text += f", fed in {p['batch_parts']} parts"
    if p["pipeline"] > 1 and p["pipeline_group"] < p["grad_accum"] // p["batch_parts"]:
        text += f" (pipeline passes of {p['pipeline_group']})"
    return text


def _memory_text(p: dict) -> str:
    """The memory settings: device profile, remat, offload, phases, stream, token slices."""
    offload = ",".join(p["offload"]) or "none"
    fetched = ", each step gathering its weights" if p["rts"] > 1 else ""
    text = (
        f"{p['device_profile']}: remat {p['remat']}, offload {offload}, "
        f"phases {p['configured_phases']}, stream {p['configured_stream']}"
    )
    if p["configured_stream"] == "matrix":
        text += f" (mlp_panels {p['mlp_panels']}{fetched})"
    if p["vocab_slices"] > 1:
        text += f", token table in {p['vocab_slices']} slices"
    return text


def _settings_rows(p: dict) -> list[tuple[str, str]]:
    """The report's head: what is planned (model, mesh, batch, schedule, weights, memory)."""
    unit = "image" if p["model"] == "efficientnet" else "token"
    return [
        ("model", f"{p['model']}  ({p['params']:,} params{' ~est.' * p['params_estimated']})"),
        ("forward", f"{p['flops_per_example']:,} FLOP per {unit} (2 x multiply-adds)"),
        (
            "devices",
            f"{p['devices']} = replica {p['replica']} x pipeline {p['pipeline']} "
            f"x tensor {p['tensor']}",
        ),
        ("global batch", _batch_text(p)),
        *_schedule_row(p),
        (
            "weights/device",
            f"1/{round(1 / p['weight_fraction_per_device'])} of the model "
            f"(1/(t·p·rts), rts {p['rts']}, optimizer rts {p['rts_optimizer']}); "
            f"{p['params_per_device']:,} params held",
        ),
        ("memory", _memory_text(p)),
    ]


def _byte_rows(p: dict) -> list[tuple[str, int, str]]:
    """The per-device table's rows: each kind of state, its bytes and what it is."""
    b = p["bytes_per_device"]
    weights = "master (+16-bit working copy)"
    if p["held_phases"] > 1:  # jaxpod.planner.phased
        weights += f"; host-resident, one of {p['held_phases']} phases of the stack at a time"
    elif "params" in p["offload"]:  # docs/memory.md, "Which program the planner counts"
        weights += "; host-resident, counted on the device all step (CPU fetches no piece)"
    acts, remat = p["activations_breakdown"], f"remat {p['remat']}"
    if acts.get("host"):
        remat += f"; the saved values, {format_bytes(acts['host'])}, in host memory"
        if acts["saved_on_device"] == acts["saved"]:  # `jaxpod.planner.host_saved`
            remat += " (one backward tick's, read back within it: on the device as well)"
    elif acts.get("host_why"):
        remat += f"; saved values not offloaded ({acts['host_why']})"
    return [
        ("weights", b["weights"], weights),
        ("grads", b["grads"], "peak during backward"),
        ("optimizer", b["optimizer"], p["optimizer"]),
        ("moved in", b["moved_in"], "host-resident state moved to the device for the update"),
        ("activations", b["activations"], remat),
        ("updates", b["updates"], "optimizer update working set"),
        ("gathered", b["gathered"], "RTS all-gathered weights"),
        ("widened", b["widened"], "the step's matrices in float32 for their dots"),
        ("scattered", b["scattered"], "a whole weight gradient before its RTS reduce-scatter"),
        ("inputs", b["inputs"], "batch" if p["batch_parts"] == 1 else "a part of the batch"),
        ("input copy", b["input_copy"], "the image batch copied into the chip's tiles"),
        ("grad sum", b["grad_sum"], "the earlier parts' gradients, summed unreduced"),
        ("in VMEM", -b.get("in_vmem", 0), "temporaries XLA:TPU keeps in on-chip VMEM"),
    ]


def format_plan(p: dict) -> str:
    """The plan as an aligned, human-readable table (the default output of `jaxpod plan`)."""
    b = p["bytes_per_device"]
    head = _settings_rows(p)
    width = max(len(k) for k, _ in head)
    lines = [f"{k.ljust(width)}  {v}" for k, v in head]
    lines += ["", f"{'per device':<14}{'bytes':>12}", "-" * 26]
    lines += [f"{name:<14}{format_bytes(n):>12}   {note}" for name, n, note in _byte_rows(p) if n]
    lines.append("-" * 26)
    lines.append(
        f"{'device total':<14}{format_bytes(b['device_total']):>12}   peak at {b['peak']}; "
        f"limit {format_bytes(p['device_memory_bytes'])}"
    )
    lines.append(
        f"{'host total':<14}{format_bytes(b['host_total']):>12}   streaming memory "
        f"{format_bytes(p['streaming_memory_bytes'])}"
    )
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines += [
        "",
        f"planner, {p['device_profile']}: {verdict} ({format_bytes(b['device_total'])} of "
        f"{format_bytes(p['device_memory_bytes'])}); `jaxpod compile` gives XLA's bytes",
    ]
    if not p["host_fits"]:
        lines.append("host/streaming memory is exceeded too")
    if "suggestion" in p:
        lines.append(p["suggestion"])
    return "\n".join(lines)
