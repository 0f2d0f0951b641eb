"""The Single Controller on the session's Ray with the four real Gym servers: saves in both write
modes, failed saves that abort and let the run go on, and the restore's choices (topology,
corruption, empty store, which continuations start over). Every run's final rows are compared with
an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import ray
from harness import CONFIG, RUN_S, WORKLOAD, InRayJob

from coordinator.errors import TooManyFailuresError
from devtools.accounting import content, trained_once
from devtools.gym_fleet import wait_until
from gymkit.checkpoint_dir import read_agent_dir
from schemas.errors import SnapshotError, TopologyMismatchError
from schemas.gym_files import agent_instance_dir
from schemas.topology import manifest_fingerprint
from snapformat import SnapshotStore, open_snapshot, verify_snapshot

pytestmark = pytest.mark.usefixtures("tq_runtime")
DISCARD_MODEL_SLOW_MS = 400
IDS = [s.rollout_id for i in range(WORKLOAD.prompts) for s in WORKLOAD.group(i)]


def check_finished(job: InRayJob, reference_rows) -> None:
    assert content(job.call("data_plane_tables")) == reference_rows
    assert trained_once(msgspec.to_builtins(job.call("records")), IDS) == []


def check_store(store: SnapshotStore) -> list[int]:
    seqs = [c.sequence for c in store.list()]
    for seq in seqs:
        report = verify_snapshot(store.open(seq))
        assert report.ok, report.problems
    return seqs


@pytest.mark.parametrize("mode", ["background", "in_pause"])
def test_a_run_with_saves_ends_like_an_uninterrupted_one(mode, fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, config=msgspec.structs.replace(CONFIG, write_mode=mode))
    assert job.setup() is None  # an empty store: start fresh
    outcome = job.run()
    assert outcome.done
    published = [s for s in outcome.saves if s.published]
    assert published and all(s.ok and s.error is None for s in outcome.saves)
    for s in published:  # every step timed, the pause measured
        assert {"flush_acks", "prepare", "gym_commit", "gym_adopt", "cut", "resume", "write", "publish"} <= set(s.steps_s)
        assert 0 < s.pause_s
        if mode == "background":  # the bytes were written after the resume, which ended the pause: the write
            # found the pause measured (a sum of step times against the pause flaked on a loaded machine)
            assert open_snapshot(s.snapshot_url).manifest.timings_s["pause_s"] == s.pause_s
    newest = store.latest()
    assert newest is not None and newest.manifest.topology_fingerprint == manifest_fingerprint(job.gym.fingerprint())
    timings = newest.manifest.timings_s
    assert ("pause_s" in timings) == (mode == "background") and "prepare_s" in timings
    commit = newest.manifest.gym_commit  # Gym's files are the snapshot's Gym parts, one per exported participant
    assert [(p.component, p.name) for p in commit.participants] == [
        ("responses_api_agents", "agent0"), ("responses_api_models", "policy0"), ("resources_servers", "tools")]
    assert all(p.part_prefix is not None and p.part_prefix.startswith("gym/") for p in commit.participants)
    assert len(check_store(store)) <= CONFIG.rollout_checkpointing.keep_latest_k
    check_finished(job, reference_rows)
    job.kill()
    token_nowhere(fleet.token, [tmp_path / "store", fleet.workdir, Path("/tmp/ray/session_latest/logs")])


def token_nowhere(token: str, roots: list[Path]) -> None:
    """The control token is in no snapshot file, no server log, no Ray log (only in its own file)."""
    needle = token.encode()
    seen = 0
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path.name != "token":
                seen += 1
                assert needle not in path.read_bytes(), f"the control token leaked into {path}"
    assert seen > 10  # the scan looked at something


def _faults(job: InRayJob, **plan) -> None:
    """Switch on faults in the ``tools`` resources server (started with ``--test-faults``)."""
    r = httpx.post(f"{job.gym.servers.resource.url}/test/faults", json=plan)
    assert r.status_code == 200, r.text


def _all_idle(job: InRayJob) -> None:
    """Every Gym server was resumed: no checkpoint is active anywhere."""
    for c in job.gym.clients:
        caps = c.capabilities()
        assert (caps.name, caps.phase, caps.active_checkpoint_id) == (caps.name, "idle", None)


def test_a_commit_error_aborts_that_save_and_the_run_goes_on(fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, test_faults=True)
    job.setup()
    _faults(job, commit_errors=1)
    outcome = job.run()
    assert outcome.done
    failed = outcome.saves[0]
    assert not failed.published and "resources-checkpoint/commit of resources_servers tools" in failed.error
    assert "500" in failed.error
    later = job.call("save_now", True)  # a later save succeeds
    assert later.published, later.error
    assert failed.checkpoint_id not in {store.open(c.sequence).manifest.gym_commit.checkpoint_id for c in store.list()}
    _all_idle(job)  # every server was resumed by the abort
    check_store(store)
    check_finished(job, reference_rows)
    job.kill()


def test_a_prepare_that_hangs_past_the_deadline_is_aborted(fleet, tmp_path: Path, reference_rows) -> None:
    """The ``tools`` server's export hangs past the prepare deadline: the actor gives up at the
    deadline (not when the server finally answers) and that save is aborted; the run goes on.

    New under Gym's protocol: a prepare is never cancelled, so the hung server goes on preparing that
    checkpoint, and the saves tried meanwhile fail too: 409 ``checkpoint_conflict`` from it, or
    ``agent_prepare_incomplete`` from the agent (a turn waiting for the closed ``tools`` server cannot
    end at a boundary). When it ends, past its deadline with sessions left to export, it fails
    (``resources_checkpoint_error``), back to ``idle`` with its admission closed (CONTROL.md §2); the
    next save's resume (or abort) reopens it under a fresh id, so every rollout still finishes."""
    store = SnapshotStore(str(tmp_path / "store"))
    hang_s, prepare_timeout_s = 5.0, 2.0
    config = CONFIG.with_rollout_checkpointing(max_consecutive_failures=1000,
                                               gym={"prepare_timeout_s": prepare_timeout_s})
    job = InRayJob(fleet, store.url, config=config, test_faults=True)
    job.setup()
    # The saves tried while the hung server blocks them fail, some only at their 2 s deadline, and
    # the run moves only between saves (0.3 s apart): on a loaded machine it needs more than RUN_S.
    running = job.ctl.run.remote(3 * RUN_S)
    wait_until(lambda: any(s.published for s in job.call("saves_since", 0)), "a first published save")
    _faults(job, prepare_hang_s=hang_s, prepare_hangs=1)  # the next save's export of a session hangs
    outcome = ray.get(running)
    assert outcome.done
    published = [i for i, s in enumerate(outcome.saves) if s.published]
    failed = [i for i, s in enumerate(outcome.saves) if not s.published]
    assert failed and published and published[0] < failed[0], [s.error for s in outcome.saves]
    # (saves succeed again after it: the run may end first, so the explicit save_now below proves it)
    first = outcome.saves[failed[0]]
    assert "resources-checkpoint/prepare of resources_servers tools" in first.error
    assert "deadline" in first.error, first.error  # given up at the deadline, not when the server finally answered
    assert first.pause_s < hang_s
    for i in failed[1:]:  # the saves tried while the server still prepared the first one, or was still closed
        error = outcome.saves[i].error
        assert "checkpoint_conflict" in error or "agent_prepare_incomplete" in error, error
    # The run may end while the hung server still prepares the aborted checkpoint. Once that prepare
    # has ended (failed, or prepared late and holding the old id: the next prepare resumes it first,
    # gymkit.gym_fleet's dangling participants), a save succeeds again.
    wait_until(lambda: job.gym.resource.capabilities().phase != "preparing", "the hung prepare to end",
               timeout=hang_s + 30)
    later = job.call("save_now", True)
    assert later.published, later.error
    _all_idle(job)
    check_store(store)
    check_finished(job, reference_rows)
    job.kill()


