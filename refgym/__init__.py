"""Reference Gym servers: the test bed and the demo's Gym for save and restore.

Small FastAPI servers, each a real process (``python -m refgym.serve``) on 127.0.0.1, each mounting
the participant kit's route family of Gym's per-component control protocol under ``/ng-control/v1``
(``spec/CONTROL.md``). A deployment is four of them:

* ``model_server`` (``policy0``): a deterministic policy model (same seed and prompt, same tokens
  and log probs) with a model ledger of Gym's TokenEntry rows; Gym's model admission refuses new
  calls while paused (409 ``checkpoint_parked``).
* ``agent_server`` (``agent0``): multi-turn rollouts (model call, tool calls, next turn), parked at
  turn ends for a checkpoint, restored as attempt n+1 continuing after the last committed model call.
* ``resource_server``: per-attempt tool sessions with revisions; ``tools`` (tool ``notes``) is
  ``export_restore``, ``sandbox`` is ``restart_only`` (rollouts that used it start over after a
  restore).

``rules`` holds the pure functions they share. What the tests and the demo drive them with
(starting and killing server processes, a fork server, fleets of servers, snapshots, bounded waits)
is tooling, not part of this package: ``devtools.gym_procs``, ``devtools.gym_forkserver`` and
``devtools.gym_fleet``, which are not shipped. See README.md.
"""
