"""The reference model's ledger through a commit and a restore, in process (no HTTP).

A restore keeps each call's token record as the bytes of its lineage row and decodes it only when
the call is replayed (issue 22: decoding every token record was most of the model's restore). These
tests hold what that must not change: the next commit writes the restored rows byte for byte, a
replayed call answers exactly as before, and bytes that are not a lineage are refused as
``ledger_mismatch``, never with another error.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymkit.checkpoint_dir import read_ledger_dir, write_ledger_dir
from gymkit.fence import ControlError
from gymkit.model_control import ModelAdmission, ModelCommitContext, ModelRestoreContext
from refgym import model_server
from refgym.api import ApiRefused, ModelCall, ModelReply
from refgym.model_server import RefModel
from schemas.gym_files import ledger_dir
from schemas.gym_records import AgentContinuationRoot
from snapformat.gym_dir import write_jsonl

NAME = "policy0"
ROLLOUTS, TURNS = 3, 3


def _call(i: int, t: int) -> ModelCall:
    return ModelCall(rollout_id=f"r{i}", attempt_index=0, capture_key=f"r{i}", model_call_id=f"c{t}",
                     parent_call_id=f"c{t - 1}" if t else None, turn_index=t, prompt_token_ids=[1 + t, 2 + i, 3] * 5)


async def _commit(model: RefModel, folder: Path, checkpoint_id: str) -> None:
    """Commit ``model``'s ledger into ``folder`` for the roots of every rollout's last call."""
    roots = [AgentContinuationRoot(rollout_id=f"r{i}", attempt_index=0, capture_key=f"r{i}",
                                   last_committed_model_call_id=f"c{TURNS - 1}", resource_state_revisions={})
             for i in range(ROLLOUTS)]
    index = write_jsonl(folder, "agent/agent0/continuations.jsonl", roots)
    await model.commit(ModelCommitContext(checkpoint_id=checkpoint_id, deadline_ts=time.time() + 60,
                                          checkpoint_dir=str(folder), continuation_indexes=(index,)))


async def _served_and_restored(first: Path) -> tuple[RefModel, dict[tuple[int, int], ModelReply], RefModel]:
    """A model that answered ROLLOUTS x TURNS calls and committed them into ``first``, and a fresh
    model that restored that commit."""
    model = RefModel(NAME, 7, ModelAdmission())
    replies = {(i, t): await model.call(_call(i, t)) for i in range(ROLLOUTS) for t in range(TURNS)}
    await _commit(model, first, "ck-1")
    restored = RefModel(NAME, 7, ModelAdmission())
    await restored.restore(ModelRestoreContext(checkpoint_id="rs-1", deadline_ts=time.time() + 60,
                                               checkpoint_dir=str(first)))
    return model, replies, restored


def _lineages(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((folder / ledger_dir(NAME)).glob("*.lineage.jsonl"))}


def test_a_restored_ledger_commits_its_rows_byte_for_byte_and_replays_as_before(tmp_path: Path) -> None:
    async def scenario() -> None:
        first, again = tmp_path / "first", tmp_path / "again"
        model, replies, restored = await _served_and_restored(first)
        await _commit(restored, again, "ck-2")
        assert _lineages(again) == _lineages(first) and len(_lineages(first)) == ROLLOUTS
        for (i, t), reply in replies.items():  # a retried call gets the recorded answer
            replayed = await restored.call(_call(i, t))
            assert replayed == msgspec.structs.replace(reply, replayed=True)
        assert restored.ledger_view() == model.ledger_view()

    asyncio.run(scenario())


def test_a_restored_call_asked_with_another_prompt_is_refused(tmp_path: Path) -> None:
    async def scenario() -> str:
        _model, _replies, restored = await _served_and_restored(tmp_path / "first")
        other = msgspec.structs.replace(_call(0, 1), prompt_token_ids=[9, 9, 9])
        with pytest.raises(ApiRefused) as refused:
            await restored.call(other)
        return str(refused.value)

    assert "different prompt" in asyncio.run(scenario())


def test_a_served_call_is_committed_as_the_bytes_it_was_recorded_as(tmp_path: Path) -> None:
    """A call is encoded once, when answered: each lineage row carries those bytes verbatim, and they
    decode to the answer the call gave (its token record, in Gym's field order)."""
    async def scenario() -> None:
        model = RefModel(NAME, 7, ModelAdmission())
        replies = {(i, t): await model.call(_call(i, t)) for i in range(ROLLOUTS) for t in range(TURNS)}
        await _commit(model, tmp_path, "ck-1")
        lineages = _lineages(tmp_path)
        for (i, t), reply in replies.items():
            held = model.calls[(f"r{i}", f"c{t}")].token
            assert isinstance(held, msgspec.Raw)
            row = lineages[f"r{i}.lineage.jsonl"].splitlines()[t]
            assert row.endswith(b'"token":' + bytes(held) + b"}")
            token = msgspec.json.decode(held)
            assert list(token)[:4] == ["schema_version", "rollout_id", "model_call_id", "model"]
            assert (token["response_id"], token["model_call_id"], token["generation_token_ids"], token["digest"]) == (
                reply.response_id, reply.model_call_id, reply.generation_token_ids, reply.digest)

    asyncio.run(scenario())


_ROW = (b'{"entry":{"rollout_id":"r0","attempt_index":0,"capture_key":"r0","model_call_id":"c0",'
        b'"parent_call_id":null,"turn_index":0,"model":"m","created_at":1.0},"token":{"rollout_id":"r0"}}')
_LINES = st.one_of(
    st.just(_ROW),
    st.binary(max_size=60),
    st.sampled_from([b"", b"  ", b"{}", b"[]", b"null", b'{"entry":{},"token":{}}',
                     _ROW.replace(b'"token":{"rollout_id":"r0"}', b'"token":5'),
                     _ROW.replace(b'"token":{"rollout_id":"r0"}', b'"token":"x"'),
                     _ROW.replace(b'"capture_key":"r0"', b'"capture_key":"r1"'),
                     _ROW.replace(b'"rollout_id":"r0"', b'"rollout_id":"../r0"', 1),
                     _ROW + b',"extra":1}', _ROW[:-1]]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINES, min_size=1, max_size=4))
def test_lineage_bytes_restore_or_are_refused_as_ledger_mismatch(tmp_path: Path, lines: list[bytes]) -> None:
    """Any bytes in a lineage file (with a manifest that vouches for them, so the reader gets past
    the digests): the restore loads them, or refuses them as ``ledger_mismatch`` naming the file."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one folder per example (the fixture's is shared)
    data = b"\n".join(lines) + b"\n"
    write_ledger_dir(folder, "ck-1", NAME, lineages={"r0": data}, storage_references=[], roots=[])
    model = RefModel(NAME, 7, ModelAdmission())

    async def restore() -> None:
        await model.restore(ModelRestoreContext(checkpoint_id="rs", deadline_ts=time.time() + 60,
                                                checkpoint_dir=str(folder)))

    try:
        asyncio.run(restore())
    except ControlError as exc:
        assert exc.code == "ledger_mismatch"
        assert "r0.lineage.jsonl" in str(exc), str(exc)  # the manifest vouches for the bytes: the file is named
        assert model.calls == {}  # a failed load changes nothing
    else:
        for (key, _call_id), call in model.calls.items():
            assert key == "r0"
            assert isinstance(call.fields(), dict)  # every token a JSON object


# -- lineages over any order of calls -------------------------------------------------------------------------
#: One step of a rollout's calls: the next call of its chain, a call whose parent is an earlier call
#: of the chain (a second child), a call naming a parent nobody made, a retried call, or a next
#: attempt whose first call continues one of the last attempt's calls (its call ids start again at
#: ``c0``: an id is unique within its capture key only).
_STEPS = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["next", "branch", "unresolved", "retry", "attempt",
                                                                    "odd_turn"]),
                            st.integers(0, 50)), min_size=1, max_size=25)


async def _serve_steps(model: RefModel, steps: list[tuple[int, str, int]]) -> dict[int, tuple[int, str]]:
    """Run ``steps`` against ``model``; returns each rollout's latest attempt and a call of it to root at."""
    made: dict[tuple[int, int], list[ModelCall]] = {}  # (rollout, attempt) -> its calls, in order
    attempt: dict[int, int] = {}
    for i, step, pick in steps:
        n = attempt.setdefault(i, 0)
        mine = made.setdefault((i, n), [])
        parent: str | None = mine[-1].model_call_id if mine else None
        if step == "retry" and mine:
            await model.call(mine[pick % len(mine)])
            continue
        if step == "branch" and mine:
            parent = mine[pick % len(mine)].model_call_id
        elif step == "unresolved":
            parent = "nobody-made-this"
        elif step == "attempt" and mine:
            attempt[i] = n = n + 1
            parent, mine = mine[pick % len(mine)].model_call_id, made.setdefault((i, n), [])
        key = f"r{i}" if n == 0 else f"r{i}-a{n}"
        call = ModelCall(rollout_id=f"r{i}", attempt_index=n, capture_key=key, model_call_id=f"c{len(mine)}",
                         parent_call_id=parent, turn_index=pick % 3 if step == "odd_turn" else len(mine),
                         prompt_token_ids=[1 + len(mine), 2 + i, pick])
        await model.call(call)
        mine.append(call)
    return {i: (n, made[(i, n)][steps[-1][2] % len(made[(i, n)])].model_call_id)
            for i, n in attempt.items() if made.get((i, n))}


def _root_rows(roots: dict[int, tuple[int, str]]) -> list[AgentContinuationRoot]:
    return sorted((AgentContinuationRoot(rollout_id=f"r{i}", attempt_index=n, capture_key=f"r{i}" if n == 0 else f"r{i}-a{n}",
                                         last_committed_model_call_id=call_id, resource_state_revisions={})
                   for i, (n, call_id) in roots.items()), key=lambda r: (r.capture_key, r.last_committed_model_call_id))


def _rows_of(lineages: dict[str, list[Any]]) -> dict[str, list[bytes]]:
    return {key: [c.row for c in calls] for key, calls in lineages.items()}


async def _commit_roots(model: RefModel, folder: Path, roots: dict[int, tuple[int, str]]) -> None:
    index = write_jsonl(folder, "agent/agent0/continuations.jsonl", _root_rows(roots))
    await model.commit(ModelCommitContext(checkpoint_id="ck", deadline_ts=time.time() + 60,
                                          checkpoint_dir=str(folder), continuation_indexes=(index,)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
def test_any_order_of_calls_commits_lineages_a_restore_reads_back(tmp_path: Path,
                                                                  steps: list[tuple[int, str, int]]) -> None:
    """Whatever order of calls, branches, unknown parents, retries and attempts the model saw, the
    lineages taken by position where keys hold one chain are those a walk of every root finds;
    each lineage file's ``sha256``, ``rows`` and ``bytes`` in the manifest are those of the file,
    and a restore reads back the very calls the model served (entries and token bytes)."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    model = RefModel(NAME, 7, ModelAdmission())

    async def scenario() -> None:
        roots = await _serve_steps(model, steps)
        assert roots  # the first step always makes a call
        rows = _root_rows(roots)
        assert _rows_of(model.lineages(rows)) == _rows_of(model.lineages(rows, walk=True))
        await _commit_roots(model, folder, roots)

    asyncio.run(scenario())
    manifest = msgspec.json.decode((folder / ledger_dir(NAME) / "manifest.json").read_bytes())
    for key, rollout in manifest["rollouts"].items():
        (name, digest), = rollout["files"].items()
        data = (folder / ledger_dir(NAME) / name).read_bytes()
        assert (digest, rollout["rows"], rollout["bytes"]) == (
            hashlib.sha256(data).hexdigest(), len(data.splitlines()), len(data)), key
    restored = RefModel(NAME, 7, ModelAdmission())
    asyncio.run(restored.restore(ModelRestoreContext(checkpoint_id="rs", deadline_ts=time.time() + 60,
                                                     checkpoint_dir=str(folder))))
    assert restored.calls and all(call == model.calls[key] for key, call in restored.calls.items())


def test_a_lineage_follows_its_chain_into_the_attempt_it_continues(tmp_path: Path) -> None:
    """A next attempt continuing an earlier attempt's last call: the commit writes the earlier
    attempt's whole chain, though the next attempt's call ids repeat its ids (the walk stopped at
    the first repeated id when it remembered ids alone)."""
    steps = [(i, "next", 0) for i in range(2) for _ in range(4)] + [(1, "attempt", 3), (1, "next", 0)]
    model = RefModel(NAME, 7, ModelAdmission())

    async def scenario() -> None:
        await _serve_steps(model, steps)
        await _commit_roots(model, tmp_path, {0: (0, "c3"), 1: (1, "c1")})

    asyncio.run(scenario())
    lineages = _lineages(tmp_path)
    assert sorted(lineages) == ["r0.lineage.jsonl", "r1-a1.lineage.jsonl", "r1.lineage.jsonl"]
    ids = [msgspec.json.decode(row)["entry"]["model_call_id"] for row in lineages["r1.lineage.jsonl"].splitlines()]
    assert ids == ["c0", "c1", "c2", "c3"]
    ids = [msgspec.json.decode(row)["entry"]["model_call_id"] for row in lineages["r1-a1.lineage.jsonl"].splitlines()]
    assert ids == ["c0", "c1"]


def test_chained_lineages_are_taken_by_position_also_across_a_restored_attempt(tmp_path: Path, monkeypatch) -> None:
    """Rollouts whose calls each form one chain, one of them continued as attempt 1 on a restored
    model: the commit takes every lineage by position (no call-by-call walk), and writes what the
    walk writes."""
    steps = [(i, "next", 0) for i in range(3) for _ in range(3)]
    model = RefModel(NAME, 7, ModelAdmission())
    restored = RefModel(NAME, 7, ModelAdmission())
    walks: list[str] = []
    walk = RefModel._lineage

    def counted(self: RefModel, last: Any) -> Any:
        walks.append(last.entry.capture_key)
        return walk(self, last)

    async def scenario() -> None:
        await _serve_steps(model, steps)
        await _commit_roots(model, tmp_path / "first", {i: (0, "c2") for i in range(3)})
        await restored.restore(ModelRestoreContext(checkpoint_id="rs", deadline_ts=time.time() + 60,
                                                   checkpoint_dir=str(tmp_path / "first")))
        for t in range(2):  # attempt 1 of r1 continues after its c2
            await restored.call(ModelCall(rollout_id="r1", attempt_index=1, capture_key="r1-a1", model_call_id=f"c{3 + t}",
                                          parent_call_id=f"c{2 + t}", turn_index=3 + t, prompt_token_ids=[5, t]))
        monkeypatch.setattr(RefModel, "_lineage", counted)
        await _commit_roots(restored, tmp_path / "again", {0: (0, "c1"), 1: (1, "c4"), 2: (0, "c2")})
        assert walks == []
        rows = _root_rows({0: (0, "c1"), 1: (1, "c4"), 2: (0, "c2")})
        assert _rows_of(restored.lineages(rows)) == _rows_of(restored.lineages(rows, walk=True))
        assert len(walks) == 3  # the oracle walked

    asyncio.run(scenario())
    first, again = _lineages(tmp_path / "first"), _lineages(tmp_path / "again")
    assert again["r1.lineage.jsonl"] == first["r1.lineage.jsonl"]  # attempt 0's whole chain, as restored
    assert again["r0.lineage.jsonl"] == b"".join(first["r0.lineage.jsonl"].splitlines(keepends=True)[:2])
    assert [msgspec.json.decode(row)["entry"]["model_call_id"] for row in again["r1-a1.lineage.jsonl"].splitlines()] == [
        "c3", "c4"]


def test_commits_hash_each_row_once_and_every_prefix_gets_its_files_digest(tmp_path: Path, monkeypatch) -> None:
    """A capture key's lineage takes its SHA-256 from the key's running digest: across commits each
    row is hashed once (the history is not hashed again at every pause), a commit for an earlier
    call than one already hashed hashes its prefix whole, and every folder's manifest holds its
    files' digests and row counts (its reader checks them against the bytes)."""
    hashed: list[int] = []  # the bytes given to the model's digests, call by call

    class CountingSha:
        def __init__(self, data: bytes = b"") -> None:
            self._sha = hashlib.sha256(data)
            hashed.append(len(data))

        def update(self, data: bytes) -> None:
            hashed.append(len(data))
            self._sha.update(data)

        def hexdigest(self) -> str:
            return self._sha.hexdigest()

    monkeypatch.setattr(model_server, "hashlib", SimpleNamespace(sha256=CountingSha))
    model = RefModel(NAME, 7, ModelAdmission())

    def rows(last: str) -> dict[str, list[bytes]]:
        return _rows_of(model.lineages(_root_rows({i: (0, last) for i in range(ROLLOUTS)}), walk=True))

    def size(last: str, since: int = 0) -> int:
        """The bytes of every lineage's rows at call ``last``, from row ``since`` on."""
        return sum(len(row) for v in rows(last).values() for row in v[since:])

    async def commit(name: str, last: str) -> int:
        """Commit every rollout at call ``last`` into ``name``; the bytes hashed for it."""
        before = sum(hashed)
        await _commit_roots(model, tmp_path / name, {i: (0, last) for i in range(ROLLOUTS)})
        manifest, _, files = read_ledger_dir(tmp_path / name / ledger_dir(NAME))  # checks digests and rows
        assert {k: p.read_bytes() for k, p in files.items()} == {k: b"".join(v) for k, v in rows(last).items()}
        assert {k: r.rows for k, r in manifest.rollouts.items()} == {k: len(v) for k, v in rows(last).items()}
        return sum(hashed) - before

    async def scenario() -> None:
        for t in range(2):
            for i in range(ROLLOUTS):
                await model.call(_call(i, t))
        assert await commit("first", "c1") == size("c1") > 0
        for i in range(ROLLOUTS):
            await model.call(_call(i, 2))
        assert await commit("later", "c2") == size("c2", since=2) > 0  # only the rows recorded since
        assert await commit("again", "c2") == 0
        assert await commit("earlier", "c1") == size("c1")  # behind the running digest: hashed whole

    asyncio.run(scenario())


def test_a_restored_lineage_line_without_its_newline_is_committed_with_one(tmp_path: Path) -> None:
    data = _ROW + b"\n" + _ROW.replace(b'"c0"', b'"c1"').replace(b'"parent_call_id":null', b'"parent_call_id":"c0"')
    write_ledger_dir(tmp_path / "first", "ck-1", NAME, lineages={"r0": data}, storage_references=[], roots=[])
    model = RefModel(NAME, 7, ModelAdmission())

    async def scenario() -> None:
        await model.restore(ModelRestoreContext(checkpoint_id="rs", deadline_ts=time.time() + 60,
                                                checkpoint_dir=str(tmp_path / "first")))
        await _commit_roots(model, tmp_path / "again", {0: (0, "c1")})

    asyncio.run(scenario())
    assert _lineages(tmp_path / "again") == {"r0.lineage.jsonl": data + b"\n"}
