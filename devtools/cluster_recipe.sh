#!/usr/bin/env bash
# The multi-node recipe of the README, command for command: three Ray nodes on this machine (each its
# own `ray start`, temp dir and process session), SeaweedFS as the store, a job whose parts are pinned
# to the nodes, the loss of machine C mid-run, and the operator's restart. Run from the repository
# root with the venv active (`. .venv/bin/activate`); R, where everything goes, defaults below. Every
# process it starts is killed (by session id) when it exits. `make cluster-demo` runs the same with
# random ports and checks every row; CLUSTER_SOAK=1 tests/coordinator/test_cluster.py runs this file.
set -euo pipefail
R=${R:-/tmp/rc-recipe}
rm -rf "$R" && mkdir -p "$R"
SESSIONS=()
trap 'for s in "${SESSIONS[@]}"; do pkill -KILL -s "$s" || true; done' EXIT

# Every machine: the code, the store's credentials, Ray on loopback. On one machine Ray keeps a node on
# 127.0.0.1 only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and then `ray start` refuses worker nodes:
# `python -m devtools.ray_cli start` is `ray start` with that refusal lifted (same arguments). On
# separate machines: `ray start`, no --node-ip-address=127.0.0.1, --address=<head's address>:6390.
export PYTHONPATH=$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export AWS_ENDPOINT_URL=http://127.0.0.1:18333 AWS_ACCESS_KEY_ID=rl-demo AWS_SECRET_ACCESS_KEY=rl-demo-secret
export AWS_REGION=us-east-1

