"""A job that heals itself, across its attempts: ``supervisor`` (run an attempt, stop, decide,
relaunch), ``policy`` (its decisions, pure), ``settle`` (between two attempts: the stop taken
everywhere, which nodes answer, the master port free; pure), ``timeline`` (the attempts' record),
``in_process_events`` (the restarts the ranks make in their processes, into the timeline) and
``requeue`` (a Slurm job requeued after its batch host was lost: where its attempts go on).

The top room of hfscale.launch: may import the layers below it and every other part of
hfscale.launch (tests/test_architecture.py holds this); nothing in hfscale.launch imports it.
"""


def __getattr__(name: str) -> object:
    """The previous release's module of this name (hfscale.core.moved.MOVED_INTO_PACKAGE): its names
    still work, with a DeprecationWarning naming the module that holds them now."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
