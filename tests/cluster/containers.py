"""Real containers on the test cluster: podman behind a ``docker``-compatible wrapper on every node.

Docker's engine cannot run on this machine; podman (Debian packages ``podman runc``) can, with the
flags in ../shared/testbed/NOTES.md (vfs storage, cgroupfs, runc, file events). The wrapper passes
those global flags and keeps one storage root per node (``$(hostname)`` inside the node), then
hands every argument to podman unchanged, which accepts the ``docker run`` arguments hfscale
renders. So the test exercises hfscale's real pdsh_docker plan, only with ``docker.binary`` set to
the wrapper.

No registry is reachable, so the image is a few empty directories imported from a tarball; the
interpreter, the libraries and the code reach the container as read-only bind mounts of the host's
own paths (which is exactly what ``docker.mounts`` is for).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import Cluster, ClusterUnavailable, run_on

IMAGE = "localhost/hfscale-test:latest"
APT_LINE = "apt-get install -y podman runc"


def podman_preflight() -> ClusterUnavailable | None:
    """Why containers cannot run here (podman or runc missing), or None."""
    missing = [tool for tool, path in (("podman", shutil.which("podman")), ("runc", _runc())) if path is None]
    if missing:
        return ClusterUnavailable("containers", f"{', '.join(missing)} not installed ({APT_LINE})")
    return None


def _runc() -> str | None:
    return shutil.which("runc") or (str(Path("/usr/sbin/runc")) if Path("/usr/sbin/runc").exists() else None)


@dataclass
class Podman:
    """The wrapper (``binary``) and what a config needs to run the test image on the cluster."""

    binary: Path
    storage: Path
    image: str = IMAGE

    def host_mounts(self, *paths: Path | str, writable: tuple[Path | str, ...] = ()) -> list[dict]:
        """``docker.mounts`` entries: the system and this interpreter read-only, ``writable`` read-write.

        /etc/alternatives holds the targets of /usr/bin/c++ and friends: DeepSpeed JIT-builds its
        CPU op with ``c++`` when the shared build cache needs it."""
        ro = ["/usr", "/etc/alternatives", sys.prefix, sys.base_prefix, *map(str, paths)]
        mounts = [{"host": p, "container": p, "readonly": True} for p in dict.fromkeys(str(Path(p).resolve()) for p in ro)]
        return mounts + [{"host": str(p), "container": str(p)} for p in writable]

    def containers(self, cluster: Cluster, node: str, label: str = "hfscale.job") -> list[str]:
        """Names of the containers (running or not) carrying ``label`` on ``node``."""
        r = run_on(cluster, node, f"{self.binary} ps -a --filter label={label} --format '{{{{.Names}}}}'")
        if r.returncode != 0:
            raise RuntimeError(f"podman ps on {node}: {r.stderr.strip()}")
        return r.stdout.split()


def _rootfs_tar() -> bytes:
    """An image with nothing but the directories a bind-mounted interpreter needs (merged /usr)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, mode in [("etc", 0o755), ("root", 0o700), ("usr", 0o755), ("proc", 0o555), ("sys", 0o555),
                        ("dev", 0o755), ("run", 0o755), ("tmp", 0o1777), ("var", 0o755), ("var/tmp", 0o1777)]:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for link, target in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")]:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def start_podman(cluster: Cluster, workdir: Path) -> Podman:
    """Write the wrapper and import the test image on every node (and in the root namespace)."""
    problem = podman_preflight()
    if problem is not None:
        raise problem
    workdir.mkdir(parents=True, exist_ok=True)
    storage = Path(tempfile.mkdtemp(prefix="hfpm", dir="/tmp"))  # podman refuses a runroot over 50 characters
    binary = workdir / "podman-docker"
    binary.write_text(
        "#!/bin/sh\n"
        "# docker-compatible podman for this machine (see tests/cluster/containers.py)\n"
        f'n=$(hostname); exec podman --root {storage}/"$n"/root --runroot {storage}/"$n"/run'
        f" --storage-driver vfs --cgroup-manager cgroupfs --events-backend file --runtime {_runc()}"
        ' "$@"\n')
    binary.chmod(0o755)
    tar = workdir / "rootfs.tar"
    tar.write_bytes(_rootfs_tar())
    podman = Podman(binary=binary, storage=storage)
    for node in cluster.nodes:
        r = run_on(cluster, node, f"{binary} import {tar} {IMAGE}", timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"podman import on {node} failed: {r.stderr.strip()}")
    r = subprocess.run([str(binary), "import", str(tar), IMAGE], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"podman import failed: {r.stderr.strip()}")
    return podman


def stop_podman(podman: Podman, cluster: Cluster) -> None:
    """Remove every container the tests left (there should be none) and the storage."""
    for node in cluster.nodes:
        run_on(cluster, node, f"{podman.binary} rm -af >/dev/null 2>&1", timeout=120)
    subprocess.run([str(podman.binary), "rm", "-af"], capture_output=True, timeout=120)
    # vfs layers are plain directories, but podman may have left read-only bits
    subprocess.run(["rm", "-rf", str(podman.storage)], capture_output=True, timeout=120)
