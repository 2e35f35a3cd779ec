"""Who may join: a rogue client of the producer's store (a plain ``torch.distributed.TCPStore`` client, as anyone who
reaches the port can make) cannot join, abort or crash a run, never reads the token, and two runs on one port never
exchange weights; the CLI refuses a wrong token on both sides, warns on loopback and refuses an exposed port."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from cli_utils import COVER_STARTUP, load_metrics, run_dir
from conditions import needs_outward_ipv4, outward_ipv4_addresses
from failure_utils import Launcher, RefitProcess
from mp_utils import STARTUP_LIMIT_S, deadline_budget, free_port, gloo_spec, run_ranks

from refit_app.app import rank_harness
from refit_app.common.errors import ConfigError, PeerError
from refit_app.protocol.session import ConsumerSession, ProducerSession
from refit_app.transport.auth import TOKEN_ENV, RunAuth
from refit_app.transport.groups import connect
from refit_app.transport.records import RecordError, seal, unseal
from refit_app.transport.rendezvous import announce, start_store
from refit_app.transport.signed_store import SignedStore

TIMEOUT_S = 20.0
"""group.timeout_s where the run must succeed; nothing waits for it."""
SHORT_S = 4.0
"""group.timeout_s where a rank is expected to wait out its deadline."""
TOKEN = "s3cret-token-for-tests-0123456789"
HANG_S = 120.0
"""Hard limit on any wait here; only a hang gets near it."""

_GARBAGE = [
    b"{",
    b"[]",
    b"null",
    b'{"rank": "x"}',
    b'{"rank": 1, "caps": {}}',
    b"[" * 100_000,
    b"1" * 5000,
    b'{"body": "{}", "mac": "zz"}',
    b"\xff\xfe",
    b'{"ok": false, "kind": "ConfigError"}',
]
"""Values a rogue writes: malformed JSON, deep nesting, huge numbers, wrong types, missing fields, bad signatures."""


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.arange(1000, dtype=torch.float32)), ("b", torch.ones(7, dtype=torch.bfloat16))]


def _round(rg) -> float | None:
    """One refit round; a consumer returns the sum of what it received."""
    if rg.is_producer:
        with ProducerSession(rg) as session:
            session.send(_weights())
        return None
    got: dict[str, float] = {}

    def keep(batch):
        for name, t in batch:
            got[name] = float(t.float().sum())

    with ConsumerSession(rg) as session:
        while session.receive(keep) is not None:  # until the producer ends the session
            pass
    return sum(got.values())


def _open_client(port: int) -> dist.TCPStore:
    deadline = time.monotonic() + HANG_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the producer's store never came up"
            time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=HANG_S))


class Rogue:
    """A plain store client that attacks the run at ``port`` and records every value it can read."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: list[bytes] = []
        self.done = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            store = _open_client(self.port)
            store.wait(["refit/rdzv/hello"])
            hello = json.loads(store.get("refit/rdzv/hello"))
            doc = json.loads(hello["body"]) if "body" in hello else hello
            ns = f"refit/run/{doc['run_id']}/{doc['nonce']}/"  # public: anyone can list the keys anyway
            for value in _GARBAGE:
                n = store.add("refit/rdzv/checkins", 1)
                store.set(f"refit/rdzv/checkin/{n}", value)
            # A well-formed but unsigned claim to be rank 1 (it joins a run without a token: that is the point).
            forged = {
                "rank": 1,
                "run_id": doc["run_id"],
                "producer_address": "127.0.0.1",
                "caps": {"backend": "gloo", "cuda": False, "vllm": False},
            }
            if "body" in hello:
                n = store.add("refit/rdzv/checkins", 1)
                store.set(f"refit/rdzv/checkin/{n}", json.dumps({"body": json.dumps(forged), "mac": "00" * 32}))
            # Abort attempts: a failed outcome and a first error of its choosing, where the ranks look for them.
            abort = json.dumps({"ok": False, "kind": "ConfigError", "message": "ATTACKER: please run rm -rf"})
            store.set(ns + "rdzv/outcome", abort if "body" in hello else _GARBAGE[0])
            store.set(
                ns + "refit/ctl/error",
                json.dumps({"rank": 1, "message": "ATTACKER: please run rm -rf", "phase": None})
                if "body" in hello
                else _GARBAGE[3],
            )
            self.done.set()
            while not self.stop.is_set():  # read everything it can while the run goes on
                for key in store.list_keys():
                    try:
                        self.seen.append(store.get(key))
                    except dist.DistError:
                        pass
                time.sleep(0.01)
        except dist.DistError:
            pass  # the producer exited: the run is over
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


