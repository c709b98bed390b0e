"""A real multi-host cluster on one Linux machine, for hfscale's launcher tests (and a Slurm on it).

Each node is a network namespace with its own UTS/mount/PID namespaces and its own sshd
(see ``cluster_up.sh``).  The filesystem is shared, so the same interpreter and checkout are
visible on every node; every ssh session gets PATH=<dir of sys.executable>:<cluster bin>:/usr/...
and HOME=<cluster dir>/home, so remote commands find this Python and never run root's ~/.bashrc.

IDs: a cluster takes the lowest free ID in 1..199 (subnet 10.78.ID.0/24) by holding an flock on
/run/hfscale-test-clusters/ID.lock for its lifetime.  An ID whose lock is free but which still has
namespaces/bridge is a leftover of a crashed run and is torn down first.  For clusters made by hand
with cluster_up.sh, use IDs 200..254.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import signal
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
UP = HERE / "cluster_up.sh"
DOWN = HERE / "cluster_down.sh"
LOCK_DIR = Path("/run/hfscale-test-clusters")
AUTO_IDS = range(1, 200)
APT_INSTALL = "apt-get install -y --no-install-recommends openssh-server openssh-client pdsh iproute2 util-linux"
REQUIRED_BINARIES = ("sshd", "ssh", "scp", "ssh-keygen", "pdsh", "ip", "unshare", "nsenter", "setsid")
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a test cluster (kind is 'not-root', 'no-namespaces' or 'missing-binaries')."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass
class Cluster:
    dir: Path
    id: int
    nodes: list[str]
    addresses: dict[str, str]
    ssh_config: Path
    bin: Path
    home: Path
    bridge_address: str
    _launcher_pids: list[int] = field(default_factory=list, repr=False)
    _lock_fd: int | None = field(default=None, repr=False)

    @property
    def hostlist(self) -> str:
        """``node0,node1,...`` for ``pdsh -w``."""
        return ",".join(self.nodes)

    def netns(self, node: str) -> str:
        return f"hfs{self.id}-{node}"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for client commands (ssh, pdsh, launchers) run from the root namespace."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}:{env.get('PATH', STD_PATH)}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        return env


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


_preflight_cache: ClusterUnavailable | None | bool = False


def preflight() -> ClusterUnavailable | None:
    """Why this machine cannot run a cluster, or None.  Cached: probing creates a netns once."""
    global _preflight_cache
    if _preflight_cache is not False:
        return _preflight_cache  # type: ignore[return-value]
    problem: ClusterUnavailable | None = None
    if os.geteuid() != 0:
        problem = ClusterUnavailable("not-root", "the multi-host test cluster needs root (network namespaces, sshd)")
    else:
        missing = [b for b in REQUIRED_BINARIES if _which(b) is None]
        if missing:
            problem = ClusterUnavailable(
                "missing-binaries", f"missing {', '.join(missing)}; install with: apt-get update && {APT_INSTALL}"
            )
        else:
            probe = f"hfsprobe{os.getpid()}"
            steps = [
                [_which("ip"), "netns", "add", probe],
                [_which("unshare"), "--uts", "--mount", "--pid", "--fork", "--mount-proc", "true"],
            ]
            try:
                for cmd in steps:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                    if r.returncode != 0:
                        problem = ClusterUnavailable(
                            "no-namespaces",
                            f"namespaces not permitted here: `{' '.join(cmd)}` failed: {r.stderr.strip()}",
                        )
                        break
            finally:
                subprocess.run([_which("ip"), "netns", "del", probe], capture_output=True)
    _preflight_cache = problem
    return problem


def _try_lock(cluster_id: int) -> int | None:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_DIR / f"{cluster_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def start_cluster(
    n: int,
    workdir: Path | str,
    *,
    setenv: dict[str, str] | None = None,
    cluster_id: int | None = None,
) -> Cluster:
    """Start an ``n``-node cluster with its files under ``workdir`` (must not contain whitespace).

    ``setenv`` adds/overrides variables of every remote ssh session.  ``cluster_id`` forces an ID
    (its lock must be free); by default the lowest free ID in 1..199 is taken.
    Raises ClusterUnavailable if the machine cannot do it, RuntimeError if starting failed.
    """
    problem = preflight()
    if problem is not None:
        raise problem
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if cluster_id is None:
        for cid in AUTO_IDS:
            fd = _try_lock(cid)
            if fd is not None:
                cluster_id = cid
                break
        else:
            raise RuntimeError(f"no free cluster ID in {AUTO_IDS} (locks under {LOCK_DIR})")
    else:
        fd = _try_lock(cluster_id)
        if fd is None:
            raise RuntimeError(f"cluster ID {cluster_id} is held by another live process ({LOCK_DIR})")
    env_entries = {
        "PATH": f"{os.path.dirname(sys.executable)}:{workdir / 'bin'}:{STD_PATH}",
        "HOME": str(workdir / "home"),
        **(setenv or {}),
    }
    cmd = [str(UP), "-f", "-d", str(workdir), "-i", str(cluster_id), "-n", str(n)]
    for k, v in env_entries.items():
        cmd += ["-e", f"{k}={v}"]
    try:
        # -f: the lock is ours, so anything left with this ID is from a crashed run: tear it down first.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except BaseException:
        subprocess.run([str(DOWN), "-d", str(workdir), "-i", str(cluster_id)], capture_output=True)
        os.close(fd)
        raise
    if r.returncode != 0:
        os.close(fd)
        raise RuntimeError(f"cluster_up.sh failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr}")
    net = f"10.78.{cluster_id}"
    nodes = [f"node{i}" for i in range(n)]
    cluster = Cluster(
        dir=workdir,
        id=cluster_id,
        nodes=nodes,
        addresses={f"node{i}": f"{net}.{i + 1}" for i in range(n)},
        ssh_config=workdir / "ssh_config",
        bin=workdir / "bin",
        home=workdir / "home",
        bridge_address=f"{net}.254",
        _launcher_pids=[int(p) for p in (workdir / "pids").read_text().split()],
        _lock_fd=fd,
    )
    atexit.register(stop_cluster, cluster)
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    """Tear the cluster down and release its ID.  Idempotent: once stopped (ID released, maybe
    already reused by another run), later calls do nothing."""
    if cluster._lock_fd is None:
        return
    subprocess.run(
        [str(DOWN), "-d", str(cluster.dir), "-i", str(cluster.id)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    if cluster._lock_fd is not None:
        os.close(cluster._lock_fd)
        cluster._lock_fd = None


def run_on(
    cluster: Cluster, node: str, cmd: str, *, timeout: float = 60, check: bool = False, input: str | None = None
) -> subprocess.CompletedProcess:
    """``ssh node cmd`` through the cluster's ssh config; text output captured."""
    return subprocess.run(
        [str(cluster.bin / "ssh"), node, cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def cmdline(pid: int) -> str | None:
    """The command line of ``pid`` as one string (None when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _is_infra(pid: int, cmd: str, cluster: Cluster) -> bool:
    return pid in cluster._launcher_pids or cmd.startswith("sshd:") or cmd.split(" ", 1)[0].endswith("/sshd")


def pids_in_node(cluster: Cluster, node: str, *, include_infra: bool = False) -> dict[int, str]:
    """Processes living in ``node`` (pid in the root PID namespace -> command line).

    Without ``include_infra`` the node's own machinery (its launcher, sshd and sshd session
    processes) is left out, so what remains is what commands started there.
    """
    r = subprocess.run(["ip", "netns", "pids", cluster.netns(node)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip netns pids {cluster.netns(node)}: {r.stderr.strip()}")
    out: dict[int, str] = {}
    for tok in r.stdout.split():
        pid = int(tok)
        cmd = cmdline(pid)
        if cmd is None or (not include_infra and _is_infra(pid, cmd, cluster)):
            continue
        out[pid] = cmd
    return out


FREEZERS = (Path("/sys/fs/cgroup/freezer"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _freezer() -> tuple[Path, str] | None:
    """A cgroup hierarchy that can freeze processes: v1's freezer, else v2 (``cgroup.freeze``)."""
    for root in FREEZERS:
        if root.name == "freezer" and (root / "cgroup.procs").exists():
            return root, "v1"
        if (root / "cgroup.subtree_control").exists():
            return root, "v2"
    return None


def kill_node_at_once(cluster: Cluster, node: str, *, timeout: float = 20) -> int:
    """Kill every process of ``node`` but its ssh machinery (``pids_in_node``) at one instant, as a host that
    dies takes them all at once: they are moved into a cgroup, frozen there together, sent SIGKILL while
    frozen and thawed, so none of them runs again. Processes killed one by one see each other die, and
    SIGSTOP is job control: once their parent died, the kernel sends stopped process groups SIGHUP and
    SIGCONT, and an srun woken so cancels its step (a CI run lost the other nodes' watch steps to that).
    Returns how many processes were killed."""
    found = _freezer()
    if found is None:
        raise RuntimeError("kill_node_at_once needs a cgroup freezer (v1 freezer or cgroup v2); none is mounted")
    root, version = found
    group = root / f"hfscale-test-kill-{os.getpid()}-{node}"
    group.mkdir(exist_ok=True)
    procs = group / "cgroup.procs"

    def members() -> set[int]:
        return {int(t) for t in procs.read_text().split()}

    def freeze() -> None:
        if version == "v1":
            (group / "freezer.state").write_text("FROZEN")
        else:
            (group / "cgroup.freeze").write_text("1")

    deadline = time.monotonic() + timeout
    try:
        freeze()  # an empty frozen group: each process moved in stops there at once
        while True:
            inside = members()
            outside = [pid for pid in pids_in_node(cluster, node) if pid not in inside]
            if not outside:
                break  # a child forked before its parent moved in is found by the next listing
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{node}: processes {outside} did not move into {group}")
            for pid in outside:
                try:
                    procs.write_text(str(pid))
                except OSError:  # gone meanwhile
                    pass
        killed = members()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)  # pending while frozen: nothing runs between two kills
        if version == "v1":
            (group / "freezer.state").write_text("THAWED")
        else:
            (group / "cgroup.freeze").write_text("0")
        while members():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{node}: processes {sorted(members())} outlived SIGKILL")
            time.sleep(0.05)
        return len(killed)
    finally:
        try:
            group.rmdir()
        except OSError:
            pass


