"""The ``recovery:`` section (jobs that heal themselves): its defaults, the rules ``check`` applies to
it, the accumulation that keeps the global batch on fewer nodes and the job a relaunch runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hfscale.config.errors import ConfigError
from hfscale.config.model import HostSpec, RecoveryConfig
from hfscale.launch.runners.slurm_step import in_allocation
from hfscale.rules.check import check
from hfscale.rules.config_file import load_text
from hfscale.rules.recovery import accumulation_at, recovery_findings
from hfscale.rules.relaunch import job_on


def hosts(n: int, slots: int = 1) -> str:
    return "[" + ", ".join(f"{{host: node{i}, slots: {slots}}}" for i in range(n)) + "]"


def job(text: str):
    return load_text(textwrap.dedent(text), "t.yaml", Path("."))


def problems(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(ConfigError) as info:
        job(text)
    return [(p.path, p.line, p.message) for p in info.value.problems]


def warnings(text: str) -> list[tuple[str, int | None, str]]:
    return [(p.path, p.line, p.message) for p in job(text).warnings]


def six_nodes(recovery: str, extra: str = "") -> str:
    return f"""\
        name: x
        cluster: {{hosts: {hosts(6)}}}
        runner: {{type: pdsh}}
        batch: {{micro_batch_size: 1, global_batch_size: 12}}
        recovery: {recovery}
        training: {{max_steps: 100, save_steps: 50}}
        {extra}"""


def test_off_by_default_and_a_config_without_it_is_unchanged():
    r = RecoveryConfig()
    assert (r.max_restarts, r.window, r.strikes, r.min_nodes, r.keep_global_batch, r.probe_excluded) == (
        0, None, 2, None, True, True)
    j = job(f"name: x\ncluster: {{hosts: {hosts(2)}}}\nrunner: {{type: pdsh}}\nbatch: {{micro_batch_size: 1}}\n")
    assert j.config.recovery == RecoveryConfig() and "recovery" not in j.config.model_fields_set
    assert j.warnings == () and check(j).problems == ()
    assert recovery_findings(j) == ([], [])


def test_unknown_key_under_recovery_has_a_hint():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\nrecovery: {max_restart: 2}\n")
    assert got == [("recovery.max_restart", 3, "unknown key 'max_restart'; did you mean 'max_restarts'?")]


def test_a_kubernetes_job_restarts_through_its_operator():
    got = problems("""\
        name: x
        cluster: {num_nodes: 2, nproc_per_node: 1}
        runner: {type: kubernetes, launcher: torchrun, kubernetes: {image: i}}
        batch: {micro_batch_size: 1}
        recovery: {max_restarts: 3}
        """)
    assert got == [("recovery.max_restarts", 5, "restarts on Kubernetes are the operator's (the PyTorchJob's "
                    "restartPolicy and runner.kubernetes.elastic); hfscale's recovery works with the runners whose "
                    "jobs hfscale runs itself: local, pdsh and pdsh_docker, and slurm (supervised inside the allocation)")]


def test_min_nodes_above_the_node_count_and_without_restarts():
    assert problems(six_nodes("{max_restarts: 3, min_nodes: 7}")) == [
        ("recovery.min_nodes", 5, "7 is more than the 6 nodes of the job")]
    assert warnings(six_nodes("{min_nodes: 7}")) == [
        ("recovery.min_nodes", 5, "has no effect while recovery.max_restarts is 0 (hfscale relaunches nothing)")]


def test_the_global_batch_must_be_keepable_at_every_node_count_down_to_min_nodes():
    assert problems(six_nodes("{max_restarts: 3, min_nodes: 4}")) == [
        ("recovery.min_nodes", 5, "the global batch 12 (micro 1 x accumulation 2 x 6 ranks) cannot be kept at 5 "
         "nodes; it can at 1, 2, 3, 4, 6 nodes: raise recovery.min_nodes to 6 (the job then never shrinks), or "
         "choose a global batch that 60 divides (micro 1 x the ranks at each of 4 to 6 nodes)")]
    assert warnings(six_nodes("{max_restarts: 3, min_nodes: 6}")) == []
    seven = """\
        name: x
        cluster: {hosts: %s}
        runner: {type: pdsh}
        batch: {micro_batch_size: 2, global_batch_size: 84}
        recovery: {max_restarts: 3, min_nodes: 2}
        """ % hosts(7)
    assert problems(seven) == [
        ("recovery.min_nodes", 5, "the global batch 84 (micro 2 x accumulation 6 x 7 ranks) cannot be kept at 4, 5 "
         "nodes; it can at 1, 2, 3, 6, 7 nodes: raise recovery.min_nodes to 6, or choose a global batch that 840 "
         "divides (micro 2 x the ranks at each of 2 to 7 nodes)")]


def test_tensor_parallel_ranks_share_samples_and_groups_must_fit():
    text = """\
        name: x
        cluster: {hosts: %s}
        runner: {type: pdsh}
        distributed: {backend: fsdp, parallelism: {dp_replicate_size: 2, dp_shard_size: 2, tp_size: 2}}
        batch: {micro_batch_size: 1, global_batch_size: 8}
        recovery: {max_restarts: 3, min_nodes: 1}
        """ % hosts(2, slots=4)
    j = job(text)
    assert (j.data_parallel_size, j.gradient_accumulation_steps) == (4, 2)
    assert [accumulation_at(j, n) for n in (1, 2, 3)] == [4, 2, None]  # 3 nodes: 6 data-parallel ranks
    smaller = job_on(j, j.hosts[:1])  # the replicas shrink, the shards stay
    p = smaller.config.distributed.parallelism
    assert (smaller.world_size, p.dp_replicate_size, p.dp_shard_size, p.tp_size) == (4, 1, 2, 2)
    assert (smaller.gradient_accumulation_steps, smaller.global_batch_size) == (4, 8)
    spanning = text.replace("dp_replicate_size: 2, dp_shard_size: 2, tp_size: 2", "cp_size: 2, tp_size: 4")
    assert problems(spanning.replace("global_batch_size: 8", "global_batch_size: 2")) == [
        ("recovery.min_nodes", 6, "the global batch 2 (micro 1 x accumulation 2 x 1 rank) cannot be kept at 1 "
         "node; it can at 2 nodes: raise recovery.min_nodes to 2 (the job then never shrinks); at 1 node the "
         "processes do not split into whole tensor x context x sequence parallel groups of 8 ranks")]


def test_a_shrinking_global_batch_is_a_warning():
    assert warnings(six_nodes("{max_restarts: 3, min_nodes: 4, keep_global_batch: false}")) == [
        ("recovery.keep_global_batch", 5, "false: when the job shrinks below its 6 nodes (down to "
         "recovery.min_nodes 4), the global batch 12 shrinks with the ranks, and so the loss curve changes; set it "
         "to true to keep the global batch")]


def test_checkpoints_to_restart_from():
    text = six_nodes("{max_restarts: 3}").replace("save_steps: 50", "save_steps: 100")
    assert warnings(text) == [
        ("training.save_steps", 6, "100 >= max_steps 100: no checkpoint is saved before the job ends, so a restart "
         "(recovery.max_restarts) starts again at step 0; save more often to resume from one")]
    assert warnings(text.replace("recovery: {max_restarts: 3}", "recovery: {}")) == []
    plain = six_nodes("{max_restarts: 3}").replace("training: {max_steps: 100, save_steps: 50}",
                                                   "training: {script: train.py, pass_args: none}")
    assert [w for w in warnings(plain) if w[0].startswith("recovery")] == [
        ("recovery.max_restarts", 5, "hfscale cannot see a plain script's checkpoints (training.pass_args: none): "
         "each restart runs train.py again as it is, so it must resume from its own newest checkpoint by itself")]


def test_slurm_recovery_is_checked_and_relaunches_on_the_allocations_hosts():
    """runner slurm with recovery: hfscale supervises the job inside its allocation
    (hfscale.launch.runners.slurm_step); the allocation's hosts become the job's, the last
    ``spares`` of them its spares, and a relaunch keeps them (job_on)."""
    slurm = """\
        name: x
        cluster: {num_nodes: 4, nproc_per_node: 2}
        runner: {type: slurm}
        batch: {micro_batch_size: 1, global_batch_size: 24}
        recovery: {max_restarts: 3, min_nodes: 3, spares: 1}
        """
    job(slurm)  # no problem
    j = in_allocation(job(slurm), ("n0", "n1", "n2", "n3", "n4", "n5"))  # one node more than asked: not used
    assert [h.host for h in j.hosts] == ["n0", "n1", "n2", "n3"] and [h.slots for h in j.hosts] == [2] * 4
    assert [(h.host, h.spare) for h in j.spares] == [("n4", True)] and j.master_addr == "n0"
    assert (j.num_nodes, j.world_size, j.gradient_accumulation_steps) == (4, 8, 3)
    by = {h.host: h for h in j.hosts + j.spares}
    smaller = job_on(j, (by["n1"], by["n2"], by["n3"]))  # n0 left out
    assert [h.host for h in smaller.hosts] == ["n1", "n2", "n3"] and smaller.master_addr == "n1"
    assert (smaller.num_nodes, smaller.world_size, smaller.gradient_accumulation_steps) == (3, 6, 4)
    assert [h.host for h in smaller.spares] == ["n4"]
    replaced = job_on(j, (by["n0"], by["n4"], by["n2"], by["n3"]), ())  # the spare in n1's place, none left
    assert [(h.host, h.spare) for h in replaced.hosts][:2] == [("n0", False), ("n4", False)]
    assert (replaced.world_size, replaced.gradient_accumulation_steps, replaced.spares) == (8, 3, ())
    with pytest.raises(ConfigError, match=r"the Slurm allocation has 4 node\(s\) \(n0, n1, n2, n3\), the job needs "
                       r"4 and 1 spare\(s\)"):
        in_allocation(job(slurm), ("n0", "n1", "n2", "n3"))
    idle = slurm.replace("max_restarts: 3, min_nodes: 3, spares: 1", "spares: 1")
    assert [w[0] for w in warnings(idle)] == ["recovery.spares"]


def test_accumulation_at_fewer_nodes():
    j = job(six_nodes("{max_restarts: 3, min_nodes: 6}").replace(hosts(6), hosts(3)).replace("min_nodes: 6",
                                                                                             "min_nodes: 1"))
    assert [accumulation_at(j, n) for n in (3, 2, 1)] == [4, 6, 12]
    assert accumulation_at(j, 5) is None and accumulation_at(j, 24) is None


THREE = """\
    name: x
    cluster: {hosts: [{host: node0, slots: 2}, {host: node1, slots: 2}, {host: node2, slots: 2}], master_addr: node0}
    runner: {type: pdsh}
    env: {per_host: {node0: {NCCL_SOCKET_IFNAME: eth1}, node2: {NCCL_SOCKET_IFNAME: eth2}}}
    batch: {micro_batch_size: 1, global_batch_size: 12}
    recovery: {max_restarts: 3, min_nodes: 1}
    """


def test_job_on_fewer_hosts_keeps_the_global_batch_and_moves_the_master():
    j = job(THREE)
    assert (j.world_size, j.gradient_accumulation_steps, j.master_addr) == (6, 2, "node0")
    smaller = job_on(j, j.hosts[1:])
    assert (smaller.world_size, smaller.gradient_accumulation_steps, smaller.global_batch_size) == (4, 3, 12)
    assert smaller.master_addr == "node1" and smaller.config.cluster.master_addr == "node1"
    assert [h.host for h in smaller.hosts] == ["node1", "node2"] and smaller.config.cluster.hostfile is None
    assert set(smaller.config.env.per_host) == {"node2"}
    assert smaller.source == j.source and smaller.line_of is j.line_of
    one = job_on(smaller, smaller.hosts[1:])
    assert (one.world_size, one.gradient_accumulation_steps, one.global_batch_size, one.master_addr) == (
        2, 6, 12, "node2")
    kept = job_on(j, j.hosts[:2])  # the master stays
    assert kept.master_addr == "node0" and kept.gradient_accumulation_steps == 3
    assert job_on(j, j.hosts) is j


def test_a_master_address_of_a_host_still_in_the_job_is_kept():
    """master_addr written as node0's IP address: leaving node2 out keeps it (it names no host left out)."""
    j = job(THREE.replace("master_addr: node0", "master_addr: 10.0.0.1"))
    assert job_on(j, j.hosts[:2]).master_addr == "10.0.0.1"


