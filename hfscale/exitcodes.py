"""hfscale's own exit codes (otherwise ``launch`` exits with the training's code, 128+N for signal N)."""

OK = 0
BAD_INPUT = 2  # a config, argument or output directory that cannot be used; nothing was started
UNREACHABLE = 3  # a host (or a scheduler) that cannot be reached
HUNG = 4  # the hang watchdog found no rank finishing a step (hfscale.watchdog); stacks in the run directory
