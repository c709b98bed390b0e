"""In-process restart: when a node is lost, the ranks on the other nodes do
not exit. They leave the failed attempt, join the next one with the standby ranks of a spare node in
the lost node's place, and train on from the newest checkpoint with the interpreter, the imports and
the data they already have.

- ``assignment``: who is which rank in the next attempt (pure);
- ``restart``: the loop each rank runs around its training function, the store the processes meet on,
  leaving a process group and what the libraries cached of it.

The launcher's part (the standbys started on the spare nodes, a lost node not stopping the others, the
full relaunch when ``restart`` gives up) is not built yet: a launch sets none of this package's variables.

May import core, config, checkpoints, rules and the rest of training; imports torch only inside the
functions that run in a rank.
"""
