"""``gymkit.token_store.TokenStore`` against released NeMo Gym's own contract and our stronger one.

* Gym's conformance suite (``nemo_gym.token_id_capture.conformance.run_conformance``), unchanged,
  on local disk, SeaweedFS and moto: once with every instance in this process, once with every
  instance in a process of its own (``token_store_proc.ProcessTokenStore``).
* Hypothesis round trips of entries built and stamped with Gym's own helpers.
* The log's rules: conflicts, the strict fence under racing writers, versions, retirement, typed
  errors naming the rollout or the object, a put acknowledged by a process that is then killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.conformance import run_conformance
from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot, TokenSink, TokenSource
from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

from gymkit.token_store import (
    ConflictingEntryError,
    FrozenRecords,
    IncompleteEvent,
    PutEvent,
    RolloutFencedError,
    TokenStore,
    canonical_bytes,
    read_log,
)
from schemas.errors import CorruptSnapshotError, InvalidRecordError, VersionError
from snapformat.store import open_store
from tests.gym_entries import token_entries
from tests.gymkit.token_store_proc import ProcessTokenStore

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["put_then_freeze_visibility", "idempotent_reput", "conflicting_reput", "mark_incomplete_durability",
          "freeze_idempotency", "post_freeze_write_safety", "conditional_retirement", "begin_call_custody"]
BACKENDS = ["local", "seaweedfs", "moto"]


@pytest.fixture(params=BACKENDS)
def location(request: pytest.FixtureRequest, tmp_path: Path, aws_env, new_bucket) -> tuple[str, dict[str, str]]:
    """A fresh empty location on each backend and the environment a process needs to reach it."""
    if request.param == "local":
        return str(tmp_path / "tokens"), {}
    server = request.getfixturevalue("seaweed" if request.param == "seaweedfs" else "moto_s3")
    aws_env(server)
    return f"s3://{new_bucket(server)}/tokens", server.env_vars()


def entry(rollout_id: str, call: str, *, prompt: list[int] | None = None, generation: list[int] | None = None,
          text: str = "a", created_at: float = 1700000000.0) -> TokenEntry:
    generation = [13, 14] if generation is None else generation
    e = TokenEntry(rollout_id=rollout_id, model_call_id=call, model="m", prompt_token_ids=prompt or [11, 12],
                   generation_token_ids=generation, generation_log_probs=[-0.5] * len(generation),
                   output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                     "text": text}]}],
                   token_item_index=0, created_at=created_at)
    return stamp_lineage(e, None, parent_resolution=ParentResolutionStatus.ROOT)


def dumps(entries: Any) -> list[dict]:
    return [e.model_dump(mode="json") for e in entries]


# -- Gym's conformance suite, unchanged -----------------------------------------------------------


def test_conformance_in_process(location: tuple[str, dict[str, str]]) -> None:
    url, _ = location
    passed = asyncio.run(run_conformance(lambda: TokenStore(url), lambda: TokenStore(url)))
    assert passed == CHECKS


def test_conformance_every_instance_in_its_own_process(location: tuple[str, dict[str, str]]) -> None:
    """Each instance the suite makes is a separate process: durability and visibility are real."""
    url, env = location
    made: list[ProcessTokenStore] = []

    def factory() -> ProcessTokenStore:
        made.append(ProcessTokenStore(url, env))
        return made[-1]

    async def run() -> tuple[list[str], set[int]]:
        passed = await run_conformance(factory, factory)
        pids = set()
        for proxy in made:  # closed by the suite; the pids were taken while they ran
            pids.add(proxy._proc.pid)
        return passed, pids

    passed, pids = asyncio.run(run())
    assert passed == CHECKS
    assert len(pids) == len(made) >= 17 and os.getpid() not in pids
    assert all(not p._proc.is_alive() for p in made)


def test_the_store_is_a_gym_sink_and_source(tmp_path: Path) -> None:
    store = TokenStore(str(tmp_path))
    assert isinstance(store, TokenSink) and isinstance(store, TokenSource) and callable(store.begin_call)


# -- round trips ----------------------------------------------------------------------------------

_round_trip_ids = iter(range(10**9))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(token_entries(), min_size=1, max_size=6), st.booleans())
def test_put_then_freeze_round_trips_gym_entries(entries: list[TokenEntry], retry: bool) -> None:
    """Entries stamped by Gym's own helpers come back from a fresh instance equal, in put order."""
    key = f"rt-{next(_round_trip_ids)}"
    for i, e in enumerate(entries):
        e.rollout_id = key
        e.model_call_id = f"{i}-{e.model_call_id}"
    with tempfile.TemporaryDirectory() as root:
        async def run() -> TokenCaptureSnapshot:
            writer = TokenStore(root)
            for e in entries:
                await writer.put(e)
            if retry:  # a retry resends the same bytes: a no-op
                for e in entries:
                    await writer.put(TokenEntry.model_validate(e.model_dump(mode="json")))
            return await TokenStore(root).freeze(key)

        snapshot = asyncio.run(run())
        assert dumps(snapshot.entries) == dumps(entries)
        assert not snapshot.incomplete and snapshot.version == len(entries) + 1
        assert all(isinstance(e, TokenEntry) for e in snapshot.entries)


