#!/usr/bin/env bash
# slurm_down.sh -c CLUSTER_DIR -s SLURM_DIR
# Stops what slurm_up.sh started, leaving the cluster itself up: inside the cluster's node network
# namespaces it kills job processes (SLURM_JOB_ID in their environment) and slurmstepd, then the
# daemons of THIS Slurm (slurmctld/slurmd whose command line names SLURM_DIR/slurm.conf, munged
# whose names SLURM_DIR's munge socket), then removes the controller state, spool and munge files
# (logs stay). Idempotent. Never looks outside this cluster's namespaces.
set -uo pipefail
C="" S=""
while getopts "c:s:" opt; do
  case $opt in
    c) C=$OPTARG ;;
    s) S=$OPTARG ;;
    *) echo "usage: slurm_down.sh -c CLUSTER_DIR -s SLURM_DIR" >&2; exit 2 ;;
  esac
done
[ -n "$C" ] && [ -n "$S" ] || { echo "usage: slurm_down.sh -c CLUSTER_DIR -s SLURM_DIR" >&2; exit 2; }
[ -d "$S" ] && S=$(cd "$S" && pwd)
ID=$(cat "$C/id" 2>/dev/null || true)
nslist=$( { cat "$C/nodes" 2>/dev/null; [ -n "$ID" ] && ip netns list 2>/dev/null | awk '{print $1}' | grep "^hfs$ID-node[0-9]*$"; } | sort -u)

# pids in our namespaces matching: jobs (environment) | steps | daemons of this Slurm dir
ours() {   # $1 = jobs|daemons
  local ns p cmd
  for ns in $nslist; do
    [ -e "/run/netns/$ns" ] || continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do
      cmd=$( { tr '\0' ' ' < "/proc/$p/cmdline"; } 2>/dev/null) || continue
      case $1 in
        jobs)
          case $cmd in slurmstepd*) echo "$p"; continue ;; esac
          { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -q '^SLURM_JOB_ID=' && echo "$p" ;;
        daemons)
          # the daemon itself, not the nsenter that started it: killed first, that parent would
          # leave its child to the machine's init, and the node's PID namespace lingers until
          # that init reaps it
          case $cmd in
            */slurmctld\ *"$S/slurm.conf"*|*/slurmd\ *"$S/slurm.conf"*|*/munged\ *"$S/munge/munge.sock"*)
              case ${cmd%% *} in */slurmctld|*/slurmd|*/munged) echo "$p" ;; esac ;;
          esac ;;
      esac
    done
  done
}
stop() {   # $1 = jobs|daemons: TERM, wait up to 3 s, then KILL
  local t pids
  for t in $(seq 1 31); do
    pids=$(ours "$1")
    [ -z "$pids" ] && return 0
    if [ "$t" -ge 30 ]; then kill -9 $pids 2>/dev/null; else [ "$t" = 1 ] && kill $pids 2>/dev/null; fi
    sleep 0.1
  done
}
stop jobs
stop daemons
if [ -d "$S" ]; then
  rm -rf "$S/state" "$S/spool" "$S/munge" "$S"/slurmd-*.pid "$S/slurmctld.pid" "$S/daemons"
fi
echo "slurm down ($S)"
exit 0
