"""The commands that choose a mapping for a pod, analytic and instant: `jaxpod estimate` (one
mapping's step time) and `jaxpod search` (the fastest mappings that fit). Imports nothing
heavy until a command runs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

TARGET_HELP = (
    "N devices of a profile (a100-80gb:1024, h100-80gb:64) or a TPU topology (tpu-v5p:8x8x4)"
)


def add_pod_commands(sub, split: Callable) -> None:
    """Add `estimate` and `search` to the CLI's subparsers; `split(items, command)` parts a
    command line into CONFIG and its KEY=VALUE overrides."""
    est = sub.add_parser("estimate", help="the step time of a mapping on N devices (analytic)")
    est.add_argument("items", nargs="+", metavar="CONFIG [KEY=VALUE ...]")
    est.add_argument("--target", required=True, metavar="PROFILE:N", help=TARGET_HELP)
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(run=lambda args: _estimate(args, split))

    find = sub.add_parser("search", help="the fastest mappings that fit N devices (analytic)")
    find.add_argument("items", nargs="+", metavar="CONFIG [KEY=VALUE ...]")
    find.add_argument("--target", required=True, metavar="PROFILE:N", help=TARGET_HELP)
    find.add_argument("--global-batch", type=int, help="examples per step (default: the config's)")
    find.add_argument("--top", type=int, default=5, help="how many mappings to print (5)")
    find.add_argument("--json", action="store_true", help="print one JSON object")
    find.add_argument(
        "--verify",
        action="store_true",
        help="compile the top mappings for the TPU topology of --target (minutes each)",
    )
    find.set_defaults(run=lambda args: _search(args, split))


def _estimate(args: argparse.Namespace, split: Callable) -> None:
    from jaxpod.config import MAX_PLANNED_DEVICES, load_config
    from jaxpod.inspect.estimate import estimate_config, format_estimate, parse_estimate_target

    config, overrides = split(args.items, "estimate")
    profile, devices = parse_estimate_target(args.target)
    on = [*overrides, f"devices={devices}"]  # mesh.replica=-1 fills from the target
    cfg = load_config(config, on, max_devices=MAX_PLANNED_DEVICES)
    result = estimate_config(cfg, profile)
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))


def _search(args: argparse.Namespace, split: Callable) -> None:
    import sys

    from jaxpod.errors import UserError
    from jaxpod.inspect.estimate import parse_estimate_target
    from jaxpod.inspect.search import format_search, search

    config, overrides = split(args.items, "search")
    profile, devices = parse_estimate_target(args.target)
    if args.top < 1 or (args.global_batch is not None and args.global_batch < 1):
        raise UserError("--top and --global-batch must be positive")
    if args.verify and not args.target.startswith("tpu-"):
        raise UserError(f"--verify compiles for a TPU topology (tpu-v5p:2x2x2); not {args.target}")
    result = search(config, overrides, profile, devices, args.global_batch)
    result["top"] = result["top"][: args.top + 1]
    if not args.json:
        print(format_search(result, args.top, args.target), flush=True)
    if args.verify:
        from jaxpod.inspect.search_verify import format_verified, verify

        shown = result["top"][: args.top]
        progress = None if args.json else sys.stderr
        verified = verify(config, overrides, args.target, shown, progress)
        for entry, v in zip(shown, verified, strict=True):
            entry["compiled"] = v
        if not args.json:
            print(format_verified(verified, args.target))
    if args.json:
        result["top"] = result["top"][: args.top]
        print(json.dumps(result, indent=2))
