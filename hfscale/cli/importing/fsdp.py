"""``hfscale import``: an accelerate config's ``fsdp_config`` into the hfscale draft.

hfscale writes FSDP2. An FSDP1 config is converted as ``accelerate to-fsdp2`` converts it, with the
installed accelerate's own mapping (hfscale.config.sources.accelerate reads it from its source), and a note
for each key whose meaning changes; FSDP1's numeric sharding strategies are read as accelerate
reads them, and FSDP1's default checkpoint layout (a full state dict) is kept.
"""

from __future__ import annotations

from typing import Any

from hfscale.cli.importing.draft import Draft, as_bool
from hfscale.config.sources.accelerate import accelerate_keys, fsdp2_mapping

FSDP_KEYS = {"reshard_after_forward", "offload_params", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
             "min_num_params", "state_dict_type", "activation_checkpointing", "activation_checkpointing_offload",
             "cpu_ram_efficient_loading"}
# accelerate's values where its file leaves a key out and hfscale's default differs
FSDP_ABSENT = {"auto_wrap_policy": "NO_WRAP"}

# what each FSDP1 key dropped or renamed by accelerate's conversion meant, for the notes
_FSDP1_MEANING = {
    "fsdp_backward_prefetch": "FSDP2 prefetches the next all-gather in backward by itself",
    "fsdp_forward_prefetch": "accelerate does not offer forward prefetch with FSDP2",
    "fsdp_sync_module_states": "FSDP2 has no such switch; with cpu_ram_efficient_loading accelerate loads the "
                               "weights on rank 0 and broadcasts them",
    "fsdp_use_orig_params": "FSDP2 always trains the original parameters",
}
_SHARDING_NOTE = {
    "HYBRID_SHARD": "FSDP2 shards across every rank; hybrid sharding (replicas across nodes) is "
                    "distributed.parallelism.dp_replicate_size",
    "HYBRID_SHARD_ZERO2": "FSDP2 shards across every rank; hybrid sharding (replicas across nodes) is "
                          "distributed.parallelism.dp_replicate_size",
    "NO_SHARD": "FSDP2 still shards parameters, gradients and optimizer state; for no sharding use backend ddp",
}


def import_fsdp(fsdp: Any, draft: Draft, where: str, backend: str) -> None:
    """Put the accelerate config's fsdp_config (file ``where``) into ``draft``."""
    if backend != "fsdp":
        draft.refuse(f"{where}: fsdp_config", f"FSDP settings, but the backend is {backend}")
        return
    if not isinstance(fsdp, dict):
        draft.refuse(f"{where}: fsdp_config", f"must be a mapping, got {type(fsdp).__name__}")
        return
    fsdp = _read_by_accelerate(fsdp, draft, where)
    # accelerate launch adds the fsdp_ prefix where the file leaves it out
    named = {f"fsdp_{str(k).removeprefix('fsdp_')}": str(k) for k in fsdp}  # prefixed -> as written in the file
    prefixed = {f"fsdp_{str(k).removeprefix('fsdp_')}": v for k, v in fsdp.items()}
    version = prefixed.get("fsdp_version", 1)
    if not (isinstance(version, (int, float, str)) and str(version).strip() in ("1", "2", "1.0", "2.0")):
        draft.refuse(f"{where}: fsdp_config.{named.get('fsdp_version', 'fsdp_version')}", f"{version!r}: 1 or 2")
        return
    origin = {k: k for k in prefixed}  # FSDP2 key -> the key of the file it comes from
    if float(version) == 1:
        prefixed, origin = _to_fsdp2(prefixed, named, draft, where)
        if prefixed is None:
            return
    values = {k.removeprefix("fsdp_"): v for k, v in prefixed.items() if k != "fsdp_version"}
    for key, value in values.items():
        written = named.get(origin.get(f"fsdp_{key}", f"fsdp_{key}"), f"fsdp_{key}")
        if key not in FSDP_KEYS:
            draft.refuse(f"{where}: fsdp_config.{written}", "not an FSDP2 setting hfscale writes")
            continue
        value = as_bool(value)
        if key == "transformer_layer_cls_to_wrap":  # accelerate reads a comma-separated string
            items = value if isinstance(value, list) else str(value).split(",")
            value = [str(c).strip() for c in items if str(c).strip()]
        draft.set(("distributed", "fsdp", key), value, key=f"fsdp_config.{written}")
    for key, value in FSDP_ABSENT.items():
        if key not in values:
            draft.set(("distributed", "fsdp", key), value, "absent from the accelerate config: accelerate's default")


def _read_by_accelerate(fsdp: dict[str, Any], draft: Draft, where: str) -> dict[str, Any]:
    """``fsdp`` without the keys accelerate launch has no argument for (it copies every key onto its
    arguments, and only its own become FSDP's variables: nothing reads the rest), each said."""
    keys = accelerate_keys()
    section = keys.keys["fsdp_config"].section if keys is not None and "fsdp_config" in keys.keys else None
    if section is None or section.open:
        return fsdp
    unread = [k for k in fsdp if str(k) not in section.keys and f"fsdp_{str(k).removeprefix('fsdp_')}" not in section.keys]
    if unread:
        draft.notes.append(f"{where}: left out fsdp_config.{', fsdp_config.'.join(map(str, unread))}: not an argument "
                           "of the installed accelerate's launch, so nothing reads it")
    return {k: v for k, v in fsdp.items() if k not in unread}


def _to_fsdp2(fsdp: dict[str, Any], named: dict[str, str], draft: Draft, where: str
              ) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The FSDP1 section as accelerate's to-fsdp2 converts it (None: it cannot be), and for each
    FSDP2 key the FSDP1 key it came from."""
    mapping = fsdp2_mapping()
    if mapping is None:
        draft.refuse(f"{where}: fsdp_config", "FSDP1: hfscale writes FSDP2, and the installed accelerate has no "
                     "to-fsdp2 conversion to convert it with")
        return None, {}
    strategy = fsdp.get("fsdp_sharding_strategy")
    if isinstance(strategy, (int, str)) and str(strategy).isdigit() and 1 <= int(strategy) <= len(mapping.strategies):
        strategy = fsdp["fsdp_sharding_strategy"] = mapping.strategies[int(strategy) - 1]  # FSDP1 reads 1 as FULL_SHARD
    converted, dropped = mapping.convert(fsdp)
    origin = {mapping.keys.get(k, k): k for k in fsdp if k not in dropped}
    draft.notes.append(f"{where}: FSDP1 (fsdp_version 1) converted to FSDP2 as `accelerate to-fsdp2` does")
    for key in dropped:
        draft.notes.append(f"{where}: left out {named[key]}: {mapping.dropped[key]} "
                           f"({_FSDP1_MEANING.get(key, 'accelerate drops it')})")
    if strategy is not None:
        new = converted.get(mapping.keys.get("fsdp_sharding_strategy", ""), strategy)
        why = _SHARDING_NOTE.get(str(strategy), "the same sharding")
        draft.notes.append(f"{where}: {named['fsdp_sharding_strategy']} {strategy} became reshard_after_forward "
                           f"{str(new).lower()}: {why}")
    if "fsdp_state_dict_type" not in converted:  # FSDP1's default; FSDP2's is SHARDED_STATE_DICT
        converted["fsdp_state_dict_type"] = "FULL_STATE_DICT"
        draft.notes.append(f"{where}: state_dict_type FULL_STATE_DICT written out: FSDP1's default, which FSDP2 "
                           "would change to SHARDED_STATE_DICT")
    return converted, origin
