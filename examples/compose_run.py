"""An experiment script: compose refit_app's config with Hydra's compose API, run one refit, print its figures.

    python examples/compose_run.py
    python examples/compose_run.py refit.num_buffers=3 source.preset=llama-1b source.size=1GiB sink=discard
    python examples/compose_run.py --output-dir runs/baseline refit.buffer_size_bytes=64MiB

Arguments are Hydra overrides, the same ones ``python -m refit_app`` takes; they are applied after this script's
own defaults, so they win. Unlike the command line, compose does not create an output directory: metrics.json and
the resolved config are written only where ``--output-dir`` says.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hydra import compose, initialize_config_module

from refit_app import run
from refit_app.app.schema import CONF_MODULE
from refit_app.common.errors import RefitError

# The experiment: the one-machine refit of the tiny synthetic model, in 1 MiB buffers so that it moves several
# chunks, with every received tensor checked against the producer's checksums.
DEFAULT_OVERRIDES = ["role=local", "sink=verify", "refit.buffer_size_bytes=1MiB"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. refit.num_buffers=3")
    parser.add_argument("--output-dir", help="write metrics.json and config_resolved.yaml here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=[*DEFAULT_OVERRIDES, *args.overrides])
    try:
        metrics = run(cfg, output_dir=args.output_dir)
    except RefitError as e:
        print(f"compose_run: refit failed: {e}", file=sys.stderr)
        return 1

    print(
        f"moved {metrics['bytes'] / 1e6:.1f} MB in {metrics['num_tensors']} tensors / {metrics['num_chunks']} "
        f"chunks in {metrics['seconds']:.3f} s: {metrics['gb_per_s']:.3f} GB/s "
        f"(buffer {metrics['buffer_size_bytes']} bytes x {metrics['num_buffers']}, {metrics['backend']})"
    )
    if metrics.get("peak_extra_bytes") is not None:
        print(f"producer peak memory: {metrics['peak_extra_bytes'] / 2**20:+.1f} MiB over its start")
    for consumer in metrics.get("consumers", []):
        print(f"consumer {consumer['rank']}: sink={consumer['sink']} verified={consumer['verified']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
