"""How the files beside it were captured (2026-11-26, Slurm 22.05.8 on tests/cluster's 2-node test bed,
no accounting): five jobs, COMPLETED, FAILED by exit 3, ranks SIGKILLed (137), scancel'ed while
running, requeued with scontrol then cancelled; ``scontrol show job --oneliner`` of each, sacct, and
their output files. Run as root: python tests/data/slurm_state/capture.py (writes /tmp/c29s/out)."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cluster import start_cluster, stop_cluster, start_slurm, stop_slurm
out = Path("/tmp/c29s/out"); out.mkdir(exist_ok=True)
c = start_cluster(2, "/tmp/c29s/cl")
s = start_slurm(c, "/tmp/c29s/sl")
def run(*a, check=False):
    r = s.run(*a, check=False)
    return r
def save(name, *argv):
    r = run(*argv)
    (out / f"{name}.txt").write_text(f"$ {' '.join(argv)}\n# rc={r.returncode}\n# stdout:\n{r.stdout}# stderr:\n{r.stderr}")
    return r
def script(name, body):
    p = out / f"{name}.sh"
    p.write_text("#!/bin/bash\n" + body + "\n")
    return str(p)
try:
    jobs = {}
    jobs["completed"] = s.sbatch("-N2", f"--output={out}/completed-%j.out", script("completed", "srun -N2 --ntasks-per-node=1 true; rc=$?; echo \"HFSCALE_EXIT rc=$rc\"; exit $rc"))
    jobs["exit3"] = s.sbatch("-N2", f"--output={out}/exit3-%j.out", script("exit3", "srun -N2 --ntasks-per-node=1 bash -c 'exit 3'; rc=$?; echo \"HFSCALE_EXIT rc=$rc\"; exit $rc"))
    jobs["killed"] = s.sbatch("-N2", f"--output={out}/killed-%j.out", script("killed", "srun -N2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'sleep 2; kill -9 $$'; rc=$?; echo \"HFSCALE_EXIT rc=$rc\"; exit $rc"))
    for k in ("completed", "exit3", "killed"):
        s.wait(jobs[k], timeout=120)
    jobs["cancelled"] = s.sbatch("-N2", f"--output={out}/cancelled-%j.out", script("cancelled", "srun -N2 --ntasks-per-node=1 sleep 300; rc=$?; echo \"HFSCALE_EXIT rc=$rc\"; exit $rc"))
    s.wait(jobs["cancelled"], "RUNNING", timeout=60)
    time.sleep(2)
    save("running", "scontrol", "show", "job", "--oneliner", jobs["cancelled"])
    save("running-sacct", "sacct", "-n", "-P", "-X", "-j", jobs["cancelled"], "-o", "JobIDRaw,State,ExitCode,Submit,Start,End")
    run("scancel", jobs["cancelled"])
    s.wait(jobs["cancelled"], timeout=90)
    jobs["requeued"] = s.sbatch("-N2", "--requeue", f"--output={out}/requeued-%j.out", "--open-mode=append", script("requeued", "echo start ${SLURM_RESTART_COUNT:-0}; srun -N2 --ntasks-per-node=1 sleep 300; rc=$?; echo \"HFSCALE_EXIT rc=$rc\"; exit $rc"))
    s.wait(jobs["requeued"], "RUNNING", timeout=60)
    time.sleep(2)
    run("scontrol", "requeue", jobs["requeued"])
    time.sleep(1)
    save("requeued-pending", "scontrol", "show", "job", "--oneliner", jobs["requeued"])
    s.wait(jobs["requeued"], "RUNNING", timeout=90)
    time.sleep(1)
    save("requeued-running", "scontrol", "show", "job", "--oneliner", jobs["requeued"])
    run("scancel", jobs["requeued"])
    s.wait(jobs["requeued"], timeout=90)
    for k, j in jobs.items():
        save(k, "scontrol", "show", "job", "--oneliner", j)
        save(k + "-multi", "scontrol", "show", "job", j)
        save(k + "-sacct", "sacct", "-n", "-P", "-X", "-j", j, "-o", "JobIDRaw,State,ExitCode,Submit,Start,End")
    save("invalid", "scontrol", "show", "job", "--oneliner", "999999")
    (out / "jobs.json").write_text(json.dumps(jobs))
    print("done", jobs)
finally:
    stop_slurm(s); stop_cluster(c)