def test_max_consecutive_failures_stops_the_run_clearly(fleet, tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, config=CONFIG.with_rollout_checkpointing(max_consecutive_failures=2),
                   test_faults=True)
    job.setup()
    _faults(job, commit_errors=1000)
    with pytest.raises(TooManyFailuresError, match=r"2 consecutive save attempts failed "
                                                   r".*resources-checkpoint/commit of resources_servers tools"):
        job.run()
    assert store.list() == []
    job.kill()


def _run_with_snapshots(fleet, store: SnapshotStore, stop_after: int, interval_s: float = 0.05) -> None:
    """A job that publishes at least ``stop_after`` snapshots and is then killed mid-run."""
    job = InRayJob(fleet, store.url, crash_at="save.begin", occurrence=stop_after + 1, kill_gym=True,
                   config=CONFIG.with_rollout_checkpointing(snapshot_attempt_interval_s=interval_s))
    job.setup()
    with pytest.raises(ray.exceptions.RayActorError):
        job.run()
    job.kill()
    assert len(store.list()) >= stop_after


def test_restore_refuses_another_topology_naming_both(fleet, tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    _run_with_snapshots(fleet, store, 1)
    saved = store.latest().manifest.topology_fingerprint
    other = InRayJob(fleet, store.url, gym_options={"model_name": "policy1"})  # another name: another topology
    with pytest.raises(TopologyMismatchError) as err:
        other.setup()
    assert saved in str(err.value) and "the running topology is sha256:" in str(err.value)
    other.kill()


def test_a_corrupt_newest_snapshot_falls_back_to_the_one_before(fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    _run_with_snapshots(fleet, store, 2)
    newest = store.latest()
    # A file only the newest holds: a training segment written by its save (an incremental save
    # lists the older ones again, so a damaged shared object would spoil both), else its ledger.
    older = {e.object for e in store.open(newest.sequence - 1).manifest.files}
    victim = next((e for e in newest.manifest.files if e.kind == "training_rows" and e.object not in older),
                  None) or next(e for e in newest.manifest.files if e.kind == "recovery_ledger")
    path = Path(newest.store.local_path(newest.key(victim)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    job = InRayJob(fleet, store.url)
    restored = job.setup()
    assert restored.sequence == newest.sequence - 1
    assert len(restored.skipped) == 1 and f"snapshot {newest.sequence}" in restored.skipped[0]
    assert "checksum" in restored.skipped[0]
    assert job.run().done
    check_finished(job, reference_rows)
    job.kill()


def _parked(snap) -> tuple[list, set[tuple[str, int]], set[tuple[str, int]]]:
    """Gym's own account of a snapshot's parked executions: the agent's boundary records, and the
    continuations (a model call committed) that depend on the restart-only ``sandbox`` and those that do not."""
    (agent,) = [p for p in snap.manifest.gym_commit.participants if p.component == "responses_api_agents"]
    _, records, roots = read_agent_dir(Path(snap.url) / agent.part_prefix)
    on_sandbox = {(r.rollout_id, r.attempt_index) for r in roots if "sandbox" in r.resource_state_revisions}
    return records, on_sandbox, {(r.rollout_id, r.attempt_index) for r in roots} - on_sandbox


def test_a_restore_discards_exactly_the_continuations_on_the_restart_only_server(fleet, tmp_path: Path,
                                                                                 reference_rows) -> None:
    """After a restore every unfinished rollout is sent again as run n + 1 (Gym's ``/run`` of n + 1).
    Those whose continuation depends on the restart-only ``sandbox`` (its state is gone with the old
    process) are discarded first and start over; the others continue after their committed model
    call. Checked against Gym's own continuation index in the snapshot and against the final rows:
    the turns before the boundary of a continued rollout keep the old run's capture key."""
    store = SnapshotStore(str(tmp_path / "store"))
    # Slow model calls: at the harness's 80 ms the run lasts about 1 s and holds 2 saves, and 1 run in 4
    # published no snapshot with a rollout parked after a sandbox call. At 400 ms it lasts about 3.4 s,
    # and each of its 7 snapshots held one (8 runs of 8). The rows do not depend on the timing.
    first = InRayJob(fleet, store.url, model_slow_ms=DISCARD_MODEL_SLOW_MS)
    first.setup()
    running = first.ctl.run.remote(RUN_S)

    def both_kinds() -> bool:  # the newest snapshot holds a continuation on the sandbox (others are checked too)
        try:
            snap = store.latest()
            if snap is not None and _parked(snap)[1]:
                return True
        except (OSError, SnapshotError):  # removed by the store's GC while read: the next one
            pass
        ended, _ = ray.wait([running], timeout=0)
        assert not ended, "the run ended before a snapshot held a continuation on the sandbox"
        return False

    wait_until(both_kinds, "a snapshot with continuations on and off the sandbox", RUN_S)
    first.kill()  # the whole job, as a machine failure
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(running)
    snap = store.latest()
    records, on_sandbox, elsewhere = _parked(snap)
    assert on_sandbox, "a newer snapshot was published as the job was killed"
    job = InRayJob(fleet, store.url)
    restored = job.setup()
    assert restored.sequence == snap.sequence
    continued = {c.rollout_id: c for c in restored.continued}
    assert sorted(continued) == sorted(r.rollout_id for r in records)  # every parked execution, once
    uses_sandbox = {s.rollout_id for i in range(WORKLOAD.prompts) for s in WORKLOAD.group(i) if "sandbox" in s.tools}
    for rec in records:
        c = continued[rec.rollout_id]
        assert (c.attempt_index, c.after_call) == (rec.attempt_index + 1, rec.last_committed_model_call_id)
        discard = (rec.rollout_id, rec.attempt_index) in on_sandbox
        assert discard == (c.after_call is not None and rec.rollout_id in uses_sandbox)
        assert (c.restart_only, c.discarded) == ((["sandbox"], True) if discard else ([], False)), c
    assert any(c.discarded for c in continued.values()), restored.continued
    # Those off the sandbox continue after their call (a run may park none of them: then none to check).
    assert all(not c.discarded for c in continued.values() if (c.rollout_id, c.attempt_index - 1) in elsewhere)
    assert job.run().done
    check_finished(job, reference_rows)
    ledger = msgspec.to_builtins(job.call("records"))["ledger"]
    runs = {(r["rollout_id"], r["attempt_index"]): r["state"] for r in ledger if r["record"] == "rollout_attempt"}
    tokens = job.call("data_plane_tables")["token_capture_rows"].to_pylist()
    for rid, c in continued.items():  # run n + 1 was sent and stored; run n abandoned
        assert runs[(rid, c.attempt_index)] == "sealed" and runs[(rid, c.attempt_index - 1)] == "abandoned"
        keys = {int(row["model_call_id"].removeprefix("call-")): row["capture_key"] for row in tokens
                if row["rollout_id"] == rid}
        new_key = f"{rid}-a{c.attempt_index}"
        if c.after_call is None or c.discarded:  # started over: every turn is run n + 1's
            assert set(keys.values()) == {new_key}, (rid, keys)
        else:  # continued after its boundary: the turns before it are the old run's
            boundary = int(c.after_call.removeprefix("call-"))
            assert all((key != new_key) == (t <= boundary) for t, key in keys.items()), (rid, c, keys)
    job.kill()


def test_on_an_object_store_saves_and_restores_with_no_local_path(seaweed, aws_env, new_bucket, tmp_path: Path,
                                                                   reference_rows) -> None:
    """Store on SeaweedFS: Gym's servers write their files into a local staging folder, which the
    publisher uploads into the draft as the Gym parts; a restore downloads them (checked) into a
    staging folder again."""
    from devtools.gym_fleet import new_fleet

    aws_env(seaweed)
    store = SnapshotStore(f"s3://{new_bucket(seaweed)}/run")
    env = {"runtime_env": {"env_vars": seaweed.env_vars()}}
    fleet = new_fleet(tmp_path / "fleet")  # fresh interpreters: they inherit the S3 variables
    try:
        first = InRayJob(fleet, store.url, crash_at="save.begin", occurrence=3, actor_options=env,
                         config=CONFIG.with_rollout_checkpointing(snapshot_attempt_interval_s=0.05))
        first.setup()
        with pytest.raises(ray.exceptions.RayActorError):
            first.run()
        first.kill()
        newest = store.latest()
        assert newest is not None and newest.url.startswith("s3://")
        assert all(e.path.startswith(("gym/", "tq/", "controller/")) for e in newest.manifest.files)
        assert {p.part_prefix for p in newest.manifest.gym_commit.participants} == {
            f"gym/{agent_instance_dir('agent0')}", "gym/model-ledger/policy0", "gym/resources/tools"}
        job = InRayJob(fleet, store.url, actor_options=env)
        restored = job.setup()
        assert restored.sequence == newest.sequence and restored.snapshot_url.startswith("s3://")
        assert job.run().done
        check_store(store)
        check_finished(job, reference_rows)
        job.kill()
    finally:
        fleet.close()


def test_gym_files_staged_outside_a_local_store_survive_a_crash_and_restore(fleet, tmp_path: Path,
                                                                          reference_rows) -> None:
    """``gym_staging="always"`` on a local store: Gym commits into the staging folder (a RAM-backed
    one in production) and adoption copies the files into the draft after the resume. A crash after
    Gym's commit and before publish leaves only that save's staging folder, which no snapshot names;
    the restored run ends like an uninterrupted one, and every finished save removed its folder."""
    store = SnapshotStore(str(tmp_path / "store"))
    staging = tmp_path / "staging"
    config = msgspec.structs.replace(CONFIG, gym_staging="always")
    first = InRayJob(fleet, store.url, staging_dir=str(staging), crash_at="save.gym_committed", occurrence=3,
                     config=config.with_rollout_checkpointing(snapshot_attempt_interval_s=0.05))
    assert first.setup() is None
    with pytest.raises(ray.exceptions.RayActorError):
        first.run()
    first.kill()
    published = {c.snapshot_id for c in store.list()}
    assert published  # the saves before the crash published
    (left,) = staging.iterdir()  # the crashed save's folder only: the others were removed after adoption
    assert not any(left.name.startswith(f"{sid}-") for sid in published)
    assert (left / "gym" / "model-ledger" / "policy0" / "manifest.json").is_file()  # Gym had committed
    newest = store.latest()
    for part in newest.manifest.gym_commit.participants:  # Gym's files are in the store, not in staging
        if part.part_prefix is not None:
            assert Path(newest.url, part.part_prefix, "manifest.json").is_file()
    job = InRayJob(fleet, store.url, config=config, staging_dir=str(staging))
    restored = job.setup()
    assert restored.sequence == newest.sequence
    outcome = job.run()
    assert outcome.done and any(s.published for s in outcome.saves)
    check_finished(job, reference_rows)
    check_store(store)
    assert list(staging.iterdir()) == [left]
    job.kill()


def test_a_store_that_stalls_aborts_saves_and_the_run_goes_on(seaweed, new_bucket, monkeypatch, tmp_path: Path,
                                                               reference_rows) -> None:
    """SeaweedFS behind a proxy that accepts connections and then never answers: every process of the
    job (controller and Gym servers) reaches it through the proxy, with short timeouts."""
    from devtools import s3servers
    from devtools.gym_fleet import new_fleet
    from devtools.stall_proxy import StallProxy
    from snapformat.store import s3

    with StallProxy(seaweed.endpoint) as proxy:
        env = {**seaweed.env_vars(), "AWS_ENDPOINT_URL": proxy.endpoint,
               s3.CONNECT_TIMEOUT_VAR: "1", s3.READ_TIMEOUT_VAR: "2", s3.RETRIES_VAR: "1"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        url = f"s3://{new_bucket(seaweed)}/run"
        direct = SnapshotStore(s3.S3Store(url, endpoint_url=seaweed.endpoint, key=s3servers.ACCESS_KEY,
                                          secret=s3servers.SECRET_KEY))  # the store, not through the proxy
        fleet = new_fleet(tmp_path / "fleet")  # fresh interpreters: they inherit the variables
        try:
            config = CONFIG.with_rollout_checkpointing(snapshot_attempt_interval_s=0.05, max_consecutive_failures=1000)
            job = InRayJob(fleet, url, config=config, actor_options={"runtime_env": {"env_vars": env}})
            assert job.setup() is None
            first = job.call("save_now", True)
            assert first.published, first.error
            proxy.stall()  # before the run: its first save, 0.05 s in, meets the stalled store
            running = job.ctl.run.remote(120)
            failed = wait_until(lambda: [s for s in job.call("saves_since", 1) if not s.published],
                                "a save on the stalled store to fail", 90)[0]
            said = f"S3 endpoint {proxy.endpoint} did not answer (read timeout 2 s per try"
            assert said in failed.error, failed.error
            assert [c.sequence for c in direct.list()] == [first.sequence]  # nothing was published meanwhile
            proxy.answer()
            outcome = ray.get(running, timeout=180)
            assert outcome.done  # Gym was resumed after each aborted save: every rollout finished
            later = job.call("save_now", True)
            assert later.published, later.error
            assert later.sequence > first.sequence
            published = {direct.open(c.sequence).manifest.gym_commit.checkpoint_id for c in direct.list()}
            assert failed.checkpoint_id not in published
            _all_idle(job)
            check_store(direct)
            check_finished(job, reference_rows)
            job.kill()
        finally:
            fleet.close()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (we run as root in CI); unmounted afterwards whatever happens."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                      check=False).returncode:
        pytest.fail("cannot mount a tmpfs (the test needs root): disk-full behaviour would go unchecked")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_saves_clearly_and_the_run_goes_on(fleet, small_disk: Path, reference_rows) -> None:
    store = SnapshotStore(str(small_disk / "store"))
    filler = small_disk / "filler"
    import os

    st = os.statvfs(small_disk)
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    try:  # leave 24 KiB: the store marker fits, a snapshot does not
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - (24 << 10))
    finally:
        os.close(fd)
    config = CONFIG.with_rollout_checkpointing(max_consecutive_failures=1000)
    job = InRayJob(fleet, store.url, config=config)
    job.setup()
    running = job.ctl.run.remote(120)
    failed = wait_until(lambda: [s for s in job.call("saves_since", 0) if not s.published], "a failed save", 60)
    assert "No space left" in failed[0].error or "ENOSPC" in failed[0].error or "disk" in failed[0].error.lower()
    assert store.list() == []  # nothing partial is published
    filler.unlink()  # space returns
    outcome = ray.get(running)
    assert outcome.done
    later = job.call("save_now", True)
    assert later.published, later.error
    check_store(store)
    check_finished(job, reference_rows)
    job.kill()