def _attacked_run(rank: int, world_size: int, port: int, my_port: int, token: str | None, attacked) -> float | None:
    if rank == 1:
        assert attacked.wait(HANG_S), "the rogue never finished its attack"
    with connect(gloo_spec(rank, 2, my_port, timeout_s=TIMEOUT_S, token=token)) as rg:
        return _round(rg)


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no_token"])
def test_rogue_client_cannot_abort_or_crash_the_run(token, caplog):
    """Garbage check-ins, a forged outcome and a forged error (all before the consumer joins) change nothing: the
    run succeeds with the real consumer's data; with a token, no value the rogue can read contains the token."""
    port = free_port()
    attacked = mp.get_context(rank_harness.START_METHOD).Event()
    rogue = Rogue(port)

    def relay() -> None:
        rogue.done.wait(HANG_S)
        attacked.set()

    threading.Thread(target=relay, daemon=True).start()
    try:
        results = run_ranks(_attacked_run, 2, port, token, attacked, timeout=HANG_S)
    finally:
        rogue.stop.set()
        rogue.thread.join(HANG_S)
    assert rogue.error is None, repr(rogue.error)
    assert results[1] == pytest.approx(sum(float(t.float().sum()) for _, t in _weights()))
    assert rogue.seen, "the rogue read nothing: the test did not test"
    if token is not None:
        leaked = [v for v in rogue.seen if TOKEN.encode() in v or TOKEN.encode().hex().encode() in v]
        assert not leaked, leaked[:3]


def test_rogue_client_cannot_join_with_a_token():
    """With a token, a rogue's check-in as rank 1 (unsigned, wrongly signed, garbage) is ignored: the producer does
    not start a refit with it, and fails at its deadline naming the missing rank and the ignored check-ins."""
    port = free_port()
    spec = gloo_spec(0, 2, port, timeout_s=SHORT_S, token=TOKEN)
    rogue = Rogue(port)
    with pytest.raises(PeerError) as info:
        connect(spec)
    rogue.stop.set()
    rogue.thread.join(HANG_S)
    assert rogue.error is None, repr(rogue.error)
    message = str(info.value)
    assert "rank 1 did not join" in message and "check-in(s) were ignored" in message, message
    assert "\n" not in message


def _two_runs(rank: int, world_size: int, port: int, my_port: int, refused) -> object:
    if rank == 0:
        with connect(gloo_spec(0, 2, my_port, timeout_s=TIMEOUT_S, run_id="run-b")) as rg:
            return _round(rg)
    if rank == 2:  # a consumer of run A, pointed at run B's port
        try:
            connect(gloo_spec(1, 2, my_port, timeout_s=TIMEOUT_S, run_id="run-a"))
        except ConfigError as e:
            return str(e)
        finally:
            refused.set()
        return "joined"
    assert refused.wait(HANG_S)
    with connect(gloo_spec(1, 2, my_port, timeout_s=TIMEOUT_S, run_id="run-b")) as rg:
        return _round(rg)


