"""How a job is stopped on a node: by the job id in its processes' environment, with a grace
period and then SIGKILL (pure: shell text for the plans).

Names are never matched (another job's ``python`` looks the same), and process groups are not
enough: torchrun's workers and docker's containers leave the launcher's group or session. Every
process hfscale starts on a node carries ``HFSCALE_JOB_ID`` in the environment it was started
with (``/proc/<pid>/environ``; the shell running the node's line is started with it too), so one
``grep -z`` over ``/proc`` finds exactly this job's processes, the ones ``runner.setup`` started
included.
"""

from __future__ import annotations

JOB_ID_VAR = "HFSCALE_JOB_ID"
# TERM first (a rank saves a preemption checkpoint at its next step boundary), KILL after this many
# seconds: a stop is complete within 15 s of hfscale deciding on it
STOP_GRACE_S = 10


def stop_script(job_id: str) -> str:
    """Shell text: TERM this job's processes now; in the background, KILL what is left once they
    all ended or ``STOP_GRACE_S`` seconds passed. It returns at once (so a bounded fan-out reaches
    thousands of hosts within the grace period) and exits 0."""
    # job ids are validated ([a-z0-9-]): safe inside single quotes
    find = f"grep -lsxzF '{JOB_ID_VAR}={job_id}' /proc/[0-9]*/environ | cut -d/ -f3"
    # the waiting pass outlives the ssh session or the terminal: no HUP/INT, nothing held open
    wait_kill = (f"( trap '' HUP INT; n=0; while [ $n -lt {STOP_GRACE_S} ] && k 0; do sleep 1; n=$((n+1)); done; "
                 "k KILL ) </dev/null >/dev/null 2>&1 &")
    return f'k() {{ p=$({find}); [ -n "$p" ] && kill -$1 $p 2>/dev/null; [ -n "$p" ]; }}; k TERM; {wait_kill} true'
