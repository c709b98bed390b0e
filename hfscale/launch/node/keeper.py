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
from hfscale.launch.run_dir import BEAT_ADDR, BEATS_DIR, LAUNCHER_BEAT, LOGS_DIR, ORPHANED_DIR
from hfscale.launch.node.stopping import JOB_ID_VAR, STOP_GRACE_S
from hfscale.launch.spec import Keeper

HOST_VAR = "HFSCALE_HOST"  # set on the node before the keeper starts (hfscale.launch.node.line)
LAUNCHER_BEAT_S = 5  # the launcher rewrites its beat this often (hfscale.launch.attempt.beats.LauncherBeat)
NODE_BEAT_S = 10  # a node rewrites its beat this often
KEEPER_CHECK_S = 5  # a node reads the launcher's beat this often
LAUNCHER_LOST_S = 30  # a node stops its job when the launcher's beat has not changed for this long
# from the launcher's last beat to the job's last process on every node: noticed after LAUNCHER_LOST_S
# (+ one check), then TERM, KILL after the grace period, and a few seconds of slack
SELF_STOP_S = LAUNCHER_LOST_S + KEEPER_CHECK_S + (LAUNCHER_BEAT_S + 1) + STOP_GRACE_S + 5
CONNECT_S = 5  # the heartbeat line's connect and its first answer, each at most
SSH_REACH = '"${SSH_CONNECTION%% *}"'  # the launcher's address as a node reached by ssh sees it
SRUN_REACH = '"$SLURM_LAUNCH_NODE_IPADDR"'  # ... and one whose line srun started
LOCAL_REACH = "127.0.0.1"  # ... and this host's own line (runner.type local)


def keeper_of(run_dir: str, reach: str = SSH_REACH) -> Keeper:
    """The keeper of a job whose run directory is ``run_dir`` (which every node sees); ``reach``:
    shell text for the launcher's address as a node sees it."""
    return Keeper(posixpath.join(run_dir, LAUNCHER_BEAT), posixpath.join(run_dir, BEATS_DIR),
                  posixpath.join(run_dir, ORPHANED_DIR), posixpath.join(run_dir, LOGS_DIR), LAUNCHER_BEAT_S,
                  NODE_BEAT_S, KEEPER_CHECK_S, LAUNCHER_LOST_S, SELF_STOP_S, posixpath.join(run_dir, BEAT_ADDR), reach)


def _line_open(k: Keeper) -> str:
    """Shell text: connect to the launcher's heartbeat line on fd 3 (``tcp=1``), or say once in
    the node's log why not (``tcp=0``: the files instead). The connect is tried first with a bound
    (bash's own /dev/tcp has none: a dropped SYN would wait minutes)."""
    if not k.beat_addr:
        return ""
    said = f"no heartbeat line to the launcher at $ip port $port; reading {posixpath.basename(k.launcher_beat)} instead"
    return (f"if read -r port tok addr < {quote(k.beat_addr)} 2>/dev/null; then ip={k.reach or '$addr'}; ip=${{ip:-$addr}}; "
            f"if timeout {CONNECT_S} bash -c ': <\"/dev/tcp/$1/$2\"' _ \"$ip\" \"$port\" 2>/dev/null "
            f'&& exec 3<>"/dev/tcp/$ip/$port" 2>/dev/null; then '
            f'printf "HFSBEAT1 %s %s\\n" "$tok" "${HOST_VAR}" >&3 2>/dev/null; read -r -t {CONNECT_S} -u 3 ack; fi; '
            f'if [ "$ack" = ok ]; then tcp=1; else exec 3<&- 3>&-; say "{said}"; fi; fi; ')