def test_a_consumer_never_joins_another_runs_producer():
    """Run B's producer on the port; run A's consumer refuses it in one line and receives nothing, and run B's own
    consumer then refits as if A's had never been there."""
    refused = mp.get_context(rank_harness.START_METHOD).Event()
    results = run_ranks(_two_runs, 3, free_port(), refused, timeout=HANG_S)
    assert "belongs to run 'run-b', this consumer to run 'run-a'" in results[2], results[2]
    assert "\n" not in results[2]
    assert results[1] == pytest.approx(sum(float(t.float().sum()) for _, t in _weights()))


def _one_line_error(proc: RefitProcess, limit_s: float, *fragments: str) -> str:
    outcome = proc.wait(limit_s)
    details = outcome.describe()
    assert outcome.returncode == 1, details
    assert "Traceback" not in outcome.stderr, details
    assert len(outcome.error_lines) == 1 and outcome.error.startswith("refit_app: error: "), details
    for fragment in fragments:
        assert fragment in outcome.error, details
    return outcome.stdout + outcome.stderr


def test_wrong_token_is_refused_on_both_sides_within_the_deadline(tmp_path):
    port = free_port()
    common = [f"group.port={port}", "group.world_size=2", f"group.timeout_s={SHORT_S:g}"]
    with Launcher(tmp_path) as launcher:
        procs = launcher.start_together(
            {"producer": ["role=producer", *common], "consumer": ["role=consumer", "sink=discard", *common]},
            STARTUP_LIMIT_S,
            {"producer": {TOKEN_ENV: TOKEN}, "consumer": {TOKEN_ENV: "another-token"}},
        )
        _one_line_error(procs["consumer"], deadline_budget(SHORT_S), "holds another group.token")
        output = _one_line_error(
            procs["producer"], deadline_budget(SHORT_S), "rank 1 did not join", "check-in(s) were ignored"
        )
        assert "signature that does not check" in output
    # Neither the logs nor anything in the run directories (config_resolved.yaml, metrics.json) hold a token.
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert TOKEN.encode() not in data and b"another-token" not in data, path


def test_no_token_warns_on_loopback_and_refuses_an_exposed_port_unless_allowed(tmp_path):
    short = ["role=producer", "group.timeout_s=1"]
    with Launcher(tmp_path) as launcher:
        loopback = launcher.start("loopback", *short, f"group.port={free_port()}")
        exposed = launcher.start("exposed", *short, "group.host=0.0.0.0", f"group.port={free_port()}")
        allowed = launcher.start(
            "allowed", *short, "group.host=0.0.0.0", f"group.port={free_port()}", "group.allow_unauthenticated=true"
        )
        limit = STARTUP_LIMIT_S + deadline_budget(1)
        output = _one_line_error(loopback, limit, "rank 1 did not join")
        assert "group.token is not set: any process on this host can join" in output, output
        _one_line_error(
            exposed,
            limit,
            "group.host=0.0.0.0 is not a loopback address and group.token is not set",
            "group.allow_unauthenticated=true",
        )
        output = _one_line_error(allowed, limit, "rank 1 did not join")
        assert "group.allow_unauthenticated=true: any host" in output, output


@needs_outward_ipv4
def test_the_store_listens_on_group_host_only():
    """The default group.host=127.0.0.1 keeps the port off every other interface."""
    port = free_port()
    store = start_store(gloo_spec(0, 2, port, timeout_s=TIMEOUT_S))
    try:
        for address in sorted(outward_ipv4_addresses()):
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=2).close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        del store


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no_token"])
def test_a_record_is_believed_only_as_its_run_signed_it(token):
    """Round trip; then every garbage value, a tampered body, another kind and another run's key: each a
    RecordError (the one exception callers catch), never a JSONDecodeError, KeyError or RecursionError. Without a
    token there is nothing to check a record against: a JSON object comes back as it was written."""
    auth = RunAuth.derive(token, "run-a", "nonce-1", 0)
    record = {"rank": 1, "message": "boom", "phase": None}
    sealed = seal(auth, "error", record)
    assert unseal(auth, "error", sealed) == record
    if token is not None:
        assert TOKEN not in sealed
        tampered = json.loads(sealed)
        tampered["body"] = tampered["body"].replace("boom", "ATTACKER")
        forged = [json.dumps(tampered), json.dumps(record)]
        for other in (
            RunAuth.derive(TOKEN, "run-a", "nonce-2", 0),
            RunAuth.derive("other", "run-a", "nonce-1", 0),
            RunAuth.derive(TOKEN, "run-b", "nonce-1", 0),
        ):
            forged.append(seal(other, "error", record))
        forged.append(seal(auth, "outcome", record))  # a signature made for another kind of record
        for value in forged:
            with pytest.raises(RecordError):
                unseal(auth, "error", value)
    for value in _GARBAGE:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
        if token is None and isinstance(parsed, dict):
            assert unseal(auth, "error", value) == parsed, value  # no token, no signature: an object is taken as sent
            continue
        with pytest.raises(RecordError):
            unseal(auth, "error", value)


