"""Every problem of a config is reported at once, with its dotted YAML path and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from hfscale.config.errors import ConfigError
from hfscale.rules.config_file import load_job, load_text


def problems(yaml_text: str, base: Path = Path(".")) -> list[tuple[str, int | None, str]]:
    with pytest.raises(ConfigError) as info:
        load_text(textwrap.dedent(yaml_text), "t.yaml", base)
    return [(p.path, p.line, p.message) for p in info.value.problems]


def test_minimal_config_defaults():
    job = load_text("name: x\nbatch: {micro_batch_size: 3}\n", "t.yaml", Path("."))
    assert (job.world_size, job.num_nodes, job.gradient_accumulation_steps, job.global_batch_size) == (1, 1, 1, 3)
    assert job.master_addr == "127.0.0.1"
    assert job.deepspeed is not None and job.deepspeed.stage == 2 and job.fsdp is None


def test_global_batch_derives_accumulation():
    job = load_text(
        "name: x\ncluster: {hosts: [{host: a, slots: 4}, {host: b, slots: 4}]}\nrunner: {type: pdsh}\n"
        "batch: {micro_batch_size: 2, global_batch_size: 64}\n",
        "t.yaml",
        Path("."),
    )
    assert (job.world_size, job.gradient_accumulation_steps, job.global_batch_size) == (8, 4, 64)
    assert job.master_addr == "a"


def test_config_model_is_frozen():
    job = load_text("name: x\nbatch: {micro_batch_size: 3}\n", "t.yaml", Path("."))
    with pytest.raises(ValidationError, match="frozen"):
        job.config.batch.micro_batch_size = 4  # type: ignore[misc]


def test_unknown_keys_at_every_depth_with_hints():
    got = problems(
        """\
        name: x
        batch: {micro_batch_size: 1}
        clutser: {}
        distributed:
          deepspeed:
            offload_optimizer: {devise: cpu}
        training:
          model: {pth: /m}
        """
    )
    assert got == [
        ("clutser", 3, "unknown key 'clutser'; did you mean 'cluster'?"),
        ("distributed.deepspeed.offload_optimizer.devise", 6, "unknown key 'devise'; did you mean 'device'?"),
        ("training.model.pth", 8, "unknown key 'pth'; did you mean 'path'?"),
    ]


def test_keys_from_other_tools_point_to_the_hfscale_key():
    got = problems("name: x\nbatch: {micro_batch_size: 1, per_device_train_batch_size: 2}\nzero_stage: 3\n")
    assert got == [
        ("batch.per_device_train_batch_size", 2, "unknown key 'per_device_train_batch_size'; hfscale sets this with 'batch.micro_batch_size'"),
        ("zero_stage", 3, "unknown key 'zero_stage'; hfscale sets this with 'distributed.deepspeed.stage'"),
    ]


def test_key_in_wrong_section_names_the_right_one():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ncluster: {stage: 3}\n")
    assert got == [("cluster.stage", 3, "unknown key 'stage'; did you mean 'distributed.deepspeed.stage'?")]


def test_wrong_types_are_not_coerced():
    got = problems(
        """\
        name: x
        batch: {micro_batch_size: "4"}
        precision: true
        cluster: {hosts: {host: a, slots: 1}, master_port: 29500.5}
        distributed: {deepspeed: {overlap_comm: "yes"}}
        """
    )
    assert got == [
        ("batch.micro_batch_size", 2, "must be a whole number, got '4' (a string)"),
        ("precision", 3, "must be one of 'bf16', 'fp16', 'fp8' or 'no', got True (a boolean)"),
        ("cluster.hosts", 4, "must be a list, got {'host': 'a', 'slots': 1} (a mapping)"),
        ("cluster.master_port", 4, "must be a whole number, got 29500.5 (a number)"),
        ("distributed.deepspeed.overlap_comm", 5, "must be true or false, got 'yes' (a string)"),
    ]


def test_zero_and_negative_sizes():
    got = problems(
        """\
        name: x
        batch: {micro_batch_size: 0, gradient_accumulation_steps: -2, global_batch_size: 0}
        cluster: {hosts: [{host: a, slots: 0}]}
        training: {learning_rate: -1.0, warmup_steps: -5}
        """
    )
    assert [(p, line) for p, line, _ in got] == [
        ("batch.micro_batch_size", 2),
        ("batch.gradient_accumulation_steps", 2),
        ("batch.global_batch_size", 2),
        ("cluster.hosts[0].slots", 3),
        ("training.learning_rate", 4),
        ("training.warmup_steps", 4),
    ]
    assert got[0][2] == "must be >= 1, got 0 (a number)"
    assert got[4][2] == "must be > 0.0, got -1.0 (a number)"


def test_missing_required_keys():
    got = problems("cluster: {nproc_per_node: 2}\n")
    # in the model's field order (both have no line: they are not in the file)
    assert got == [("name", None, "required key is missing"), ("batch", None, "required key is missing")]


def test_batch_math_against_world_size():
    got = problems(
        """\
        name: x
        cluster:
          hosts:
            - {host: a, slots: 4}
            - {host: b, slots: 4}
        runner: {type: pdsh}
        batch:
          micro_batch_size: 4
          gradient_accumulation_steps: 2
          global_batch_size: 100
        """
    )
    assert got == [
        (
            "batch.global_batch_size",
            10,
            "100 != micro_batch_size 4 x gradient_accumulation_steps 2 x world size 8 "
            "(sum of slots in cluster.hosts) = 64",
        )
    ]


def test_global_batch_not_divisible():
    got = problems("name: x\ncluster: {nproc_per_node: 3}\nbatch: {micro_batch_size: 2, global_batch_size: 8}\n")
    assert got == [
        (
            "batch.global_batch_size",
            3,
            "8 is not a multiple of micro_batch_size 2 x world size 3 (cluster.nproc_per_node) = 6, "
            "so no whole gradient_accumulation_steps gives it",
        )
    ]


def test_offload_rules_against_stage():
    got = problems(
        """\
        name: x
        batch: {micro_batch_size: 1}
        distributed:
          deepspeed:
            stage: 2
            offload_optimizer: {device: nvme}
            offload_param: {device: cpu, nvme_path: /nvme}
        """
    )
    assert got == [
        ("distributed.deepspeed.offload_optimizer.device", 6, "NVMe offload (ZeRO-Infinity) needs ZeRO stage 3, stage is 2"),
        ("distributed.deepspeed.offload_optimizer.nvme_path", 6, "required with device: nvme"),
        ("distributed.deepspeed.offload_param.device", 7, "parameter offload needs ZeRO stage 3, stage is 2"),
        ("distributed.deepspeed.offload_param.nvme_path", 7, "only used with device: nvme"),
    ]


def test_offload_with_stage0_and_cpu_offload_with_stage1():
    got = problems(
        "name: x\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {stage: 0, offload_optimizer: {device: cpu}}}\n"
    )
    assert got == [("distributed.deepspeed.offload_optimizer.device", 3, "optimizer offload needs ZeRO stage 1-3, stage is 0")]
    ok = load_text(
        "name: x\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {stage: 1, offload_optimizer: {device: cpu}}}\n",
        "t.yaml",
        Path("."),
    )
    assert ok.deepspeed.offload_optimizer.device == "cpu"


def test_duplicate_hosts_uneven_slots_and_local_runner():
    got = problems(
        """\
        name: x
        batch: {micro_batch_size: 1}
        cluster:
          hosts:
            - {host: n1, slots: 8}
            - {host: n2, slots: 4}
            - {host: n1, slots: 8}
        """
    )
    assert got == [
        ("cluster.hosts", 4, "every host needs the same slots (accelerate and torchrun start the same number of "
                             "processes on each node); got n1=8, n2=4, n1=8"),
        ("cluster.hosts[2].host", 7, "duplicate host 'n1' (also cluster.hosts[0])"),
        ("runner.type", None, "'local' runs on this node only but the cluster has 3 hosts; use 'pdsh' or 'pdsh_docker'"),
    ]


def test_host_names_with_shell_metacharacters_are_rejected():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ncluster: {hosts: [{host: 'n1;touch /tmp/p', slots: 1}]}\n")
    assert got[0][:2] == ("cluster.hosts[0].host", 3) and "is not a host name" in got[0][2]
    got = problems("name: 'x $(id)'\nbatch: {micro_batch_size: 1}\n")
    assert got[0][:2] == ("name", 1) and "is not a job name" in got[0][2]


def test_engine_section_must_match_backend():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ndistributed: {backend: ddp, fsdp: {}, deepspeed: {}}\n")
    assert [p for p, _, _ in got] == ["distributed.deepspeed", "distributed.fsdp"]


def test_hostfile_is_read_relative_to_the_yaml(tmp_path):
    (tmp_path / "hosts").write_text("# two nodes\nn0 slots=2\nn1 slots=2\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: x\ncluster: {hostfile: hosts}\nrunner: {type: pdsh}\nbatch: {micro_batch_size: 1}\n")
    job = load_job(cfg)
    assert [h.host for h in job.hosts] == ["n0", "n1"] and job.world_size == 4


def test_hostfile_problems_name_file_and_line(tmp_path):
    (tmp_path / "hosts").write_text("n0 slots=2\nn0 slots=2\n")
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ncluster: {hostfile: hosts}\n", tmp_path)
    assert got == [("cluster.hostfile", 3, f"{tmp_path / 'hosts'}:2: duplicate host 'n0' (first on line 1)")]
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ncluster: {hostfile: nope}\n", tmp_path)
    assert got == [("cluster.hostfile", 3, f"no such file: {tmp_path / 'nope'}")]


def test_hosts_and_hostfile_together():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ncluster: {hosts: [{host: a, slots: 1}], hostfile: h, nproc_per_node: 1}\n")
    assert [(p, m) for p, _, m in got] == [
        ("cluster.hostfile", "set either 'hosts' or 'hostfile', not both"),
        ("cluster.nproc_per_node", "only for one local node; with hosts, 'slots' sets processes per host"),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "the file is empty; `hfscale init` writes a template to start from"),
        ("# only a comment\n", "the file is empty; `hfscale init` writes a template to start from"),
        ("- a\n- b\n", "the top level must be a mapping of keys, not a list"),
        ("just text\n", "the top level must be a mapping of keys, not a str"),
        ("name: x\nname: y\n", "invalid YAML: duplicate key 'name' (first defined on line 1)"),
        ("name: [x\n", "invalid YAML: while parsing a flow sequence expected ',' or ']', but got '<stream end>'"),
        ("1: x\n", "key 1 must be a string (quote it)"),
        ("name: x\n  bad indent: 1\n", "invalid YAML: mapping values are not allowed here"),
    ],
)
def test_malformed_documents(text, message):
    with pytest.raises(ConfigError) as info:
        load_text(text, "t.yaml", Path("."))
    assert [p.message for p in info.value.problems] == [message]


def test_yaml12_exponent_floats():
    job = load_text(
        "name: x\nbatch: {micro_batch_size: 1}\ntraining: {learning_rate: 3e-4}\n"
        "distributed: {deepspeed: {reduce_bucket_size: 2E8}}\n",
        "t.yaml",
        Path("."),
    )
    assert job.config.training.learning_rate == 3e-4
    assert job.deepspeed.reduce_bucket_size == 200_000_000


def test_bucket_sizes_must_be_whole():
    got = problems("name: x\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {reduce_bucket_size: 1.5}}\n")
    assert got == [("distributed.deepspeed.reduce_bucket_size", 3, "must be a whole number, got 1.5 (a number)")]


def test_shm_size_only_with_a_private_ipc_namespace():
    doc = """\
        name: x
        cluster: {hosts: [{host: a, slots: 1}]}
        runner:
          type: pdsh_docker
          docker:
            image: img
            shm_size: 64g
        batch: {micro_batch_size: 1}
        """
    assert problems(doc) == [
        ("runner.docker.shm_size", 7, "has no effect with ipc: host (the container uses the host's /dev/shm; "
                                      "podman refuses the pair): remove it, or set runner.docker.ipc: private")]
    job = load_text(textwrap.dedent(doc).replace("image: img", "image: img\n    ipc: private"), "t.yaml", Path("."))
    assert (job.config.runner.docker.ipc, job.config.runner.docker.shm_size) == ("private", "64g")


def test_a_key_several_sections_have_is_not_guessed_into_another():
    """'extra' exists in runner.slurm, distributed.deepspeed and accelerate: under training it is
    unknown, and no other section's 'extra' is offered as the meaning."""
    ((path, line, message),) = problems("name: x\nbatch: {micro_batch_size: 1}\ntraining: {extra: {a: 1}}\n")
    assert (path, line) == ("training.extra", 3)
    assert message.startswith("unknown key 'extra'; allowed here: script, pass_args,") and "slurm" not in message


def test_inet_aton_shorthand_is_an_address_with_a_warning():
    """accelerate's multi_node.yaml template writes main_process_ip '1234': getaddrinfo (ssh, torch's
    TCPStore) reads it as 0.0.4.210, so it is accepted as the engine accepts it, with a warning."""
    job = load_text("name: x\nbatch: {micro_batch_size: 1}\nrunner: {type: pdsh}\n"
                    "cluster: {master_addr: '1234', hosts: [{host: '10.1', slots: 1}, {host: b, slots: 1}]}\n",
                    "t.yaml", Path("."))
    assert job.master_addr == "1234"
    said = {p.path: p.message for p in job.warnings}
    assert "0.0.4.210" in said["cluster.master_addr"] and "10.0.0.1" in said["cluster.hosts[0].host"]
    for bad in ("1234 ; reboot", "1.2.3.4.5", "99999999999", "1.2.3.256"):
        got = problems(f"name: x\nbatch: {{micro_batch_size: 1}}\ncluster: {{master_addr: '{bad}'}}\n")
        assert got[0][0] == "cluster.master_addr" and "is not a host name" in got[0][2], bad
