"""The participant kit: what a Gym server mounts to take part in save and restore.

A server supplies a :class:`Participant` (its own state export and import); the kit gives it the
``/ng-control/v1`` routes, the phase machine with fencing, idempotency and deadlines, bearer-token
checks, and writing or reading its part of a snapshot with ``snapformat`` into the staging
location it is given at commit (never outside it).
"""

from gymkit.control_plane import ControlPlane, ControlRefused
from gymkit.participant import Participant
from gymkit.token_store import TokenStore as TokenStore  # Gym's TokenSink and TokenSource over a snapformat store

__all__ = ["ControlPlane", "ControlRefused", "Participant"]
