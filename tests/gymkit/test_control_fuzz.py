"""Fuzzing the control routes: whatever arrives, the answer is a 2xx or a typed 4xx ``ControlError``,
never a 500, never the token, and the server stays usable.

Bodies come from hypothesis: well-formed requests with one field replaced by an arbitrary JSON value,
arbitrary JSON documents, and arbitrary bytes; plus hostile values where they matter (draft URLs and
part prefixes that climb out of their folder, huge numbers, NULs). ``FUZZ_EXAMPLES`` raises the count.
They are sent with gymkit's own control client, raw (``ControlClient.request``: any bytes, any token).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_control_plane import TOKEN, FakeAgent

from gymkit import ControlClient, ControlPlane
from schemas.control import CONTROL_PREFIX, ControlError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
ROUTES = ["/prepare", "/commit", "/restore", "/resume", "/abort", "/agent/acknowledge", "/agent/discard",
          "/admission/pause", "/admission/resume", "/admission/abort"]
HOSTILE = ["../../etc", "/etc/passwd", "gym/agent/agent0/../../x", "a\x00b", "s3://other-bucket/x", "", "x" * 5000,
           "file:///etc", "gym/model/policy0", 10**30, -1, float("nan"), None, [], {}]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
    | st.sampled_from(HOSTILE[:9]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


def _valid(route: str, draft: str) -> dict[str, Any]:
    body: dict[str, Any] = {"checkpoint_id": "c1", "deadline": time.time() + 30}
    if route == "/commit":
        body |= {"draft_url": draft, "part_prefix": "gym/agent/agent0", "continuations": []}
    if route == "/restore":
        body |= {"snapshot_url": draft, "saved_checkpoint_id": "c0", "part_prefix": "gym/agent/agent0",
                 "topology_fingerprint": "sha256:" + "0" * 64}
    if route == "/agent/acknowledge":
        body = {"results": [{"rollout_id": "f1", "attempt_index": 0}]}
    if route == "/agent/discard":
        body |= {"rollouts": [{"rollout_id": "r1", "attempt_index": 1}]}
    return body


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(ControlPlane(FakeAgent(), TOKEN).router())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield ControlClient(str(c.base_url), TOKEN, http=c)


def _check(resp) -> None:
    assert resp.status_code < 500, resp.text
    assert TOKEN not in resp.text
    if resp.status_code >= 400:
        msgspec.json.decode(resp.content, type=ControlError)  # always the typed error body


def _send(client: ControlClient, route: str, content: bytes, auth: bool = True):
    return client.request("POST", CONTROL_PREFIX + route, content=content, token=None if auth else "")


def _back_to_idle(client: ControlClient) -> None:
    """Whatever the example did, end any checkpoint it began, so the next example starts from idle."""
    cid = client.status().checkpoint_id
    if cid:
        _check(_send(client, "/abort", msgspec.json.encode({"checkpoint_id": cid, "deadline": time.time() + 30})))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), field=st.text(max_size=20), value=json_values, drop=st.booleans())
def test_a_request_with_one_field_replaced(client, tmp_path_factory, route: str, field: str, value: Any,
                                           drop: bool) -> None:
    body = _valid(route, str(tmp_path_factory.getbasetemp() / "no-such-draft"))
    key = next(iter(body)) if drop or field not in body else field
    if drop:
        body.pop(key)
    else:
        body[field if field else key] = value
    _check(_send(client, route, msgspec.json.encode(body)))
    _back_to_idle(client)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=300) | json_values.map(msgspec.json.encode),
       auth=st.booleans())
def test_arbitrary_bodies(client, route: str, raw: bytes, auth: bool) -> None:
    resp = _send(client, route, raw, auth)
    _check(resp)
    if not auth:
        assert resp.status_code == 401
    _back_to_idle(client)


@pytest.mark.parametrize("where", ["draft_url", "part_prefix"])
@pytest.mark.parametrize("hostile", [h for h in HOSTILE if isinstance(h, str)])
def test_a_commit_never_writes_outside_its_prefix(client, tmp_path, where: str, hostile: str) -> None:
    from snapformat import SnapshotStore

    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cid = f"c-{abs(hash((where, hostile)))}"
    ok = _send(client, "/prepare", msgspec.json.encode({"checkpoint_id": cid, "deadline": time.time() + 30}))
    assert ok.status_code == 200, ok.text
    body = _valid("/commit", draft.url) | {"checkpoint_id": cid, where: hostile}
    resp = _send(client, "/commit", msgspec.json.encode(body))
    _check(resp)
    if resp.status_code == 200:  # only a prefix that is its own, or a real draft, can be accepted
        written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} - set(before)
        assert all(str(p).startswith(f"store/snapshots/{draft.snapshot_id}/gym/agent/agent0") or p.name == "agent0"
                   or str(p) in ("store/snapshots/" + draft.snapshot_id + "/gym", "store/snapshots/" + draft.snapshot_id
                                 + "/gym/agent") for p in written), written
    _back_to_idle(client)
