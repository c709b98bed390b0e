"""Every cross-field check of a config. ``resolved`` derives the ``Job`` (hosts, world size, batch
geometry) and checks nothing; ``check.check(job) -> Findings`` runs every rule; ``check.resolve``
is the two in order; ``config_file`` reads a YAML file (and its host file) through them;
``recovery`` holds the rules of the ``recovery:`` section and ``relaunch`` the job a relaunch runs.

Layer 3: may import hfscale.core, hfscale.config, hfscale.checkpoints.
"""
