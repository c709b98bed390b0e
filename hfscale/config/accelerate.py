"""The accelerate side of the config: FSDP2, accelerate's parallelism_config, and the keys of
the accelerate config file hfscale does not type (``accelerate.extra``, checked against the
installed accelerate's own keys by hfscale.rules.accelerate)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from hfscale.config.base import PositiveInt, Strict, _seq, must_match


class FsdpSection(Strict):
    """PyTorch FSDP (version 2) settings; rendered into the accelerate config."""

    reshard_after_forward: bool = Field(True, description="Free gathered parameters after forward (ZeRO-3 like).")
    offload_params: bool = Field(False, description="Offload parameters and gradients to CPU.")
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP", description="How modules are grouped into FSDP units. (accelerate's default, NO_WRAP, "
        "makes the whole model one unit: every parameter gathered at once, no saving per layer.)"
    )
    transformer_layer_cls_to_wrap: tuple[str, ...] = _seq(
        description="Layer classes to wrap (TRANSFORMER_BASED_WRAP); empty: the model's _no_split_modules."
    )
    min_num_params: PositiveInt = Field(100_000_000, description="Unit size for SIZE_BASED_WRAP.")
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT", description="Checkpoint layout."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    activation_checkpointing_offload: bool = Field(
        False, description="With activation_checkpointing: keep each checkpointed layer's input in pinned CPU memory.")
    cpu_ram_efficient_loading: bool = Field(True, description="Load pretrained weights on rank 0 only.")


class ParallelismConfig(Strict):
    """accelerate's parallelism_config: how the ranks split into data-, tensor-, context- (FSDP2) and
    sequence-parallel (DeepSpeed ALST/Ulysses) groups. Their product is the world size; the batch is
    per data-parallel rank."""

    dp_replicate_size: PositiveInt = Field(1, description="Data-parallel replicas (each holding a whole shard group).")
    dp_shard_size: PositiveInt = Field(1, description="Ranks FSDP shards the model across, within a replica.")
    tp_size: PositiveInt = Field(1, description="Tensor-parallel ranks (they see the same batch).")
    cp_size: PositiveInt = Field(1, description="Context-parallel ranks: the sequence split across them.")
    sp_size: PositiveInt = Field(1, description="Sequence-parallel ranks (DeepSpeed ALST/Ulysses, backend deepspeed): "
                                 "each holds a slice of every sequence; they see the same samples.")
    sp_backend: Literal["deepspeed"] = Field("deepspeed", description="Sequence-parallel backend; accelerate has "
                                             "only deepspeed.")
    sp_seq_length: PositiveInt | None = Field(None, description="Sequence length of every batch, when "
                                              "sp_seq_length_is_variable is false.")
    sp_seq_length_is_variable: bool = Field(True, description="Batches may differ in sequence length (the sequence "
                                            "variables are derived on every forward).")
    sp_attn_implementation: str = Field("sdpa", description="Attention under sequence parallelism: sdpa, "
                                        "flash_attention_2, flash_attention_3 or a hub flash-attn kernel; the model "
                                        "must be loaded with the same.")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def total(self) -> int:
        return self.data_parallel * self.tp_size * self.cp_size * self.sp_size


class AccelerateSection(Strict):
    """accelerate config keys beyond the engine's (accelerate launch reads them)."""

    gpu_ids: str | None = Field(
        None, description="GPUs each node uses, 'all' or a list such as '0,1,2,3' (as many as its processes). "
        "Null: all.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Further keys of the accelerate config file, merged in, e.g. "
        "{enable_cpu_affinity: true}. Checked against the installed accelerate's own keys; a key hfscale sets from "
        "another part of this file is refused with that part's name.")

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids(cls, v: str | None) -> str | None:
        return must_match(v, r"^(all|[0-9]{1,4}(,[0-9]{1,4})*)$", " is not 'all' or a comma-separated list of GPU ids")
