"""Memory per GPU (and per node) of one training setting, before a GPU is touched (pure).

Model states follow DeepSpeed's own accounting (``estimate_zero2/3_model_states_mem_needs``,
mixed precision with Adam) where it has one, and the same bytes-per-parameter reasoning
elsewhere: 16-bit weights and gradients, fp32 master weights, two fp32 Adam moments and the fp32
gradient partition the optimizer steps on. Activations come from hfscale.memory.model_shape (the
tensors autograd keeps per token). The CUDA context and NCCL's buffers are a separate line:
``torch.cuda.max_memory_reserved`` does not see them, the GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # check imports this module for bucket_bytes only
    from hfscale.memory.model_shape import Shape

GiB = 2**30
CONTEXT_BYTES = GiB  # CUDA context, cuBLAS workspaces and NCCL buffers of one process
CONTEXT_LINE = "CUDA context + NCCL"
ALLOCATOR_MARGIN = 0.10  # of what torch allocates: the caching allocator's fragmentation
OFFLOAD_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for pinned CPU memory
# 16-bit training precisions. fp8 counts as bf16: accelerate runs it under bf16 autocast, with
# DeepSpeed's bf16 on and FSDP's parameters in bf16 (DeepSpeedPlugin / FullyShardedDataParallelPlugin
# set_mixed_precision), and what fp8 layers save for backward is no larger. Not counted: the fp8
# copies of the weights Transformer Engine or torchao cast while a layer runs.
HALF = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Setting:
    """What decides memory: the engine and its sharding, the batch and the precision."""

    engine: str  # deepspeed, fsdp, ddp
    stage: int  # ZeRO stage; fsdp: 3 (reshard after forward) or 2; ddp: 0
    offload_optimizer: bool
    offload_params: bool
    micro_batch: int
    accumulation: int
    checkpointing: bool  # gradient (activation) checkpointing
    precision: str  # bf16, fp16, fp8, no
    seq_len: int
    world: int  # ranks that shard the model states (data-parallel ranks)
    gpus_per_node: int
    nodes: int
    reduce_bucket: int = 500_000_000  # elements (DeepSpeed)
    allgather_bucket: int = 500_000_000
    prefetch_bucket: int = 50_000_000
    overlap_comm: bool = False
    comm_bytes: int = 2  # bytes per element in the buckets

    def describe(self) -> str:
        """One line: the engine, the batch, checkpointing."""
        if self.engine == "deepspeed":
            off = [w for w, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
            eng = f"ZeRO-{self.stage}" + (f", {' and '.join(off)} offloaded to CPU" if off else "")
        elif self.engine == "fsdp":
            eng = "FSDP2" + (" (parameters kept gathered)" if self.stage == 2 else "") + (
                ", offloaded to CPU" if self.offload_params else "")
        else:
            eng = "DDP"
        ckpt = ", gradient checkpointing" if self.checkpointing else ""
        return f"{eng}, micro batch {self.micro_batch} x accumulation {self.accumulation}{ckpt}"


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU by line (name, bytes, how), and per node on the CPU."""

    setting: Setting
    params: int
    gpu: tuple[tuple[str, int, str], ...]
    cpu: tuple[tuple[str, int, str], ...]

    @property
    def gpu_total(self) -> int:
        return sum(b for _, b, _ in self.gpu)

    @property
    def reserved(self) -> int:
        """What torch's caching allocator would hold: everything but the context line."""
        return sum(b for n, b, _ in self.gpu if n != CONTEXT_LINE)

    @property
    def cpu_total(self) -> int:
        return sum(b for _, b, _ in self.cpu)


