"""Staged rounds (refits beside generation) over real gloo groups: a consumer session receives and verifies each
round beside its targets, which keep serving the round before, bit for bit, until ``apply`` writes it in a pause.

Every scenario runs a producer and one consumer: dense rounds with a thread reading the targets throughout the
stage; delta rounds (1% of the elements changed) that stage only their changes, one of them discarded; a staged round
corrupted in the staged copy, and one whose checksums disagree, never applied and followed by a dense round; calls
out of order and a base written while staged, refused in one line; the staging bound refused in one line, before
anything moves or at the manifest. The producer SIGKILLed mid-stage runs on its own (it ends the group)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path

import torch
from mp_utils import RankFailure, deadline_budget, gloo_spec, run_ranks

from refit_app.common.errors import StagingError
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.groups import connect

TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 6.0
"""The group's deadline where the producer is killed: the consumer must give up within its budget."""
BUFFER = 4096
"""Small buffers: a round of the model below takes several chunks, so "mid-stage" has room."""
SCENARIO_RANKS = 2


def _model(k: int) -> dict[str, torch.Tensor]:
    """Round ``k``'s weights (about 16 KB): seeded, then each later round flips one bit in 1% of each tensor's
    elements."""
    g = torch.Generator().manual_seed(0)
    model = {
        "w": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b": torch.randn(97, generator=g),
        "i8": torch.randint(-128, 127, (513,), generator=g, dtype=torch.int8),
        "big": torch.randn(2500, generator=g),
        "mask": torch.rand(301, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
    }
    for r in range(2, k + 1):
        gr = torch.Generator().manual_seed(r)
        for t in model.values():
            if t.numel():
                rows = t.view(-1).view(torch.uint8).view(t.numel(), t.element_size())
                rows[torch.randperm(t.numel(), generator=gr)[: max(1, t.numel() // 100)], 0] ^= 0x01
    return model


MODEL_BYTES = sum(t.numel() * t.element_size() for t in _model(1).values())


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def _produce(rg, rounds: int, delta: str, checksum_flip_round: int = 0) -> list[int]:
    """Send ``rounds`` rounds; in ``checksum_flip_round`` the first checksum goes out with a bit flipped (the data
    disagrees with it on every consumer). Returns each round's base."""
    from refit_app.protocol import producer_session

    original = producer_session.send_checksums
    with ProducerSession(rg, buffer_size_bytes=BUFFER, delta=delta) as session:

        def flipped(group, checksums):
            if session.rounds + 1 == checksum_flip_round:
                checksums = [checksums[0] ^ 1, *checksums[1:]]
            return original(group, checksums)

        producer_session.send_checksums = flipped
        try:
            return [session.send(list(_model(k).items())).base_round for k in range(1, rounds + 1)]
        finally:
            producer_session.send_checksums = original


class _Engine:
    """Stands in for an engine: its pause records what the targets held as it stopped and as it resumed."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.events: list[tuple[str, dict[str, bytes]]] = []

    @contextlib.contextmanager
    def paused(self):
        self.events.append(("pause", _bytes(self.targets)))
        yield
        self.events.append(("resume", _bytes(self.targets)))


class _Reader:
    """A thread that reads the targets over and over while a round is staged (as generation would), recording
    whether every read saw the bytes of the round they held; ``on_chunk`` makes the stage wait for a read that
    started after its first chunk arrived, so at least one read falls inside the stage."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.expected: dict[str, bytes] = {}
        self.reads_in_stage = 0
        self.differed = 0
        self._staging = threading.Event()
        self._read_in_stage = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, expected: dict[str, bytes]) -> None:
        self.expected = expected
        self._thread.start()

    def on_chunk(self, nbytes: int, count: int) -> None:
        if not self._staging.is_set():
            self._staging.set()
            if not self._read_in_stage.wait(TIMEOUT_S):
                raise AssertionError("the reader thread read nothing while the round was staged")

    def _run(self) -> None:
        while not self._stop.is_set():
            staging = self._staging.is_set()
            if _bytes(self.targets) != self.expected:
                self.differed += 1
            if staging:
                self.reads_in_stage += 1
                self._read_in_stage.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S)


def _dense_beside_a_reader(rank: int, port: int) -> list:
    """Dense rounds (no deltas): each staged on a side thread while another reads the targets, then applied on this
    thread in the engine's pause."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 3, "off")
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        engine = _Engine(targets)
        readers: list[_Reader] = []
        session = ConsumerSession(rg, verify=True, on_chunk=lambda n, c: readers[-1].on_chunk(n, c))
        out = []
        while True:
            reader = _Reader(targets)
            readers.append(reader)
            before = _bytes(targets)
            reader.start(before)
            try:
                # Staged on a side thread, applied on this one (the engine's), as an engine's worker would.
                with concurrent.futures.ThreadPoolExecutor(1) as side:
                    staged = side.submit(session.stage, targets).result(TIMEOUT_S)
            finally:
                reader.stop()
            if staged is None:
                return out
            untouched = _bytes(targets) == before
            engine.events.clear()
            metrics = staged.apply(pause=engine.paused())
            (paused, at_pause), (resumed, at_resume) = engine.events
            out.append(
                {
                    "round": staged.version,
                    "base": staged.base_round,
                    "reads_in_stage": reader.reads_in_stage,
                    "reads_that_differed": reader.differed,
                    "untouched_until_apply": untouched
                    and at_pause == before
                    and (paused, resumed) == ("pause", "resume"),
                    "applied": _bytes(targets) == _bytes(_model(staged.version)) and at_resume == _bytes(targets),
                    "metrics": metrics,
                    "applied_round": session.applied_round,
                }
            )


def _deltas_one_discarded(rank: int, port: int, *, verify: bool) -> list:
    """Six rounds, 1% changed each: round 3 is staged and discarded, so round 4 comes dense and 5-6 as changes."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 6, "on")
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        session = ConsumerSession(rg, verify=verify)
        out = []
        while True:
            before = _bytes(targets)
            staged = session.stage(targets)
            if staged is None:
                return out
            row = {"round": staged.version, "base": staged.base_round, "staged_bytes": staged.staged_bytes}
            # What an engine builds its own state from beside generation: the round's tensors, read unapplied.
            row["changed"] = staged.changed
            will_hold = _bytes(dict(staged.tensors(list(targets))))
            row["untouched_until_apply"] = _bytes(targets) == before
            if staged.version == 3:
                staged.discard()
                row["kept"] = _bytes(targets) == _bytes(_model(2))
                row["state"] = staged.state
            else:
                row["metrics"] = staged.apply()
                row["kept"] = _bytes(targets) == _bytes(_model(staged.version)) == will_hold
            out.append(row)


def _never_applied(rank: int, port: int, *, how: str) -> list:
    """Round 3 goes wrong: ``copy``: the consumer flips a byte of its staged copy (dense rounds only) before the
    verifier hashes it; ``checksums``: the producer's checksums for it (a delta round) disagree with its data. The
    consumer records what ``stage`` raised and that its targets still hold round 2, then stages rounds 4 and 5."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 5, "off" if how == "copy" else "on", checksum_flip_round=3 if how == "checksums" else 0)
        from refit_app.protocol import consumer_session

        original = consumer_session.stage_dense

        def corrupting(*args, show, **kwargs):
            flipped = []

            def corrupt_then_show(batch):
                if not flipped and batch[0][1].numel():
                    batch[0][1].view(-1).view(torch.uint8)[0] ^= 0x01  # a view of the staged copy
                    flipped.append(batch[0][0])
                return show(batch)

            return original(*args, show=corrupt_then_show, **kwargs)

        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        session = ConsumerSession(rg, verify=True)
        out = []
        while True:
            k = session.rounds + 1
            if how == "copy":
                consumer_session.stage_dense = corrupting if k == 3 else original
            try:
                staged = session.stage(targets)
            except StagingError as e:
                out.append({"round": k, "error": str(e), "kept": _bytes(targets) == _bytes(_model(k - 1))})
                continue
            finally:
                consumer_session.stage_dense = original
            if staged is None:
                return out
            staged.apply()
            out.append({"round": k, "base": staged.base_round, "kept": _bytes(targets) == _bytes(_model(k))})


def _bounded(rank: int, port: int, *, first: str) -> list:
    """``max_staging_bytes`` one byte short of the model: round 1 by ``first`` (``receive`` unstaged, or ``stage``:
    refused at the manifest); then round 2 staged (refused before anything moves) and received unstaged."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 2, "on")
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        session = ConsumerSession(rg, verify=True, max_staging_bytes=MODEL_BYTES - 1)
        out = []
        if first == "stage":
            session.stage(targets)
        session.receive(targets=targets)
        try:
            session.stage(targets)
        except StagingError as e:
            out.append(str(e))
        r = session.receive(targets=targets)
        out.append((r.round, _bytes(targets) == _bytes(_model(2))))
        assert session.receive(targets=targets) is None  # the producer's end of the session
        return out


def _out_of_order(rank: int, port: int) -> list:
    """Calls out of order, each refused in one line: a round taken while one is staged, a round applied twice, and
    a delta round applied after the engine wrote its targets (then never applied: round 4 comes dense)."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 5, "on")
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        session = ConsumerSession(rg, verify=True)
        out = []

        def refused(call) -> str:
            try:
                call()
            except StagingError as e:
                return str(e)
            return "not refused"

        session.stage(targets).apply()
        staged = session.stage(targets)
        out.append(refused(lambda: session.receive(targets=targets)))
        out.append(refused(lambda: session.stage(targets)))
        staged.apply()
        out.append(refused(staged.apply))
        staged = session.stage(targets)
        targets["b"].add_(1.0)  # the engine writes its weights while round 3 is staged against round 2
        written = _bytes(targets)
        out.append(refused(staged.apply))
        out.append(_bytes(targets) == written)
        staged = session.stage(targets)
        staged.apply()
        out.append((staged.version, staged.base_round, _bytes(targets) == _bytes(_model(4))))
        staged = session.stage(targets)  # round 5, changes to round 4
        targets["b"].numpy()[0] += 1.0  # a write behind torch's version counter: only the bytes show it
        written = _bytes(targets)
        out.append(refused(staged.apply))
        out.append(_bytes(targets) == written)
        assert session.stage(targets) is None
        return out


def _targets_changed_before_apply(rank: int, port: int) -> list:
    """Dense rounds: ``stage(None)`` refused before round 1 moves; round 2 staged, then the engine swaps a target's
    tensor for one of another dtype (same shape and bytes); round 3 staged, then a name dropped from the mapping it
    was staged against. ``apply`` must refuse each in one line, writing nothing."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            return _produce(rg, 3, "off")
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        session = ConsumerSession(rg, verify=True)
        out = []
        try:
            session.stage(None)  # refused before anything moves: the round is then staged
            out.append("not refused")
        except StagingError as e:
            out.append(str(e))
        session.stage(targets).apply()
        # The first apply's pause swallows what is raised in it (an engine's pause that logs and goes on): apply()
        # must still not return as if the round were applied.
        cases = (("w", torch.zeros(64, 48, dtype=torch.float16), contextlib.suppress(StagingError)), ("b", None, None))
        for name, replacement, pause in cases:
            staged = session.stage(targets)
            original = targets.pop(name)
            if replacement is not None:
                targets[name] = replacement
            written = _bytes(targets)
            try:
                staged.apply(pause=pause)
                out.append("not refused")
            except StagingError as e:
                out.append(str(e))
            out.append((staged.state, _bytes(targets) == written))
            targets[name] = original
        assert session.stage(targets) is None
        return out


def _closed_with_a_round_staged(rank: int, port: int) -> list:
    """Round 2 staged in a session that is then closed: its round must never be applied after that (another
    session may have written newer weights into the targets since)."""
    with connect(gloo_spec(rank, 2, port, timeout_s=TIMEOUT_S)) as rg:
        if rank == 0:
            session = ProducerSession(rg, buffer_size_bytes=BUFFER)
            bases = [session.send(list(_model(k).items())).base_round for k in (1, 2)]
            session.close(notify=False)  # the consumer closes its side without waiting for an end
            return bases
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        first = ConsumerSession(rg, verify=True)
        first.stage(targets).apply()
        staged = first.stage(targets)
        first.close()
        written = _bytes(targets)
        try:
            staged.apply()
            out = ["not refused"]
        except StagingError as e:
            out = [str(e)]
        return [*out, staged.state, _bytes(targets) == written]


SCENARIOS = {
    "dense_beside_a_reader": _dense_beside_a_reader,
    "deltas_one_discarded": functools.partial(_deltas_one_discarded, verify=True),
    "deltas_unverified": functools.partial(_deltas_one_discarded, verify=False),
    "corrupted_copy": functools.partial(_never_applied, how="copy"),
    "checksums_disagree": functools.partial(_never_applied, how="checksums"),
    "out_of_order": _out_of_order,
    "bound": functools.partial(_bounded, first="receive"),
    "bound_at_the_manifest": functools.partial(_bounded, first="stage"),
    "targets_changed_before_apply": _targets_changed_before_apply,
    "closed_with_a_round_staged": _closed_with_a_round_staged,
}


def test_dense_staged_rounds_leave_the_targets_untouched_until_apply_writes_them_bit_for_bit(played):
    producer, consumer = (p["dense_beside_a_reader"] for p in played)
    assert producer == [0, 0, 0]
    assert [row["round"] for row in consumer] == [1, 2, 3]
    for row in consumer:
        assert row["reads_in_stage"] >= 1 and row["reads_that_differed"] == 0, row
        assert row["untouched_until_apply"] and row["applied"], row
        m = row["metrics"]
        assert (m["version"], m["state"], m["base_round"], m["verified"]) == (row["round"], "applied", 0, True)
        assert m["staged_bytes"] == MODEL_BYTES and row["applied_round"] == row["round"]
        assert 0 < m["apply_seconds"] <= m["pause_seconds"] and m["stage_seconds"] > 0


def test_delta_rounds_stage_only_their_changes_and_a_discarded_round_is_never_the_base(played):
    for name in ("deltas_one_discarded", "deltas_unverified"):
        producer, consumer = (p[name] for p in played)
        # Round 3 discarded: the targets keep round 2, so round 4 comes dense, then changes again.
        assert producer == [0, 1, 2, 0, 4, 5], name
        assert [(row["round"], row["base"]) for row in consumer] == list(enumerate(producer, 1)), name
        for row in consumer:
            assert row["untouched_until_apply"] and row["kept"], (name, row)
            if row["base"]:
                # 1% of the elements: positions and values of those, far below one copy of the model.
                assert 0 < row["staged_bytes"] < MODEL_BYTES // 10, (name, row)
                assert row["changed"] == [n for n, t in _model(1).items() if t.numel()], (name, row)
            else:
                assert row["staged_bytes"] == MODEL_BYTES, (name, row)
                assert row["changed"] == list(_model(1)), (name, row)
        assert consumer[2]["state"] == "discarded"
        assert consumer[4]["metrics"]["changed_elements"] > 0


def test_a_staged_round_that_fails_verification_is_never_applied_and_the_next_comes_dense(played):
    for name, bases in (("corrupted_copy", [0, 0, 0, 0, 0]), ("checksums_disagree", [0, 1, 2, 0, 4])):
        producer, consumer = (p[name] for p in played)
        assert producer == bases, name
        failed = consumer[2]
        assert failed["round"] == 3 and failed["kept"], (name, failed)
        assert "\n" not in failed["error"], failed
        assert failed["error"].startswith("round 3: not applied, the targets keep round 2"), failed
        assert "1 of 6 tensor(s) differ from what the producer sent: 'w'" in failed["error"], failed
        assert [(row["round"], row.get("base"), row["kept"]) for row in consumer[3:]] == [
            (4, 0, True),
            (5, bases[4], True),
        ], name


def test_calls_out_of_order_are_refused_in_one_line_and_a_written_base_is_never_patched(played):
    producer, consumer = (p["out_of_order"] for p in played)
    assert producer == [0, 1, 2, 0, 4]
    while_staged = "round 2 is staged, neither applied nor discarded: apply() or discard() it before {}() takes round 3"
    assert consumer[:3] == [
        while_staged.format("receive"),
        while_staged.format("stage"),
        "round 2: cannot apply it: it was applied already",
    ]
    assert consumer[3] == (
        "round 3: not applied: the targets were written to since it was staged as changes to round 2; they are "
        "untouched by it, and the next round comes dense"
    )
    assert consumer[4] is True and consumer[5] == (4, 0, True)
    assert producer[4] == 4 and consumer[6] == (
        "round 5: not applied: the targets no longer hold round 4's bytes it was staged against (written behind "
        "torch's version counter); they are untouched by it, and the next round comes dense"
    )
    assert consumer[7] is True


def test_the_staging_bound_is_refused_in_one_line(played):
    producer, consumer = (p["bound"] for p in played)
    assert producer == [0, 1]
    refusal, received = consumer
    assert refusal == (
        f"round 2: staging a round of this model takes up to {refusal.split('takes up to ')[1].split(' (')[0]} "
        f"({MODEL_BYTES} bytes, one host copy), over max_staging_bytes={MODEL_BYTES - 1}; raise it, or receive() "
        "the round unstaged"
    )
    assert received == (2, True)
    # Where the round brings the manifest, the refusal is this consumer's answer to it: every rank stops.
    producer, consumer = (p["bound_at_the_manifest"] for p in played)
    assert "round 1" in str(consumer) and f"over max_staging_bytes={MODEL_BYTES - 1}" in str(consumer), consumer
    assert f"over max_staging_bytes={MODEL_BYTES - 1}" in str(producer), producer


def test_a_staged_round_is_not_applied_to_targets_that_no_longer_match_its_manifest(played):
    producer, consumer = (p["targets_changed_before_apply"] for p in played)
    assert producer == [0, 0, 0]
    assert consumer.pop(0) == "round 1: stage() needs the targets (tensors by name) the round is applied to"
    assert consumer[0] == (
        "round 2: not applied: the targets do not match the manifest: 'w' is [64, 48] torch.float16, the manifest "
        "says [64, 48] torch.bfloat16; they are untouched by it, and the next round comes dense"
    ), consumer
    assert consumer[1] == ("broken", True)
    assert consumer[2].startswith("round 3: not applied: the targets do not match the manifest: ") and (
        "'b' has no target" in consumer[2]
    ), consumer
    assert consumer[3] == ("broken", True)


def _killed_mid_stage(rank: int, world_size: int, port: int, killed_at: str) -> dict:
    """The producer SIGKILLs itself once the third chunk of round 2 is handed to the group (after noting the
    time); the consumer, staging round 2, notes when ``stage`` raised."""
    with connect(gloo_spec(rank, world_size, port, timeout_s=KILL_TIMEOUT_S)) as rg:
        if rank == 0:
            chunks = []

            def on_chunk(nbytes: int, count: int) -> None:
                if session.rounds == 1:
                    chunks.append(nbytes)
                    if len(chunks) == 3:
                        Path(killed_at).write_text(repr(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)

            with ProducerSession(rg, buffer_size_bytes=BUFFER, on_chunk=on_chunk) as session:
                for k in (1, 2):
                    session.send(list(_model(k).items()))
            return {}
        targets = {n: torch.zeros_like(t) for n, t in _model(1).items()}
        landed = []
        session = ConsumerSession(rg, verify=True, on_chunk=lambda nbytes, count: landed.append(session.rounds))
        session.stage(targets).apply()
        try:
            session.stage(targets)
        except StagingError as e:
            raised_at = time.time()
            return {
                "error": str(e),
                "after_kill_s": raised_at - float(Path(killed_at).read_text()),
                "untouched": _bytes(targets) == _bytes(_model(1)),
                "chunks_staged_in_round_2": landed.count(1),
            }
        return {"error": None}


def test_a_producer_killed_mid_stage_leaves_the_targets_untouched_and_the_consumer_says_so_in_time(tmp_path):
    producer, consumer = run_ranks(
        _killed_mid_stage,
        2,
        str(tmp_path / "killed_at"),
        timeout=TIMEOUT_S + deadline_budget(KILL_TIMEOUT_S),
        return_exceptions=True,
    )
    assert isinstance(producer, RankFailure) and producer.exc_type == "Died", producer
    assert consumer["error"] is not None and consumer["untouched"], consumer
    assert consumer["chunks_staged_in_round_2"] >= 1, consumer  # it died mid-stage, not before it
    assert consumer["error"].startswith("round 2: ") and "\n" not in consumer["error"], consumer
    assert consumer["error"].endswith("(not staged: the targets are untouched)"), consumer
    # Measured from the kill: a rank notices a dead peer within its deadline (mp_utils.DEADLINE_MARGIN).
    assert consumer["after_kill_s"] <= deadline_budget(KILL_TIMEOUT_S), consumer


def test_a_round_staged_in_a_closed_session_is_never_applied(played):
    producer, consumer = (p["closed_with_a_round_staged"] for p in played)
    assert producer == [0, 0]
    assert consumer == ["round 2: cannot apply it: it was discarded already", "discarded", True]