def leftover_processes(cluster: Cluster, *, timeout: float = 0, contains: str = "",
                       but: Iterable[str] = ()) -> dict[str, dict[int, str]]:
    """Non-infrastructure processes on any node but ``but`` whose command line contains ``contains``.

    Polls up to ``timeout`` seconds for them to go; returns {node: {pid: cmdline}} ({} when clean).
    """
    deadline, skip = time.monotonic() + timeout, frozenset(but)  # read once: ``but`` may be an iterator
    while True:
        found = {}
        for node in (n for n in cluster.nodes if n not in skip):
            procs = {p: c for p, c in pids_in_node(cluster, node).items() if contains in c}
            if procs:
                found[node] = procs
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# Slurm on the cluster (slurm_up.sh / slurm_down.sh): munged + slurmctld on node0, one slurmd per
# node, node names = the nodes' hostnames. Clients (sbatch, squeue, scontrol, scancel, sinfo) run
# in the root namespace with Slurm.env(): SLURM_CONF points at this Slurm's config.
# ---------------------------------------------------------------------------------------------

SLURM_UP = HERE / "slurm_up.sh"
SLURM_DOWN = HERE / "slurm_down.sh"
SLURM_APT_INSTALL = "apt-get install -y --no-install-recommends slurm-wlm munge"
SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
SLURM_FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class SlurmUnavailable(ClusterUnavailable):
    """This machine cannot run the test Slurm (kind 'missing-slurm', or a ClusterUnavailable kind)."""