def test_a_chain_of_calls_round_trips_on_s3(seaweed, aws_env, new_bucket) -> None:
    """A parent-linked chain (root, resolved, delta prompt) through SeaweedFS, read in parallel."""
    aws_env(seaweed)
    url = f"s3://{new_bucket(seaweed)}/tokens"
    chain, cumulative = [], []
    for i in range(12):
        e = TokenEntry(rollout_id="chain", model_call_id=f"call-{i}", prompt_token_ids=cumulative + [i, i + 1],
                       generation_token_ids=[100 + i], generation_log_probs=[-0.25], created_at=float(i))
        parent = chain[-1].model_call_id if chain else None
        status = ParentResolutionStatus.RESOLVED if parent else ParentResolutionStatus.ROOT
        if i % 3 == 2:
            full = list(e.prompt_token_ids) + list(e.generation_token_ids)
            e.prompt_token_ids = e.prompt_token_ids[len(cumulative):]
            e.prompt_is_delta = True
            stamp_lineage(e, parent, parent_resolution=status, cumulative=full)
        else:
            stamp_lineage(e, parent, parent_resolution=status)
        cumulative = cumulative + [i, i + 1, 100 + i]
        chain.append(e)

    async def run() -> TokenCaptureSnapshot:
        writer = TokenStore(url)
        for e in chain:
            await writer.put(e)
        return await TokenStore(url).freeze("chain")

    snapshot = asyncio.run(run())
    assert dumps(snapshot.entries) == dumps(chain) and not snapshot.incomplete


def test_dict_entries_and_gym_free_records(tmp_path: Path) -> None:
    """``put`` takes the JSON dict; ``freeze_records`` returns typed records with JSON entries."""
    payloads = [entry("plain", f"c{i}").model_dump(mode="json") for i in range(3)]

    async def run() -> tuple[FrozenRecords, FrozenRecords]:
        store = TokenStore(str(tmp_path))
        for p in payloads:
            await store.put(p)
        await store.put(dict(payloads[0]))  # the same JSON again: a no-op
        return await store.freeze_records("plain"), await TokenStore(str(tmp_path)).freeze_records("plain")

    first, second = asyncio.run(run())
    assert first == second
    assert list(first.entries) == payloads and not first.incomplete and first.incomplete_reasons == ()
    assert msgspec.json.decode(msgspec.json.encode(first), type=FrozenRecords) == first


# -- conflicts, fences, versions, retirement ------------------------------------------------------


def test_a_conflicting_reput_raises_and_marks_the_rollout_incomplete(location: tuple[str, dict[str, str]]) -> None:
    url, _ = location

    async def run() -> TokenCaptureSnapshot:
        sink = TokenStore(url)
        await sink.put(entry("r", "call-1"))
        with pytest.raises(ConflictingEntryError, match=r"call 'call-1' of rollout 'r' was already put"):
            await sink.put(entry("r", "call-1", generation=[15]))
        with pytest.raises(ConflictingEntryError):  # another instance, which learns of call-1 from the log
            await TokenStore(url).put(entry("r", "call-1", text="b"))
        return await TokenStore(url).freeze("r")

    snapshot = asyncio.run(run())
    assert snapshot.incomplete
    assert dumps(snapshot.entries) == dumps([entry("r", "call-1")])  # the first payload, never the second
    log = read_log(open_store(url), "r")
    assert [type(e).__name__ for e in log] == ["PutEvent", "IncompleteEvent", "IncompleteEvent", "FreezeEvent"]
    assert all("conflicting re-put" in e.reason for e in log if isinstance(e, IncompleteEvent))


