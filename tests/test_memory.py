"""hfscale plan: parameter counts against transformers' own models (built on the meta device),
activation bytes against the tensors autograd really keeps (saved-tensor hooks on CPU), model
states against DeepSpeed's own estimate functions, and the verdict on hand-checked cases."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ROOT
from hfscale.memory.estimate import CONTEXT_BYTES, Setting, estimate, model_states
from hfscale.memory.fit import judge, micro_batches
from hfscale.memory.model_shape import ShapeError, shape_of

CASES = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 500, "n_positions": 128,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt2-untied-inner": {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64, "vocab_size": 500,
                          "n_positions": 128, "n_inner": 100, "tie_word_embeddings": False, "resid_pdrop": 0.0,
                          "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama-gqa": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "hidden_size": 64, "intermediate_size": 172, "vocab_size": 500},
    "llama-bias-tied": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                        "intermediate_size": 172, "vocab_size": 500, "attention_bias": True, "mlp_bias": True,
                        "tie_word_embeddings": True, "head_dim": 32},
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "hidden_size": 64, "intermediate_size": 160, "vocab_size": 500},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "intermediate_size": 160, "vocab_size": 500},
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "head_dim": 16, "intermediate_size": 160, "vocab_size": 500},
}
# full-size defaults: Llama-2-7B, Mistral-7B, GPT-2 small (the config classes' defaults)
DEFAULTS = ["gpt2", "llama", "mistral"]


def _meta(cfg: dict):
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(CASES) + DEFAULTS)
def test_parameter_counts_equal_the_models_transformers_builds(name):
    cfg = CASES.get(name, {"model_type": name})
    model = _meta(cfg)
    shape = shape_of(cfg)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_layer_params() == largest


def test_full_size_counts_are_the_published_ones():
    assert shape_of({"model_type": "llama"}).params() == 6_738_415_616  # Llama-2-7B
    assert shape_of({"model_type": "gpt2"}).params() == 124_439_808  # GPT-2 small


def _saved_bytes(model, vocab: int, b: int, s: int) -> int:
    """Bytes of the distinct tensors autograd keeps for backward, parameters left out."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_bytes_equal_what_autograd_keeps(name, dtype):
    cfg = CASES[name]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa").to(dtype).train()
    shape, k, (b, s) = shape_of(cfg), dtype.itemsize, (2, 64)
    measured = _saved_bytes(model, cfg["vocab_size"], b, s)
    # what stays saved of the head: the log-softmax (4 B x vocab); the (4 + k) B x vocab more of
    # hfscale's head line are the logits and their gradient alive at the start of backward
    predicted = b * s * (shape.num_hidden_layers * shape.layer_activation_bytes(k) + shape.head_bytes(k)
                         - (4 + k) * shape.vocab_size)
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "qwen3"])
def test_checkpointed_layers_keep_their_input_only(name):
    cfg = CASES[name]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa")
    model = model.to(torch.bfloat16).train()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    shape, (b, s) = shape_of(cfg), (2, 64)
    measured = _saved_bytes(model, cfg["vocab_size"], b, s)
    predicted = b * s * (shape.num_hidden_layers * shape.checkpointed_layer_bytes(2) + shape.head_bytes(2)
                         - 6 * shape.vocab_size)
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


def test_unknown_model_types_are_named():
    with pytest.raises(ShapeError, match="model_type 'bert': hfscale plan sizes gpt2, llama, mistral, qwen2, qwen3"):
        shape_of({"model_type": "bert"})
    with pytest.raises(ShapeError, match="hidden_size must be a positive whole number, got 'big'"):
        shape_of({"model_type": "llama", "hidden_size": "big"})


def setting(**kw) -> Setting:
    base = dict(engine="deepspeed", stage=2, offload_optimizer=False, offload_params=False, micro_batch=4,
                accumulation=2, checkpointing=False, precision="bf16", seq_len=2048, world=32, gpus_per_node=8,
                nodes=4)
    return Setting(**{**base, **kw})


def _states(shape, s: Setting) -> int:
    return sum(b for _, b, _ in model_states(shape, s))


