"""Export a Trainer checkpoint as one Hugging Face model folder that ``from_pretrained`` loads.

    from hfscale.checkpoints.export import export_model
    result = export_model("out", "final")     # the newest complete checkpoint in output_dir "out"
    AutoModelForCausalLM.from_pretrained("final")

A checkpoint written under DeepSpeed ZeRO-1/2/3 holds the model only as per-rank shards of the
fp32 master weights (ZeRO-1/2 often add a whole ``model.safetensors`` too; the master weights are
still what the optimizer trained, so they are used); one written by FSDP2 with
``SHARDED_STATE_DICT`` holds a torch.distributed.checkpoint (DCP) folder ``pytorch_model_fsdp_0/``.
Both are read by their own libraries (DeepSpeed's ``zero_to_fp32``; ``torch.distributed.checkpoint``,
as accelerate's ``merge_fsdp_weights`` does), loaded into the model built from the checkpoint's
``config.json`` with every key accounted for, and written with ``save_pretrained`` (safetensors),
next to the checkpoint's generation config and tokenizer files. A checkpoint that holds only a
whole model (DDP, one process, FSDP ``FULL_STATE_DICT``) is loaded with ``from_pretrained``.

The Trainer saves no ``config.json`` into a sharded FSDP checkpoint: it is looked for in the
checkpoint, then in its output_dir, or given with ``config=`` (a model folder or the file).

Everything is written into a temporary folder beside ``out`` and renamed at the end, so ``out``
never holds half an export. Peak memory: about twice the model in fp32, on the CPU. Training-side
module: torch, transformers and DeepSpeed are imported inside the functions that need them.

A checkpoint is hostile input (anyone who could write it chooses what is read): tensors are read
with ``torch.load(weights_only=True)`` only (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` while DeepSpeed's
reader runs, with the few DeepSpeed classes its files hold allow-listed), or from safetensors; no
link is followed out of the checkpoint (a tokenizer file that is one is left out, and said); a
FIFO or device is never opened. One reader cannot work that way: torch.distributed.checkpoint
unpickles its ``.metadata`` with plain pickle, so an FSDP checkpoint is exported only when that
file and its folders belong to you and no one else can write them.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hfscale.checkpoints.files import TRAINER_STATE, deepspeed_tag, odd_entry
from hfscale.checkpoints.resume import CHECKPOINT_RE, checkpoint_problem, checkpoints, scan_output
from hfscale.checkpoints.tensors_only import refusal, tensors_only
from hfscale.core.untrusted import (MiB, Unreadable, open_regular, parse_json, printable, read_text, read_trusted,
                        real_file)

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's FSDP_MODEL_NAME + "_0" (save_fsdp_model, model 0)
DCP_PREFIX = "model."  # accelerate saves {"model": state_dict}; DCP flattens it to "model.<name>"
WHOLE_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
Kind = Literal["zero1", "zero2", "zero3", "fsdp2", "whole"]
KINDS: tuple[Kind, ...] = ("zero1", "zero2", "zero3", "fsdp2", "whole")
CONFIG_CAP = 16 * MiB  # a model's config.json
DCP_METADATA_CAP = 1 << 30

__all__ = ["ExportError", "ExportResult", "export_model"]


class ExportError(ValueError):
    """The export cannot be done; the message names the path and the reason."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote, and from what."""

    checkpoint: str  # the checkpoint folder exported
    kind: Kind  # how the checkpoint holds the model
    weights: str  # the state the weights were read from
    parameters: int  # parameters of the exported model (tied ones once)
    out: str
    files: tuple[str, ...]  # written into ``out``, relative names
    left_out: tuple[str, ...] = ()  # files not copied, and why (a link out of the checkpoint)

    def summary(self) -> str:
        left = f"; left out: {'; '.join(self.left_out)}" if self.left_out else ""
        return (f"exported {self.checkpoint} ({self.kind}; weights: {self.weights}) to {self.out}: "
                f"{self.parameters:,} parameters, {', '.join(self.files)}{left}")


