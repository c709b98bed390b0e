#!/usr/bin/env bash
# slurm_up.sh -c CLUSTER_DIR -s SLURM_DIR [-p CPUS] [-r SECONDS] [-t SECONDS] [-e NAME=VALUE]...
#
# A multi-node Slurm on top of a running cluster_up.sh cluster (apt-get install slurm-wlm munge).
# Everything runs INSIDE the cluster's nodes, so it dies with the cluster and two clusters never
# share a port:
#   node0:  munged (its socket is a file under SLURM_DIR, so every namespace uses it) + slurmctld
#   nodeI:  one slurmd -N nodeI (node names = the nodes' hostnames), in all of that node's namespaces
# Clients run anywhere with SLURM_CONF=SLURM_DIR/slurm.conf (the controller address is node0's IP on
# the cluster bridge, reachable from the root namespace): sbatch, squeue, scontrol, scancel, sinfo.
# Jobs run as root on the shared filesystem, with the submitter's environment (sbatch --export=ALL).
#
#   -c DIR   the cluster dir of cluster_up.sh (reads id, nodes, pids, setenv)
#   -s DIR   Slurm's dir: slurm.conf, munge key/socket, controller state, spool, logs; no whitespace
#   -p N     CPUs declared per node (default: this machine's count; more than that is allowed,
#            slurmd then reports the configured value: SlurmdParameters=config_overrides)
#   -r SECONDS  job credential lifetime (AuthInfo cred_expire, default 10; Slurm's own default is
#            120). It is also how long a requeued job waits before it may start again.
#   -t SECONDS  SlurmdTimeout: how long a node's slurmd may not answer before slurmctld sets the node
#            DOWN (default 300, Slurm's own); srun then says "Node failure on <node>" about 2-3 times this
#   -e NAME=VALUE   environment of the daemons (slurmd passes it to prolog/epilog; jobs get the
#            submitter's). Default: the cluster's ssh session environment (CLUSTER_DIR/setenv).
#
# Stop with slurm_down.sh -c CLUSTER_DIR -s SLURM_DIR (or just cluster_down.sh: the kernel ends the rest).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
C="" S="" CPUS="" CRED=10 SLURMD_TIMEOUT=300
SETENV=()
while getopts "c:s:p:r:t:e:" opt; do
  case $opt in
    c) C=$OPTARG ;;
    s) S=$OPTARG ;;
    p) CPUS=$OPTARG ;;
    r) CRED=$OPTARG ;;
    t) SLURMD_TIMEOUT=$OPTARG ;;
    e) SETENV+=("$OPTARG") ;;
    *) sed -n '2,22p' "$0" >&2; exit 2 ;;
  esac
done
[ -n "$C" ] && [ -n "$S" ] || { echo "usage: slurm_up.sh -c CLUSTER_DIR -s SLURM_DIR [-p CPUS] [-r SECONDS] [-e NAME=VALUE]..." >&2; exit 2; }
[[ "$S" =~ [[:space:]] ]] && { echo "slurm dir must not contain whitespace: $S" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "must be root" >&2; exit 1; }
PATH=$PATH:/usr/sbin:/sbin
for b in slurmctld slurmd munged sbatch squeue scontrol scancel sinfo nsenter setsid pgrep; do
  command -v $b >/dev/null || { echo "missing $b (apt-get install -y --no-install-recommends slurm-wlm munge)" >&2; exit 1; }
