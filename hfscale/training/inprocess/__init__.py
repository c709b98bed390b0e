"""In-process restart (``recovery.in_process``): when a node is lost, the ranks on the other nodes do
not exit. They leave the failed attempt, join the next one with the standby ranks of a spare node in
the lost node's place, and train on from the newest checkpoint with the interpreter, the imports and
the data they already have.

- ``assignment``: who is which rank in the next attempt (pure);
- ``restart``: the loop each rank runs around its training function, the store the processes meet on,
  leaving a process group and what the libraries cached of it;
- ``node_agent``: what each node runs in torchrun's place: it starts the node's ranks, and a rank that
  died again as a standby;
- ``store_host``: the store, run beside the launcher by hfscale.launch.attempt.execute;
- ``opt_in``: ``hfscale.restart_in_process``, a user script's opt-in through the public face.

The launcher's part (the plan: hfscale.launch.node.command; a failed node healed, not stopping the
others: hfscale.launch.attempt.in_process) starts these on the nodes.

May import core, config, checkpoints, rules and the rest of training; imports torch only inside the
functions that run in a rank (and in store_host's main).
"""
