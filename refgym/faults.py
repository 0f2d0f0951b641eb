"""Faults a test can switch on in a reference resources server (only when started with ``--test-faults``).

``POST /test/faults`` with ``{"prepare_hang_s": S, "prepare_hangs": N, "commit_errors": M}``: the
next ``N`` prepares hang ``S`` seconds once admission has closed, before any session is exported (past any short deadline), the
next ``M`` ``resources-checkpoint/commit`` calls fail before writing anything (the kit answers 500
``control_error``, the answer of an unexpected failure, CONTROL.md §1). This is how the coordinator's
tests make a real server misbehave over real HTTP; a server started without the flag has no such
route.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import FastAPI, Request, Response

from refgym.api import decode, reply


class FaultPlan(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prepare_hang_s: float = 0.0
    prepare_hangs: int = 0
    commit_errors: int = 0


class Faults:
    def __init__(self) -> None:
        self.plan = FaultPlan()

    async def before_prepare(self) -> None:
        """Called by the server at the start of each prepare (admission already closed)."""
        if self.plan.prepare_hangs > 0:
            self.plan.prepare_hangs -= 1
            await asyncio.sleep(self.plan.prepare_hang_s)

    def commit_fails(self) -> bool:
        """Whether this commit fails on purpose (counts it)."""
        if self.plan.commit_errors > 0:
            self.plan.commit_errors -= 1
            return True
        return False

    def install(self, app: FastAPI) -> None:
        """``POST /test/faults`` (the server calls :meth:`before_prepare` and :meth:`commit_fails`)."""

        @app.post("/test/faults")
        async def set_faults(request: Request) -> Response:
            self.plan = await decode(request, FaultPlan)
            return reply(msgspec.to_builtins(self.plan))


class InjectedFault(RuntimeError):
    """A commit failed on purpose: the kit answers 500 ``control_error`` and the phase stays ``prepared``."""
