"""Write-behind: a row file's bytes go to disk on a second thread while the caller builds the next.

A row part's writer does two kinds of work: checking and serialising each batch (Arrow compute,
which releases the GIL) and passing the bytes on (xxh3 and the ``write`` system call, which also
release it). Done one after the other, the save is the sum of both; here the caller only queues the
bytes and one background thread hashes and writes them, in order, so on two cores the sum becomes
roughly the larger of the two.

What is queued is bounded (:data:`MAX_PENDING` bytes) and owned: pyarrow hands large buffers over
as ``pyarrow.Buffer`` objects that keep the batch's memory alive, and small pieces (message headers,
padding) are copied into one chunk of at least :data:`COALESCE` bytes, which also turns Arrow's
thousands of tiny writes into a few large ones.

Errors keep their type: a failure on the thread (a full disk: :class:`StoreError`) is raised, as
the same exception, by the caller's next :meth:`WriteBehind.write`, by :meth:`WriteBehind.finish`,
or not at all after :meth:`WriteBehind.abort` (the caller is already failing). Nothing becomes
durable here; the target's own ``close()`` does that, after :meth:`finish`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from snapformat.store.base import WriteStream

MAX_PENDING = 32 << 20  # bytes handed over and not yet written: the memory write-behind may hold
COALESCE = 1 << 20  # small pieces are gathered into chunks of at least this many bytes
SMALL = 64 << 10  # a piece below this size is copied into the current chunk


def _nbytes(data: Any) -> int:
    return len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes


class WriteBehind(WriteStream):
    """A write-only stream whose bytes reach ``target`` (in order) on one background thread."""

    def __init__(self, target: Any, max_pending: int = MAX_PENDING) -> None:
        self._target = target
        self._max_pending = max_pending
        self._pending = 0
        self._chunk = bytearray()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = threading.Condition()
        self._error: BaseException | None = None
        self._dropping = False
        self.size = 0
        self._thread = threading.Thread(target=self._run, name="snapformat-write-behind", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------
    def write(self, data: Any) -> int:
        """Queue ``data``; raises the thread's error if an earlier write failed."""
        self._raise_failure()
        if self.closed:
            raise ValueError("write to a finished or aborted write-behind stream")
        n = _nbytes(data)
        if n < SMALL:
            self._chunk += data
            if len(self._chunk) >= COALESCE:
                self._hand_chunk()
        else:
            self._hand_chunk()
            self._hand(data, n)
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def finish(self) -> None:
        """Wait until every byte has reached the target, then stop the thread. Raises the thread's
        error, if any (the target is then not complete and must be aborted by its owner)."""
        if self.closed:
            self._raise_failure()
            return
        self._hand_chunk()
        self._stop()
        self._raise_failure()

    def close(self) -> None:
        # pyarrow closes the sink it was given when its writer closes; the owner calls finish().
        pass

    def abort(self) -> None:
        """Stop the thread, dropping what is still queued (the owner aborts the target)."""
        if not self.closed:
            self._dropping = True
            self._stop()

    def _hand_chunk(self) -> None:
        if self._chunk:
            chunk, self._chunk = bytes(self._chunk), bytearray()
            self._hand(chunk, len(chunk))

    def _hand(self, data: Any, n: int) -> None:
        with self._room:
            while self._pending and self._pending + n > self._max_pending and self._error is None:
                self._room.wait()
            self._raise_failure()  # nothing is counted or queued for a thread that has failed
            self._pending += n
        self._queue.put((data, n))

    def _stop(self) -> None:
        self.closed = True
        self._queue.put(None)
        self._thread.join()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            data, n = item
            if self._error is None and not self._dropping:
                try:
                    self._target.write(data)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                    self._error = exc
            with self._room:
                self._pending -= n
                self._room.notify_all()
