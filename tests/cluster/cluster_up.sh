#!/usr/bin/env bash
# cluster_up.sh -d DIR -i ID [-n N] [-e NAME=VALUE]... [-f]
#
# A fake N-node cluster on one Linux box (root required), for hfscale's multi-host tests.
# Node i (0..N-1) = network namespace "hfs${ID}-node$i" + its own UTS namespace (hostname node$i),
# mount namespace (private /etc/hosts) and PID namespace, running its own sshd on 10.78.${ID}.$((i+1)):22.
# The root namespace reaches every node through the bridge "hfsbr${ID}" (10.78.${ID}.254/24).
# Nothing is routed anywhere else: nodes have no default route; ip_forward is left alone.
#
#   -d DIR   cluster dir (keys, configs, logs, node HOME); created if missing; no whitespace.
#   -i ID    0..254; picks the subnet 10.78.ID.0/24 and the names; several IDs can coexist.
#   -n N     number of nodes, 1..200 (default 2).
#   -e NAME=VALUE   environment for every ssh session on the nodes (sshd SetEnv), repeatable.
#            Defaults: HOME=DIR/home (so root's real ~/.bashrc never runs in remote commands)
#            and PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin.
#            Put your interpreter's directory first, e.g. -e PATH=$(dirname $PY):/usr/bin:/bin
#   -f       first tear down leftovers of a crashed earlier cluster with the same ID.
#
# Client side: DIR/bin/ssh and DIR/bin/scp are wrappers adding -F DIR/ssh_config;
#   export PATH=DIR/bin:$PATH PDSH_RCMD_TYPE=ssh; pdsh -w node[0-1] hostname
# Files that tests may add under DIR/ssh_config.d/*.conf are included by DIR/ssh_config.
# If HFS_SSH_ARGV_LOG is set, the ssh wrapper appends its argument list to that file (one line per call).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
C="" ID="" N=2 FORCE=0
SETENV=()
while getopts "d:i:n:e:f" opt; do
  case $opt in
    d) C=$OPTARG ;;
    i) ID=$OPTARG ;;
    n) N=$OPTARG ;;
    e) SETENV+=("$OPTARG") ;;
    f) FORCE=1 ;;
    *) sed -n '2,25p' "$0" >&2; exit 2 ;;
  esac
done
[ -n "$C" ] && [ -n "$ID" ] || { echo "usage: cluster_up.sh -d DIR -i ID [-n N] [-e NAME=VALUE]... [-f]" >&2; exit 2; }
[[ "$ID" =~ ^[0-9]+$ ]] && [ "$ID" -le 254 ] || { echo "ID must be 0..254" >&2; exit 2; }
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] && [ "$N" -le 200 ] || { echo "N must be 1..200" >&2; exit 2; }
[[ "$C" =~ [[:space:]] ]] && { echo "cluster dir must not contain whitespace: $C" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "must be root" >&2; exit 1; }
PATH=$PATH:/usr/sbin:/sbin
for b in sshd ssh scp ssh-keygen pdsh ip unshare nsenter setsid; do
  command -v $b >/dev/null || {
    echo "missing $b (apt-get install -y --no-install-recommends openssh-server openssh-client pdsh iproute2 util-linux)" >&2; exit 1; }
done
SSHD=$(command -v sshd) SSH=$(command -v ssh) SCP=$(command -v scp)

mkdir -p "$C"
C=$(cd "$C" && pwd)
NET=10.78.$ID
BR=hfsbr$ID
DOWN=$HERE/cluster_down.sh

if [ "$FORCE" = 1 ]; then "$DOWN" -d "$C" -i "$ID" >/dev/null; fi
if [ -e "$C/nodes" ]; then echo "cluster already up ($C/nodes exists); run cluster_down.sh -d $C first" >&2; exit 1; fi
if ip link show "$BR" >/dev/null 2>&1 || ip netns list | grep -q "^hfs$ID-node"; then
  echo "ID $ID is in use (bridge $BR or netns hfs$ID-node* exists); pick another ID, or pass -f if it is a leftover" >&2
  exit 1
fi

trap 'echo "cluster_up.sh failed (line $LINENO); tearing down" >&2; "$DOWN" -d "$C" -i "$ID" >&2' ERR
mkdir -p "$C/bin" "$C/log" "$C/mnt" "$C/home" "$C/ssh_config.d"
chmod 700 "$C"
echo "$ID" > "$C/id"
echo "$N" > "$C/n"
mkdir -p /run/sshd            # sshd's compiled-in privsep dir (not created without systemd)

# ---- keys (reused if present) ----
[ -f "$C/id_ed25519" ]       || ssh-keygen -q -t ed25519 -N '' -C hfs-client -f "$C/id_ed25519"
[ -f "$C/ssh_host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hfs-host -f "$C/ssh_host_ed25519"
cp "$C/id_ed25519.pub" "$C/authorized_keys"
echo "node*,$NET.* $(cut -d' ' -f1,2 "$C/ssh_host_ed25519.pub")" > "$C/known_hosts"

# ---- private /etc/hosts seen inside every node ----
{ echo "127.0.0.1 localhost"; for i in $(seq 0 $((N-1))); do echo "$NET.$((i+1)) node$i"; done; } > "$C/hosts"

# ---- per-session environment (sshd SetEnv) ----
have() { local k; for k in "${SETENV[@]}"; do [ "${k%%=*}" = "$1" ] && return 0; done; return 1; }
have HOME || SETENV+=("HOME=$C/home")
have PATH || SETENV+=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
SETENV_LINE="SetEnv"
for kv in "${SETENV[@]}"; do
  case $kv in *=*) ;; *) echo "-e wants NAME=VALUE, got: $kv" >&2; exit 2 ;; esac
  case $kv in *'"'*) echo "-e value must not contain a double quote: $kv" >&2; exit 2 ;; esac
  SETENV_LINE+=" \"$kv\""
