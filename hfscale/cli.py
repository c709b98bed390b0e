"""The ``hfscale`` command: parse, call the library, print, map errors to exit codes.

Exit codes: 0 ok, 2 bad input (config, arguments), 1 anything else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__
from .errors import ConfigError

EXIT_BAD_INPUT = 2


def _load(path: str):
    from .load import load_job

    try:
        return load_job(path)
    except ConfigError as e:
        click.echo(f"error: {e.render()}", err=True)
        sys.exit(EXIT_BAD_INPUT)


def summary(job) -> str:
    """The few numbers people check before they launch."""
    cfg = job.config
    if job.hosts:
        names = ", ".join(h.host for h in job.hosts[:4]) + (", ..." if len(job.hosts) > 4 else "")
        nodes = f"{job.num_nodes} ({names}) x {job.procs_per_node} processes"
    else:
        nodes = f"1 (local) x {job.procs_per_node} processes"
    backend = cfg.distributed.backend
    if job.deepspeed is not None:
        ds = job.deepspeed
        engine = f"deepspeed ZeRO-{ds.stage}"
        offloads = [f"{k}={getattr(ds, 'offload_' + k).device}" for k in ("optimizer", "param")
                    if getattr(ds, "offload_" + k).device != "none"]
        if offloads:
            engine += f" (offload {', '.join(offloads)})"
    else:
        engine = backend
    b = cfg.batch
    rows = [
        ("job", cfg.name),
        ("nodes", nodes),
        ("world size", str(job.world_size)),
        ("engine", engine),
        ("precision", cfg.precision),
        ("global batch", f"{job.global_batch_size} = micro {b.micro_batch_size} x accumulation "
                         f"{job.gradient_accumulation_steps} x world {job.world_size}"),
        ("runner", f"{cfg.runner.type} ({cfg.runner.launcher})"),
    ]
    return "\n".join(f"  {k:<13}{v}" for k, v in rows)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hfscale")
def main() -> None:
    """One YAML for Accelerate + DeepSpeed training jobs.

    \b
    Examples:
      hfscale init my-run.yaml          # commented template to start from
      hfscale check my-run.yaml         # validate, print world size and batch math
      hfscale config my-run.yaml --out generated/
      accelerate launch --config_file generated/accelerate_config.yaml train.py
    """


@main.command()
@click.argument("config_file", metavar="CONFIG")
def check(config_file: str) -> None:
    """Validate CONFIG and print world size, global batch, stage and precision."""
    job = _load(config_file)
    click.echo(f"ok: {config_file}")
    click.echo(summary(job))


@main.command("config")
@click.argument("config_file", metavar="CONFIG")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory for the artifacts.")
def config_cmd(config_file: str, out_dir: str) -> None:
    """Write the accelerate YAML, DeepSpeed JSON and host file for CONFIG into --out.

    The accelerate YAML names the DeepSpeed JSON by absolute path, so it works from any directory.
    """
    from .artifacts import DEEPSPEED_FILE, render_artifacts
    from .files import write_files

    job = _load(config_file)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        click.echo(f"error: --out {out_dir} exists and is not a directory", err=True)
        sys.exit(EXIT_BAD_INPUT)
    files = render_artifacts(job, str((out / DEEPSPEED_FILE).resolve()))
    for path in write_files(out, files):
        click.echo(str(path))


@main.command()
@click.argument("path", default="hfscale.yaml", metavar="[PATH]")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
def init(path: str, force: bool) -> None:
    """Write a commented config template to PATH (default hfscale.yaml; '-' for stdout)."""
    from .files import write_files
    from .template import render_template

    text = render_template()
    if path == "-":
        click.echo(text, nl=False)
        return
    dest = Path(path)
    if dest.exists() and not force:
        click.echo(f"error: {path} exists; pass --force to overwrite it", err=True)
        sys.exit(EXIT_BAD_INPUT)
    write_files(dest.parent, {dest.name: text})
    click.echo(f"wrote {path}; check it with: hfscale check {path}")


@main.command()
def schema() -> None:
    """Print the JSON Schema of the config (for editor completion)."""
    from .config import HfscaleConfig

    s = HfscaleConfig.model_json_schema()
    s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    s["title"] = "hfscale config"
    click.echo(json.dumps(s, indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
