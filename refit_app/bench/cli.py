"""The command line of ``python -m refit_app.bench``: its flags, the cases they make (every combination of the
list-valued flags is one), and :func:`main`, which runs them on this machine (:mod:`.spawned`) or as one rank of
several hosts (:mod:`.ranks`) and prints the results."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from refit_app.bench.app_rounds import APP_ROUNDS_JSON, format_app_rounds, run_app_rounds
from refit_app.bench.cases import (
    DEFAULT_DELTA_ROUNDS,
    DEFAULT_FLAT_REFITS,
    DEFAULT_PRESETS,
    DEFAULT_REPS,
    DEFAULT_SIZES,
    MODES,
    POSTS,
    Case,
)
from refit_app.bench.colocated import COLOCATED_JSON, format_colocated, run_colocated
from refit_app.bench.ranks import run_rank
from refit_app.bench.report import BENCH_JSON, format_table, memory_lines, plot_files
from refit_app.bench.spawned import DEFAULT_TIMEOUT_S, run
from refit_app.common.errors import ConfigError, RefitError
from refit_app.common.sizes import format_size, parse_size
from refit_app.models.presets import PRESETS
from refit_app.packed_tensor import get_num_buffers, get_target_packed_tensor_size
from refit_app.transport.auth import TOKEN_ENV
from refit_app.transport.groups import GroupSpec
from refit_app.transport.spec import DEFAULT_HOST, DEFAULT_PORT
from refit_app.transport.spec import DEFAULT_TIMEOUT_S as DEFAULT_GROUP_TIMEOUT_S

logger = logging.getLogger(__name__)

COLOCATED_CONSUMERS = 3
"""``--colocated``'s many-consumer group without ``--consumers``: issue 23 compares three consumers with one."""

CASE_FLAGS = (
    "preset",
    "size",
    "buffer_size",
    "num_buffers",
    "post",
    "modes",
    "reps",
    "flat_refits",
    "delta_shares",
    "delta_rounds",
)
"""The flags that make the cases: across hosts, rank 0's decide and a consumer's own are not used."""


