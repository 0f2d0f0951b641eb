"""The Single Controller on the session's Ray with real Gym servers: saves in both write modes,
failed saves that abort and let the run go on, and the restore's choices (topology, corruption,
empty store). Every run's final rows are compared with an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import ray

from devtools.accounting import content, trained_once
from coordinator.errors import TooManyFailuresError
from harness import CONFIG, WORKLOAD, InRayJob
from schemas.errors import TopologyMismatchError
from devtools.gym_fleet import wait_until
from snapformat import SnapshotStore, verify_snapshot

pytestmark = pytest.mark.usefixtures("tq_runtime")
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
        assert {"flush_acks", "prepare", "gym_commit", "cut", "resume", "write", "publish"} <= set(s.steps_s)
        assert 0 < s.pause_s
        if mode == "background":  # the bytes were written after the resume: not part of the pause
            assert s.pause_s < sum(s.steps_s.values())
    newest = store.latest()
    assert newest is not None and newest.manifest.topology_fingerprint
    timings = newest.manifest.timings_s
    assert ("pause_s" in timings) == (mode == "background") and "prepare_s" in timings
    assert len(check_store(store)) <= CONFIG.keep_latest_k
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
    r = httpx.post(f"{job.gym.trio.resource.url}/test/faults", json=plan)
    assert r.status_code == 200, r.text


def test_a_commit_error_aborts_that_save_and_the_run_goes_on(fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, test_faults=True)
    job.setup()
    _faults(job, commit_errors=1)
    outcome = job.run()
    assert outcome.done
    failed = outcome.saves[0]
    assert not failed.published and "commit of resource tools" in failed.error and "500" in failed.error
    later = job.call("save_now", True)  # a later save succeeds
    assert later.published, later.error
    assert failed.checkpoint_id not in {store.open(c.sequence).manifest.gym_commit.checkpoint_id for c in store.list()}
    for p in job.gym.clients:  # every server was resumed by the abort
        assert p.status().phase == "idle"
    check_store(store)
    check_finished(job, reference_rows)
    job.kill()


def test_a_prepare_that_hangs_past_the_deadline_is_aborted(fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    config = msgspec.structs.replace(CONFIG, prepare_timeout_s=0.5)
    job = InRayJob(fleet, store.url, config=config, test_faults=True)
    job.setup()
    _faults(job, prepare_hang_s=8.0, prepare_hangs=1)
    outcome = job.run()
    assert outcome.done
    failed = outcome.saves[0]
    assert not failed.published and "prepare of resource tools" in failed.error
    assert "deadline" in failed.error  # given up at the deadline, not when the server finally answered
    later = job.call("save_now", True)
    assert later.published, later.error
    check_store(store)
    check_finished(job, reference_rows)
    job.kill()


def test_max_consecutive_failures_stops_the_run_clearly(fleet, tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, config=msgspec.structs.replace(CONFIG, max_consecutive_failures=2),
                   test_faults=True)
    job.setup()
    _faults(job, commit_errors=1000)
    with pytest.raises(TooManyFailuresError, match=r"2 consecutive save attempts failed .*commit of resource tools"):
        job.run()
    assert store.list() == []
    job.kill()


def _run_with_snapshots(fleet, store: SnapshotStore, stop_after: int) -> None:
    """A job that publishes at least ``stop_after`` snapshots and is then killed mid-run."""
    job = InRayJob(fleet, store.url, crash_at="save.begin", occurrence=stop_after + 1, kill_gym=True,
                   config=msgspec.structs.replace(CONFIG, snapshot_attempt_interval_s=0.05))
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
    victim = next(e for e in newest.manifest.files if e.kind == "training_rows")
    path = Path(newest.url) / victim.path
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


def test_on_an_object_store_saves_and_restores_with_no_local_path(seaweed, aws_env, new_bucket, tmp_path: Path,
                                                                   reference_rows) -> None:
    """Store on SeaweedFS: Gym servers write their parts straight to S3 through the draft's URL."""
    from devtools.gym_fleet import new_fleet

    aws_env(seaweed)
    store = SnapshotStore(f"s3://{new_bucket(seaweed)}/run")
    env = {"runtime_env": {"env_vars": seaweed.env_vars()}}
    fleet = new_fleet(tmp_path / "fleet")  # fresh interpreters: they inherit the S3 variables
    try:
        first = InRayJob(fleet, store.url, crash_at="save.begin", occurrence=3, actor_options=env,
                         config=msgspec.structs.replace(CONFIG, snapshot_attempt_interval_s=0.05))
        first.setup()
        with pytest.raises(ray.exceptions.RayActorError):
            first.run()
        first.kill()
        newest = store.latest()
        assert newest is not None and newest.url.startswith("s3://")
        assert all(e.path.startswith(("gym/", "tq/", "controller/")) for e in newest.manifest.files)
        job = InRayJob(fleet, store.url, actor_options=env)
        restored = job.setup()
        assert restored.sequence == newest.sequence and restored.snapshot_url.startswith("s3://")
        assert job.run().done
        check_store(store)
        check_finished(job, reference_rows)
        job.kill()
    finally:
        fleet.close()


def test_a_store_that_stalls_aborts_saves_and_the_run_goes_on(seaweed, new_bucket, monkeypatch, tmp_path: Path,
                                                               reference_rows) -> None:
    """SeaweedFS behind a proxy that accepts connections and then never answers: every process of the
    job (controller and Gym servers) reaches it through the proxy, with short timeouts."""
    from devtools.gym_fleet import new_fleet
    from snapformat.store import s3
    from devtools import s3servers
    from devtools.stall_proxy import StallProxy

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
            config = msgspec.structs.replace(CONFIG, snapshot_attempt_interval_s=0.05, max_consecutive_failures=1000)
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
            for p in job.gym.clients:
                assert p.status().phase == "idle"
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
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
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
    config = msgspec.structs.replace(CONFIG, max_consecutive_failures=1000)
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
