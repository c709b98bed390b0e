"""Launching a job: the launch plan value (spec) and its builder (build), what starts on a node
(node_command), ssh and preflight checks, the run directory, and the one module that starts processes
(execute) with its followers (follow, watchdog, console). ``runners`` holds one Runner per runner.type.

Layer 6: may import the layers below (core, config, checkpoints, rules, render, training).
"""
