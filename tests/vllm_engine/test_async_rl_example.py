"""``examples/async_rl.py`` as a user runs it: a Llama built from a config, trained by AdamW, a ``vllm serve`` engine
kept busy by client threads, a staged refit every step. Every step must be applied and say its pause, transfer and
the engine's tokens per second; the outputs must carry the versions, some of them split by a refit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_rl.py"
STEPS = 3
DEADLINE_S = 600.0
"""The server's start (30-50 s idle, minutes under load) and three steps."""


def test_async_rl_example_refits_a_serving_engine_every_step() -> None:
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--hidden", "64", "--layers", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S)
    print(done.stdout)
    assert done.returncode == 0, f"the example failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    pattern = re.compile(
        r"^step (\d+): loss [\d.]+ \| transfer [\d.]+ s, pause \d+ ms \| engine \d+ tokens/s while receiving, "
        r"\d+ idle \| outputs since the step before: (\{.*\})$"
    )
    steps = [m for line in done.stdout.splitlines() if (m := pattern.match(line))]
    assert [int(m.group(1)) for m in steps] == list(range(1, STEPS + 1)), done.stdout
    versions = " ".join(m.group(2) for m in steps)
    assert re.search(r"'(default|\d+)->\d+'", versions), f"no output was split by a refit: {versions}"
