"""The coordinator's errors: every one is a :class:`~schemas.errors.SnapshotError`."""

from __future__ import annotations

from schemas.errors import SnapshotError


class CoordinatorError(SnapshotError):
    """The coordinator could not do what it was asked (the message says which step and why)."""


class GymCallError(CoordinatorError):
    """A Gym server refused a call, answered an error, was unreachable, or missed the deadline.

    ``held``: a prepare that stopped at completed results not yet acknowledged and left every
    participant it called paused under its id (``prepare_checkpoint(..., hold_when_unacknowledged=True)``);
    the caller prepares that id again or aborts it."""

    def __init__(self, message: str, *, component: str = "", name: str = "", status: int | None = None,
                 error: str | None = None, held: bool = False) -> None:
        super().__init__(message)
        self.component = component
        self.name = name
        self.status = status
        self.error = error
        self.held = held

    def __reduce__(self):  # crosses Ray's process boundary with its fields
        return (_rebuild_gym_call_error, (str(self), self.component, self.name, self.status, self.error, self.held))


def _rebuild_gym_call_error(message: str, component: str, name: str, status: int | None,
                            error: str | None, held: bool = False) -> GymCallError:
    return GymCallError(message, component=component, name=name, status=status, error=error, held=held)


class TooManyFailuresError(CoordinatorError):
    """``max_consecutive_failures`` saves in a row failed; the last error is the cause."""


class RestoreError(CoordinatorError):
    """A restore could not be completed; Gym was aborted and nothing was resumed."""
