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

import posixpath

JOB_ID_VAR = "HFSCALE_JOB_ID"
# TERM first (a rank saves a preemption checkpoint at its next step boundary), KILL after this many
# seconds: a stop is complete within 15 s of hfscale deciding on it
STOP_GRACE_S = 10


def stop_script(job_id: str, grace_s: int = STOP_GRACE_S) -> str:
    """Shell text: TERM this job's processes now; in the background, KILL those of them that are
    left once they all ended or ``grace_s`` seconds passed. It returns at once (so a bounded
    fan-out reaches thousands of hosts within the grace period) and exits 0. The KILL pass takes
    only the processes it TERMed (still carrying the job id): what starts under the same id in the
    meantime (a Slurm requeue of the job, a relaunch) is not this stop's.

    ``grace_s`` 0 is the stop after a hang (``LaunchPlan.kill``): ranks stuck in a collective run no
    signal handler and cannot save, so the grace would only be time lost before the relaunch."""
    # job ids are validated ([a-z0-9-]): safe inside single quotes
    find = f"grep -lsxzF '{JOB_ID_VAR}={job_id}' /proc/[0-9]*/environ | cut -d/ -f3"
    # the waiting pass outlives the ssh session or the terminal: no HUP/INT, nothing held open
    wait_kill = (f"( trap '' HUP INT; n=0; while [ $n -lt {int(grace_s)} ] && [ -n \"$(l)\" ]; do sleep 1; "
                 "n=$((n+1)); done; s=$(l); [ -n \"$s\" ] && kill -KILL $s ) </dev/null >/dev/null 2>&1 &")
    return (f"f() {{ {find}; }}; t=\" $(f | tr '\\n' ' ')\"; "
            "l() { for q in $(f); do case \"$t\" in *\" $q \"*) echo $q ;; esac; done; }; "
            f'[ -n "${{t# }}" ] && kill -TERM $t 2>/dev/null; {wait_kill} true')


def dump_script(job_id: str, stacks_dir: str, python: str) -> str:
    """Shell text: write the Python stack of each of this job's ranks on this node (processes
    with ``RANK`` in the environment they started with, or forked ranks with their ``pid-<host>-<pid>``
    file) to ``<stacks_dir>/rank-<RANK>.txt`` with py-spy (beside ``python``, or on PATH), or, without
    py-spy, signal SIGUSR2 to ranks that registered faulthandler for it (hfscale.training.heartbeat writes ``rank-<RANK>.fh``; a rank that did
    not would die of the signal). First it asks each rank for its flight recorder (a write to
    ``rank-<RANK>.fifo``, which hfscale.training.heartbeat reads). All ranks at once; exits 0."""
    from hfscale.core.shell import quote

    d, spy = quote(stacks_dir), quote(posixpath.join(posixpath.dirname(python), "py-spy"))
    one = (f'[ -p {d}/rank-$r.fifo ] && timeout 2 sh -c \'echo > "$0"\' {d}/rank-$r.fifo; '
           f's={spy}; [ -x "$s" ] || s=$(command -v py-spy); '
           f'if [ -n "$s" ] && "$s" dump --full-filenames --pid $p > {d}/rank-$r.txt 2>&1; then :; '
           f'elif [ -e {d}/rank-$r.fh ]; then rm -f {d}/rank-$r.txt; kill -USR2 $p; fi')
    # a rank forked by hfscale.training.warm_launcher was started with its launcher's environment (no RANK): its
    # rank is in <stacks_dir>/pid-<host>-<pid> (host: $HFSCALE_HOST of that environment) with its start time
    # (/proc/<pid>/stat field 22), which must match: a pid of an earlier attempt, reused since, is not a rank
    forked = ("h=$(tr '\\0' '\\n' < $f 2>/dev/null | sed -n 's/^HFSCALE_HOST=//p'); "
              'case "$h" in ""|*[!A-Za-z0-9._-]*) h=/ ;; esac; '
              f'if [ -z "$r" ] && read -r fr fs < {d}/pid-$h-$p 2>/dev/null && '
              "[ \"$fs\" = \"$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f20)\" ]; then "
              'case "$fr" in *[!0-9]*) ;; *) r=$fr ;; esac; fi; ')
    return (f"mkdir -p {d}; for f in $(grep -lsxzF '{JOB_ID_VAR}={job_id}' /proc/[0-9]*/environ); do "
            "p=${f#/proc/}; p=${p%/environ}; r=$(tr '\\0' '\\n' < $f 2>/dev/null | sed -n 's/^RANK=//p'); "
            f'{forked}[ -n "$r" ] || continue; ( {one} ) & done; wait; sleep 1; true')  # 1 s: the flight recorders' files
