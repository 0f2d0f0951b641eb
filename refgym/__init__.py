"""Reference Gym servers: the test bed and the demo's Gym for save and restore.

Three small FastAPI servers, each a real process (``python -m refgym.serve``) on 127.0.0.1, each
mounting the participant kit's ``/ng-control/v1`` routes:

* ``model_server``: a deterministic policy model (same seed and prompt, same tokens and log
  probs) with a model ledger of token-capture rows; refuses new calls while paused.
* ``agent_server``: multi-turn rollouts (model call, tool calls, next turn), parked at turn ends
  for a snapshot, restored as attempt n+1 continuing after the last committed model call.
* ``resource_server``: per-session tool state with revisions; ``notes`` is exported, ``sandbox``
  is restart-only (rollouts that used it start over after a restore).

``rules`` holds the pure functions all three share. What the tests and the demo drive them with
(starting and killing server processes, a fork server, fleets of servers, snapshots, bounded waits)
is tooling, not part of this package: ``devtools.gym_procs``, ``devtools.gym_forkserver`` and
``devtools.gym_fleet``, which are not shipped. See README.md.
"""
