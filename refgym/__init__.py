"""Reference Gym servers: the test bed and the demo's Gym for save and restore.

Three small FastAPI servers, each a real process (``python -m refgym.serve``) on 127.0.0.1, each
mounting the participant kit's ``/ng-control/v1`` routes:

* ``model_server``: a deterministic policy model (same seed and prompt, same tokens and log
  probs) with a model ledger of token-capture rows; refuses new calls while paused.
* ``agent_server``: multi-turn rollouts (model call, tool calls, next turn), parked at turn ends
  for a snapshot, restored as attempt n+1 continuing after the last committed model call.
* ``resource_server``: per-session tool state with revisions; ``notes`` is exported, ``sandbox``
  is restart-only (rollouts that used it start over after a restore).

``rules`` holds the pure functions all three share. For whoever drives them (tests, the demo):
``client`` (one method per call), ``procs`` and ``forkserver`` (starting server processes), and
``testing`` (fleets of servers, snapshots driven call by call, bounded waits). See README.md.
"""
