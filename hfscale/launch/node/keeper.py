"""Each node's keeper: the node's own watch over its launcher (pure: shell text for the plans).

Started in the background by a node's line before its launcher (hfscale.launch.node.line), it
runs while that line runs and, every ``check_s`` seconds:

- rewrites ``<run dir>/alive/<host>`` every ``beat_s`` seconds (a counter, in place: ``1<>`` does
  not truncate), which tells a detached launch's follower and any later launch that the job still
  runs here;
- reads the launcher's heartbeat (hfscale.launch.attempt.beats.LauncherBeat). When it has not changed for
  ``lost_after_s`` seconds (the launcher was killed -9, its login node rebooted), the keeper appends
  a line saying so to ``logs/<host>.log``, writes ``orphaned/<host>`` and stops the job on this
  node as the launcher's cleanup would (the runner's own stop: TERM, so the ranks save a checkpoint
  at their next step, then KILL). The stop runs without the job id in its environment, so it does
  not find itself. The keeper carries the job id: the cleanup of a live launcher stops it too.

A job whose launcher is gone thus trains unwatched for at most ``lost_after_s`` + ``check_s``
seconds, and ends; the next launch resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import posixpath

from hfscale.core.shell import Line, Script, Sh, quote
from hfscale.launch.run_dir import BEATS_DIR, LAUNCHER_BEAT, LOGS_DIR, ORPHANED_DIR
from hfscale.launch.node.stopping import JOB_ID_VAR, STOP_GRACE_S
from hfscale.launch.spec import Keeper

HOST_VAR = "HFSCALE_HOST"  # set on the node before the keeper starts (hfscale.launch.node.line)
LAUNCHER_BEAT_S = 5  # the launcher rewrites its beat this often (hfscale.launch.attempt.beats.LauncherBeat)
NODE_BEAT_S = 10  # a node rewrites its beat this often
KEEPER_CHECK_S = 5  # a node reads the launcher's beat this often
LAUNCHER_LOST_S = 30  # a node stops its job when the launcher's beat has not changed for this long
# from the launcher's last beat to the job's last process on every node: noticed after LAUNCHER_LOST_S
# (+ one check), then TERM, KILL after the grace period, and a few seconds of slack
SELF_STOP_S = LAUNCHER_LOST_S + KEEPER_CHECK_S + STOP_GRACE_S + 5


def keeper_of(run_dir: str) -> Keeper:
    """The keeper of a job whose run directory is ``run_dir`` (which every node sees)."""
    return Keeper(posixpath.join(run_dir, LAUNCHER_BEAT), posixpath.join(run_dir, BEATS_DIR),
                  posixpath.join(run_dir, ORPHANED_DIR), posixpath.join(run_dir, LOGS_DIR), LAUNCHER_BEAT_S,
                  NODE_BEAT_S, KEEPER_CHECK_S, LAUNCHER_LOST_S, SELF_STOP_S)


def keeper_line(k: Keeper, stop: Line) -> Line:
    """``( <the keeper loop> ) </dev/null >/dev/null 2>&1 & hb=$!;``: what a node's shell runs
    before its launcher (``$HFSCALE_HOST`` set); ``kill $hb`` ends it with the line. ``stop``: the
    runner's stop of this job on this node."""
    host = f'"${HOST_VAR}"'
    beat = f"{quote(k.beats_dir)}/{host}"
    orphan = f"{quote(k.orphaned_dir)}/{host}"
    log = f"{quote(k.logs_dir)}/{host}.log"
    every = max(1, k.beat_s // k.check_s)
    said = (f"hfscale: $(date '+%F %T') ${HOST_VAR}: the launcher's heartbeat ({posixpath.basename(k.launcher_beat)} "
            f"in the run directory) has not changed for {k.lost_after_s} s: the launcher is gone (killed, or its host "
            f"lost); stopping this node's job (TERM: the ranks save a checkpoint at their next step; KILL after "
            f"{STOP_GRACE_S} s)")
    # the trap kills its jobs (the sleep), not only itself: a TERM between 'sleep &' and 'wait' would leave it
    loop = (f"( trap 'kill $(jobs -p) 2>/dev/null; exit 0' TERM; n=0; last=; same=0; "
            f"while kill -0 $$ 2>/dev/null; do "
            f"if [ $((n % {every})) = 0 ]; then printf '%012d\\n' $((n / {every} + 1)) 1<> {beat}; fi; "
            f"c=$(head -c 64 {quote(k.launcher_beat)} 2>/dev/null); "
            f'if [ -n "$c" ] && [ "$c" != "$last" ]; then last=$c; same=0; else same=$((same + {k.check_s})); fi; '
            f"if [ $same -ge {k.lost_after_s} ]; then "
            f'echo "{said}" >> {log}; date +%s > {orphan}; env -u {JOB_ID_VAR} bash -c')
    return Line.of(Sh(loop), Script(stop), Sh(f"; exit 0; fi; n=$((n + 1)); sleep {k.check_s} & wait $!; done ) "
                                              "</dev/null >/dev/null 2>&1 & hb=$!;", glue=True))
