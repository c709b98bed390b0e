"""Read a config file (and the host file it names) into a checked ``Job``."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from hfscale.config.errors import ConfigError, Problem
from hfscale.config.hostfile import parse_hostfile
from hfscale.config.model import HfscaleConfig, HostSpec
from hfscale.config.schema_errors import problems_from_validation
from hfscale.config.yaml_source import CONTROL, dotted, parse
from hfscale.core.untrusted import Missing, Unreadable, read_text
from hfscale.rules.check import resolve
from hfscale.rules.resolved import Job


MAX_FILE = 1 << 20  # a config or host file is text people write: 1 MiB is far beyond any


def _read(path: Path) -> tuple[str | None, str | None]:
    """(text, None) or (None, why it cannot be read). Only regular files up to ``MAX_FILE``: a FIFO
    would hang the read, a device (/dev/zero) never end it (hfscale.core.untrusted; a link the user
    named is followed)."""
    try:
        return read_text(path, MAX_FILE, follow_links=True), None
    except Missing:
        return None, f"no such file: {path}"
    except Unreadable as e:
        return None, str(e)


def _name_problem(path: str) -> str | None:
    """Why a file name given on the command line cannot be used (it is written into generated files)."""
    m = CONTROL.search(path)
    if m:
        return f"the file name holds the control character U+{ord(m.group()):04X}; rename the file"
    return None


def load_text(text: str, source: str, base_dir: Path) -> Job:
    """Validate YAML ``text``; a host file it names is read relative to ``base_dir``."""
    doc, problems = parse(text)
    if doc is None or problems:
        raise ConfigError(source, problems)
    early = doc.value_problems  # control characters, lengths, infinities: beside the model's findings
    try:
        cfg = HfscaleConfig.model_validate(doc.data)
    except ValidationError as e:
        seen = {p.path for p in early}
        found = early + [p for p in problems_from_validation(HfscaleConfig, e, doc) if p.path not in seen]
        raise ConfigError(source, sorted(found, key=lambda p: (p.line is None, p.line or 0))) from None
    file_hosts: tuple[HostSpec, ...] | None = None
    extra: list[Problem] = list(early)
    if cfg.cluster.hostfile is not None and cfg.cluster.hosts is None:
        key = ("cluster", "hostfile")
        hostfile = base_dir / cfg.cluster.hostfile
        hf_text, why = _read(hostfile) if not _name_problem(cfg.cluster.hostfile) else (None, "bad file name")
        if hf_text is None:
            extra.append(Problem("cluster.hostfile", why or "unreadable", doc.line(key)))
        else:
            file_hosts, hf_problems = parse_hostfile(hf_text, str(hostfile))
            extra += [Problem("cluster.hostfile", f"{p.path}: {p.message}", doc.line(key)) for p in hf_problems]
    warnings: list[Problem] = []
    if cfg.training.model.config is not None:
        # transformers' config classes are read from source, only when a model config is given
        from hfscale.config.model_config import check as check_model_config

        base = ("training", "model", "config")
        found, notes = check_model_config(cfg.training.model.config)
        extra += [Problem(dotted(base + p), m, doc.line(base + p)) for p, m in found]
        warnings += [Problem(dotted(base), m, doc.line(base)) for m in notes]
    for base, check in ((("distributed", "deepspeed", "extra"), _deepspeed_extra), (("accelerate", "extra"), _accelerate_extra)):
        found, notes = check(cfg)
        extra += [Problem(dotted(base + p), m, doc.line(base + p)) for p, m in found]
        warnings += [Problem(dotted(base + p), m, doc.line(base + p)) for p, m in notes]
    return resolve(cfg, source, doc.line, file_hosts, extra, tuple(warnings))


def _deepspeed_extra(cfg: HfscaleConfig) -> tuple[list, list]:
    # DeepSpeed's keys are read from its source, only when there is an extra mapping to check
    ds = cfg.distributed.deepspeed
    if ds is None or not ds.extra:
        return [], []
    from hfscale.rules.deepspeed import extra_problems

    return extra_problems(ds.extra)


def _accelerate_extra(cfg: HfscaleConfig) -> tuple[list, list]:
    if not cfg.accelerate.extra:
        return [], []
    from hfscale.rules.accelerate import extra_problems

    return extra_problems(cfg.accelerate.extra)


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read and check the config at ``path``; raise ConfigError with every problem."""
    bad_name = _name_problem(str(path))
    if bad_name:
        raise ConfigError(repr(str(path)), [Problem("", bad_name)])
    p = Path(path)
    text, why = _read(p)
    if text is None:
        raise ConfigError(str(path), [Problem("", why or "unreadable")])
    return load_text(text, str(path), p.parent)
