"""What runs inside each rank: the built-in entry point (train), the wrapper for users' own scripts
(run_script, trainer_hook), the Trainer callbacks, asynchronous DeepSpeed saves (async_save), the watchdog heartbeat each rank
writes, and a clean exit after saving.

Layer 5: may import the layers below (core, config, checkpoints, rules, render).
"""
