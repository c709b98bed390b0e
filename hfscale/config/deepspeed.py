"""The ``distributed.deepspeed`` section: every DeepSpeed setting people tune, typed.

Key names are DeepSpeed's own, so a DeepSpeed user finds them where the JSON has them
(``zero_optimization.X`` is ``distributed.deepspeed.X``; sections such as ``aio`` keep their
name). Defaults are those of DeepSpeed's config classes unless a description says why not. What is
not typed here goes into ``extra``, checked against DeepSpeed's own key set (hfscale.rules.deepspeed).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from hfscale.config.base import Count, Integral, NoBool, Strict, WholeInt

Device = Literal["none", "cpu", "nvme"]
DType = Literal["fp32", "fp16", "bf16"]
_NVME_ONLY = " NVMe offload only."


class OffloadOptimizerConfig(Strict):
    """ZeRO-Offload / ZeRO-Infinity of the optimizer state (DeepSpeed's offload_optimizer)."""

    device: Device = Field("none", description="Where to offload: none, cpu or nvme (stage 3).")
    nvme_path: str | None = Field(None, description="Local NVMe directory; required (and only allowed) with device nvme.")
    pin_memory: bool = Field(True, description="Page-locked host memory: full-bandwidth, asynchronous transfers.")
    buffer_count: Annotated[int, Integral] = Field(4, ge=0, le=1024, description="Buffers in the NVMe swap pool; at least the states "
                              "kept per parameter (Adam: 4)." + _NVME_ONLY)
    pipeline_read: bool = Field(False, description="Overlap reading the next tile with the optimizer step." + _NVME_ONLY)
    pipeline_write: bool = Field(False, description="Overlap writing the last tile with the optimizer step." + _NVME_ONLY)
    fast_init: bool = Field(False, description="Faster optimizer initialisation." + _NVME_ONLY)
    ratio: float = Field(1.0, ge=0, le=1, description="Share of the optimizer states on the CPU (partial offload, "
                         "ZeRO stage 3 with device cpu).")


class OffloadParamConfig(Strict):
    """ZeRO-Infinity offload of the parameters (DeepSpeed's offload_param; stage 3 only)."""

    device: Device = Field("none", description="Where to offload: none, cpu or nvme.")
    nvme_path: str | None = Field(None, description="Local NVMe directory; required (and only allowed) with device nvme.")
    pin_memory: bool = Field(True, description="Page-locked host memory: full-bandwidth, asynchronous transfers.")
    buffer_count: Annotated[int, Integral] = Field(5, ge=0, le=1024, description="Buffers in the NVMe swap pool." + _NVME_ONLY)
    buffer_size: Count = Field(100_000_000, description="Elements per swap buffer; at least the largest parameter."
                               + _NVME_ONLY)
    max_in_cpu: Count = Field(1_000_000_000, description="Parameter elements kept in CPU memory." + _NVME_ONLY)


class AioConfig(Strict):
    """Asynchronous I/O for NVMe offload (DeepSpeed's aio section)."""

    block_size: WholeInt = Field(1_048_576, description="Bytes per read or write request.")
    queue_depth: WholeInt = Field(8, description="Requests in flight.")
    intra_op_parallelism: WholeInt = Field(1, description="Threads per I/O operation.")
    single_submit: bool = Field(False, description="Submit requests one by one instead of in batches.")
    overlap_events: bool = Field(True, description="Overlap submitting requests with waiting for them.")
    use_gds: bool = Field(False, description="GPUDirect Storage (NVIDIA GDS) instead of a CPU bounce buffer.")


class ActivationCheckpointingConfig(Strict):
    """DeepSpeed's activation checkpointing (only for models that call deepspeed.checkpointing;
    Hugging Face models checkpoint with torch: use the Trainer's gradient_checkpointing)."""

    partition_activations: bool = Field(False, description="Partition the checkpoints across model-parallel ranks.")
    cpu_checkpointing: bool = Field(False, description="Keep the checkpoints in CPU memory (with partition_activations).")
    contiguous_memory_optimization: bool = Field(False, description="Copy checkpoints into one buffer.")
    number_checkpoints: WholeInt | None = Field(None, description="Checkpoints per pass, for the contiguous buffer.")
    synchronize_checkpoint_boundary: bool = Field(False, description="Synchronise the device at each checkpoint.")
    profile: bool = Field(False, description="Time the checkpointing functions.")


class FlopsProfilerConfig(Strict):
    """DeepSpeed's flops profiler: FLOPs, latency and parameters per module, once."""

    enabled: bool = Field(False, description="Profile one step.")
    profile_step: WholeInt = Field(1, description="The step profiled.")
    module_depth: Annotated[int, Integral] = Field(-1, ge=-1, le=1000, description="Depth of the per-module table; -1: all.")
    top_modules: WholeInt = Field(1, description="Modules listed per depth.")
    detailed: bool = Field(True, description="Print the per-module table.")
    output_file: str | None = Field(None, description="Write the profile here instead of to stdout.")


class CommsLoggerConfig(Strict):
    """DeepSpeed's communication logger: size and latency of each collective."""

    enabled: bool = Field(False, description="Log collectives.")
    verbose: bool = Field(False, description="Print every collective as it happens.")
    prof_all: bool = Field(True, description="Log every collective (else only those in prof_ops).")
    prof_ops: tuple[str, ...] = Field((), strict=False, description="Collectives to log when prof_all is false, "
                                      "e.g. [all_reduce, all_gather].")
    debug: bool = Field(False, description="Name the calling function of each collective.")


class MonitorConfig(Strict):
    """A DeepSpeed monitor writing to files (tensorboard, csv_monitor)."""

    enabled: bool = Field(False, description="Write DeepSpeed's own metrics (loss, lr, samples).")
    output_path: str = Field("", description="Directory; empty: DeepSpeed's default.")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory of the run.")


class WandbMonitorConfig(Strict):
    """DeepSpeed's W&B monitor."""

    enabled: bool = Field(False, description="Log DeepSpeed's own metrics to W&B.")
    group: str | None = Field(None, description="W&B group.")
    team: str | None = Field(None, description="W&B entity.")
    project: str = Field("deepspeed", description="W&B project.")


class DsOptimizerConfig(Strict):
    """DeepSpeed builds the optimizer (its fused or CPU implementation); its parameters are
    training.learning_rate, adam_beta1/2, adam_epsilon and weight_decay."""

    type: Literal["Adam", "AdamW", "Lamb", "Lion", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"] = Field(
        "AdamW", description="DeepSpeed optimizer type (further params through 'extra', e.g. torch_adam). The 1-bit "
        "ones only where the installed DeepSpeed still builds them, and at stage 0.")


class DsSchedulerConfig(Strict):
    """DeepSpeed builds the learning-rate schedule from training.* (linear warm-up, as the Trainer)."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = Field(
        "WarmupDecayLR", description="WarmupLR (training.lr_scheduler_type constant or constant_with_warmup), "
        "WarmupDecayLR (linear) or WarmupCosineLR (cosine); the last two need training.max_steps.")


class DeepSpeedSection(Strict):
    """DeepSpeed settings; rendered into the DeepSpeed JSON."""

    def overlap(self) -> bool:
        """overlap_comm as DeepSpeed applies it: null means on for stage 3 only."""
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3

    def comm_bytes(self, precision: str) -> int:
        """Bytes per element in the communication buckets (communication_data_type, else the precision's)."""
        return 4 if (self.communication_data_type or {"no": "fp32"}.get(precision, "fp16")) == "fp32" else 2

    stage: Annotated[Literal[0, 1, 2, 3], NoBool] = Field(2, description="ZeRO stage: 0 off, 1 optimizer state, 2 +gradients, 3 +parameters. Default 2: DeepSpeed's own default is 0, but choosing DeepSpeed means choosing ZeRO.")
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig, description="Optimizer state offload (stages 1-3; nvme needs stage 3).")
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig,
                                              description="Parameter offload (stage 3 only).")
    overlap_comm: bool | None = Field(
        None, description="Overlap gradient reduction with the backward pass; costs 4.5x the bucket sizes in memory "
        "(check prints it). Null: DeepSpeed's default, true for stage 3, false for stages 1-2.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one buffer to avoid fragmentation.")
    reduce_bucket_size: Count = Field(500_000_000, description="Elements reduced at a time.")
    allgather_bucket_size: Count = Field(500_000_000, description="Elements all-gathered at a time (stages 1-2).")
    round_robin_gradients: bool = Field(False, description="Stages 1-2 with CPU offload: copy gradients to the CPU "
                                        "in parallel across ranks.")
    sub_group_size: Count = Field(1_000_000_000, description="Parameter elements per optimizer-step tile (offload).")
    stage3_prefetch_bucket_size: Count = Field(50_000_000, description="Parameter elements prefetched (stage 3).")
    stage3_param_persistence_threshold: Count = Field(
        100_000, description="Parameters smaller than this stay unpartitioned (stage 3)."
    )
    stage3_max_live_parameters: Count = Field(1_000_000_000, description="Live parameters per GPU before release (stage 3).")
    stage3_max_reuse_distance: Count = Field(1_000_000_000, description="Keep a parameter if reused within this distance (stage 3).")
    gather_16bit_weights_on_model_save: bool = Field(
        False, description="Stage 3: gather a whole 16-bit model when saving (a loadable model file; costs a gather "
        "of every parameter per save). DeepSpeed's stage3_gather_16bit_weights_on_model_save.")
    zero_hpz_partition_size: WholeInt = Field(
        1, description="ZeRO++ hierarchical partitioning (stage 3): ranks holding a secondary copy of the "
        "parameters, usually the GPUs of one node; must divide the world size. 1: off.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++: all-gather int8-quantized weights (stage 3).")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++: reduce-scatter int4-quantized gradients (stage 3).")
    zero3_init: bool = Field(
        True, description="Stage 3: build the model already partitioned (deepspeed.zero.Init), so no rank holds it "
        "whole. false: the built-in entry point builds it whole on every rank, then DeepSpeed partitions it. Only the "
        "built-in entry point can honour false: transformers uses zero.Init for any stage-3 config a script's "
        "TrainingArguments or Accelerator names.")
    communication_data_type: DType | None = Field(
        None, description="Precision of gradient communication. Null: DeepSpeed's choice (the training precision).")
    grad_accum_dtype: DType | None = Field(
        None, description="Precision gradients are accumulated in (DeepSpeed's data_types.grad_accum_dtype). Null: "
        "DeepSpeed's choice.")
    aio: AioConfig | None = Field(None, description="Asynchronous I/O for NVMe offload. Null: DeepSpeed's defaults.")
    activation_checkpointing: ActivationCheckpointingConfig | None = Field(
        None, description="DeepSpeed's activation checkpointing (models that use deepspeed.checkpointing).")
    flops_profiler: FlopsProfilerConfig | None = Field(None, description="DeepSpeed's flops profiler.")
    comms_logger: CommsLoggerConfig | None = Field(None, description="DeepSpeed's communication logger.")
    tensorboard: MonitorConfig | None = Field(None, description="DeepSpeed's TensorBoard monitor.")
    wandb: WandbMonitorConfig | None = Field(None, description="DeepSpeed's W&B monitor.")
    csv_monitor: MonitorConfig | None = Field(None, description="DeepSpeed's CSV monitor.")
    optimizer: DsOptimizerConfig | None = Field(
        None, description="DeepSpeed builds the optimizer. Null: the script (the Trainer) does; with optimizer offload "
        "accelerate swaps the script's torch optimizer for DeepSpeed's CPU Adam (unless zero_force_ds_cpu_optimizer is "
        "false).")
    scheduler: DsSchedulerConfig | None = Field(None, description="DeepSpeed builds the learning-rate schedule. Null: "
                                                "the script (the Trainer) does.")
    steps_per_print: WholeInt | None = Field(None, description="DeepSpeed's own progress print interval in steps. "
                                                "Null: DeepSpeed's default, no periodic print.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Further DeepSpeed JSON keys, merged into the generated file, e.g. "
        "{zero_optimization: {stage3_module_granularity_threshold: 1000}}. Keys are checked against the installed "
        "DeepSpeed's own; a key hfscale types above is refused with its name.")