def export_model(source: str | os.PathLike[str], out: str | os.PathLike[str], *, force: bool = False,
                 config: str | os.PathLike[str] | None = None) -> ExportResult:
    """Write the model of ``source`` (a ``checkpoint-N`` folder, or an output_dir: its newest complete
    checkpoint) to ``out`` as ``model.safetensors`` + ``config.json`` (+ generation config, tokenizer).

    ``out`` must not exist or be empty, unless ``force`` (then it is replaced once the export is
    whole). ``config``: where the model's config.json is when the checkpoint has none. Raises
    :class:`ExportError` for a missing or incomplete checkpoint, an occupied ``out`` and unreadable
    or mismatched weights."""
    ckpt = find_checkpoint(source)
    odd = odd_entry(ckpt, TOKENIZER_FILES)  # what the libraries read follows links, out of it too, or waits on a FIFO
    if odd is not None:
        raise ExportError(f"{printable(str(ckpt))}: {odd}; hfscale export reads regular files only (tokenizer files "
                          "that are links are left out)")
    out = Path(out).absolute()
    _check_out(out, ckpt, force)
    kind, weights = checkpoint_kind(ckpt)
    source_config = _config_dir(ckpt, kind, config)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError as e:
        raise ExportError(f"{printable(str(out))}: cannot be created ({e.strerror or e}); nothing was written"
                          ) from None
    try:
        parameters = _write_model(ckpt, kind, source_config, staging)
        left_out: list[str] = []
        if not _tokenizer_files(ckpt, staging, left_out):  # the checkpoint's, else the config folder's
            _tokenizer_files(source_config.folder, staging, left_out, source_config.named)
        files = tuple(sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()))
        _replace(staging, out)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(f"{printable(str(out))}: cannot write the export ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(str(ckpt), kind, weights, parameters, str(out), files, tuple(left_out))


def find_checkpoint(source: str | os.PathLike[str]) -> Path:
    """The complete checkpoint folder ``source`` names, or the newest complete one in it."""
    src = Path(source)
    if not src.exists():
        raise ExportError(f"{printable(str(src))}: no such file or directory")
    if not src.is_dir():
        raise ExportError(f"{src}: not a directory (expected a checkpoint-N folder or an output_dir holding them)")
    found = checkpoints(src)
    if CHECKPOINT_RE.match(src.name) or (not found and (src / TRAINER_STATE).exists()):
        why = checkpoint_problem(src)
        if why is not None:
            raise ExportError(f"{src}: incomplete checkpoint: {why}")
        return src
    if not found:
        raise ExportError(f"{src}: neither a Trainer checkpoint (no {TRAINER_STATE}) nor an output_dir "
                          "holding checkpoint-N folders")
    scan = scan_output(src, None)
    if scan.resume is None:
        why = "; ".join(f"{name}: {reason}" for name, reason in scan.skipped)
        raise ExportError(f"{src}: none of its {len(found)} checkpoint folder(s) is complete ({why})")
    return Path(scan.resume)


def checkpoint_kind(ckpt: Path) -> tuple[str, str]:
    """(kind, what the weights are read from) of a complete checkpoint folder."""
    tag = deepspeed_tag(ckpt)  # ``latest`` names the tag; a *_universal conversion beside it is not read
    if tag is not None:
        stage = _zero_stage(ckpt / tag)
        if stage in (1, 2, 3):
            also = next((f"; {n}, the Trainer's copy, not read" for n in WHOLE_FILES if (ckpt / n).is_file()), "")
            return f"zero{stage}", f"fp32 master weights in {tag}/ (DeepSpeed zero_to_fp32{also})"
    if (ckpt / FSDP_MODEL_DIR / ".metadata").is_file():
        return "fsdp2", f"{FSDP_MODEL_DIR}/ (torch.distributed.checkpoint)"
    for name in WHOLE_FILES:
        if (ckpt / name).is_file():
            return "whole", name
    what = f"DeepSpeed state in {tag}/ without ZeRO shards" if tag else "no DeepSpeed, FSDP or whole-model weights"
    raise ExportError(f"{ckpt}: no model weights to export ({what})")


def _zero_stage(tag_dir: Path) -> int | None:
    """The ZeRO stage a DeepSpeed tag folder was saved with (from the DeepSpeed config kept in it)."""
    import torch

    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt")) + sorted(tag_dir.glob("*zero_pp_rank_0_*model_states.pt"))
    if not files:
        return None
    if not real_file(files[0]):
        raise ExportError(f"{printable(str(files[0]))}: not a regular file (a link, FIFO or device)")
    try:  # mmap: a ZeRO-1/2 model-states file holds the whole module; only its small dicts are read
        with tensors_only():
            state = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
        stage = state["ds_config"]["zero_optimization"]["stage"]
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise TypeError(f"the stage is {type(stage).__name__}, not a number")
        return stage
    except Exception as e:  # noqa: BLE001 (whatever torch raises on a crafted file is a bad input)
        why = refusal(e) if isinstance(e, pickle.UnpicklingError) else \
            f"cannot read the DeepSpeed config it holds: {type(e).__name__}: {printable(str(e))}"
        raise ExportError(f"{printable(str(files[0]))}: {why}") from None


def _check_out(out: Path, ckpt: Path, force: bool) -> None:
    try:
        src = ckpt.resolve()
        real = out.resolve()
    except (OSError, RuntimeError) as e:
        raise ExportError(f"{printable(str(out))}: cannot be used ({e})") from None
    if real == src or real in src.parents or src in real.parents:
        raise ExportError(f"{out}: the export would overwrite or sit inside the checkpoint {ckpt}; "
                          "choose a folder outside it")
    try:
        if out.is_dir() and not any(out.iterdir()):
            return
    except OSError as e:
        raise ExportError(f"{printable(str(out))}: cannot be read ({e.strerror or e})") from None
    if out.exists() and not force:
        what = "a non-empty directory" if out.is_dir() else "a file"
        raise ExportError(f"{out}: exists and is {what}; choose another folder or pass force to replace it")


@dataclass(frozen=True)
class ConfigSource:
    """Where the model's config.json (and, failing the checkpoint, the tokenizer) come from;
    ``named``: a folder the user gave (a Hugging Face cache snapshot is links: followed there)."""

    folder: Path
    named: bool = False


def _config_dir(ckpt: Path, kind: str, config: str | os.PathLike[str] | None) -> ConfigSource:
    if config is not None:
        path = Path(config)
        folder = path.parent if path.name == "config.json" else path
        if not (folder / "config.json").is_file():
            raise ExportError(f"{path}: no config.json there (config= names a model folder or its config.json)")
        return ConfigSource(folder, named=True)
    for folder in (ckpt, ckpt.parent):
        if real_file(folder / "config.json"):  # not a link out of the checkpoint, a FIFO or a device
            return ConfigSource(folder)
    note = " (the Trainer writes none into a sharded FSDP checkpoint)" if kind == "fsdp2" else ""
    raise ExportError(f"{ckpt}: no config.json in it or in {ckpt.parent}{note}; give the model's folder "
                      "or config.json with config=")


def _tokenizer_files(folder: Path, staging: Path, left_out: list[str], named: bool = False) -> list[str]:
    """Copy the tokenizer files of ``folder`` into ``staging`` (those not there yet); their names.
    Regular files only, copied in pieces: a link is not followed out of the checkpoint (its name
    and why go to ``left_out``; ``named``: a folder the user gave, whose links are theirs), a FIFO
    or device is never read."""
    found = []
    for n in TOKENIZER_FILES:
        if not os.path.lexists(folder / n) or os.path.lexists(staging / n):
            continue
        try:
            fd, _ = open_regular(folder / n, None if named else folder, follow_links=named)
        except Unreadable as e:
            left_out.append(f"{n} ({e.reason})")
            continue
        with os.fdopen(fd, "rb") as src, open(staging / n, "wb") as dst:
            shutil.copyfileobj(src, dst)
        found.append(n)
    return found


def _write_model(ckpt: Path, kind: str, source: ConfigSource, staging: Path) -> int:
    """Build the model, load the checkpoint's weights into it, save it into ``staging``; its parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dir = source.folder
    for name in ("config.json", "generation_config.json"):  # checked before transformers reads them
        if os.path.lexists(config_dir / name):
            try:
                parse_json(read_text(config_dir / name, CONFIG_CAP, None if source.named else config_dir,
                                     follow_links=source.named), config_dir / name)
            except Unreadable as e:
                raise ExportError(f"{e}; the model's {name} cannot be used") from None
    try:
        config = AutoConfig.from_pretrained(config_dir)
        if getattr(config, "transformers_weights", None) is not None:
            config.transformers_weights = None  # a weights file the config names, outside the checked ones
        if kind == "whole":
            with tensors_only():
                model, info = AutoModelForCausalLM.from_pretrained(ckpt, config=config, output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if bad:
                raise ExportError(f"{ckpt}: the weights do not fit the model of {config_dir / 'config.json'}: {bad}")
        else:
            # fp32: the master weights are fp32, whatever dtype the config names for inference
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if kind == "fsdp2":
                _load_dcp(model, ckpt / FSDP_MODEL_DIR, config_dir)
            else:
                _load_zero(model, ckpt, config_dir)
        generation = config_dir / "generation_config.json"
        if os.path.isfile(generation) if source.named else real_file(generation):
            model.generation_config = GenerationConfig.from_pretrained(config_dir)
        model.save_pretrained(staging, safe_serialization=True)
    except ExportError:
        raise
    except ImportError as e:
        raise ExportError(f"{ckpt}: exporting a {kind} checkpoint needs {e.name or 'a missing module'}: {e}") from e
    except pickle.UnpicklingError as e:
        raise ExportError(f"{printable(str(ckpt))}: {refusal(e)}") from None
    except Exception as e:  # noqa: BLE001 (what torch, DeepSpeed or transformers raise on checkpoint data)
        raise ExportError(f"{printable(str(ckpt))}: cannot export its {kind} weights: {type(e).__name__}: "
                          f"{printable(str(e), 600)}") from None
    return sum(p.numel() for p in model.parameters())


def _load_zero(model, ckpt: Path, config: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # DeepSpeed prints its progress (stdout is the caller's); its torch.load calls read tensors only
    with contextlib.redirect_stdout(sys.stderr), tensors_only():
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=deepspeed_tag(ckpt))
    names = _match_keys(model, {k: tuple(v.shape) for k, v in state.items()}, ckpt, config)
    # not strict: a tied twin that DeepSpeed did not save is missing, and _match_keys allowed only those
    model.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)


def _load_dcp(model, folder: Path, config: Path) -> None:
    """Read accelerate's sharded FSDP save (a DCP folder of ``{"model": state_dict}``) into ``model``."""
    import torch.distributed.checkpoint as dcp

    # torch.distributed.checkpoint unpickles .metadata with plain pickle (it cannot read tensors only):
    # exported only when no one but you could have written it, and its shards are regular files
    try:
        data = read_trusted(folder / ".metadata", folder.parent, DCP_METADATA_CAP)
    except Unreadable as e:
        raise ExportError(f"{e}. DCP's reader unpickles this file, so hfscale reads it only from a checkpoint "
                          "you alone could have written") from None
    odd = [p.name for p in folder.iterdir() if not real_file(p)]
    if odd:
        raise ExportError(f"{printable(str(folder))}: {printable(odd[0])} is not a regular file (a link, FIFO or "
                          "device)")
    reader = _verified_reader(folder, pickle.loads(data))  # the bytes checked, not the file read again
    saved = {k[len(DCP_PREFIX):]: tuple(getattr(m, "size", ())) for k, m in
             reader.read_metadata().state_dict_metadata.items() if k.startswith(DCP_PREFIX)}
    if not saved:
        raise ExportError(f"{folder}: no model entries (accelerate's sharded save names them {DCP_PREFIX}<parameter>)")
    names = _match_keys(model, saved, folder, config)
    own = model.state_dict()  # tensors sharing the parameters' storage: DCP reads into them in place
    with warnings.catch_warnings(), tensors_only():  # one process reading all shards is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": {k: own[names[k]] for k in saved}}, storage_reader=reader, no_dist=True)


def _verified_reader(folder: Path, metadata):
    """A DCP FileSystemReader whose metadata is the one unpickled from the bytes checked above (its
    own read_metadata would unpickle the file again, after the check)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Verified(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Verified(str(folder))


def _match_keys(model, saved: dict[str, tuple[int, ...]], where: Path, config: Path) -> dict[str, str]:
    """Saved name -> the model's name; every model tensor covered (a tied one through its twin), every
    shape the model's. ``saved``: name -> shape."""
    own = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    names = {}
    for key in saved:
        name = key
        while name not in own and name.startswith(("module.", "_orig_mod.")):  # DDP / torch.compile wrappers
            name = name.split(".", 1)[1]
        names[key] = name
    covered = set(names.values())
    covered |= _tied_elsewhere(model, covered)
    problems = [f"unexpected {k}" for k, n in names.items() if n not in own]
    problems += [f"missing {k}" for k in own if k not in covered]
    problems += [f"{n} is {list(saved[k])} in the checkpoint, {list(own[n])} in the model"
                 for k, n in names.items() if n in own and saved[k] != own[n]]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ExportError(f"{where}: the weights do not fit the model of {config / 'config.json'}: "
                          f"{'; '.join(problems[:3])}{more}")
    return names


def _tied_elsewhere(model, loaded: set[str]) -> set[str]:
    """The model's tensor names not loaded but sharing storage with a loaded one (tied embeddings)."""
    tensors = model.state_dict(keep_vars=True)
    have = {(t.data_ptr(), tuple(t.shape)) for k, t in tensors.items() if k in loaded}
    return {k for k, t in tensors.items() if k not in loaded and (t.data_ptr(), tuple(t.shape)) in have}


def _replace(staging: Path, out: Path) -> None:
    """Rename the finished export to ``out``; an old ``out`` (force) is moved aside first, then removed."""
    old = None
    if out.is_symlink() or out.is_file() or (out.is_dir() and any(out.iterdir())):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent)) / "old"
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)