def slurm_preflight() -> ClusterUnavailable | None:
    """Why this machine cannot run a Slurm test cluster, or None."""
    problem = preflight()
    if problem is not None:
        return problem
    missing = [b for b in SLURM_BINARIES if _which(b) is None]
    if missing:
        return SlurmUnavailable(
            "missing-slurm", f"missing {', '.join(missing)}; install with: apt-get update && {SLURM_APT_INSTALL}")
    return None


@dataclass
class Slurm:
    cluster: Cluster
    dir: Path
    conf: Path
    nodes: list[str]
    partition: str = "debug"
    requeue_delay: int = 10
    _up: bool = field(default=False, repr=False)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm clients and for ``hfscale launch`` from the root namespace.

        SLURM_CONF selects this Slurm; this Python's directory comes first in PATH (a batch job gets
        the submitter's environment, so its ``python`` is this one); inherited SLURM_* variables
        (pytest itself inside a Slurm job) are dropped so nothing believes it is in an allocation.
        """
        env = {k: v for k, v in self.cluster.env(base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
        return env

    def run(self, *argv: str, timeout: float = 60, check: bool = True, cwd: Path | str | None = None
            ) -> subprocess.CompletedProcess:
        """A Slurm client command (``sbatch ...``, ``scontrol ...``) with this Slurm's environment."""
        r = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, cwd=cwd)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed (rc={r.returncode}):\n{r.stdout}{r.stderr}")
        return r

    def sbatch(self, *args: str, cwd: Path | str | None = None) -> str:
        """``sbatch --parsable ARGS``; returns the job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, StdOut, ...).
        Finished jobs stay visible for an hour (MinJobAge)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        out: dict[str, str] = {}
        for word in text.split():
            if "=" in word:
                key, _, value = word.partition("=")
                out.setdefault(key, value)
        return out

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait(self, job_id: str, states=SLURM_FINISHED, *, timeout: float = 120, poll: float = 0.2
             ) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` (default: any finished state); returns
        the job's fields. Raises TimeoutError with the last state and the controller log tail."""
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f}s: "
                                   f"{info.get('JobState')} ({info.get('Reason')})\n{self.log_tail()}")
            time.sleep(poll)

    def job_processes(self, *, timeout: float = 0, but: Iterable[str] = ()) -> dict[str, dict[int, str]]:
        """Processes of Slurm jobs still on the nodes but ``but`` (slurmstepd, or SLURM_JOB_ID in the
        environment), as {node: {pid: cmdline}}; polls up to ``timeout`` seconds for them to go ({} when none)."""
        deadline, skip = time.monotonic() + timeout, frozenset(but)  # read once: ``but`` may be an iterator
        while True:
            found: dict[str, dict[int, str]] = {}
            for node in (n for n in self.nodes if n not in skip):
                for pid, cmd in pids_in_node(self.cluster, node).items():
                    try:
                        environ = Path(f"/proc/{pid}/environ").read_bytes()
                    except OSError:
                        continue
                    if cmd.startswith("slurmstepd") or b"\0SLURM_JOB_ID=" in b"\0" + environ:
                        found.setdefault(node, {})[pid] = cmd
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def stop_slurmd(self, node: str) -> int:
        """Stop ``node``'s slurmd (SIGTERM), as an administrator's ``systemctl stop slurmd`` would: its
        jobs' steps (slurmstepd) run on; slurmctld sets the node DOWN after SlurmdTimeout. Its pid."""
        for line in (self.dir / "daemons").read_text().split("\n"):
            words = line.split()
            if words[:2] == ["slurmd", node]:
                for pid in subprocess.run(["pgrep", "-P", words[2]], capture_output=True, text=True).stdout.split():
                    os.kill(int(pid), signal.SIGTERM)
                    return int(pid)
        raise RuntimeError(f"no slurmd of {node} in {self.dir / 'daemons'}")

    def log_tail(self, lines: int = 30) -> str:
        """The end of slurmctld's and every slurmd's log, for failure messages."""
        out = []
        for log in sorted((self.dir / "log").glob("slurm*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)


def start_slurm(cluster: Cluster, workdir: Path | str | None = None, *, cpus: int | None = None,
                requeue_delay: int = 10, slurmd_timeout: int | None = None) -> Slurm:
    """Start Slurm on a running cluster; its files go to ``workdir`` (default ``<cluster dir>/slurm``).

    ``cpus``: CPUs declared per node (default this machine's count). ``requeue_delay``: seconds a
    requeued job waits before it may start again (Slurm's job credential lifetime; its default is 120).
    ``slurmd_timeout``: Slurm's SlurmdTimeout (default 300): a node whose slurmd stopped or whose link
    is cut is set DOWN, and srun says "Node failure on <node>", after about 2-3 times this.
    Raises ClusterUnavailable/SlurmUnavailable if the machine cannot do it, RuntimeError if starting failed.
    """
    problem = slurm_preflight()
    if problem is not None:
        raise problem
    sdir = Path(workdir).resolve() if workdir is not None else cluster.dir / "slurm"
    socket = sdir / "spool" / max(cluster.nodes, key=len) / f"{max(cluster.nodes, key=len)}_4294967291.4294967291"
    if len(str(socket)) >= 108:  # slurmstepd cannot create its step socket: every job would stay pending
        raise RuntimeError(f"the Slurm folder {sdir} is too long for slurmstepd's sockets ({socket}: "
                           f"{len(str(socket))} bytes, at most 107); give a shorter one")
    cmd = [str(SLURM_UP), "-c", str(cluster.dir), "-s", str(sdir), "-r", str(requeue_delay)]
    if cpus is not None:
        cmd += ["-p", str(cpus)]
    if slurmd_timeout is not None:
        cmd += ["-t", str(slurmd_timeout)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"slurm_up.sh failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr}")
    slurm = Slurm(cluster=cluster, dir=sdir, conf=sdir / "slurm.conf", nodes=list(cluster.nodes),
                  requeue_delay=requeue_delay, _up=True)
    atexit.register(stop_slurm, slurm)  # runs before the cluster's own atexit stop (LIFO)
    return slurm


def stop_slurm(slurm: Slurm) -> None:
    """Stop jobs and daemons of this Slurm and remove its state (logs stay); the cluster stays up.
    Idempotent."""
    if not slurm._up:
        return
    subprocess.run([str(SLURM_DOWN), "-c", str(slurm.cluster.dir), "-s", str(slurm.dir)],
                   capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    slurm._up = False


CPU_CGROUPS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
CFS_PERIOD_US = 100_000


def _cpu_cgroup() -> tuple[Path, str] | None:
    """A cgroup hierarchy with the cpu controller: v1's (``cpu.cfs_quota_us``), else v2's (``cpu.max``)."""
    for root in CPU_CGROUPS:
        if root.name == "cpu" and (root / "cpu.cfs_quota_us").exists():
            return root, "v1"
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root, "v2"
    return None


@contextmanager
def throttled(cluster: Cluster, node: str, share: float, *, timeout: float = 20) -> Iterator[Path]:
    """Hold every process of ``node`` (its sshd too, so that what it starts later is held as well) to
    ``share`` of one CPU, as a node with a throttled or failing accelerator trains slower than its peers:
    they move into a cgroup with a CPU quota (v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``). On leaving, they
    move back and the cgroup is removed. Yields the cgroup's folder."""
    found = _cpu_cgroup()
    if found is None:
        raise RuntimeError("throttled needs the cgroup cpu controller (v1 cpu or v2 cpu.max); none is usable")
    root, version = found
    group = root / f"hfscale-test-slow-{os.getpid()}-{node}"
    group.mkdir(exist_ok=True)
    quota = max(1000, int(CFS_PERIOD_US * share))
    if version == "v1":
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
    procs = group / "cgroup.procs"

    def move(pids, into: Path) -> None:
        for pid in pids:
            try:
                into.write_text(str(pid))
            except OSError:  # gone meanwhile
                pass

    try:
        deadline = time.monotonic() + timeout
        while True:
            inside = {int(t) for t in procs.read_text().split()}
            outside = [pid for pid in pids_in_node(cluster, node, include_infra=True) if pid not in inside]
            if not outside:
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{node}: processes {outside} did not move into {group}")
            move(outside, procs)
        yield group
    finally:
        for _ in range(50):  # each move may race a fork: until the group is empty
            left = [int(t) for t in procs.read_text().split()]
            if not left:
                break
            move(left, root / "cgroup.procs")
        try:
            group.rmdir()
        except OSError:
            pass
