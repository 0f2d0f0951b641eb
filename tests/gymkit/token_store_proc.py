"""A :class:`gymkit.token_store.TokenStore` living in a child process of its own, driven over a pipe.

Gym's conformance suite takes factories of fresh instances; with :class:`ProcessTokenStore` each
instance is a separate process (forked from a ``multiprocessing`` forkserver that imported the
store once), so "visible to a fresh instance" is checked across processes that share nothing but
the store: no memory, no cache, no file handle. Calls, results and exceptions cross the pipe
pickled (Gym's ``TokenEntry`` and ``TokenCaptureSnapshot`` pickle).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

_PRELOAD = ["gymkit.token_store", "nemo_gym.token_id_capture.protocols", "nemo_gym.token_id_capture.records",
            "tests.gymkit.token_store_proc"]
_context_lock = threading.Lock()
_context: Any = None
JOIN_TIMEOUT_S = 30.0


def context() -> Any:
    """The forkserver context; its server imports the store once, so each child starts in milliseconds."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            _context = ctx
        return _context


def _serve(conn: Connection, url: str, env: dict[str, str]) -> None:
    """The child: one TokenStore, one event loop, one request at a time until ``None`` or EOF."""
    os.environ.update(env)  # the forkserver's environment is the one it started with, not the test's
    from gymkit.token_store import TokenStore

    store = TokenStore(url)
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                break
            if request is None:
                break
            name, args, kwargs = request
            if name == "pid":
                conn.send(("ok", os.getpid()))
                continue
            try:
                reply = ("ok", loop.run_until_complete(getattr(store, name)(*args, **kwargs)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
                reply = ("error", exc)
            try:
                conn.send(reply)
            except Exception as exc:  # noqa: BLE001 - an unpicklable result or error is still reported
                conn.send(("error", RuntimeError(f"{name}: cannot send the result back: {exc!r}")))
    finally:
        loop.run_until_complete(store.close())
        loop.close()
        conn.close()


class ProcessTokenStore:
    """The TokenStore API (``put``, ``mark_incomplete``, ``begin_call``, ``freeze``, ``freeze_records``,
    ``drop``, ``close``), every call run by a TokenStore in this object's own child process."""

    def __init__(self, url: str, env: dict[str, str] | None = None) -> None:
        ctx = context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, url, dict(env or {})), daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._closed = False

    def _call_sync(self, name: str, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            try:
                self._conn.send((name, args, kwargs))
                status, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"token store process {self._proc.pid} died (exit code "
                                   f"{self._proc.exitcode}) during {name}") from exc
        if status == "error":
            raise value
        return value

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self._call_sync, name, args, kwargs)

    async def child_pid(self) -> int:
        return await self._call("pid")

    async def put(self, entry: Any) -> None:
        await self._call("put", entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self._call("mark_incomplete", rollout_id, model_call_id)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._call("begin_call", rollout_id, model_call_id)

    async def freeze(self, rollout_id: str) -> Any:
        return await self._call("freeze", rollout_id)

    async def freeze_records(self, rollout_id: str) -> Any:
        return await self._call("freeze_records", rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._call("drop", rollout_id, snapshot_id=snapshot_id, version=version)

    async def close(self) -> None:
        """Close the child's store and end the child. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._call("close")
        finally:
            await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(JOIN_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(JOIN_TIMEOUT_S)
        self._conn.close()