done
[ -s "$C/nodes" ] && [ -s "$C/pids" ] || { echo "cluster not up (no $C/nodes)" >&2; exit 1; }
[ -e "$S/daemons" ] && { echo "slurm already up in $S; run slurm_down.sh first" >&2; exit 1; }
[ -z "$CPUS" ] && CPUS=$(nproc)
[[ "$CPUS" =~ ^[0-9]+$ ]] && [ "$CPUS" -ge 1 ] || { echo "-p wants a CPU count" >&2; exit 2; }
[[ "$CRED" =~ ^[0-9]+$ ]] || { echo "-r wants seconds" >&2; exit 2; }
[[ "$SLURMD_TIMEOUT" =~ ^[0-9]+$ ]] || { echo "-t wants seconds" >&2; exit 2; }
ID=$(cat "$C/id"); N=$(wc -l < "$C/nodes"); NET=10.78.$ID
[ ${#SETENV[@]} = 0 ] && [ -f "$C/setenv" ] && mapfile -t SETENV < "$C/setenv"
SLURMCTLD=$(command -v slurmctld) SLURMD=$(command -v slurmd) MUNGED=$(command -v munged)

mkdir -p "$S"
S=$(cd "$S" && pwd)
trap 'echo "slurm_up.sh failed (line $LINENO); stopping what started" >&2; "$HERE/slurm_down.sh" -c "$C" -s "$S" >&2' ERR
mkdir -p "$S/munge" "$S/state" "$S/log" "$S/spool"
for i in $(seq 0 $((N-1))); do mkdir -p "$S/spool/node$i"; done
: > "$S/daemons"

# the node's pid-namespace init (its sshd): nsenter -t <it> -a joins all of that node's namespaces
mapfile -t LAUNCHERS < "$C/pids"
node_init() { pgrep -P "${LAUNCHERS[$1]}" | head -n1; }

# ---- munge: one daemon (root; socket and key private to this Slurm) ----
chmod 700 "$S/munge"
[ -f "$S/munge/munge.key" ] || dd if=/dev/urandom of="$S/munge/munge.key" bs=1 count=128 status=none
chmod 400 "$S/munge/munge.key"
INIT0=$(node_init 0)
nsenter -t "$INIT0" -a env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$MUNGED" --force \
  --socket="$S/munge/munge.sock" --key-file="$S/munge/munge.key" --log-file="$S/munge/munged.log" \
  --pid-file="$S/munge/munged.pid" --seed-file="$S/munge/munged.seed" --num-threads=2
echo "munged node0 $(cat "$S/munge/munged.pid")" >> "$S/daemons"   # pid as seen inside node0

# ---- slurm.conf ----
cat > "$S/slurm.conf" <<EOF
# written by hfscale's tests/cluster/slurm_up.sh for cluster $C
ClusterName=hfs$ID
SlurmctldHost=node0($NET.1)
AuthType=auth/munge
AuthInfo=socket=$S/munge/munge.sock,cred_expire=$CRED
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$S/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
SlurmdTimeout=$SLURMD_TIMEOUT
SchedulerParameters=sched_interval=2,sched_min_interval=100000
NodeName=node[0-$((N-1))] NodeAddr=$NET.[1-$N] CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=node[0-$((N-1))] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
printf 'SLURM_CONF=%s\n' "$S/slurm.conf" > "$S/env"

# ---- slurmctld on node0, one slurmd per node (foreground, -D; setsid so no terminal signal reaches them)
ENVV=(env -i "${SETENV[@]}")
setsid nsenter -t "$INIT0" -a "${ENVV[@]}" "$SLURMCTLD" -D -i -f "$S/slurm.conf" \
  </dev/null > "$S/log/slurmctld.out" 2>&1 &
echo "slurmctld node0 $!" >> "$S/daemons"
for i in $(seq 0 $((N-1))); do
  setsid nsenter -t "$(node_init "$i")" -a "${ENVV[@]}" "$SLURMD" -D -N "node$i" -f "$S/slurm.conf" \
    </dev/null > "$S/log/slurmd-node$i.out" 2>&1 &
  echo "slurmd node$i $!" >> "$S/daemons"
done

# ---- wait until every node is idle ----
export SLURM_CONF=$S/slurm.conf
for t in $(seq 1 300); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$' || true)
  if [ "$idle" = "$N" ]; then
    trap - ERR
    echo "slurm up: $N idle nodes (controller node0 = $NET.1); use SLURM_CONF=$S/slurm.conf sbatch ..."
    exit 0
  fi
  sleep 0.1
done
trap - ERR
echo "slurm did not come up in 30 s; sinfo says:" >&2
sinfo -N >&2 || true
tail -n 20 "$S/log/slurmctld.log" "$S"/log/slurmd-*.log >&2 2>/dev/null || true
"$HERE/slurm_down.sh" -c "$C" -s "$S" >&2
exit 1