# The store: SeaweedFS on loopback, and a bucket.
mkdir -p "$R/weed"
(cd "$R/weed" && exec setsid weed mini -dir="$R/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.telemetry=false -admin.ui=false -webdav=false -s3.port=18333 -s3.port.grpc=28333 \
  -master.port=19333 -master.port.grpc=29333 -filer.port=18888 -filer.port.grpc=28888 \
  -volume.port=18080 -volume.port.grpc=28080 -s3.port.iceberg=0 -s3.port.lance=0) > "$R/weed.log" 2>&1 &
SESSIONS+=($!)
python -c "
import time, boto3
for _ in range(240):
    try:
        boto3.client('s3').create_bucket(Bucket='rl-snapshots'); break
    except Exception: time.sleep(0.5)
else: raise SystemExit('SeaweedFS did not come up')"

active() {  # how many nodes the GCS lists as active
  ray status --address=127.0.0.1:6390 2>/dev/null | sed -n '/^Active:/,/^Pending:/p' | grep -c node_ || true
}
wait_active() {
  for _ in $(seq 240); do [ "$(active)" = "$1" ] && return 0; sleep 0.5; done
  echo "the cluster never had $1 active nodes" >&2; return 1
}

# Machine A, the head: Ray's GCS, the job's driver, the Single Controller. (The GCS declares a node dead
# after 5 missed health checks 1 s apart; Ray's defaults take about 30 s.)
RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=2000 RAY_health_check_failure_threshold=5 \
setsid python -m devtools.ray_cli start --block --head --port=6390 --node-ip-address=127.0.0.1 --node-name=head \
  --temp-dir="$R/head" --num-cpus=1 --num-gpus=0 --resources='{"snap_controller":1}' \
  --include-dashboard=false --dashboard-port=6391 --ray-client-server-port=6392 \
  --node-manager-port=6393 --object-manager-port=6394 --dashboard-agent-listen-port=6395 \
  --dashboard-agent-grpc-port=6396 --runtime-env-agent-port=6397 --metrics-export-port=6398 \
  --min-worker-port=0 --max-worker-port=0 --object-store-memory=104857600 --disable-usage-stats > "$R/head.log" 2>&1 &
SESSIONS+=($!)
wait_active 1

# Machine B: the NemoGym actor (the job binds this machine's Gym servers, the model and the agent, to 127.0.0.2).
setsid python -m devtools.ray_cli start --block --address=127.0.0.1:6390 --node-ip-address=127.0.0.1 --node-name=gym \
  --temp-dir="$R/gym" --num-cpus=1 --num-gpus=0 --resources='{"snap_gym":1}' --include-log-monitor=false \
  --node-manager-port=6403 --object-manager-port=6404 --dashboard-agent-listen-port=6405 \
  --dashboard-agent-grpc-port=6406 --runtime-env-agent-port=6407 --metrics-export-port=6408 \
  --min-worker-port=0 --max-worker-port=0 --object-store-memory=104857600 --disable-usage-stats > "$R/gym.log" 2>&1 &
SESSIONS+=($!)

# Machine C: TransferQueue's controller and storage unit (its Gym servers, the resources servers: 127.0.0.3).
start_tq() {
  setsid python -m devtools.ray_cli start --block --address=127.0.0.1:6390 --node-ip-address=127.0.0.1 --node-name=tq \
    --temp-dir="$R/tq" --num-cpus=2 --num-gpus=0 --resources='{"snap_tq":1}' --include-log-monitor=false \
    --node-manager-port=6413 --object-manager-port=6414 --dashboard-agent-listen-port=6415 \
    --dashboard-agent-grpc-port=6416 --runtime-env-agent-port=6417 --metrics-export-port=6418 \
    --min-worker-port=0 --max-worker-port=0 --object-store-memory=104857600 --disable-usage-stats >> "$R/tq.log" 2>&1 &
  TQ_SESSION=$!
  SESSIONS+=("$TQ_SESSION")
}
start_tq
wait_active 3

# The job, on A: TransferQueue on C, the NemoGym actor on B, the Single Controller on A; the Gym servers on
# hosts 127.0.0.2 and 127.0.0.3; a snapshot every second, to s3://rl-snapshots/run. Run again, it restores.
JOB=(python -m devtools.job --store s3://rl-snapshots/run --workdir "$R/job" --address 127.0.0.1:6390
  --placement '{"controller":"snap_controller","gym":"snap_gym","tq":"snap_tq"}'
  --gym-hosts '{"model":"127.0.0.2","agent":"127.0.0.2","resource":"127.0.0.3","sandbox":"127.0.0.3"}'
  --staging-dir "$R/shared-staging" --model-slow-ms 300 --progress-s 1 --workload '{"prompts":32,"group_size":4}'
  --config '{"rollout_checkpointing":{"snapshot_attempt_interval_s":1.0,"gym":{"capability_discovery_enabled":true,"participant_checkpointing_enabled":true}},"max_in_flight":16,"data_plane_timeout_s":15}')
setsid "${JOB[@]}" > "$R/job-1.log" 2>&1 &
JOB1=$!
SESSIONS+=("$JOB1")
for _ in $(seq 600); do grep -q "2 snapshots published" "$R/job-1.log" && break; sleep 0.5; done
python -c "
import json; d = json.load(open('$R/job/placement.json'))
print('placement:', ', '.join(f'{part} on {d[\"nodes\"][n][\"name\"]}' for part, n in d['actors'].items()))"

# Machine C fails: every process of node tq, and the Gym servers of host 127.0.0.3.
pkill -KILL -s "$TQ_SESSION"
kill -KILL $(python -c "import json; p = json.load(open('$R/job/gym.pids.json')); print(p['resource'], p['sandbox'])")
set +e
wait "$JOB1"
echo "job 1 exit: $? ($(grep -m1 '^job: lost' "$R/job-1.log" || tail -1 "$R/job-1.log"))"
set -e

# The operator: once the GCS has dropped the dead node, the same command for machine C, then the job again.
wait_active 2
start_tq
wait_active 3
setsid "${JOB[@]}" > "$R/job-2.log" 2>&1 &
JOB2=$!
SESSIONS+=("$JOB2")
wait "$JOB2"
grep -E "^job: (restored|done=)" "$R/job-2.log"
