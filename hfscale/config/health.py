"""The ``recovery.health_check`` section: a site's own check that a host is fit to train.

Every node runs it before its ranks start (each launch and relaunch: hfscale.launch.node.health_gate)
and every probe runs it before a spare or an excluded host is admitted (hfscale.launch.preflight.probes),
beside the built-in checks (the GPUs the slots promise are visible; no uncorrected ECC error and no
pending or failed row remapping where the driver reports them: hfscale.launch.node.health_checks).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from hfscale.config.base import Strict


class HealthCheckConfig(Strict):
    """A command each host runs before it is trusted with the job's ranks: exit 0 is healthy, any other
    exit (or still running after ``timeout``) keeps the host out, its output in the host's log."""

    command: str = Field(min_length=1, max_length=4096, description="Shell command run on each host (sh -c) "
                         "before its ranks start, at every launch "
                         "and relaunch, and by every probe of a spare or an excluded host (and by hfscale preflight). "
                         "Exit 0: healthy; anything else: the host is not admitted (a spare takes its place, or it is "
                         "left out as recovery allows). Runs as written, like runner.setup: no secret in it (ps "
                         "shows it).")
    timeout: int = Field(60, ge=1, le=3600, description="Seconds; a check still running then is killed and the host "
                         "counted unhealthy.")

    @field_validator("command")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if "\x00" in v or "\n" in v or "\r" in v:
            raise ValueError("must be one line (no NUL or line break): chain commands with && or ;")
        return v