def test_versions_fence_and_retirement(tmp_path: Path) -> None:
    url = str(tmp_path)

    async def run() -> None:
        sink, source = TokenStore(url), TokenStore(url)
        await sink.begin_call("r", "call-1")
        await sink.put(entry("r", "call-1"))
        first = await source.freeze("r")
        assert not first.incomplete and first.version == 3  # intent, put, freeze
        again = await TokenStore(url).freeze("r")
        assert (again.snapshot_id, again.version) == (first.snapshot_id, first.version)
        await sink.put(entry("r", "call-1"))  # identical bytes after freeze: already durable, a no-op
        with pytest.raises(RolloutFencedError, match="frozen"):
            await sink.put(entry("r", "call-2"))
        with pytest.raises(RolloutFencedError):
            await sink.begin_call("r", "call-3")
        assert (await TokenStore(url).freeze("r")).version == first.version  # refusals wrote nothing
        await sink.mark_incomplete("r", "call-2")
        marked = await source.freeze("r")
        assert marked.incomplete and marked.version == first.version + 1 and marked.snapshot_id == first.snapshot_id
        assert not await source.drop("r", snapshot_id=first.snapshot_id, version=first.version)  # stale
        assert not await source.drop("r", snapshot_id="other", version=marked.version)
        assert await source.drop("r", snapshot_id=marked.snapshot_id, version=marked.version)
        assert await TokenStore(url).drop("r", snapshot_id=marked.snapshot_id, version=marked.version)  # again
        with pytest.raises(RolloutFencedError, match="retired"):
            await TokenStore(url).freeze("r")
        with pytest.raises(RolloutFencedError, match="retired"):
            await TokenStore(url).put(entry("r", "call-4"))
        await TokenStore(url).mark_incomplete("r", "late")  # a failure marker is never refused
        assert not await source.drop("r", snapshot_id="x", version=1) and not await source.drop("nope", snapshot_id="x",
                                                                                                version=1)

    asyncio.run(run())


def test_a_dangling_intent_is_named(tmp_path: Path) -> None:
    async def run() -> FrozenRecords:
        store = TokenStore(str(tmp_path))
        await store.begin_call("r", "lost")
        await store.begin_call("r", "kept")
        await store.put(entry("r", "kept"))
        return await TokenStore(str(tmp_path)).freeze_records("r")

    records = asyncio.run(run())
    assert records.incomplete and len(records.entries) == 1
    assert records.incomplete_reasons == ("call 'lost' began (intent, event 1) but has no entry",)


@pytest.mark.parametrize("backend", ["local", "seaweedfs"])
def test_the_fence_is_strict_under_racing_writers(backend: str, tmp_path: Path, request: pytest.FixtureRequest,
                                                  aws_env, new_bucket) -> None:
    """Writers on separate instances race a freeze: every acknowledged put is in the snapshot, every
    other put was refused, and the log is one gap-free sequence."""
    if backend == "local":
        url = str(tmp_path)
    else:
        server = request.getfixturevalue("seaweed")
        aws_env(server)
        url = f"s3://{new_bucket(server)}/tokens"
    writers, per_writer = 4, 12 if backend == "local" else 6
    acked: list[str] = []
    refused: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    started = threading.Barrier(writers + 1)

    def write(w: int) -> None:
        store = TokenStore(url)
        started.wait()
        for i in range(per_writer):
            call = f"w{w}-{i}"
            try:
                asyncio.run(store.put(entry("race", call)))
                with lock:
                    acked.append(call)
            except RolloutFencedError:
                with lock:
                    refused.append(call)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05 if backend == "local" else 0.3)
    snapshot = asyncio.run(TokenStore(url).freeze("race"))
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(acked) + len(refused) == writers * per_writer
    assert sorted(e.model_call_id for e in snapshot.entries) == sorted(acked)
    assert not snapshot.incomplete
    final = asyncio.run(TokenStore(url).freeze("race"))
    assert (final.snapshot_id, final.version) == (snapshot.snapshot_id, snapshot.version)
    kinds = Counter(type(e).__name__ for e in read_log(open_store(url), "race"))
    assert kinds == Counter({"PutEvent": len(acked), "FreezeEvent": 1})
    assert asyncio.run(TokenStore(url).drop("race", snapshot_id=snapshot.snapshot_id, version=snapshot.version))


def test_a_warm_put_is_one_create(tmp_path: Path) -> None:
    """The per-instance cache: after its first look at a rollout, a put sends exactly one store call."""
    calls: Counter[str] = Counter()
    inner = open_store(str(tmp_path))

    class Counting:
        url = inner.url

        def __getattr__(self, name: str) -> Any:
            attr = getattr(inner, name)
            if not callable(attr):
                return attr

            def call(*a: Any, **kw: Any) -> Any:
                calls[name] += 1
                return attr(*a, **kw)
            return call

    async def run() -> None:
        store = TokenStore(Counting())  # type: ignore[arg-type]
        await store.put(entry("r", "c0"))
        calls.clear()
        for i in range(1, 6):
            await store.put(entry("r", f"c{i}"))
        await store.put(entry("r", "c5"))  # a retry: no store call at all

    asyncio.run(run())
    assert calls == {"create_exclusive": 5}


