"""Read a config file (and the host file it names) into a checked ``Job``."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from .config import HfscaleConfig, HostSpec
from .errors import ConfigError, Problem
from .hostfile import parse_hostfile
from .job import Job, resolve
from .schema_errors import problems_from_validation
from .yamlsource import dotted, parse


def _read(path: Path) -> tuple[str | None, str | None]:
    """(text, None) or (None, why it cannot be read)."""
    try:
        if path.is_dir():
            return None, f"{path} is a directory, not a file"
        return path.read_text(encoding="utf-8"), None
    except FileNotFoundError:
        return None, f"no such file: {path}"
    except UnicodeDecodeError:
        return None, f"{path} is not UTF-8 text"
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        return None, f"cannot read {path}: {getattr(e, 'strerror', None) or e}"


def load_text(text: str, source: str, base_dir: Path) -> Job:
    """Validate YAML ``text``; a host file it names is read relative to ``base_dir``."""
    doc, problems = parse(text)
    if doc is None or problems:
        raise ConfigError(source, problems)
    try:
        cfg = HfscaleConfig.model_validate(doc.data)
    except ValidationError as e:
        raise ConfigError(source, problems_from_validation(HfscaleConfig, e, doc)) from None
    file_hosts: tuple[HostSpec, ...] | None = None
    extra: list[Problem] = []
    if cfg.cluster.hostfile is not None and cfg.cluster.hosts is None:
        key = ("cluster", "hostfile")
        hostfile = base_dir / cfg.cluster.hostfile
        hf_text, why = _read(hostfile)
        if hf_text is None:
            extra.append(Problem("cluster.hostfile", why or "unreadable", doc.line(key)))
        else:
            file_hosts, hf_problems = parse_hostfile(hf_text, str(hostfile))
            extra += [Problem("cluster.hostfile", f"{p.path}: {p.message}", doc.line(key)) for p in hf_problems]
    warnings: list[Problem] = []
    if cfg.training.model.config is not None:
        # transformers' config classes are read from source, only when a model config is given
        from .model_config import check as check_model_config

        base = ("training", "model", "config")
        found, notes = check_model_config(cfg.training.model.config)
        extra += [Problem(dotted(base + p), m, doc.line(base + p)) for p, m in found]
        warnings += [Problem(dotted(base), m, doc.line(base)) for m in notes]
    return resolve(cfg, source, doc.line, file_hosts, extra, tuple(warnings))


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read and check the config at ``path``; raise ConfigError with every problem."""
    p = Path(path)
    text, why = _read(p)
    if text is None:
        raise ConfigError(str(path), [Problem("", why or "unreadable")])
    return load_text(text, str(path), p.parent)
