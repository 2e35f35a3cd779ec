"""The app's steady round against the transport limit, side by side on this machine (issue 9's last goal).

Alternates, ``--pairs`` times: a ``refit.rounds`` run of ``python -m refit_app`` with ``sink=verify``, the same with
``sink=discard``, and ``python -m refit_app.bench --modes limit`` at the same settings, so machine noise hits all
three alike. Reads ``steady_round_seconds`` (the producer's, the top level of metrics.json, and each consumer's) and
the bench's median limit time, and prints ``limit_seconds / steady_seconds`` per pair with the median and range:
1.0 is the limit's speed, 0.87 is a steady round 15% slower than the limit.

    python scripts/steady_vs_limit.py --pairs 5
    python scripts/steady_vs_limit.py --pairs 3 --preset llama-1b --size 256MiB --rounds 20 --out outputs/svl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _app(sink: str, args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "refit_app",
        f"source.preset={args.preset}",
        f"source.size={args.size}",
        f"refit.rounds={args.rounds}",
        f"sink={sink}",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"steady_vs_limit: error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if sink == "verify" and metrics.get("verified") is not True:
        raise SystemExit(f"steady_vs_limit: error: the verify run in {run_dir} was not verified")
    late = [r for r in metrics["rounds"][1:] if r.get("manifest_sent") or r.get("handshake_seconds")]
    if late:
        raise SystemExit(f"steady_vs_limit: error: rounds after the first paid a handshake in {run_dir}: {late}")
    return {
        "producer": metrics["steady_round_seconds"],
        "consumers": [c["steady_round_seconds"] for c in metrics.get("consumers", [])],
        "first": metrics["first_round_seconds"],
    }


def _limit(args: argparse.Namespace, out: Path) -> float:
    cmd = [
        sys.executable,
        "-m",
        "refit_app.bench",
        "--preset",
        args.preset,
        "--size",
        args.size,
        "--modes",
        "limit",
        "--reps",
        str(args.bench_reps),
        "--flat-refits",
        "0",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"steady_vs_limit: error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    bench = json.loads((out / "bench.json").read_text())
    return bench["cases"][0]["modes"]["limit"]["seconds"]["median"]


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="alternations of verify, discard and limit (default 5)")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--bench-reps", type=int, default=5, help="timed limit repetitions per bench run (median)")
    p.add_argument("--out", default="outputs/steady_vs_limit")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args()
    if args.pairs < 1 or args.rounds < 2 or args.bench_reps < 1:
        raise SystemExit(
            "steady_vs_limit: error: --pairs and --bench-reps must be >= 1, --rounds >= 2 (a steady round)"
        )
    out = Path(args.out).resolve()
    rows = []
    for i in range(1, args.pairs + 1):
        row = {"pair": i}
        for sink in ("verify", "discard"):
            row[sink] = _app(sink, args, out / f"{i}-{sink}")
        row["limit"] = _limit(args, out / f"{i}-limit")
        rows.append(row)
        print(
            f"pair {i}: limit {row['limit']:.4f} s | verify steady {row['verify']['producer']:.4f} s "
            f"(consumer {', '.join(f'{c:.4f}' for c in row['verify']['consumers'])}) "
            f"-> {row['limit'] / row['verify']['producer']:.2f}x | discard steady {row['discard']['producer']:.4f} s "
            f"-> {row['limit'] / row['discard']['producer']:.2f}x",
            flush=True,
        )
    verify = [r["limit"] / r["verify"]["producer"] for r in rows]
    discard = [r["limit"] / r["discard"]["producer"] for r in rows]
    verify_c = [r["limit"] / max(r["verify"]["consumers"]) for r in rows]
    print()
    print("| | median (range) |")
    print("|---|---|")
    print(f"| limit (s) | {_span([r['limit'] for r in rows])} |")
    print(f"| verify steady round, producer (s) | {_span([r['verify']['producer'] for r in rows])} |")
    print(f"| discard steady round, producer (s) | {_span([r['discard']['producer'] for r in rows])} |")
    print(f"| limit / verify steady | {_span(verify)} |")
    print(f"| limit / verify steady (slowest consumer) | {_span(verify_c)} |")
    print(f"| limit / discard steady | {_span(discard)} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "steady_vs_limit.json").write_text(json.dumps({"args": vars(args), "rows": rows, "at": time.time()}))
    print(f"\nresults: {out / 'steady_vs_limit.json'}")


if __name__ == "__main__":
    main()
