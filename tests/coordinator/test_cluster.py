"""A real multi-node Ray cluster on this machine (issue 22, §1): ``devtools.cluster.LocalCluster``, a
head and two worker nodes started with ``ray start`` (each its own raylet, temp dir and session), the
store on SeaweedFS, the Gym servers on hosts 127.0.0.2 and 127.0.0.3.

The short test (``make test``) checks where every part ran (the Single Controller on the head, the
NemoGym actor on ``gym``, TransferQueue's controller and storage unit on ``tq``), that nothing of the
cluster listens outside 127.0.0.0/8, and that a run which loses machine ``tq`` mid-run (Ray node
``tq``: raylet, agents, TQ's actors; and Gym host 127.0.0.3: the resources servers), then has the node
restarted by the same ``ray start`` command and the job started again, restores and ends with exactly
an uninterrupted run's rows, every rollout trained once. ``CLUSTER_SOAK=1`` (``make soak``) runs the
long one: a bigger workload, a whole-job crash and continue, and the loss of each worker machine in
turn.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coordinator.workload import Workload
from devtools import cluster as rc
from devtools.gym_procs import REPO_ROOT, bindable
from snapformat import SnapshotStore

RECIPE = REPO_ROOT / "devtools" / "cluster_recipe.sh"


pytestmark = [
    pytest.mark.skipif(not all(bindable(h) for h in set(rc.GYM_HOSTS.values())),
                       reason="127.0.0.2/127.0.0.3 are not loopback addresses on this machine"),
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets"),
]

# About 6 s of rollouts: the kill must land mid-run, after two snapshots, on a loaded machine too.
WORKLOAD = Workload(prompts=8, group_size=3, min_turns=2, max_turns=4, seed=77, sandbox_every=3)
CONFIG = rc.cluster_config(interval_s=0.5, max_in_flight=6)
MODEL_SLOW_MS = 400


@pytest.fixture(scope="module")
def cluster(seaweed):
    """Three Ray nodes for this module (every process SIGKILLed by session and tree at the end)."""
    c = rc.LocalCluster(env=seaweed.env_vars()).start()
    seen: set[int] = set()
    try:
        yield c
        seen = set(c.pids())
    finally:
        c.close()
    assert seen and not [p for p in seen if rc.pid_alive(p)], "a node process outlived the cluster"


@pytest.fixture
def s3_store(seaweed, aws_env, new_bucket) -> str:
    aws_env(seaweed)  # this process and the jobs it starts reach the store through these, and only these
    return f"s3://{new_bucket(seaweed)}"


def test_the_cluster_has_three_nodes_each_with_its_role(cluster) -> None:
    alive = {n.name: n for n in cluster.gcs_nodes() if n.alive}
    assert set(alive) == {rc.HEAD, rc.GYM_NODE, rc.TQ_NODE}
    for name, node in alive.items():
        assert node.resources.get(rc.RESOURCES[name]) == 1.0
        assert node.resources.get("CPU") == rc.NODE_CPUS[name]
    assert len({n.node_id for n in alive.values()}) == 3
    sessions = {os.getsid(cluster.nodes[name].popen.pid) for name in alive}
    assert len(sessions) == 3  # each node is a process session of its own, apart from this one
    assert os.getsid(0) not in sessions


def test_losing_a_machine_mid_run_restores_and_matches(cluster, s3_store: str, tmp_path: Path) -> None:
    # The uninterrupted run, on the same cluster, keeps its rows in the in-memory data plane (no TQ to start:
    # a shorter test); they must equal TransferQueue's rows of the run below (make cluster-demo uses TQ for both).
    expected = rc.reference_run(cluster, f"{s3_store}/reference", tmp_path / "reference", WORKLOAD, CONFIG,
                                MODEL_SLOW_MS, data_plane="memory")
    sc = rc.node_failure(cluster, f"{s3_store}/lost", tmp_path / "lost", WORKLOAD, CONFIG, MODEL_SLOW_MS, expected,
                         rc.TQ_NODE)
    assert sc.problems == [], "\n".join(sc.lines + sc.problems)  # placement, sockets, rows, once, snapshots verify

    before = json.loads((tmp_path / "lost" / "placement-before.json").read_text())
    after = json.loads((tmp_path / "lost" / "placement.json").read_text())
    for doc in (before, after):  # each part on the node meant for it, by the GCS's name of the node
        assert {part: doc["nodes"][node]["name"] for part, node in doc["actors"].items()} == {
            "controller": "head", "gym": "gym", "TQHost": "tq", "TransferQueueController": "tq",
            "TransferQueueStorageUnit#0": "tq"}
    for part in ("controller", "gym"):  # untouched by the loss of tq
        assert before["actors"][part] == after["actors"][part]
    old_tq, new_tq = before["actors"]["TransferQueueController"], after["actors"]["TransferQueueController"]
    assert old_tq != new_tq and new_tq in cluster.node_ids(rc.TQ_NODE)  # TQ came back on the restarted node
    assert old_tq in cluster.node_ids(rc.TQ_NODE, alive=False)
    assert any("sockets of the cluster and the job, 0 outside" in ln for ln in sc.lines), sc.lines
    assert any(ln.startswith("restored snapshot") for ln in sc.lines), sc.lines
    assert SnapshotStore(f"{s3_store}/lost").list()  # the snapshots are on SeaweedFS, reached over S3


@pytest.mark.timeout(1800)  # four runs of 128 rollouts, two node restarts: 5 minutes on a quiet machine
@pytest.mark.skipif(not os.environ.get("CLUSTER_SOAK"), reason="the long cluster run: CLUSTER_SOAK=1 (make soak)")
def test_the_long_cluster_run(cluster, s3_store: str, tmp_path: Path) -> None:
    """``make cluster-demo`` with both worker machines lost in turn (128 rollouts by default)."""
    workload = Workload(prompts=int(os.environ.get("CLUSTER_SOAK_PROMPTS", "32")), group_size=4)
    code = rc.run_cluster_demo(s3_store, tmp_path, workload, rc.cluster_config(interval_s=1.0), 250, cluster,
                               kill_nodes=(rc.TQ_NODE, rc.GYM_NODE), crash=True)
    assert code == 0


def _recipe_commands() -> tuple[list[list[str]], list[str]]:
    """The recipe's ``ray_cli start`` commands (continuation lines joined) and its job's command, each
    split as the shell would (variables left as written)."""
    text = RECIPE.read_text().replace("\\\n", " ")
    starts = [shlex.split(line) for line in text.splitlines()
              if "devtools.ray_cli start" in line and not line.lstrip().startswith("#")]
    job = re.search(r"^JOB=\((.*?)\)$", text, re.MULTILINE | re.DOTALL)
    assert job is not None, "the recipe has no JOB=(...)"
    return starts, shlex.split(job.group(1))


def _options(argv: list[str]) -> dict[str, str]:
    return dict((a.split("=", 1) + [""])[:2] for a in argv if a.startswith("--"))


def test_the_readme_holds_the_recipe_and_it_starts_the_nodes_the_tests_start() -> None:
    """The README's block is ``devtools/cluster_recipe.sh`` byte for byte, and each of its ``ray start``
    commands asks for what :class:`devtools.cluster.LocalCluster` asks of the same node (ports and temp
    dirs aside), its job for the same placement and Gym hosts."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"<!-- cluster-recipe: devtools/cluster_recipe.sh -->\n```sh\n(.*?)```\n<!-- /cluster-recipe -->",
                      readme, re.DOTALL)
    assert block is not None and block.group(1) == RECIPE.read_text()
    commands, job = _recipe_commands()
    starts = {_options(c)["--node-name"]: c for c in commands}
    assert set(starts) == {rc.HEAD, rc.GYM_NODE, rc.TQ_NODE}
    cluster = rc.LocalCluster()
    try:
        for name, argv in starts.items():
            ours = _options(cluster.nodes[name].command())
            theirs = _options(argv[argv.index("start"):])
            assert set(theirs) == set(ours), name
            fixed = {k for k in ours if not k.endswith("-port") and k not in ("--temp-dir", "--address")}
            assert {k: theirs[k] for k in fixed} == {k: ours[k] for k in fixed}, name
    finally:
        cluster.close()
    head = next(c for c in commands if _options(c).get("--node-name") == rc.HEAD)
    assert dict(a.split("=", 1) for a in head if a.startswith("RAY_health")) == rc.HEALTH_CHECK_ENV
    assert job[:3] == ["python", "-m", "devtools.job"]
    flags = dict(itertools.pairwise(job))
    assert json.loads(flags["--placement"]) == rc.PLACEMENT and json.loads(flags["--gym-hosts"]) == rc.GYM_HOSTS


@pytest.mark.timeout(1200)  # the recipe's own bound is 900 s
@pytest.mark.skipif(not os.environ.get("CLUSTER_SOAK"), reason="runs the README's recipe: CLUSTER_SOAK=1 (make soak)")
def test_the_readme_recipe_runs_as_written() -> None:
    root = Path(tempfile.mkdtemp(prefix="rcr-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", "R": str(root / "r")}
    try:
        run = subprocess.run(["bash", str(RECIPE)], check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "placement: controller on head, gym on gym, TQHost on tq, TransferQueueController on tq" in out, out[-4000:]
    assert re.search(r"job 1 exit: [13] ", out), out[-4000:]
    assert re.search(r"job: restored snapshot \d+", out) and "job: done=True" in out, out[-4000:]
