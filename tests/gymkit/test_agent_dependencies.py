"""gymkit.agent_dependencies: the agents' dependency indexes, read once for the resources servers of
a process, answer each server what a read of its own would."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gymkit import agent_dependencies
from gymkit.agent_dependencies import AgentDependencies
from gymkit.checkpoint_dir import write_agent_dir
from gymkit.fence import ControlError
from schemas.errors import SnapshotError
from schemas.gym_files import CONTINUATIONS_NAME, AgentBoundaryRecord, agent_instance_dir

SERVERS = ("tools-a", "tools-b")


def record(rid: str, revisions: dict[str, int], call: str | None = "call-0", n: int = 0) -> AgentBoundaryRecord:
    return AgentBoundaryRecord(rollout_id=rid, attempt_index=n, boundary_index=1, turn_index=1,
                               last_committed_model_call_id=call, resource_state_revisions=revisions)


def committed(ckdir: Path, shift: int = 0) -> None:
    """Two agent instances: rooted records (a model call committed) and one without a root, whose
    revisions come from its archive member."""
    write_agent_dir(ckdir, "save-1", "agent-0", [record("r0", {"tools-a": 1 + shift}),
                                                 record("r1", {"tools-a": 2 + shift, "tools-b": 5 + shift})])
    write_agent_dir(ckdir, "save-1", "agent-1", [record("r2", {"tools-b": 7 + shift}, call=None)])


def expected(shift: int = 0) -> dict[str, dict[tuple[str, int], int]]:
    return {"tools-a": {("r0", 0): 1 + shift, ("r1", 0): 2 + shift},
            "tools-b": {("r1", 0): 5 + shift, ("r2", 0): 7 + shift}}


def index_of(ckdir: Path, instance: str = "agent-0") -> Path:
    return ckdir / agent_instance_dir(instance) / CONTINUATIONS_NAME


def test_each_server_gets_what_the_agents_saw_of_it(tmp_path: Path) -> None:
    committed(tmp_path)
    deps = AgentDependencies()
    for server in SERVERS:
        assert deps.revisions(str(tmp_path), server) == expected()[server]
    assert deps.revisions(str(tmp_path), "tools-never-named") == {}
    assert AgentDependencies().revisions(str(tmp_path / "no-agents"), "tools-a") == {}
    # an answer is the caller's own: changing it changes nothing for the next server
    deps.revisions(str(tmp_path), "tools-a").clear()
    assert deps.revisions(str(tmp_path), "tools-a") == expected()["tools-a"]


def test_servers_sharing_an_instance_read_the_indexes_once(tmp_path: Path) -> None:
    committed(tmp_path)
    deps = AgentDependencies()
    assert deps.revisions(str(tmp_path), "tools-a") == expected()["tools-a"]
    # The index changed under a manifest that did not: a read of its own checks the reference and
    # refuses it; the server sharing the first read is answered from it (what that manifest binds).
    index = index_of(tmp_path)
    index.write_bytes(index.read_bytes().replace(b'"tools-a":2', b'"tools-a":9'))
    with pytest.raises(SnapshotError, match=CONTINUATIONS_NAME):
        AgentDependencies().revisions(str(tmp_path), "tools-b")
    assert deps.revisions(str(tmp_path), "tools-b") == expected()["tools-b"]


def test_a_new_commit_of_the_folder_is_read_again(tmp_path: Path) -> None:
    committed(tmp_path)
    deps = AgentDependencies()
    assert deps.revisions(str(tmp_path), "tools-a") == expected()["tools-a"]
    committed(tmp_path, shift=10)  # new manifests: the key changes
    assert deps.revisions(str(tmp_path), "tools-a") == expected(10)["tools-a"]
    assert deps.revisions(str(tmp_path), "tools-b") == expected(10)["tools-b"]


def test_a_disagreement_refuses_only_the_server_it_names(tmp_path: Path) -> None:
    write_agent_dir(tmp_path, "save-1", "agent-0", [record("r0", {"tools-a": 2, "tools-b": 1})])
    write_agent_dir(tmp_path, "save-1", "agent-1", [record("r0", {"tools-a": 3, "tools-b": 1})])
    deps = AgentDependencies()
    with pytest.raises(ControlError) as err:
        deps.revisions(str(tmp_path), "tools-a")
    assert err.value.code == "resource_revision_mismatch"
    assert "'r0' attempt 0" in err.value.detail and "revisions 2 and 3 of 'tools-a'" in err.value.detail
    assert deps.revisions(str(tmp_path), "tools-b") == {("r0", 0): 1}


def test_servers_asking_at_once_share_one_read(tmp_path: Path, monkeypatch) -> None:
    committed(tmp_path)
    folders_read: list[Path] = []
    real = agent_dependencies.iter_resource_dependencies

    def counted(folder: Path):  # the only reader of the agents' folders the module calls
        folders_read.append(Path(folder))
        time.sleep(0.05)  # long enough that every thread asks while the first read runs
        return real(folder)

    monkeypatch.setattr(agent_dependencies, "iter_resource_dependencies", counted)
    deps = AgentDependencies()
    asked = SERVERS * 4
    start = threading.Barrier(len(asked))
    answers: list[dict[tuple[str, int], int] | None] = [None] * len(asked)

    def ask(i: int) -> None:
        start.wait(timeout=10)
        answers[i] = deps.revisions(str(tmp_path), asked[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == [expected()[s] for s in asked]
    assert sorted(folders_read) == sorted({p.parent for p in (tmp_path / "agent").rglob("manifest.json")})
    # instances of their own each read every folder
    for server in SERVERS:
        AgentDependencies().revisions(str(tmp_path), server)
    assert len(folders_read) == 3 * 2


def test_a_failed_read_is_kept_for_no_one(tmp_path: Path) -> None:
    committed(tmp_path)
    index = index_of(tmp_path)
    good = index.read_bytes()
    index.write_bytes(good + b"\n{}\n")
    deps = AgentDependencies()
    for server in SERVERS:  # each caller reads, and reports, for itself
        with pytest.raises(SnapshotError, match=CONTINUATIONS_NAME):
            deps.revisions(str(tmp_path), server)
    index.write_bytes(good)
    assert deps.revisions(str(tmp_path), "tools-a") == expected()["tools-a"]


def test_only_the_last_dir_is_kept(tmp_path: Path) -> None:
    dirs = [tmp_path / f"gym-{i}" for i in range(2)]
    for d in dirs:
        committed(d)
    deps = AgentDependencies()
    for d in dirs:
        deps.revisions(str(d), "tools-a")
    for d in dirs:  # the same manifests, indexes that no longer match them
        index = index_of(d)
        index.write_bytes(index.read_bytes().replace(b'"tools-a":1', b'"tools-a":8'))
    assert deps.revisions(str(dirs[1]), "tools-a") == expected()["tools-a"]  # kept: answered from the read
    with pytest.raises(SnapshotError):  # dropped: read again, and the read checks
        deps.revisions(str(dirs[0]), "tools-a")
