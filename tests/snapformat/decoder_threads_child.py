"""A fresh process whose threads all decode Gym's records for the first time at once (run by
``test_decoder_threads.py``): 16 threads start on a barrier and each decodes every document of
:data:`DOCS` through ``snapformat.gym_dir.decode_strict``, the path of a Gym server's restore, with
the interpreter switching threads every microsecond. Exits 0, or dies by SIGSEGV if a thread uses
a decoder that another thread is still building."""

from __future__ import annotations

import sys
import threading

from schemas.gym_files import AgentBoundaryRecord, AgentIndexEntry, AgentManifest, ResourceSnapshot
from schemas.gym_records import AgentContinuationRoot
from snapformat.gym_dir import decode_strict

SHA = "a" * 64
DOCS = [
    (AgentManifest, b'{"schema_version":2,"checkpoint_id":"c","instance_name":"a","archives":[{"name":"agent-part-000000'
                    b'.tar","sha256":"' + SHA.encode() + b'","members":1,"bytes":10}],"record_index":{"relative_path":"a'
                    b'/i.jsonl","sha256":"' + SHA.encode() + b'","records":1,"bytes":1},"records":1,"continuation_index":'
                    b'{"relative_path":"a/c.jsonl","sha256":"' + SHA.encode() + b'","records":1,"bytes":1}}'),
    (AgentIndexEntry, b'{"rollout_id":"r","attempt_index":0,"archive":"agent-part-000000.tar","member":"r.a0.json",'
                      b'"sha256":"' + SHA.encode() + b'","bytes":10}'),
    (AgentBoundaryRecord, b'{"rollout_id":"r","attempt_index":0,"boundary_index":1,"output_items":[{"t":"x"}],'
                          b'"last_committed_model_call_id":"c","resource_state_revisions":{"tools":1},'
                          b'"agent_state":{"m":[1]}}'),
    (AgentContinuationRoot, b'{"rollout_id":"r","attempt_index":0,"capture_key":"r","last_committed_model_call_id":"c",'
                            b'"resource_state_revisions":{"tools":1}}'),
    (ResourceSnapshot, b'{"rollout_id":"r","attempt_index":0,"state_revision":1,"state":{"n":1},"mutation_receipts":'
                       b'[{"request_id":"q","expected_revision":0,"input_digest":"' + SHA.encode() + b'","status":200,'
                       b'"headers":[["a","b"]],"body_base64":"","resulting_revision":1}]}'),
]
THREADS = 16


def main() -> int:
    sys.setswitchinterval(1e-6)
    barrier = threading.Barrier(THREADS)
    decoded: list[int] = []

    def work(offset: int) -> None:
        barrier.wait()
        for i in range(len(DOCS)):
            record_type, data = DOCS[(offset + i) % len(DOCS)]
            decode_strict(data, record_type, "test")
        decoded.append(1)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0 if len(decoded) == THREADS else 1


if __name__ == "__main__":
    sys.exit(main())
