"""One attempt of a job on its nodes: ``execute`` (the only module that starts processes: it runs
launch plans and preflight probes, and the in-process restarts' store beside the launcher) and what
reads the running job: ``run_state`` (its bookkeeping), ``run_output`` and ``node_lines`` (its lines,
typed), ``in_process`` (with in-process restarts, the nodes' failures the ranks heal), ``first_failure``, ``disk_full``, ``console`` (the terminal),
``follow`` (a detached job, through the run directory), ``watchdog`` (hangs; ``dump_files``: what the
hang's stack dump left, and who answered it), ``beats`` (the
launcher's and the nodes' heartbeats), ``beat_server`` (the launcher's end of the nodes' heartbeat
line) and ``output_lock`` (one launch per output_dir).

May import the layers below hfscale.launch, the top modules of hfscale.launch (spec, context,
run_dir, build), node/ and runners/ (execute asks a scheduler's runner what its answers mean); never
recovery/ or preflight/ (tests/test_architecture.py holds this).
"""