@pytest.mark.parametrize("cfg", [{"model_type": "llama"}, {"model_type": "gpt2"}, CASES["mistral"]])
@pytest.mark.parametrize("nodes,gpus", [(1, 1), (1, 8), (4, 8), (16, 8)])
def test_model_states_equal_deepspeeds_own_estimates(cfg, nodes, gpus):
    """DeepSpeed's estimators assume mixed precision with Adam, as hfscale's bf16 rows do."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = shape_of(cfg)
    P, L = shape.params(), shape.largest_layer_params()
    s = setting(world=nodes * gpus, gpus_per_node=gpus, nodes=nodes)
    cpu, gpu = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=False)
    assert abs(_states(shape, s) - gpu) <= 1
    cpu, gpu = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=True)
    off = replace(s, offload_optimizer=True)
    assert _states(shape, off) == gpu
    assert estimate(shape, off).cpu_total == cpu
    for opt, par in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes, cpu_offload=opt, cpu_offload_params=par)
        s3 = replace(s, stage=3, offload_optimizer=opt, offload_params=par)
        assert abs(_states(shape, s3) - gpu) <= 2, (opt, par)
        assert abs(estimate(shape, s3).cpu_total - cpu) <= 1, (opt, par)


def test_model_states_by_hand():
    shape = shape_of(CASES["llama-gqa"])
    P = shape.params()  # 154,944
    rows = {n: b for n, b, _ in model_states(shape, setting(stage=1, world=4))}
    assert rows == {"weights": 2 * P, "gradients": 2 * P, "optimizer states": 16 * P // 4}
    rows = {n: b for n, b, _ in model_states(shape, setting(engine="ddp", stage=0))}
    assert sum(rows.values()) == 20 * P
    rows = {n: b for n, b, _ in model_states(shape, setting(engine="fsdp", stage=3, world=4))}
    assert rows == {"weights (shard)": P, "gradients (shard)": P, "optimizer states (shard)": 2 * P,
                    "gathered parameters": 3 * 2 * 500 * 64}
    fp32 = {n: b for n, b, _ in model_states(shape, setting(stage=2, world=4, precision="no"))}
    assert fp32 == {"weights": 4 * P, "gradients": P, "optimizer states": 12 * P // 4}
    # ZeRO-0: bf16 wraps the optimizer (fp32 master and gradients); fp32 runs the torch optimizer as is
    zero0 = {n: b for n, b, _ in model_states(shape, setting(stage=0, world=4, precision="no"))}
    assert zero0 == {"weights": 4 * P, "gradients": 4 * P, "optimizer states": 8 * P}
    zero0 = {n: b for n, b, _ in model_states(shape, setting(stage=0, world=4, precision="bf16"))}
    assert zero0 == {"weights": 2 * P, "gradients": 2 * P, "optimizer states": 16 * P}


def test_the_total_adds_its_lines_and_the_margin():
    shape = shape_of({"model_type": "llama"})
    e = estimate(shape, setting())
    rows = dict((n, b) for n, b, _ in e.gpu)
    dynamic = sum(b for n, b in rows.items() if n not in ("allocator margin", "CUDA context + NCCL"))
    assert rows["allocator margin"] == int(dynamic * 0.10)
    assert e.gpu_total == dynamic + rows["allocator margin"] + CONTEXT_BYTES
    tokens = 4 * 2048
    assert rows["activations"] == tokens * 32 * shape.layer_activation_bytes(2)
    assert rows["logits and loss"] == tokens * shape.head_bytes(2)


def test_micro_batches_keep_the_global_batch():
    assert micro_batches(setting(micro_batch=4, accumulation=3)) == [12, 6, 4, 3, 2, 1]


GiB = 2**30


def test_verdict_fits_and_names_the_largest_micro_batch():
    shape = shape_of({"model_type": "llama"})  # Llama-2-7B
    s = setting(micro_batch=1, accumulation=8, checkpointing=True)
    e = {m: estimate(shape, replace(s, micro_batch=m, accumulation=8 // m)).gpu_total for m in (1, 2, 4)}
    assert e[1] < e[2] < e[4]
    v = judge(shape, s, (e[2] + e[4]) // 2)  # micro batch 2 fits, 4 does not
    assert v.fits and v.changes == () and v.best is None and v.largest_micro == 2
    assert v.line().startswith("fits: ~") and v.line().endswith("; micro batch up to 2 fits")
    assert judge(shape, s, e[1]).largest_micro == 1 and judge(shape, s, e[1] - 1).fits is False


def test_verdict_prefers_a_smaller_micro_batch_then_checkpointing_then_stage_3_then_offload():
    shape = shape_of({"model_type": "llama"})
    s = setting(micro_batch=8, accumulation=1)
    e = {m: estimate(shape, replace(s, micro_batch=m, accumulation=8 // m)).gpu_total for m in (8, 4, 2, 1)}
    # a limit between micro 2 and micro 4: micro batch 2, accumulation 4, nothing else
    v = judge(shape, s, (e[2] + e[4]) // 2)
    assert not v.fits and v.changes == ("batch.micro_batch_size: 2 (gradient accumulation 4)",)
    # below micro batch 1 without checkpointing, above it with checkpointing: checkpointing
    ck = estimate(shape, replace(s, micro_batch=1, accumulation=8, checkpointing=True)).gpu_total
    assert ck < e[1]
    v = judge(shape, s, (ck + e[1]) // 2)
    assert "training.gradient_checkpointing: true" in v.changes and "distributed.deepspeed.stage: 3" not in v.changes
    # 30 GiB on 32 GPUs: a 7B model's 2 B/param weights (12.6 GiB) + activations need more: ZeRO-3 follows
    v = judge(shape, s, 16 * GiB)
    assert v.best is not None and v.best.gpu_total <= 16 * GiB
    assert v.changes == ("batch.micro_batch_size: 4 (gradient accumulation 2)", "distributed.deepspeed.stage: 3",
                         "training.gradient_checkpointing: true")
    # one GPU of 8 GiB, sequence 2048: nothing but offloading everything fits, if that
    tiny = judge(shape, replace(s, world=1, gpus_per_node=1, nodes=1), 8 * GiB)
    assert not tiny.fits and tiny.best is not None and tiny.best.gpu_total <= 8 * GiB
    assert "distributed.deepspeed.offload_param.device: cpu" in tiny.changes
    assert "distributed.deepspeed.offload_optimizer.device: cpu" in tiny.changes
    assert judge(shape, replace(s, seq_len=1_000_000), 80 * GiB).best is None


def _write(tmp_path, doc: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _run(*args: str):
    return subprocess.run([sys.executable, "-m", "hfscale", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


JOB = {"name": "size", "cluster": {"hosts": [{"host": f"n{i}", "slots": 8} for i in range(4)], "gpu_memory": "80GiB"},
       "runner": {"type": "pdsh"}, "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
       "batch": {"micro_batch_size": 8, "global_batch_size": 512},
       "training": {"model": {"config": {"model_type": "llama", "num_key_value_heads": 8,
                                          "intermediate_size": 14336, "vocab_size": 128256}},
                    "data": {"block_size": 4096}}}


def test_plan_prints_the_table_and_json_and_check_the_verdict(tmp_path):
    path = _write(tmp_path, JOB)
    r = _run("plan", str(path))
    assert r.returncode == 0, r.stderr
    shape = shape_of(JOB["training"]["model"]["config"])
    assert f"{shape.params():,} parameters (equal to the model built on the meta device)" in r.stdout
    assert "verdict      does not fit" in r.stdout and "batch.micro_batch_size: 1 (gradient accumulation 16)" in r.stdout
    j = _run("plan", str(path), "--json", "--no-build", "--gpu-memory", "141GB")
    doc = json.loads(j.stdout)
    assert doc["verdict"]["gpu_memory"] == 141 * 10**9 and doc["model"]["parameters"] == shape.params()
    assert doc["gpu_total"] == sum(doc["gpu"].values())
    c = _run("check", str(path))
    assert c.returncode == 0, c.stderr
    assert "  memory       does not fit: ~" in c.stdout and "(hfscale plan for the table)" in c.stdout


@pytest.mark.parametrize("change,args,message", [
    ({"training": {"model": {"config": {"model_type": "bert"}}}}, (),
     "error: training.model.config: model_type 'bert': hfscale plan sizes gpt2"),
    ({"training": {"script": "train.py"}}, (), "error: the script's model is not named in the YAML: give plan --model"),
    ({}, ("--gpu-memory", "80 gigs"), "error: --gpu-memory '80 gigs' is not a memory size such as 80GiB"),
    ({"training": {"script": "train.py", "script_args": ["--model_name_or_path", "meta-llama/Llama-3-8B"]}}, (),
     "error: --model_name_or_path meta-llama/Llama-3-8B (training.script_args) is not a local directory"),
])
def test_plan_refuses_what_it_cannot_size_with_exit_2(tmp_path, change, args, message):
    doc = {**JOB, **change}
    r = _run("plan", str(_write(tmp_path, doc)), "--no-build", *args)
    assert r.returncode == 2 and r.stderr.startswith(message), r.stderr
    assert "Traceback" not in r.stderr


def test_plan_reads_a_scripts_model_and_sequence_length(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CASES["qwen2"]))
    doc = {**JOB, "training": {"script": "train.py", "script_args": [
        "--model_name_or_path", str(tmp_path / "m"), "--max_seq_length", "1024"]}}
    r = _run("plan", str(_write(tmp_path, doc)), "--json", "--no-build")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"]["parameters"] == shape_of(CASES["qwen2"]).params()
    assert doc["setting"]["seq_len"] == 1024
    fifo = tmp_path / "fifo.json"
    import os

    os.mkfifo(fifo)
    r = _run("plan", str(_write(tmp_path, JOB)), "--model", str(fifo), "--no-build")
    assert r.returncode == 2 and "is not a regular file" in r.stderr


def test_a_job_naming_no_model_is_sized_as_the_model_the_entry_point_builds():
    """No training.model and no script: plan sizes the built-in entry point's default model, the
    one hfscale.training.train.build_model makes (it once sized GPT-2 small, 124M, for a 2-layer model)."""
    from conftest import job_of
    from hfscale.config.model import ModelConfig
    from hfscale.memory.plan_command import model_config
    from hfscale.training.train import build_model

    cfg, source = model_config(job_of("name: d\nbatch: {micro_batch_size: 1}\n"), None)
    built, _ = build_model(ModelConfig(), seed=0, zero_init=False)
    assert shape_of(cfg).params() == sum(p.numel() for p in built.parameters())
    assert source == "the built-in entry point's default (a 2-layer GPT-2)"


def test_ddp_and_zero_0_get_every_deepspeed_lever():
    """A 7B job on 8 GPUs of 24 GiB: DDP was only ever offered ZeRO-2 ('no change fits'), and ZeRO-0
    never optimizer offload. Now DDP gets DeepSpeed's levers with the backend switch (once), and on
    one GPU both find ZeRO-2 with optimizer offload."""
    shape = shape_of({"model_type": "llama"})
    ddp = setting(engine="ddp", stage=0, micro_batch=1, accumulation=8, world=8, gpus_per_node=8, nodes=1)
    v = judge(shape, ddp, 24 * GiB)
    assert v.best is not None and v.best.gpu_total <= 24 * GiB and v.best.setting.engine == "deepspeed"
    assert v.changes.count("distributed.backend: deepspeed") == 1 and "distributed.deepspeed.stage: 3" in v.changes
    one = replace(ddp, world=1, gpus_per_node=1)
    for s in (one, replace(one, engine="deepspeed")):
        v = judge(shape, s, 24 * GiB)
        assert v.best is not None and v.best.gpu_total <= 24 * GiB
        assert {"distributed.deepspeed.stage: 2", "distributed.deepspeed.offload_optimizer.device: cpu"} <= set(v.changes)


def test_the_reduce_bucket_is_counted_whole_even_for_a_small_model():
    """DeepSpeed allocates reduce_bucket_size elements whatever the model's size (stage_1_and_2:
    torch.empty(int(self.reduce_bucket_size)), twice with overlap_comm); the allgather and prefetch
    buckets hold at most the model. check (no model known) counts both whole, from the same formula."""
    from hfscale.memory.estimate import bucket_bytes, buckets

    shape = shape_of(CASES["llama-gqa"])
    P = shape.params()  # 154,944, far below the 5e8-element buckets
    b, _ = buckets(shape, setting(stage=2, overlap_comm=True))
    assert b == int((500_000_000 + P) * 2 * 4.5)
    b, _ = buckets(shape, setting(stage=3))
    assert b == (500_000_000 + P) * 2
    assert bucket_bytes(2, 500_000_000, 500_000_000, True, 2) == 9_000_000_000  # DeepSpeed's documented 9 GB