# -- typed errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "../escape", "a/b", ".hidden", "x" * 201, "trailing.", "nul\x00", "sp ace"])
def test_a_bad_rollout_id_is_a_typed_error_naming_it(tmp_path: Path, bad: str) -> None:
    store = TokenStore(str(tmp_path))
    payload = entry("ok", "c").model_dump(mode="json") | {"rollout_id": bad}
    calls = [store.put(payload), store.mark_incomplete(bad, "c"), store.begin_call(bad, "c"), store.freeze(bad),
             store.freeze_records(bad), store.drop(bad, snapshot_id="s", version=1)]
    for call in calls:
        with pytest.raises(InvalidRecordError) as info:
            asyncio.run(call)
        assert repr(bad) in str(info.value)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_entries_json_cannot_hold_are_refused(tmp_path: Path) -> None:
    store = TokenStore(str(tmp_path))
    bad = entry("r", "c", generation=[1, 2])
    bad.generation_log_probs = [-0.5, float("-inf")]
    with pytest.raises(InvalidRecordError, match=r"generation_log_probs\[1\] is -inf"):
        asyncio.run(store.put(bad))
    late = entry("r", "c")
    late.created_at = float("inf")
    with pytest.raises(InvalidRecordError, match="created_at is inf"):
        asyncio.run(store.put(late))
    with pytest.raises(InvalidRecordError, match="expected Gym's TokenEntry"):
        asyncio.run(store.put(["not", "an", "entry"]))
    with pytest.raises(InvalidRecordError, match="model_call_id"):
        asyncio.run(store.put({"rollout_id": "r"}))


def test_damaged_logs_are_typed_errors_naming_the_object(tmp_path: Path) -> None:
    raw = open_store(str(tmp_path))
    asyncio.run(TokenStore(raw).put(entry("r", "c")))
    raw.create_exclusive("rollouts/newer/log/00000000000000000001.json", b'{"kind":"put","v":2}')
    raw.create_exclusive("rollouts/junk/log/00000000000000000001.json", b"not json")
    raw.create_exclusive("rollouts/holey/log/00000000000000000002.json", msgspec.json.encode(
        IncompleteEvent(model_call_id="c")))
    for rollout, error, words in (("newer", VersionError, "format version 2"),
                                  ("junk", CorruptSnapshotError, "not a token-capture log event"),
                                  ("holey", CorruptSnapshotError, "hole in the log")):
        with pytest.raises(error, match=words) as info:
            asyncio.run(TokenStore(raw).freeze_records(rollout))
        assert f"rollouts/{rollout}/log/0000000000000000000" in str(info.value)
    assert isinstance(read_log(raw, "r")[0], PutEvent)


def test_closed_store_refuses_and_close_is_idempotent(tmp_path: Path) -> None:
    async def run() -> None:
        store = TokenStore(str(tmp_path))
        await store.close()
        await store.close()
        with pytest.raises(Exception, match="is closed"):
            await store.put(entry("r", "c"))

    asyncio.run(run())


def test_sweep_retired_removes_only_old_retired_rollouts(tmp_path: Path) -> None:
    async def run() -> tuple[list[str], list[str]]:
        store = TokenStore(str(tmp_path))
        for rid in ("done", "open"):
            await store.put(entry(rid, "c"))
        snap = await store.freeze("done")
        assert await store.drop("done", snapshot_id=snap.snapshot_id, version=snap.version)
        return await store.sweep_retired(3600), await store.sweep_retired(0)

    kept, swept = asyncio.run(run())
    assert kept == [] and swept == ["done"]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["open"]


def test_a_sweep_cut_short_is_finished_by_the_next(tmp_path: Path) -> None:
    """Events go oldest first and the retire event last: a log cut short still shows its retirement."""
    async def run() -> list[str]:
        store = TokenStore(str(tmp_path))
        for i in range(3):
            await store.put(entry("done", f"c{i}"))
        snap = await store.freeze("done")
        assert await store.drop("done", snapshot_id=snap.snapshot_id, version=snap.version)
        await store.mark_incomplete("done", "late")  # a marker after retirement does not hide it
        log = tmp_path / "rollouts" / "done" / "log"
        for name in sorted(p.name for p in log.iterdir())[:2]:  # the crash: two events deleted
            (log / name).unlink()
        with pytest.raises(CorruptSnapshotError, match="hole in the log"):
            await TokenStore(str(tmp_path)).freeze_records("done")
        return await TokenStore(str(tmp_path)).sweep_retired(0)

    assert asyncio.run(run()) == ["done"]
    assert list((tmp_path / "rollouts").iterdir()) == []


