"""A job that heals itself, across its attempts: ``supervisor`` (run an attempt, stop, decide,
relaunch), ``policy`` (its decisions, pure), ``settle`` (between two attempts: the stop taken
everywhere, which nodes answer, the master port free; pure), ``timeline`` (the attempts' record)
and ``requeue`` (a Slurm job requeued after its batch host was lost: where its attempts go on).

The top room of hfscale.launch: may import the layers below it and every other part of
hfscale.launch (tests/test_architecture.py holds this); nothing in hfscale.launch imports it.
"""
