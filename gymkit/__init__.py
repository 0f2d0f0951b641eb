"""What a Gym server mounts to take part in save and restore, and the client that drives it.

Gym's per-component checkpoint control protocol (``spec/CONTROL.md``), one module per component:
:mod:`gymkit.model_control` (data-plane admission and the ``model-admission``/``model-checkpoint``
routes), :mod:`gymkit.agent_control` (the execution registry and the ``agent-checkpoint`` routes),
:mod:`gymkit.resources_control` (sessions and the ``resources-checkpoint`` routes), all on one
:class:`~gymkit.fence.Fence` per process; Gym's checkpoint files (:mod:`gymkit.checkpoint_dir`); what
the agents' committed boundaries saw of each resources server, read once for the resources servers
of a process (:mod:`gymkit.agent_dependencies`).

The other side, the coordinator's: :class:`ControlClient` / :class:`AsyncControlClient` (one
server's calls, typed) and :class:`GymFleet` (every server, in NeMo-RL's call orders).
"""

from gymkit.control_client import AsyncControlClient, ControlCallError, ControlClient
from gymkit.fence import ControlError, Fence
from gymkit.gym_fleet import CommitResult, GymFleet, Topology
from gymkit.token_store import TokenStore as TokenStore  # Gym's TokenSink and TokenSource over a snapformat store

__all__ = [
    "AsyncControlClient", "CommitResult", "ControlCallError", "ControlClient", "ControlError", "Fence", "GymFleet",
    "Topology",
]