def test_canonical_bytes_are_compact_sorted_json() -> None:
    """Gym's canonical form (orjson, sorted keys) byte for byte, except that msgspec spells a large
    exponent ``1e16`` where orjson writes ``1e+16``: the same JSON value either way."""
    import orjson

    e = entry("r", "c", text="héllo \u2028 \U0001f600")
    payload = e.model_dump(mode="json")
    assert canonical_bytes(payload) == orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    payload["created_at"] = 1e16
    assert canonical_bytes(payload) != orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    assert json.loads(canonical_bytes(payload)) == json.loads(orjson.dumps(payload))
    assert canonical_bytes(dict(reversed(list(payload.items())))) == canonical_bytes(payload)


# -- across processes -----------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from gymkit.token_store import TokenStore

    async def main():
        store = TokenStore(sys.argv[1])
        for payload in json.loads(sys.stdin.read()):
            await store.put(payload)
        print("acknowledged", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush, no exit handlers

    asyncio.run(main())
""")


@pytest.mark.parametrize("backend", ["local", "seaweedfs"])
def test_a_put_acknowledged_by_a_killed_process_is_visible_to_another(backend: str, tmp_path: Path,
                                                                      request: pytest.FixtureRequest, aws_env,
                                                                      new_bucket) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if backend == "local":
        url = str(tmp_path / "tokens")
    else:
        server = request.getfixturevalue("seaweed")
        aws_env(server)
        url = f"s3://{new_bucket(server)}/tokens"
        env.update(server.env_vars())
    entries = [entry("killed", f"call-{i}", prompt=list(range(i + 2))) for i in range(3)]
    proc = subprocess.run([sys.executable, "-c", _CHILD, url], input=json.dumps(dumps(entries)), text=True,
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == -9 and proc.stdout.strip() == "acknowledged", proc.stderr
    snapshot = asyncio.run(TokenStore(url).freeze("killed"))
    assert dumps(snapshot.entries) == dumps(entries) and not snapshot.incomplete


def test_puts_from_one_child_process_freeze_in_another(tmp_path: Path) -> None:
    url = str(tmp_path)

    async def run() -> tuple[TokenCaptureSnapshot, int, int]:
        writer, reader = ProcessTokenStore(url), ProcessTokenStore(url)
        try:
            pids = (await writer.child_pid(), await reader.child_pid())
            await writer.put(entry("x", "call-1"))
            await writer.put(entry("x", "call-2"))
            return await reader.freeze("x"), *pids
        finally:
            await writer.close()
            await reader.close()

    snapshot, writer_pid, reader_pid = asyncio.run(run())
    assert len({writer_pid, reader_pid, os.getpid()}) == 3
    assert [e.model_call_id for e in snapshot.entries] == ["call-1", "call-2"]


def test_the_module_works_without_nemo_gym() -> None:
    """Imports, puts dicts and freezes records with Gym unimportable; ``freeze`` names the pip command."""
    code = textwrap.dedent("""
        import asyncio, sys, tempfile
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "nemo_gym" or name.startswith("nemo_gym."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
        import gymkit.token_store as ts
        assert not any(m.startswith("nemo_gym") for m in sys.modules)
        async def main():
            store = ts.TokenStore(tempfile.mkdtemp())
            await store.put({"rollout_id": "r", "model_call_id": "c", "prompt_token_ids": [1],
                             "generation_token_ids": [2], "generation_log_probs": [-0.5]})
            records = await store.freeze_records("r")
            assert records.entries[0]["prompt_token_ids"] == [1] and not records.incomplete
            try:
                await store.freeze("r")
            except ModuleNotFoundError as exc:
                assert "pip install" in str(exc) and "freeze_records" in str(exc), exc
                print("ok")
        asyncio.run(main())
        assert not any(m.startswith("nemo_gym") for m in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_schemas_and_snapformat_never_import_nemo_gym() -> None:
    offenders = [str(p.relative_to(ROOT)) for pkg in ("schemas", "snapformat") for p in (ROOT / pkg).rglob("*.py")
                 if "import nemo_gym" in p.read_text() or "from nemo_gym" in p.read_text()]
    assert offenders == []
