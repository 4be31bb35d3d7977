"""`jaxpod` command line: parse, set up the process, call the library. Nothing else.

CONFIG is a YAML file or the name of a shipped preset (`tiny`, `demo`: jaxpod/configs/).

    jaxpod --version
    jaxpod train CONFIG [KEY=VALUE ...] [--allow-changes KEY,...] [--logdir-exists ok]
                 [--coordinator HOST:PORT --num-processes N --process-id I | --distributed auto]
    jaxpod profile CONFIG [KEY=VALUE ...] [--steps N] [--warmup W] [same multi-host flags]
    jaxpod plan CONFIG [KEY=VALUE ...] [--json] [--chart FILE.png]
    jaxpod compile CONFIG [KEY=VALUE ...] [--json] [--target TARGET]
    jaxpod runs [DIR | URL] [--json]
    jaxpod tensorboard [LOGDIR | URL] [--host H] [--port P]

User mistakes (config, data, mesh, flags) and failed runs print one line `jaxpod: error: ...`
and exit 2, with no traceback; the config and the checks before training (`jaxpod.run.preflight`:
budget, host RAM, the run directory checked and locked) run before jax even starts (one process;
with several, the loop runs them once the processes have joined). Ctrl-C exits 130 (SIGTERM 143,
SIGHUP 129). A reader of stdout or stderr that goes away never stops a run (`jaxpod.run.console`);
the other commands then end quietly, exit 0. Options and KEY=VALUE overrides may come in any
order.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxpod import __version__, errors
from jaxpod.errors import UserError
from jaxpod.inspect.pod_commands import add_pod_commands


def _split_config_and_overrides(items: list[str], command: str) -> tuple[str, list[str]]:
    """`CONFIG` is the one argument without `=`; `KEY=VALUE` overrides may surround it, each
    key once (`check_once`)."""
    from jaxpod.config import check_once

    configs = [i for i in items if "=" not in i]
    if len(configs) != 1:
        raise UserError(
            f"expected one CONFIG file among the arguments, got {configs or 'none'}; "
            f"usage: jaxpod {command} CONFIG [KEY=VALUE ...]"
        )
    overrides = [i for i in items if "=" in i]
    check_once(overrides)
    return configs[0], overrides


def _spec(args: argparse.Namespace):
    from jaxpod.run.distributed import DistributedSpec

    return DistributedSpec(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto=args.distributed == "auto",
        init_timeout=args.init_timeout,
    )


def _warn(cfg) -> None:
    from jaxpod.config.rules import warnings

    for warning in [*cfg.warnings(), *warnings(cfg)]:
        print(f"jaxpod: warning: {warning}", file=sys.stderr)


def _preflight(cfg, spec, foreign_ok: bool = False):
    """One process: the checks before training, before jax starts (`Cleared`, for the loop).
    Several: None; the loop runs them once the processes have joined (each knows its role)."""
    if spec.enabled:
        return None
    from jaxpod.run.preflight import preflight

    return preflight(cfg, foreign_ok=foreign_ok)


def _train(args: argparse.Namespace) -> None:
    from jaxpod.run.distributed import load_run_config
    from jaxpod.run.interrupt import interrupt_at_once

    interrupt_at_once()

    from jaxpod.config import check_allowed

    config, overrides = _split_config_and_overrides(args.items, "train")
    allow = [k.strip() for k in (args.allow_changes or "").split(",") if k.strip()]
    check_allowed(allow)
    spec = _spec(args)
    cfg = load_run_config(config, overrides, spec)  # joins the runtime, before jax
    foreign_ok = args.logdir_exists == "ok"
    cleared = _preflight(cfg, spec, foreign_ok)
    _warn(cfg)
    from jaxpod.run.loop import run_training

    run_training(cfg, allow_changes=allow, cleared=cleared, foreign_ok=foreign_ok)


def _profile(args: argparse.Namespace) -> None:
    from jaxpod.run.distributed import check_spec, is_main_process, load_run_config
    from jaxpod.run.interrupt import interrupt_at_once
    from jaxpod.run.profiling import profile_overrides

    interrupt_at_once()

    config, overrides = _split_config_and_overrides(args.items, "profile")
    spec = _spec(args)
    check_spec(spec)
    overrides = profile_overrides(config, overrides, args.steps, args.warmup)
    cfg = load_run_config(config, overrides, spec)
    cleared = _preflight(cfg, spec)
    from jaxpod.run.loop import run_training
    from jaxpod.run.profiling import how_to_open

    result = run_training(cfg, cleared=cleared)
    if is_main_process():
        print(how_to_open(result.trace, cfg.train.logdir), flush=True)


def _plan(args: argparse.Namespace) -> None:
    import json

    from jaxpod.inspect.chart import check_chart_path, write_chart
    from jaxpod.planner.plan import format_plan, plan

    config, overrides = _split_config_and_overrides(args.items, "plan")
    _, cfg = _load_for_target(config, overrides, args.target, profile=True)
    _warn(cfg)
    _warn_host_ram(cfg)
    if args.chart:
        check_chart_path(args.chart)
    result = plan(cfg)
    if not result["fits"]:
        from jaxpod.inspect.search import alternatives, format_alternatives

        result["searched"] = alternatives(config, overrides, cfg)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    if "searched" in result and not args.json:
        print(format_alternatives(result["searched"], cfg))
    if args.chart:
        from pathlib import Path

        path = write_chart(result, args.chart, name=" ".join([Path(config).stem, *overrides]))
        print(f"jaxpod: chart written to {path}", file=sys.stderr)


def _warn_host_ram(cfg) -> None:
    """A plan for this machine's virtual devices (`memory.device=cpu`) warns when training it
    here would exceed the host's RAM; a plan for a pod's devices is about the pod."""
    from jaxpod.run.hostmem import host_ram_problem

    if cfg.memory.device != "cpu":
        return
    problem = host_ram_problem(cfg)
    if problem is not None:
        print(f"jaxpod: warning: `jaxpod train` would refuse this: {problem}", file=sys.stderr)


def _compile(args: argparse.Namespace) -> None:
    import json

    from jaxpod.platform import use_virtual_cpu_devices

    config, overrides = _split_config_and_overrides(args.items, "compile")
    target, cfg = _load_for_target(config, overrides, args.target)
    _warn(cfg)
    use_virtual_cpu_devices(cfg.devices)  # before jax starts
    if target is not None:  # compile-only devices: no local accelerator is started, and an
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # executable for them cannot be loaded
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # from jax's persistent cache
    from jaxpod.inspect.compile import compile_for_target, compile_step, format_compile

    progress = None if args.json else sys.stderr  # each stage and its elapsed time
    if target is None:
        from jaxpod.parallel.mesh import mesh_for

        mesh = mesh_for(cfg)
        result = compile_step(cfg, mesh, progress=progress)
    else:
        result = compile_for_target(cfg, target, progress=progress)
    print(json.dumps(result, indent=2) if args.json else format_compile(result))


def _load_for_target(config: str, overrides: list[str], text: str | None, **kw):
    """`(None, cfg)` without `--target`, else `jaxpod.target.load.load_for_target`."""
    if text is None:
        from jaxpod.config import MAX_PLANNED_DEVICES, load_config

        limit = {"max_devices": MAX_PLANNED_DEVICES} if kw.get("profile") else {}
        return None, load_config(config, overrides, **limit)
    from jaxpod.target.load import load_for_target

    return load_for_target(config, overrides, text, **kw)


def _runs(args: argparse.Namespace) -> None:
    from jaxpod.inspect.runs import format_runs, list_runs, runs_json

    runs = list_runs(args.dir)
    print(runs_json(runs) if args.json else format_runs(runs))


def _tensorboard(args: argparse.Namespace) -> None:
    from jaxpod.inspect.tensorboard import serve

    serve(args.logdir, args.host, args.port)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, overrides and the multi-host flags shared by `train` and `profile`."""
    parser.add_argument(
        "items",
        nargs="+",
        metavar="CONFIG [KEY=VALUE ...]",
        help="a preset name (e.g. demo) or YAML file, and overrides (e.g. mesh.tensor=2)",
    )
    group = parser.add_argument_group(
        "multi-host", "one process per host; `devices` then counts each process's CPU devices"
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    group.add_argument(
        "--distributed",
        choices=["auto"],
        help="auto: detect coordinator and process ids from the cluster (SLURM, TPU, MPI)",
    )
    group.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        metavar="S",
        help="seconds to wait for all processes to join (default 60)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is what `--help` is for)."""

    def error(self, message: str) -> None:
        print(f"jaxpod: error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpod", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"jaxpod {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_inspect_commands(sub)
    return parser


def _add_run_commands(sub) -> None:
    """`train` and `profile`: the commands that run steps."""
    train = sub.add_parser("train", help="train a config on the (replica, pipeline, tensor) mesh")
    _add_run_arguments(train)
    train.add_argument(
        "--allow-changes",
        metavar="KEY,...",
        help="resume although these config keys (or sections, or 'all') changed since the "
        "checkpoint; the old config is kept as config.until-<step>.yaml",
    )
    train.add_argument(
        "--logdir-exists",
        choices=["ok"],
        help="ok: train.logdir may hold files that are not a jaxpod run (never touched; none "
        "may have a name the record uses)",
    )
    train.set_defaults(run=_train)

    profile = sub.add_parser(
        "profile", help="warm up, then trace a few steps for TensorBoard's profile tab"
    )
    _add_run_arguments(profile)
    profile.add_argument("--steps", type=int, default=3, help="steps to trace (default 3)")
    profile.add_argument("--warmup", type=int, default=3, help="untraced steps first (3)")
    profile.set_defaults(run=_profile)


def _add_inspect_commands(sub) -> None:
    """`plan`, `compile`, `estimate`, `search`, `runs`, `tensorboard`: nothing trains."""
    plan = sub.add_parser("plan", help="where every byte of a mapping lives (instant, analytic)")
    plan.add_argument("items", nargs="+", metavar="CONFIG [KEY=VALUE ...]")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--chart", metavar="FILE.png", help="also draw the bytes per device against the limit"
    )
    plan.add_argument(
        "--target",
        metavar="TARGET",
        help="plan for these accelerators' profile and chip count: tpu-v5p:2x2x4, h100:8, ...",
    )
    plan.set_defaults(run=_plan)

    comp = sub.add_parser(
        "compile", help="lower + compile the train step from abstract shapes (no weights)"
    )
    comp.add_argument("items", nargs="+", metavar="CONFIG [KEY=VALUE ...]")
    comp.add_argument("--json", action="store_true", help="print one JSON object")
    comp.add_argument(
        "--target",
        metavar="TARGET",
        help="compile for these accelerators, none attached: tpu-v5p:2x2x4, tpu-v5e:4x4, "
        "tpu-v4:2x2x2, tpu-v6e:4x4, h100:8 (default: this machine's devices)",
    )
    comp.set_defaults(run=_compile)

    add_pod_commands(sub, _split_config_and_overrides)

    runs = sub.add_parser("runs", help="a table of the runs under DIR or a URL (default: runs)")
    runs.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="a folder or a URL")
    runs.add_argument("--json", action="store_true", help="print a JSON list instead")
    runs.set_defaults(run=_runs)

    tb = sub.add_parser("tensorboard", help="serve TensorBoard on the runs directory")
    tb.add_argument(
        "logdir", nargs="?", default="runs", help="a folder, or a URL (served from a local mirror)"
    )
    tb.add_argument("--host", default="127.0.0.1", help="interface (default: loopback only)")
    tb.add_argument("--port", type=int, default=6006)
    tb.set_defaults(run=_tensorboard)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse with options and KEY=VALUE overrides in any order (`--warmup 5 mesh.tensor=1`):
    the words argparse leaves over after the options join the positional items."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    flags = [e for e in extra if e.startswith("-")]
    if flags or (extra and not hasattr(args, "items")):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    if extra:
        args.items = [*args.items, *extra]
    return args