def test_a_forged_backend_record_fails_the_set_up_instead_of_redirecting_it():
    """Gloo reads each rank's address from the store; with a token a value overwritten by a stranger is refused."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    auth = RunAuth.derive(TOKEN, "run-a", "nonce-1", 0)
    signed = SignedStore(server, auth)
    signed.set("rank_1", b"10.0.0.2:1234")
    assert signed.get("rank_1") == b"10.0.0.2:1234"
    assert TOKEN.encode() not in server.get("rank_1")
    server.set("rank_1", b"10.6.6.6:1234")
    with pytest.raises(RuntimeError, match="not signed with this run's key"):
        signed.get("rank_1")


def test_cli_consumer_of_another_run_refuses_the_producer_and_saves_nothing(tmp_path):
    """Run B's producer holds the port; run A's consumer (given its run id) exits 1 with one line, and its
    sink.path never appears: no weights of another run land in it."""
    port = free_port()
    common = [f"group.port={port}", "group.world_size=2", f"group.timeout_s={SHORT_S:g}"]
    sink = tmp_path / "run-a-weights"
    with Launcher(tmp_path) as launcher:
        procs = launcher.start_together(
            {
                "producer": ["role=producer", "group.run_id=run-b", *common],
                "consumer": ["role=consumer", "group.run_id=run-a", "sink=save", f"sink.path={sink}", *common],
            },
            STARTUP_LIMIT_S,
        )
        _one_line_error(
            procs["consumer"], deadline_budget(SHORT_S), "belongs to run 'run-b'", "this consumer to run 'run-a'"
        )
        _one_line_error(procs["producer"], deadline_budget(SHORT_S), "rank 1 did not join")
    assert not sink.exists()


def _squat(port: int, values: dict[str, bytes]) -> None:
    """As a stranger: wait for the producer's public greeting, read the run's key prefix from it and pre-set
    ``values`` (keys relative to that prefix, or absolute where they start with ``refit/rdzv/``)."""
    store = _open_client(port)
    store.wait(["refit/rdzv/hello"])
    hello = json.loads(store.get("refit/rdzv/hello"))
    doc = json.loads(hello["body"]) if "body" in hello else hello
    ns = f"refit/run/{doc['run_id']}/{doc['nonce']}/"
    for key, value in values.items():
        store.set(key if key.startswith("refit/rdzv/") else ns + key, value)


_SQUATTED = {
    # Every key a rank writes or adds to, pre-set with what breaks it: a non-number kills an add's connection, a
    # 1 pre-claims rank 1, garbage sits where an outcome, an error or a check-in is looked for.
    TOKEN: {
        "refit/left": b"garbage",
        "rdzv/claim/1": b"1",
        "rdzv/outcome": b"garbage",
        "refit/ctl/error": b"garbage",
        "refit/rdzv/checkins": b"garbage",
        **{f"refit/rdzv/checkin/{n}": b"garbage" for n in range(1, 4)},
    },
    # Without a token a stranger can join or abort (docs/security.md), but not turn an agreed end into a failure.
    None: {"refit/left": b"garbage"},
}


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no_token"])
def test_keys_a_stranger_presets_cannot_fail_the_run_or_its_agreed_end(token, tmp_path):
    """A stranger reads the run's key prefix from the public greeting and pre-sets the keys the ranks count, claim
    and report with; with a token none of them is a key the ranks use, and without one the producer still ends a
    run whose rounds every rank agreed on with exit 0 and its rounds in metrics.json."""
    port = free_port()
    common = [f"group.port={port}", "group.world_size=2"]
    env = {TOKEN_ENV: token} if token is not None else {}
    with Launcher(tmp_path) as launcher:
        # The producer waits out the consumer's start-up; the consumer starts after the squat, its deadline at the
        # gate (the producer is up by then).
        producer = launcher.start("producer", "role=producer", "refit.rounds=3", COVER_STARTUP, *common, env=env)
        _squat(port, _SQUATTED[token])
        consumer_args = ["role=consumer", "sink=verify", f"group.timeout_s={TIMEOUT_S:g}", *common]
        consumer = launcher.start_together({"consumer": consumer_args}, STARTUP_LIMIT_S, {"consumer": env})["consumer"]
        outcomes = [proc.wait(deadline_budget(TIMEOUT_S)) for proc in (consumer, producer)]
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.describe()
    metrics = load_metrics(run_dir(tmp_path, "producer"))
    assert metrics["status"] == "ok" and len(metrics["rounds"]) == 3, metrics
    assert load_metrics(run_dir(tmp_path, "consumer1"))["verified"] is True


def _greeting_overwritten_by_a_stranger(port: int, forge) -> str:
    """A producer with the token greets; a stranger replaces its greeting with ``forge(doc)``; returns the line a
    consumer with the token refuses it with."""
    store = start_store(gloo_spec(0, 2, port, timeout_s=TIMEOUT_S, token=TOKEN))
    try:
        announce(store, gloo_spec(0, 2, port, timeout_s=TIMEOUT_S, token=TOKEN))
        doc = json.loads(json.loads(store.get("refit/rdzv/hello"))["body"])
        _open_client(port).set("refit/rdzv/hello", forge(doc))
        with pytest.raises(ConfigError) as info:
            connect(gloo_spec(1, 2, port, timeout_s=SHORT_S, token=TOKEN))
        return str(info.value)
    finally:
        del store


@pytest.mark.parametrize(
    "forge, fragment",
    [
        (json.dumps, "is not signed"),
        (lambda doc: json.dumps({"body": json.dumps(doc), "mac": "00" * 32}), "does not check"),
    ],
    ids=["unsigned", "foreign"],
)
def test_a_greeting_a_stranger_wrote_is_refused_for_what_it_is(forge, fragment):
    """The greeting's key is public: a consumer that cannot believe it says so without blaming the producer's
    settings (an unsigned greeting is not proof that the producer runs without a token)."""
    message = _greeting_overwritten_by_a_stranger(free_port(), forge)
    assert fragment in message and "or a client that is not the producer wrote it" in message, message
    assert "runs without group.token, and this consumer has one" not in message, message
    assert "\n" not in message


def test_without_a_token_a_rank_claimed_in_advance_is_not_blamed_on_two_consumers():
    """Without a token anyone can claim a rank before its consumer does; the line says that it may not have been a
    consumer, on the consumer and on the producer alike."""
    port = free_port()
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            connect(gloo_spec(0, 2, port, timeout_s=TIMEOUT_S))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    _squat(port, {"rdzv/claim/1": b"1"})
    with pytest.raises(ConfigError) as info:
        connect(gloo_spec(1, 2, port, timeout_s=TIMEOUT_S))
    thread.join(HANG_S)
    assert not thread.is_alive()
    for message in (str(info.value), str(errors[0])):
        assert "or by one and a client that is not: without group.token anyone can claim a rank" in message, message