def test_job_on_without_keep_global_batch_keeps_the_accumulation():
    j = job(THREE.replace("min_nodes: 1}", "min_nodes: 1, keep_global_batch: false}"))
    smaller = job_on(j, j.hosts[1:])
    assert (smaller.world_size, smaller.gradient_accumulation_steps, smaller.global_batch_size) == (4, 2, 8)


def test_job_on_refuses_a_job_that_does_not_add_up():
    j = job(THREE.replace("global_batch_size: 12", "global_batch_size: 6").replace("min_nodes: 1", "min_nodes: 3"))
    with pytest.raises(ConfigError, match="recovery.min_nodes"):
        job_on(j, j.hosts[1:])


IN_PROCESS = """\
    name: x
    cluster: {hosts: [{host: node0, slots: 2}, {host: node1, slots: 2}, {host: node2, slots: 2, spare: true}]}
    runner: {type: pdsh, launcher: torchrun}
    batch: {micro_batch_size: 1}
    recovery: {max_restarts: 3, in_process: true}
    watchdog: {timeout: 60}
    training: {max_steps: 100, save_steps: 10}
"""


def test_in_process_restarts_start_the_spares_as_standbys_and_host_the_store_in_the_launch():
    """Every node, the spare too, runs hfscale's node agent in torchrun's place: the spare's ranks are
    uids 4-5 of 6 launched, 4 active; the launch runs the ranks' store from before the nodes start."""
    from hfscale.launch.build import IN_PROCESS_MARGIN_S, build_plan
    from hfscale.launch.context import LaunchContext

    j = job(IN_PROCESS)
    assert j.warnings == () and check(j).problems == () and check(j).warnings == ()
    plan = build_plan(j, LaunchContext.of("/work", "/usr/bin/python3", "20261129-000000-abcdef", {}))
    assert [(n.host, n.rank) for n in plan.nodes] == [("node0", 0), ("node1", 1), ("node2", 2)]
    text = plan.render()
    assert ("[2] node2: /usr/bin/python3 -m hfscale.training.inprocess.node_agent --nproc 2 --node-rank 2 --world 4 "
            f"--launched 6 --store-file {plan.run_dir}/inprocess.store --reach ssh --restarts 3 --preload trainer,deepspeed,builtin -- "
            f"-m hfscale.training.train --config {plan.run_dir}/config.yaml") in text, text
    assert plan.store is not None and plan.store.real_argv()[1:] == [
        "-m", "hfscale.training.inprocess.store_host", "--file", f"{plan.run_dir}/inprocess.store"]
    assert "in-process restarts: the ranks' store, here" in text
    env = dict(plan.private)["env.sh"].real
    assert "HFSCALE_INPROCESS_RESTARTS=3" in env and "HFSCALE_INPROCESS_TIMEOUT_S=60" in env
    assert plan.watch is not None and plan.watch.timeout == 60 + IN_PROCESS_MARGIN_S  # the ranks restart first
    assert dict(plan.files)["pdsh_hosts"].split() == ["node0", "node1", "node2"]  # the spare is reached like the others


