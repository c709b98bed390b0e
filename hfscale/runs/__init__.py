"""Runs that exist: the registry of run directories (runs/status/logs), a run's history and its report,
and stopping a run.

Layer 7: may import the layers below (core .. launch).
"""