def model_states(shape: Shape, s: Setting) -> list[tuple[str, int, str]]:
    """Weights, gradients, optimizer states and gathered parameters on one GPU."""
    P, L, N = shape.params(), shape.largest_layer_params(), s.world
    half = s.precision in HALF
    w = 2 if half else 4
    opt = 16 if half else 12  # master + 2 moments + fp32 gradient partition; fp32 training: the weights are the master
    if s.engine == "ddp":
        # accelerate keeps fp32 weights under autocast; DDP copies gradients into its buckets
        return [("weights", 4 * P, "fp32: 4 B x P"), ("gradients", 4 * P, "fp32: 4 B x P"),
                ("optimizer states", 8 * P, "Adam moments: 8 B x P"),
                ("DDP gradient buckets", 4 * P, "a flat fp32 copy of the gradients (gradient_as_bucket_view off)")]
    if s.engine == "fsdp":
        shard = 0 if s.offload_params else 1
        gathered = w * P if s.stage == 2 else 3 * w * L  # this layer and the prefetched one, and its gradient
        return [("weights (shard)", shard * 4 * P // N, f"fp32: 4 B x P / {N}"),
                ("gradients (shard)", shard * 4 * P // N, f"fp32: 4 B x P / {N}"),
                ("optimizer states (shard)", shard * 8 * P // N, f"Adam moments: 8 B x P / {N}"),
                ("gathered parameters", gathered, f"{w} B x P, kept gathered" if s.stage == 2 else
                 f"{w} B x 3 x largest layer ({L:,} parameters)")]
    if s.stage == 0:  # fp32: DeepSpeed runs the torch optimizer unwrapped (engine._do_optimizer_sanity_check)
        return [("weights", w * P, f"{w} B x P"), ("gradients", w * P, f"{w} B x P"),
                ("optimizer states", (16 if half else 8) * P,
                 "fp32 master, fp32 gradients, Adam moments: 16 B x P" if half else "Adam moments: 8 B x P")]
    if s.stage in (1, 2):
        grads = w * P if s.stage == 1 else w * P // N
        out = [("weights", w * P, f"{w} B x P")]
        if not s.offload_optimizer:
            out += [("gradients", grads, f"{w} B x P" + ("" if s.stage == 1 else f" / {N}")),
                    ("optimizer states", opt * P // N, f"{opt} B x P / {N} (fp32 master, fp32 gradients, moments)")]
        return out
    out = [("gathered layer", 2 * w * L, f"{w} B x 2 (parameters, gradients) x largest layer ({L:,} parameters)")]
    if not s.offload_params:
        out.append(("weights (shard)", w * P // N, f"{w} B x P / {N}"))
    if not s.offload_optimizer:
        out.append(("optimizer states (shard)", opt * P // N, f"{opt} B x P / {N}"))
    return out


def bucket_bytes(stage: int, reduce: int, other: int, overlap: bool, elem: int, params: int | None = None) -> int:
    """DeepSpeed's communication buffers on one GPU, its documented estimate: stages 1-2 (reduce +
    allgather bucket) x element size, 4.5 times that with overlap_comm; stage 3 (reduce + prefetch
    bucket) x element size. The reduce bucket is allocated whole (stage_1_and_2: torch.empty(
    reduce_bucket_size)); ``params``, the model's size (unknown to check), caps the other one."""
    n = reduce + (min(other, params) if params is not None else other)
    return int(n * elem * (4.5 if stage in (1, 2) and overlap else 1))


def buckets(shape: Shape, s: Setting) -> tuple[int, str]:
    """Communication buffers on one GPU (bucket_bytes, capped at the model)."""
    if s.engine != "deepspeed" or s.stage == 0:
        return 0, ""
    other = s.allgather_bucket if s.stage in (1, 2) else s.prefetch_bucket
    b = bucket_bytes(s.stage, s.reduce_bucket, other, s.overlap_comm, s.comm_bytes, shape.params())
    if s.stage in (1, 2):
        return b, (f"(reduce + allgather bucket, the latter at most P) x {s.comm_bytes} B"
                   + (" x 4.5 (overlap_comm)" if s.overlap_comm else ""))
    return b, f"(reduce + prefetch bucket) x {s.comm_bytes} B"


def activations(shape: Shape, s: Setting) -> list[tuple[str, int, str]]:
    """What the forward pass keeps for backward, and the loss's float logits."""
    k = 2 if s.precision in HALF else 4
    tokens = s.micro_batch * s.seq_len
    layer = shape.layer_activation_bytes(k)
    if s.checkpointing:
        kept = shape.num_hidden_layers * shape.checkpointed_layer_bytes(k) + layer  # + one layer recomputed
        how = f"{shape.num_hidden_layers} layer inputs + one layer recomputed, per token"
    else:
        kept = shape.num_hidden_layers * layer
        how = f"{shape.num_hidden_layers} layers x {layer:,} B per token"
    return [("activations", tokens * kept, f"{how} x {s.micro_batch} x {s.seq_len} tokens"),
            ("logits and loss", tokens * shape.head_bytes(k), f"(8 + {k}) B x vocab {shape.vocab_size:,} per token")]


def step_temporary(shape: Shape, s: Setting) -> tuple[int, str]:
    """The optimizer step's transient on the GPU: torch's foreach AdamW (torch.optim.AdamW's default on
    CUDA) holds one fp32 temporary the size of its partition (the sqrt of the second moment);
    the fused kernels (adamw_torch_fused, DeepSpeed's FusedAdam) hold none, so this errs on the
    safe side. Measured on an H200: the peak of a 1.26B model at micro batch 1 is the step's."""
    if s.offload_optimizer or (s.engine == "fsdp" and s.offload_params):
        return 0, ""
    n = 1 if s.engine == "ddp" or (s.engine == "deepspeed" and s.stage == 0) else s.world
    return 4 * shape.params() // n, "AdamW's fp32 temporary: 4 B x P" + (f" / {n}" if n > 1 else "")


def cpu_memory(shape: Shape, s: Setting) -> list[tuple[str, int, str]]:
    """Per node: pinned CPU memory for offloading (DeepSpeed's estimate) and for loading."""
    P, L = shape.params(), shape.largest_layer_params()
    f = OFFLOAD_BUFFER_FACTOR
    g, n = s.gpus_per_node, s.nodes
    if s.engine == "deepspeed" and s.stage in (1, 2) and s.offload_optimizer:
        return [("optimizer offload", int(P * max(4 * s.world, 16) * f), "P x max(4 x GPUs, 16) B x 1.5")]
    if s.engine == "deepspeed" and s.stage == 3:
        if s.offload_optimizer:
            per = 18 if s.offload_params else 16
            return [("offload", int(P * per / n * f), f"{per} B x P / {n} nodes x 1.5")]
        return [("loading", int(L * 4 * g * f), f"4 B x largest layer x {g} GPUs x 1.5 (zero.Init)")]
    if s.engine == "fsdp" and s.offload_params:
        return [("offload", int(16 * P * g // s.world * f), f"16 B x P / {s.world} x {g} GPUs x 1.5")]
    return [("loading", int(4 * P * g * f), f"a whole fp32 copy per GPU: 4 B x P x {g} x 1.5")]


def estimate(shape: Shape, s: Setting) -> Estimate:
    """The memory of ``s`` for a model of ``shape``."""
    rows = model_states(shape, s)
    b, how = buckets(shape, s)
    if b:
        rows.append(("communication buckets", b, how))
    acts = activations(shape, s)
    rows += acts
    step, how = step_temporary(shape, s)
    beyond = step - sum(r[1] for r in acts)  # the step runs after backward has freed the activations
    if beyond > 0:
        rows.append(("optimizer step, beyond activations", beyond, how + ", less the activations freed before it"))
    dynamic = sum(r[1] for r in rows)
    rows.append(("allocator margin", int(dynamic * ALLOCATOR_MARGIN), f"{ALLOCATOR_MARGIN:.0%} of the above"))
    rows.append((CONTEXT_LINE, CONTEXT_BYTES, "per process, outside torch's allocator"))
    return Estimate(s, shape.params(), tuple(rows), tuple(cpu_memory(shape, s)))
