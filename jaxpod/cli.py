"""`jaxpod` command line: parse, set up the process, call the library. Nothing else.

    jaxpod train CONFIG [KEY=VALUE ...]
    jaxpod tensorboard [LOGDIR] [--host H] [--port P]

User mistakes (config, data, mesh) print one line `jaxpod: error: ...` and exit 2, with no
traceback; the config is validated before jax even starts.
"""

from __future__ import annotations

import argparse
import sys

from jaxpod.errors import UserError


def _split_config_and_overrides(items: list[str]) -> tuple[str, list[str]]:
    """`CONFIG` is the one argument without `=`; `KEY=VALUE` overrides may surround it."""
    configs = [i for i in items if "=" not in i]
    if len(configs) != 1:
        raise UserError(
            f"expected one CONFIG file among the arguments, got {configs or 'none'}; "
            "usage: jaxpod train CONFIG [KEY=VALUE ...]"
        )
    return configs[0], [i for i in items if "=" in i]


def _train(args: argparse.Namespace) -> None:
    from jaxpod.config import load_config
    from jaxpod.platform import use_virtual_cpu_devices

    config, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(config, overrides)
    use_virtual_cpu_devices(cfg.devices)  # before jax starts
    from jaxpod.loop import run_training

    run_training(cfg)


def _tensorboard(args: argparse.Namespace) -> None:
    import subprocess
    from pathlib import Path

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"jaxpod: warning: serving TensorBoard on {args.host}: it has no authentication, "
            "anyone who can reach this port can read your runs",
            file=sys.stderr,
        )
    Path(args.logdir).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir]
    cmd += ["--host", args.host, "--port", str(args.port)]
    print(f"TensorBoard on http://{args.host}:{args.port}/ (Ctrl-C to stop)", flush=True)
    raise SystemExit(subprocess.call(cmd))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpod", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a config on the (replica, pipeline, tensor) mesh")
    train.add_argument(
        "items",
        nargs="+",
        metavar="CONFIG [KEY=VALUE ...]",
        help="a YAML preset (e.g. configs/demo.yaml) and overrides (e.g. mesh.tensor=2), any order",
    )
    train.set_defaults(run=_train)

    tb = sub.add_parser("tensorboard", help="serve TensorBoard on the runs directory")
    tb.add_argument("logdir", nargs="?", default="runs")
    tb.add_argument("--host", default="127.0.0.1", help="interface (default: loopback only)")
    tb.add_argument("--port", type=int, default=6006)
    tb.set_defaults(run=_tensorboard)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except UserError as err:
        print(f"jaxpod: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("jaxpod: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