@pytest.mark.parametrize("old, new, said", [
    ("max_restarts: 3", "max_restarts: 0", "needs recovery.max_restarts > 0"),
    ("launcher: torchrun", "launcher: accelerate", "set runner.launcher to torchrun"),
    ("type: pdsh,", "type: pdsh_docker, docker: {image: x},", "runner pdsh_docker: in-process restarts work with runners local, "
                                                    "pdsh and slurm so far"),
])
def test_in_process_restarts_name_what_they_need(old, new, said):
    assert old in IN_PROCESS
    found = [(path, message) for path, _, message in problems(IN_PROCESS.replace(old, new))]
    assert [p for p, m in found if said in m] == ["recovery.in_process"], found


def test_in_process_restarts_without_a_watchdog_timeout_are_warned():
    j = job(IN_PROCESS.replace("watchdog: {timeout: 60}", "watchdog: {timeout: null}"))
    said = [(w.path, w.message[:60]) for w in check(j).warnings]
    assert ("recovery.in_process", "without watchdog.timeout a frozen or cut-off node holds the ") in said, said


def test_a_user_script_opts_in_to_in_process_restarts_through_the_public_face(tmp_path):
    """Without hfscale.restart_in_process the script would form one group of every launched process,
    standbys too: refused; a script this host cannot read is warned about."""
    opted, plain = tmp_path / "opted.py", tmp_path / "plain.py"
    opted.write_text("import sys, hfscale\n\ndef main():\n    pass\n\nsys.exit(hfscale.restart_in_process(main))\n")
    plain.write_text("def main():\n    pass\n\nmain()\n")
    with_script = lambda path: IN_PROCESS.replace("save_steps: 10}", f"save_steps: 10, script: {path}}}")  # noqa: E731
    j = job(with_script(opted))
    assert check(j).problems == () and [w.path for w in check(j).warnings] == []
    said = [(p, m) for p, _, m in problems(with_script(plain))]
    assert said == [("recovery.in_process", f"training.script {plain}: does not call hfscale.restart_in_process: "
                     "in-process restarts run its training function in attempts, so the script opts in with "
                     "sys.exit(hfscale.restart_in_process(main)), main building and resuming its training at every "
                     "call (docs/recovery.md)")]
    far = check(job(with_script(tmp_path / "elsewhere.py"))).warnings
    assert [(w.path, w.message.split(": ")[1][:18]) for w in far] == [("recovery.in_process", "cannot read it her")]
