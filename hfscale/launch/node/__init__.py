"""What runs on a node and how it is reached (pure: argv and shell text for the plans).

``command`` (the launcher argv, the ranks' environment, the entry every runner starts), ``line``
(the node line: ``env.sh``, ``nodes.sh``, the prelude, ``node_script`` and pdsh's fan-out of it),
``reach`` (ssh, ``pdsh -R ssh``, an srun probe step, this host), ``keeper`` (each node's watch over
its launcher), ``stopping`` (how a job is stopped and its stacks dumped on a node), ``controls``
(the plan's stop, stack dump and kill, built once from a runner's way to reach its nodes), and
``health_gate`` (what a node passes before its ranks start) with ``health_checks`` (its judgement of
nvidia-smi's answers, which preflight's probes share).

May import the layers below hfscale.launch and hfscale.launch.spec, context and run_dir; no runner,
nothing of attempt/, preflight/ or recovery/ (tests/test_architecture.py holds this).
"""
