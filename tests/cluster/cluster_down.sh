#!/usr/bin/env bash
# cluster_down.sh -i ID [-d DIR]  (or  cluster_down.sh -d DIR, reading the ID from DIR/id)
# Tears down what cluster_up.sh created for that ID: kills the recorded node launchers and anything
# still inside the hfs${ID}-node* network namespaces, deletes those namespaces, their veths and the
# bridge hfsbr${ID}. Idempotent: safe to run repeatedly, after a failed cluster_up, or (with -i only)
# after a crashed run whose cluster dir is gone. Never touches other IDs.
set -uo pipefail
C="" ID=""
while getopts "d:i:" opt; do
  case $opt in
    d) C=$OPTARG ;;
    i) ID=$OPTARG ;;
    *) echo "usage: cluster_down.sh [-d DIR] [-i ID]" >&2; exit 2 ;;
  esac
done
[ -z "$ID" ] && [ -n "$C" ] && ID=$(cat "$C/id" 2>/dev/null)
[[ "$ID" =~ ^[0-9]+$ ]] && [ "$ID" -le 254 ] || { echo "cluster_down.sh: need -i ID (0..254) or -d DIR with DIR/id" >&2; exit 2; }
BR=hfsbr$ID
# 1. the per-node 'unshare --kill-child' launchers: killing one SIGKILLs that node's pid-ns init
#    (its sshd), and the kernel then kills every process in that node's pid namespace.
if [ -n "$C" ] && [ -f "$C/pids" ]; then
  for p in $(cat "$C/pids"); do
    grep -q unshare "/proc/$p/cmdline" 2>/dev/null && kill "$p" 2>/dev/null
  done
fi
# 2. namespaces: kill whatever is still inside one of ours, then delete the netns.
nslist=$( { [ -n "$C" ] && cat "$C/nodes" 2>/dev/null; ip netns list 2>/dev/null | awk '{print $1}' | grep "^hfs$ID-node[0-9]*$"; } | sort -u)
for ns in $nslist; do
  [ -e "/run/netns/$ns" ] || continue
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill "$p" 2>/dev/null; done
done
for ns in $nslist; do
  [ -e "/run/netns/$ns" ] || continue
  for t in $(seq 1 30); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -z "$pids" ] && break
    if [ "$t" -ge 10 ]; then kill -9 $pids 2>/dev/null; else kill $pids 2>/dev/null; fi
    sleep 0.1
  done
  ip netns del "$ns" 2>/dev/null
done
# 3. links: veth peers vanish with their netns; delete root-side leftovers and the bridge.
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^hfs${ID}v[0-9]+$"); do
  ip link del "$l" 2>/dev/null
done
ip link show "$BR" >/dev/null 2>&1 && ip link del "$BR" 2>/dev/null
if [ -n "$C" ]; then rm -f "$C/nodes" "$C/pids"; fi
echo "cluster down (id $ID)"
exit 0
