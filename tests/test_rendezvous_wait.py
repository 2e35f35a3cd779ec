"""A consumer started before its producer says where it waits, on its first try and then every
``WAITING_NOTICE_INTERVAL_S``, and joins as soon as the producer is up; one whose port another program listens on
fails in one line within its deadline."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest

from refit_app.app.rank_harness import free_port
from refit_app.common.errors import PeerError
from refit_app.transport import rendezvous
from refit_app.transport.spec import GroupSpec

HANG_LIMIT_S = 60.0
"""Past this, a wait in a test has hung: never a deadline under test."""


class _Notices(logging.Handler):
    """Collects the consumer's "waiting for the producer" lines and signals each one as it is logged."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.times: list[float] = []
        self.messages: list[str] = []
        self.count = threading.Semaphore(0)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "waiting for the producer" in message:
            self.times.append(time.monotonic())
            self.messages.append(message)
            self.count.release()

    def wait_for_next(self) -> None:
        assert self.count.acquire(timeout=HANG_LIMIT_S), f"no waiting notice within {HANG_LIMIT_S:g}s"


@pytest.fixture
def notices():
    handler = _Notices()
    logger = logging.getLogger(rendezvous.__name__)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


class _Consumer:
    """``join_store`` on a thread, as a consumer whose producer is not up yet."""

    def __init__(self, port: int) -> None:
        self.spec = GroupSpec(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=1, timeout_s=HANG_LIMIT_S)
        self.started = time.monotonic()
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._join, daemon=True)
        self.thread.start()

    def _join(self) -> None:
        try:
            self.result["joined"] = rendezvous.join_store(self.spec, self.started + self.spec.timeout_s)
        except Exception as e:
            self.result["error"] = e

    def producer_comes_up(self) -> Any:
        """Start the producer's store; the consumer must then join it."""
        store = rendezvous.start_store(
            GroupSpec(
                backend="gloo", host="127.0.0.1", port=self.spec.port, world_size=2, rank=0, timeout_s=HANG_LIMIT_S
            )
        )
        self.thread.join(HANG_LIMIT_S)
        assert not self.thread.is_alive(), "the consumer did not join the producer's store"
        assert "error" not in self.result, self.result["error"]
        return store


def test_a_waiting_consumer_says_so_at_once_with_the_address(notices):
    consumer = _Consumer(free_port())
    notices.wait_for_next()
    # The first notice comes on the first failed try: before any repeat could, whatever the machine's load.
    assert notices.times[0] - consumer.started < rendezvous.WAITING_NOTICE_INTERVAL_S
    assert f"rank 1: waiting for the producer at 127.0.0.1:{consumer.spec.port}" in notices.messages[0]
    store = consumer.producer_comes_up()
    joined_after = time.monotonic() - consumer.started
    # Once, not at every retry: one notice per interval waited at most, whatever the machine's load made that.
    assert len(notices.messages) <= 1 + joined_after // rendezvous.WAITING_NOTICE_INTERVAL_S, (
        joined_after,
        notices.messages,
    )
    del store


def test_a_waiting_consumer_repeats_at_the_interval(notices, monkeypatch):
    interval_s = 0.2
    monkeypatch.setattr(rendezvous, "WAITING_NOTICE_INTERVAL_S", interval_s)
    consumer = _Consumer(free_port())
    for _ in range(3):
        notices.wait_for_next()
    gaps = [b - a for a, b in zip(notices.times, notices.times[1:])]
    # Never more often than the interval (retries are far more frequent than that).
    assert all(gap >= interval_s for gap in gaps), gaps
    store = consumer.producer_comes_up()
    del store


def test_a_consumer_at_a_port_another_program_listens_on_fails_in_one_line_within_the_deadline():
    # A listener that accepts and never answers (another program on the port): torch's store client alone would wait
    # for its handshake forever.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    timeout_s = 2.0
    spec = GroupSpec(
        backend="gloo", host="127.0.0.1", port=silent.getsockname()[1], world_size=2, rank=1, timeout_s=timeout_s
    )
    started = time.monotonic()
    try:
        with pytest.raises(PeerError) as failed:
            rendezvous.join_store(spec, started + timeout_s)
        took = time.monotonic() - started
    finally:
        silent.close()
    message = str(failed.value)
    assert "\n" not in message and "did not answer as a refit producer's store" in message, message
    assert f"127.0.0.1:{spec.port}" in message and "another program's" in message, message
    # From the call: the deadline, the store client's grace, and a margin for a loaded machine.
    assert took < timeout_s + rendezvous.STORE_ANSWER_GRACE_S + 5.0, took