done
printf '%s\n' "${SETENV[@]}" > "$C/setenv"

# ---- sshd config (shared by all nodes; each runs in its own namespaces) ----
cat > "$C/sshd_config" <<EOF
Port 22
ListenAddress 0.0.0.0
HostKey $C/ssh_host_ed25519
PidFile none
AuthorizedKeysFile $C/authorized_keys
StrictModes no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 200:30:400
MaxSessions 200
AcceptEnv LANG LC_*
$SETENV_LINE
LogLevel ERROR
Subsystem sftp internal-sftp
EOF
"$SSHD" -t -f "$C/sshd_config"

# ---- client ssh config + wrappers ----
{
  echo "Include $C/ssh_config.d/*.conf"
  echo "Host node* $NET.*"
  echo "  User root"
  echo "  IdentityFile $C/id_ed25519"
  echo "  IdentitiesOnly yes"
  echo "  UserKnownHostsFile $C/known_hosts"
  echo "  GlobalKnownHostsFile /dev/null"
  echo "  StrictHostKeyChecking yes"
  echo "  CheckHostIP no"
  echo "  BatchMode yes"
  echo "  ConnectTimeout 5"
  echo "  LogLevel ERROR"
  for i in $(seq 0 $((N-1))); do printf 'Host node%s\n  HostName %s.%s\n' $i $NET $((i+1)); done
} > "$C/ssh_config"
for tool in ssh scp; do
  real=$SSH; [ $tool = scp ] && real=$SCP
  cat > "$C/bin/$tool" <<EOF
#!/bin/sh
[ -n "\${HFS_SSH_ARGV_LOG:-}" ] && printf '%s %s\n' "$tool" "\$*" >> "\$HFS_SSH_ARGV_LOG"
exec $real -F $C/ssh_config "\$@"
EOF
  chmod +x "$C/bin/$tool"
done
: > "$C/nodes"; : > "$C/pids"

# ---- network: root-ns bridge + one veth pair per node ----
ip link add "$BR" type bridge
ip addr add "$NET.254/24" dev "$BR"
ip link set "$BR" up
for i in $(seq 0 $((N-1))); do
  ns=hfs$ID-node$i
  ip netns add "$ns"
  echo "$ns" >> "$C/nodes"
  ip link add "hfs${ID}v$i" type veth peer name "hfs${ID}p$i"
  ip link set "hfs${ID}p$i" netns "$ns"
  ip link set "hfs${ID}v$i" master "$BR" up
  ip -n "$ns" link set "hfs${ID}p$i" name eth0
  ip -n "$ns" addr add "$NET.$((i+1))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
done

# ---- one sshd per node, PID 1 of its own pid ns: killing the unshare pid kills the whole node ----
for i in $(seq 0 $((N-1))); do
  ns=hfs$ID-node$i
  # nsenter, not 'ip netns exec' (that remounts /sys and hides /sys/fs/cgroup). Inside: private
  # /etc/hosts; best effort, a sysfs of this netns with the host cgroup tree re-bound under it.
  setsid nsenter --net=/run/netns/$ns unshare --uts --mount --pid --fork --kill-child --mount-proc \
    sh -c "set -e; mount --bind $C/hosts /etc/hosts; hostname node$i;
           if mount --rbind /sys/fs/cgroup $C/mnt 2>/dev/null; then
             mount -t sysfs sysfs /sys && mount --rbind $C/mnt /sys/fs/cgroup || true; umount -l $C/mnt || true
           fi
           exec $SSHD -D -e -f $C/sshd_config" \
    </dev/null >"$C/log/sshd-node$i.log" 2>&1 &
  echo $! >> "$C/pids"
done

# ---- wait until every sshd answers (in parallel) ----
wait_node() {
  local i=$1 t
  for t in $(seq 1 100); do
    "$C/bin/ssh" -o ConnectTimeout=1 "node$i" true 2>/dev/null && return 0
    sleep 0.1
  done
  echo "node$i did not come up; see $C/log/sshd-node$i.log" >&2; return 1
}
waiters=()
for i in $(seq 0 $((N-1))); do wait_node "$i" & waiters+=($!); done
ok=1
for w in "${waiters[@]}"; do wait "$w" || ok=0; done
if [ $ok = 0 ]; then trap - ERR; "$DOWN" -d "$C" -i "$ID" >&2; exit 1; fi
echo "cluster up: $N nodes (node0..node$((N-1)) = $NET.1..$NET.$N), config in $C"
echo "use:  export PATH=$C/bin:\$PATH PDSH_RCMD_TYPE=ssh; pdsh -w node[0-$((N-1))] hostname"