RUNS = ("train", "profile")  # commands whose console may go away while they run on


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    errors.exit_on_user_error()
    if args.command in RUNS:
        from jaxpod.run.console import keep_going

        keep_going()  # the reader of stdout or stderr going away never stops training
    try:
        code, line = _run(args)
    finally:  # a run directory claimed but not released, on every way out
        if "jaxpod.run.logdir" in sys.modules:
            sys.modules["jaxpod.run.logdir"].release_all()
    if line is not None:
        try:
            print(line, file=errors.user_stderr(), flush=True)
        except (OSError, ValueError):  # noqa: S110 - nobody reads stderr any more
            pass
    if code:
        errors.exit_now(code, wait=1.0 if code > 128 else 5.0)


def _run(args: argparse.Namespace) -> tuple[int, str | None]:
    """`(exit code, the line to print)` of running the command: 0 and None when it ran."""
    import signal

    try:
        args.run(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is seen
        return 0, None
    except UserError as err:
        return 2, f"jaxpod: error: {errors.one_line(err)}"
    except KeyboardInterrupt as stop:
        code = 128 + getattr(stop, "signum", signal.SIGINT)
        return code, f"jaxpod: {getattr(stop, 'message', 'interrupted')}"
    except (RuntimeError, AssertionError) as exc:  # jax cannot start JAX_PLATFORMS's
        from jaxpod.platform import backend_error

        err = backend_error(exc)
        if err is None:
            raise
        return 2, f"jaxpod: error: {errors.one_line(err)}"
    except BrokenPipeError:  # `jaxpod runs | head -1`: the reader has what it wanted
        from jaxpod.run.console import to_devnull

        for fd in (1, 2):  # what is still buffered goes nowhere, quietly
            to_devnull(fd)
        return 0, None


if __name__ == "__main__":
    main()