def keeper_line(k: Keeper, stop: Line) -> Line:
    """``( <the keeper loop> ) </dev/null >/dev/null 2>&1 & hb=$!;``: what a node's shell runs
    before its launcher (``$HFSCALE_HOST`` set); ``kill $hb`` ends it with the line. ``stop``: the
    runner's stop of this job on this node. Kept short: it rides in every node's command line."""
    host = f'"${HOST_VAR}"'
    every = max(1, k.beat_s // k.check_s)
    silent = f" has not answered on its heartbeat line for {k.lost_after_s} s"
    stale = f"'s heartbeat ({posixpath.basename(k.launcher_beat)}) has not changed for {k.lost_after_s} s"
    closed = 'same={k.lost_after_s}; why=" closed its heartbeat line"; '.format(k=k)
    # the line: a byte sent each check, its answer awaited; then a wait for the line's close (the launcher
    # killed: its kernel closes the socket, heard at once). Silent for lost_after_s: its host is gone.
    # An "x" on the line: the launch ended its attempt (not its death): back to the file, which the next
    # attempt rewrites (a node the stop did not reach must not take the close for a dead launcher).
    back = "tcp=0; same=0; exec 3<&- 3>&-; "
    line_check = (f"r=0; printf b >&3 2>/dev/null || r=1; [ $r = 1 ] || {{ read -r -t {k.check_s} -N 1 -u 3 c; r=$?; }}; "
                  f'if [ $r = 0 ] && [ "$c" = x ]; then {back}'
                  f"elif [ $r = 0 ]; then same=0; read -r -t {k.check_s} -N 1 -u 3 c; r=$?; "
                  f'if [ $r = 0 ] && [ "$c" = x ]; then {back}'
                  f"elif [ $r != 0 ] && [ $r -le 128 ]; then {closed}fi; "
                  f'elif [ $r -gt 128 ]; then same=$((same + {k.check_s})); why="{silent}"; w $((n + 2)); '
                  f"else {closed}fi; ")
    file_check = (f"[ $((n % {every})) = 0 ] && w $((n / {every} + 1)); "
                  f"c=$(head -c 64 {quote(k.launcher_beat)} 2>/dev/null); "
                  f'if [ -n "$c" ] && [ "$c" != "$last" ]; then last=$c; same=0; else same=$((same + {k.check_s})); '
                  f'why="{stale}"; fi; ')
    # w: the node's beat file; say: a line in its log
    helpers = (f"b={quote(k.beats_dir)}/{host}; l={quote(k.logs_dir)}/{host}.log; "
               f'w() {{ printf "%012d\\n" $1 1<> "$b"; }}; say() {{ echo "hfscale: $(date +%F\\ %T) ${HOST_VAR}: $1" >> "$l"; }}; ')
    # the line lost (closed without its "x", or silent): the launcher's file confirms before anything stops.
    # A launcher killed or frozen beats it no more; a node cut off from the launch (and its stop) whose file
    # still changes goes back to the file: it must not stop, or requeue, the job its launch carries on
    wait = k.launcher_beat_s + 1
    # (its own beat file beats meanwhile: a later launch sees that its job still runs here)
    confirm = (f"if [ $same -ge {k.lost_after_s} ] && [ $tcp = 1 ]; then {back}w $((n + 2)); c=$(head -c 64 "
               f"{quote(k.launcher_beat)} 2>/dev/null); sleep {wait} & wait $!; w $((n + 3)); "
               f"last=$(head -c 64 {quote(k.launcher_beat)} 2>/dev/null); "
               f'if [ -n "$last" ] && [ "$last" != "$c" ]; then say "the heartbeat line to the launcher is lost, '
               f'but {posixpath.basename(k.launcher_beat)} still changes: watching it instead"; '
               f'else same={k.lost_after_s}; why="$why, and {posixpath.basename(k.launcher_beat)} has not changed for '
               f'{wait} s"; fi; fi; ')
    said = f"the launcher$why: stopping this node's job (TERM: the ranks save a checkpoint; KILL after {STOP_GRACE_S} s)"
    # the trap kills its jobs (the sleep), not only itself: a TERM between 'sleep &' and 'wait' would leave it
    loop = (f"( trap 'kill $(jobs -p) 2>/dev/null; exit 0' TERM; n=0; last=; same=0; tcp=0; why=; {helpers}"
            f"w 0; {_line_open(k)}"
            f"while kill -0 $$ 2>/dev/null; do "
            f"if [ $tcp = 1 ]; then {line_check}else {file_check}fi; "
            f"{confirm}if [ $same -ge {k.lost_after_s} ]; then "
            f'say "{said}"; date +%s > {quote(k.orphaned_dir)}/{host}; env -u {JOB_ID_VAR} bash -c')
    return Line.of(Sh(loop), Script(stop), Sh(f"; exit 0; fi; n=$((n + 1)); [ $tcp = 1 ] || {{ sleep {k.check_s} & "
                                              "wait $!; }; done ) </dev/null >/dev/null 2>&1 & hb=$!;", glue=True))
