"""Findings of an adversarial pass that ended in a misleading or endless error line instead of a clear one: a consumer
that refused a copied greeting was counted as joined, sizes and world sizes past every sane bound got through the
schema, and an error line listed every one of 99,999 ranks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from cli_utils import load_metrics, run_dir
from mp_utils import free_port, gloo_spec
from test_auth import HANG_S, TOKEN, _open_client

from refit_app.common.errors import ConfigError, RefitError
from refit_app.common.sizes import MAX_SIZE, parse_size
from refit_app.transport.control import ranks_text
from refit_app.transport.groups import connect
from refit_app.transport.spec import MAX_WORLD_SIZE

TIMEOUT_S = 30.0
"""The producer's group.timeout_s: the refusal must reach it long before, so nothing here waits for it."""


def test_producer_says_a_consumer_refused_an_unsigned_copy_of_its_greeting():
    """A stranger replaces the greeting with an unsigned copy (the real run id and nonce): the consumer refuses it,
    and its check-in, signed with the run's key after all, must not count as joined. The producer says what
    happened, in one line, as soon as the check-in arrives (before: it counted the rank as joined and failed later
    naming a consumer that "may have died")."""
    port = free_port()
    outcome: list[BaseException | None] = []
    ended = threading.Event()

    def producer() -> None:
        try:
            connect(gloo_spec(0, 2, port, timeout_s=TIMEOUT_S, token=TOKEN)).close()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)
        ended.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    client = _open_client(port)
    client.wait(["refit/rdzv/hello"])
    hello = json.loads(json.loads(client.get("refit/rdzv/hello"))["body"])
    client.set("refit/rdzv/hello", json.dumps(hello))
    with pytest.raises(ConfigError, match="is not signed"):
        connect(gloo_spec(1, 2, port, timeout_s=TIMEOUT_S, token=TOKEN))
    refused_at = time.monotonic()
    assert ended.wait(HANG_S)
    waited = time.monotonic() - refused_at
    error = outcome[0]
    assert isinstance(error, RefitError), error
    message = str(error)
    assert "consumer rank 1 refused the greeting" in message and "is not signed" in message, message
    assert "overwritten by a client that is not one of this run's ranks" in message, message
    assert "\n" not in message
    # Well inside the producer's own deadline: it learnt why from the check-in, it did not wait the rank out.
    assert waited < TIMEOUT_S / 2, waited


@pytest.mark.parametrize("text", [10**23, "100000000000000000000000", "9000000TiB", str(2**63)])
def test_a_size_past_64_bits_is_refused_naming_the_key(text):
    with pytest.raises(ConfigError, match=r"refit\.buffer_size_bytes: .* more bytes than any size can be"):
        parse_size(text, key="refit.buffer_size_bytes")
    assert parse_size(MAX_SIZE, key="k") == MAX_SIZE


def test_cli_refuses_a_buffer_size_past_64_bits_before_any_rank_starts(cli):
    result = cli("refit.buffer_size_bytes=100000000000000000000000")
    assert result.returncode == 1, result.describe()
    assert result.stderr_lines() == [
        "refit_app: error: refit.buffer_size_bytes: '100000000000000000000000' is more bytes than any size can be "
        "(at most 9223372036854775807, 8 EiB); use an integer number of bytes or a size like 256MiB, 1GiB, 64MB"
    ], result.describe()
    assert not (cli.cwd / "outputs").exists() or not any((cli.cwd / "outputs").rglob("metrics.json"))


@pytest.mark.parametrize(
    "args, key",
    [
        (["role=producer", "group.world_size=100000"], "group.world_size=100000"),
        (["role=consumer", "group.world_size=100000", "group.rank=5"], "group.world_size=100000"),
        (["role.num_consumers=5000"], "role.num_consumers=5000"),
    ],
)
def test_world_size_is_bounded_where_the_schema_is_checked(cli, args, key):
    result = cli(*args)
    assert result.returncode == 1, result.describe()
    lines = result.stderr_lines()
    assert len(lines) == 1 and lines[0].startswith(f"refit_app: error: {key} is invalid"), result.describe()
    assert f"..{MAX_WORLD_SIZE - ('num_consumers' in key)}" in lines[0] and len(lines[0]) < 200, lines[0]


def test_lists_of_ranks_in_error_lines_are_capped():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([1, 2]) == "ranks 1, 2"
    assert ranks_text(list(range(1, 100_000))) == "ranks 1, 2, 3, 4, 5 and 99994 more"


def test_a_producer_of_the_largest_group_names_its_missing_ranks_in_a_short_line(cli, tmp_path):
    """Before: one line of 689,047 characters naming ranks 1..99999."""
    result = cli(
        "role=producer", f"group.world_size={MAX_WORLD_SIZE}", "group.timeout_s=1", f"group.port={free_port()}"
    )
    assert result.returncode == 1, result.describe()
    lines = result.stderr_lines()
    assert lines[-1].startswith("refit_app: error: ranks 1, 2, 3, 4, 5 and 1018 more did not join"), lines[-1]
    assert len(lines[-1]) < 500, lines[-1]
    assert load_metrics(run_dir(tmp_path, "producer"))["status"] == "failed"


def _beyond_this_host() -> int:
    """Bytes no single allocation here can have: twice memory and swap together (the kernel's heuristic
    overcommit refuses such a request at once, without touching a page)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = sum(int(meminfo[key].split()[0]) for key in ("MemTotal", "SwapTotal"))
    return 2 * kib * 1024


@pytest.mark.skipif(
    not Path("/proc/sys/vm/overcommit_memory").exists()
    or Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="needs Linux with overcommit that refuses an allocation larger than the host",
)
def test_a_gloo_buffer_larger_than_the_host_is_one_line_naming_the_setting(cli):
    """With gloo (or auto, which falls back to it when shared memory would not fit) a buffer the host cannot hold
    fails in torch's allocator; before, the line was torch's ``RuntimeError: err == 0. DefaultCPUAllocator...``,
    naming neither the setting nor the fix."""
    size = _beyond_this_host()
    result = cli("group.backend=gloo", f"refit.buffer_size_bytes={size}")
    assert result.returncode == 1, result.describe()
    line = result.stderr_lines()[-1]
    assert line.startswith("refit_app: error: ") and "cannot allocate a buffer of" in line, result.describe()
    assert "refit.buffer_size_bytes" in line and "NRL_REFIT_NUM_BUFFERS" in line, line
