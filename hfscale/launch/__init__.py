"""Launching a job, in rooms that follow a launch: plan -> one attempt on the nodes -> relaunch.

At the top, what every room reads (pure data): ``spec`` (the ``LaunchPlan`` value ``--dry-run``
prints and ``attempt.execute`` runs), ``context`` (``LaunchContext``, the attempt ids, and
``Common``, the runner-independent part of a plan), ``run_dir`` (the run directory's files), and
``build`` (config -> ``LaunchPlan``, pure, through the runner of ``runner.type``); ``netcheck``
(one host's part of ``preflight --network``, run there as ``python -m hfscale.launch.netcheck``).
Then the rooms, lowest first (a room imports the top modules, its own room and the rooms before it,
never one after it; tests/test_architecture.py holds this):

- ``node/``: what runs on a node and how it is reached (pure);
- ``runners/``: one module per ``runner.type``, found in ``RUNNERS``;
- ``preflight/``: what to ask every host before a launch, and what the answers mean;
- ``attempt/``: one attempt on the nodes: ``execute`` (the only module that starts processes) and
  what reads the running job (its lines, the console, the watchdog, the heartbeats);
- ``recovery/``: between attempts and across them: the supervisor, its policy, the timeline.

Layer 6: may import the layers below (core, config, checkpoints, rules, render, training).
"""
