"""The participant kit: what a Gym server mounts to take part in save and restore, and the client
that drives it.

A server supplies a :class:`Participant` (its own state export and import); the kit gives it the
``/ng-control/v1`` routes, the phase machine with fencing, idempotency and deadlines, bearer-token
checks, admission (``Participant.admits_work``), and writing or reading its part of a snapshot with
``snapformat`` into the staging location it is given at commit (never outside it).

The other side, the coordinator's: :class:`ControlClient` / :class:`AsyncControlClient` (one
server's calls, typed) and :class:`GymFleet` (every server, in the protocol's call orders).
"""

from gymkit.control_client import (
    AsyncControlClient,
    CommitResult,
    ControlCallError,
    ControlClient,
    GymFleet,
    gym_commit,
)
from gymkit.control_plane import ControlPlane, ControlRefused
from gymkit.participant import CommitContext, Participant, part_prefix
from gymkit.token_store import TokenStore as TokenStore  # Gym's TokenSink and TokenSource over a snapformat store

__all__ = [
    "AsyncControlClient", "CommitContext", "CommitResult", "ControlCallError", "ControlClient", "ControlPlane",
    "ControlRefused", "GymFleet", "Participant", "gym_commit", "part_prefix",
]