def _parse_sizes(values: Sequence[str]) -> list[int | None]:
    return [None if v == "natural" else parse_size(v, "--size") for v in values]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line. One long function on purpose: it only lists the options, one
    ``add_argument`` each, in the order ``--help`` shows them; the rules between them live in :func:`main`."""
    p = argparse.ArgumentParser(
        prog="python -m refit_app.bench",
        description="Time the packed refit against the transport limit and per-tensor broadcast over gloo.",
    )
    p.add_argument(
        "--preset",
        nargs="+",
        choices=sorted(PRESETS),
        default=list(DEFAULT_PRESETS),
        help="synthetic model shapes (default: %(default)s)",
    )
    p.add_argument(
        "--size",
        nargs="+",
        default=None,
        help="bytes on the wire, e.g. 256MB 1GB 4GB, or 'natural' for the preset's own size "
        "(default: 1GB for llama presets, natural and 1GiB for lora)",
    )
    p.add_argument(
        "--buffer-size",
        nargs="+",
        default=None,
        help="packed buffer target, e.g. 64MiB (default: get_target_packed_tensor_size(), "
        f"{format_size(get_target_packed_tensor_size())} here)",
    )
    p.add_argument(
        "--num-buffers",
        nargs="+",
        type=int,
        default=None,
        help=f"buffers in flight (default: get_num_buffers(), {get_num_buffers()} here)",
    )
    p.add_argument(
        "--consumers",
        nargs="+",
        type=int,
        default=None,
        help="consumer processes (default: 1; across hosts: --world-size - 1)",
    )
    p.add_argument(
        "--post",
        nargs="+",
        choices=POSTS,
        default=["none"],
        help="producer post_iter_func: none, or cast (fp32 model sent as bf16) (default: none)",
    )
    p.add_argument(
        "--modes", nargs="+", choices=MODES, default=None, help="what to time (default: all; none with --delta-shares)"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=DEFAULT_REPS,
        help="timed repetitions per mode (and per delta mode and share) (default: %(default)s)",
    )
    p.add_argument(
        "--flat-refits",
        type=int,
        default=None,
        help="consecutive refits after the timed ones, for the memory flatness check "
        f"(default: {DEFAULT_FLAT_REFITS}; 0 with --delta-shares)",
    )
    p.add_argument(
        "--delta-shares",
        nargs="+",
        type=float,
        default=None,
        metavar="SHARE",
        help="time session rounds with delta off, on and auto against each other, the model changed "
        "between rounds at each of these shares of its elements, e.g. 0.001 0.01 0.1 (default: "
        "none; with it, --modes and --flat-refits default to none)",
    )
    p.add_argument(
        "--delta-rounds",
        type=int,
        default=None,
        help="delta rounds after those, for the memory flatness check with deltas "
        f"(default: {DEFAULT_DELTA_ROUNDS} with --delta-shares)",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="instead: group.backend=shm against gloo over loopback and against one memcpy of the model, one "
        "consumer against --consumers (default 3) on shm, interleaved in one run; prints the ratios "
        "(one --preset and --size)",
    )
    p.add_argument(
        "--app",
        action="store_true",
        help="instead: a steady round of the application's own loop (python -m refit_app, sink=discard) against "
        "the library's session round, on gloo over loopback and on shm, interleaved in one run; prints "
        "app/session (one --preset, --size, --buffer-size and --num-buffers; one consumer)",
    )
    p.add_argument(
        "--out",
        default="outputs/bench",
        help="directory for bench.json, table.md and throughput.png (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="deadline for each group of cases (default: %(default)s)",
    )
    hosts = p.add_argument_group(
        "across hosts",
        "run one rank per host (the same --host, --port and --world-size on each; REFIT_APP_TOKEN "
        "set alike on every host for non-loopback addresses); rank 0's other flags pick the cases, "
        "and rank 0 prints and writes every rank's results",
    )
    hosts.add_argument(
        "--rank",
        type=int,
        default=None,
        help="this process's rank: 0 is the producer, 1..world-size-1 the consumers (default: spawn "
        "every rank on this machine over loopback)",
    )
    hosts.add_argument("--world-size", type=int, default=2, help="ranks in all, producer included (default: 2)")
    hosts.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="the producer's address; rank 0 listens on it (0.0.0.0: every interface) (default: %(default)s)",
    )
    hosts.add_argument("--port", type=int, default=DEFAULT_PORT, help="the producer's port (default: %(default)s)")
    hosts.add_argument("--interface", default=None, help="the NIC gloo uses (default: the route to the producer)")
    hosts.add_argument(
        "--group-timeout-s",
        type=float,
        default=DEFAULT_GROUP_TIMEOUT_S,
        help="deadline of the rendezvous and of every collective, as group.timeout_s: a rank that dies "
        "ends the others within about that (default: %(default)s)",
    )
    return p


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    buffer_sizes = (
        [get_target_packed_tensor_size()]
        if args.buffer_size is None
        else [parse_size(v, "--buffer-size") for v in args.buffer_size]
    )
    num_buffers = [get_num_buffers()] if args.num_buffers is None else args.num_buffers
    problems = [f"--num-buffers {n} must be >= 1" for n in num_buffers if n < 1]
    if args.rank is None:
        consumers = args.consumers or [1]
        problems += [f"--consumers {n} must be >= 1" for n in consumers if n < 1]
    else:
        consumers = [args.world_size - 1]
        if args.consumers is not None:
            problems.append("--consumers is --world-size - 1 across hosts; drop it")
        if args.world_size < 2:
            problems.append(f"--world-size {args.world_size} must be >= 2 (the producer and at least one consumer)")
    if args.reps < 1:
        problems.append(f"--reps {args.reps} must be >= 1")
    shares = tuple(args.delta_shares or ())
    problems += [f"--delta-shares {s:g} must be above 0 and at most 1" for s in shares if not 0 < s <= 1]
    if len(set(shares)) < len(shares):
        problems.append("--delta-shares has a share twice; give each once")
    if args.delta_rounds is not None and not shares:
        problems.append("--delta-rounds needs --delta-shares (the shares its rounds change)")
    delta_rounds = (DEFAULT_DELTA_ROUNDS if args.delta_rounds is None else args.delta_rounds) if shares else 0
    if delta_rounds < 0:
        problems.append(f"--delta-rounds {delta_rounds} must be >= 0")
    # A run for the delta comparison times only that, unless asked for more: the other modes take as long again.
    modes = tuple(args.modes) if args.modes is not None else () if shares else MODES
    flat_refits = args.flat_refits if args.flat_refits is not None else 0 if shares else DEFAULT_FLAT_REFITS
    if flat_refits < 0:
        problems.append(f"--flat-refits {flat_refits} must be >= 0")
    if problems:
        raise SystemExit("refit_app.bench: error: " + "; ".join(problems))
    cases = []
    for preset in args.preset:
        sizes = _parse_sizes(args.size if args.size is not None else DEFAULT_SIZES.get(preset, ("1GB",)))
        for size, buf, nb, n, post in itertools.product(sizes, buffer_sizes, num_buffers, consumers, args.post):
            cases.append(Case(preset, size, buf, nb, n, post, args.reps, modes, flat_refits, shares, delta_rounds))
    return cases


def _spec_from_args(args: argparse.Namespace) -> GroupSpec:
    return GroupSpec(
        backend="gloo",
        host=args.host,
        port=args.port,
        world_size=args.world_size,
        rank=args.rank,
        timeout_s=args.group_timeout_s,
        interface=args.interface,
        token=os.environ.get(TOKEN_ENV),
    )


def _check_out(out_dir: Path) -> None:
    """Refuse an --out that cannot take the results before the run, not after it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".bench-probe-"):
            pass
    except OSError as e:
        raise SystemExit(
            f"refit_app.bench: error: --out {str(out_dir)!r} cannot take the results: {e.strerror or e}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cases = cases_from_args(args)
    except ConfigError as e:
        raise SystemExit(f"refit_app.bench: error: {e}") from None
    out, out_dir = sys.stdout, Path(args.out)
    if args.colocated and args.app:
        raise SystemExit("refit_app.bench: error: --colocated and --app are two runs; give one")
    if args.colocated:
        return _colocated(args, out_dir)
    if args.app:
        return _app(args, out_dir)
    writes = args.rank in (None, 0)
    if writes:
        _check_out(out_dir)
    elif ignored := [f"--{f.replace('_', '-')}" for f in CASE_FLAGS if getattr(args, f) != parser.get_default(f)]:
        logger.warning("rank %d runs rank 0's cases: its own %s not used", args.rank, ", ".join(ignored))
    try:
        if args.rank is None:
            summaries = run(cases, out_dir, args.timeout_s)
        else:
            summaries = run_rank(_spec_from_args(args), cases, out_dir)
    except ConfigError as e:
        raise SystemExit(f"refit_app.bench: error: {e}") from None
    except RefitError as e:
        print(f"refit_app.bench: error: rank {args.rank}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if not writes:
            raise
        print(f"refit_app.bench: error: could not write the results to {str(out_dir)!r}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("refit_app.bench: interrupted; no results written", file=sys.stderr)
        return 130
    if summaries is None:
        out.write(f"rank {args.rank}: done; rank 0 prints and writes the results\n")
        return 0
    out.write(format_table(summaries))
    for line in memory_lines(summaries):
        out.write(line + "\n")
    out.write(f"results: {out_dir / BENCH_JSON}\n")
    for name in plot_files(summaries):
        out.write(f"plot: {out_dir / name}\n")
    return 0


def _run_one_case(
    args: argparse.Namespace,
    out_dir: Path,
    flag: str,
    problems: list[str],
    run_case: Callable[[Case, Path, float], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    json_name: str,
) -> int:
    """``flag`` (``--colocated``, ``--app``): ``run_case`` on the one case the flags make, every rank on this
    machine, its ``markdown`` printed; refuses, with ``problems`` of the flag's own, flags that would make several."""
    if args.rank is not None:
        problems.insert(0, f"{flag} runs every rank on this machine; drop --rank")
    if len(args.preset) != 1 or (args.size is not None and len(args.size) != 1):
        problems.append(f"{flag} takes one --preset and one --size")
    for name in ("buffer_size", "num_buffers", "post"):
        if getattr(args, name) is not None and len(getattr(args, name)) > 1:
            problems.append(f"{flag} takes one --{name.replace('_', '-')}")
    if problems:
        raise SystemExit("refit_app.bench: error: " + "; ".join(problems))
    case = cases_from_args(args)[0]
    _check_out(out_dir)
    sys.stdout.write(markdown(run_case(case, out_dir, args.timeout_s)))
    sys.stdout.write(f"results: {out_dir / json_name}\n")
    return 0


def _colocated(args: argparse.Namespace, out_dir: Path) -> int:
    """``--colocated``: one case, every rank on this machine (:mod:`.colocated`)."""
    consumers = args.consumers or [COLOCATED_CONSUMERS]
    problems = []
    if len(consumers) != 1 or consumers[0] < 2:
        problems.append("--colocated takes one --consumers of at least 2 (compared with one consumer)")
    args.consumers = consumers
    return _run_one_case(args, out_dir, "--colocated", problems, run_colocated, format_colocated, COLOCATED_JSON)


def _app(args: argparse.Namespace, out_dir: Path) -> int:
    """``--app``: one case, the producer and one consumer on this machine (:mod:`.app_rounds`)."""
    problems = []
    if args.consumers not in (None, [1]):
        problems.append("--app compares one consumer; drop --consumers")
    if args.post != ["none"]:
        problems.append("--app sends the application's source as it is; drop --post")
    return _run_one_case(args, out_dir, "--app", problems, run_app_rounds, format_app_rounds, APP_ROUNDS_JSON)
