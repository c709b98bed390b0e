"""The ``hfscale`` command: parse, call the library, print, map errors to exit codes.

Exit codes (hfscale.core.exitcodes): 0 ok, 2 bad input, 3 hosts not ready, 4 a hang, 65 the loss guard stopped
training; ``launch`` otherwise exits with the training's own code (128+N when stopped by signal N).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hfscale import __version__
from hfscale.cli.runs import RUN_COMMANDS
from hfscale.config.errors import ConfigError
from hfscale.core.exitcodes import BAD_INPUT as EXIT_BAD_INPUT, UNREACHABLE as EXIT_UNREACHABLE
from hfscale.core.untrusted import printable


def _load(path: str):
    from hfscale.rules.config_file import load_job

    try:
        job = load_job(path)
    except ConfigError as e:
        click.echo(f"error: {e.render()}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    for w in job.warnings:
        click.echo(f"warning: {w}", err=True)
    return job


class Number(click.ParamType):
    """A finite number from ``low`` (excluded for floats) to ``high``: anything else, a 5,000-digit
    value or nan included, is click's exit 2 naming the option, the value shortened."""

    def __init__(self, kind: type, low: float, high: float):
        self.kind, self.low, self.high = kind, low, high
        self.name = "integer" if kind is int else "seconds"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        shown = printable(text, 40)
        if self.kind is int:  # int() of more than 4,300 digits raises; nothing that long is in range
            if not (text.isascii() and text.lstrip("+-").isdigit()):
                self.fail(f"{shown!r} is not a whole number", param, ctx)
            number = int(text) if len(text) <= 30 else None
            within = f"from {int(self.low):,} to {int(self.high):,}"
        else:
            try:
                number = float(text)  # a 5,000-digit one is inf
            except ValueError:
                self.fail(f"{shown!r} is not a number", param, ctx)
            within = f"more than {self.low:g} and at most {self.high:g}"
        if number is None or not (self.low <= number <= self.high) or (self.kind is float and number == self.low):
            self.fail(f"{shown} is not {within}", param, ctx)  # nan fails the comparison too
        return number


def _written(write, where: str):
    """Run ``write``; an OSError (a path that cannot be written) is exit 2 naming the path."""
    try:
        return write()
    except OSError as e:
        click.echo(f"error: cannot write {e.filename or where}: {e.strerror or e}; nothing was written", err=True)
        sys.exit(EXIT_BAD_INPUT)


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
      # precision fp8 with DeepSpeed: add --mixed_precision fp8 (hfscale launch does)
    """


@main.command()
@click.argument("config_file", metavar="CONFIG")
def check(config_file: str) -> None:
    """Validate CONFIG and print world size, global batch, stage and precision."""
    from hfscale.cli.check_summary import summary

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
    from hfscale.core.atomic_files import write_files
    from hfscale.render.artifacts import DEEPSPEED_FILE, launch_note, render_artifacts

    job = _load(config_file)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        click.echo(f"error: --out {out_dir} exists and is not a directory", err=True)
        sys.exit(EXIT_BAD_INPUT)
    files = render_artifacts(job, str((out / DEEPSPEED_FILE).resolve()))
    for path in _written(lambda: write_files(out, files), out_dir):
        click.echo(str(path))
    note = launch_note(job)
    if note:
        click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("path", default="hfscale.yaml", metavar="[PATH]")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
def init(path: str, force: bool) -> None:
    """Write a commented config template to PATH (default hfscale.yaml; '-' for stdout)."""
    from hfscale.core.atomic_files import write_files
    from hfscale.config.template import render_template

    text = render_template()
    if path == "-":
        click.echo(text, nl=False)
        return
    dest = Path(path)
    if dest.exists() and not force:
        click.echo(f"error: {path} exists; pass --force to overwrite it", err=True)
        sys.exit(EXIT_BAD_INPUT)
    _written(lambda: write_files(dest.parent, {dest.name: text}), path)
    click.echo(f"wrote {path}; check it with: hfscale check {path}")


@main.command("import")
@click.argument("accelerate_yaml", metavar="ACCELERATE_YAML")
@click.option("--deepspeed", "deepspeed", metavar="DS_JSON", help="DeepSpeed JSON (default: the deepspeed_config_file "
              "the accelerate config names).")
@click.option("--hostfile", metavar="FILE", help="Host file, 'host slots=N' lines (default: the deepspeed_hostfile "
              "the accelerate config names).")
@click.option("--out", "out", default="hfscale.yaml", show_default=True, help="Where to write the hfscale YAML; "
              "'-' prints it.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
def import_cmd(accelerate_yaml: str, deepspeed: str | None, hostfile: str | None, out: str, force: bool) -> None:
    """Write one commented hfscale YAML from an accelerate config, its DeepSpeed JSON and a host file.

    \b
    'auto' values are resolved from the other file or hfscale's defaults, each with a comment;
    everything hfscale cannot express is listed (exit 2) and nothing is written.
    Examples:
      hfscale import accelerate_configs/zero3.yaml --out job.yaml
      hfscale import accelerate.yaml --deepspeed ds_config.json --hostfile hosts --out -
    """
    from hfscale.core.atomic_files import write_files
    from hfscale.cli.importing.importer import follow, import_configs, read_source

    dest = None if out == "-" else Path(out)
    if dest is not None and dest.exists() and not force:
        click.echo(f"error: {out} exists; pass --force to overwrite it", err=True)
        sys.exit(EXIT_BAD_INPUT)
    try:
        acc = read_source(accelerate_yaml, accelerate_yaml)
        ds, hosts = follow(acc, deepspeed, hostfile)
        text = import_configs(acc, ds, hosts, dest.parent if dest is not None else None)
    except ConfigError as e:
        click.echo(f"error: {e.render()}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if dest is None:
        click.echo(text, nl=False)
        return
    _written(lambda: write_files(dest.parent, {dest.name: text}), out)
    click.echo(f"wrote {out}; check it with: hfscale check {out}")


def _context(job, extra_args: tuple[str, ...], restart: bool, job_id: str | None = None, attempt: int = 0):
    import os
    import secrets
    import time

    from hfscale.launch.context import LaunchContext, output_dir_to_scan
    from hfscale.checkpoints.resume import scan_output

    job_id = job_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    where = output_dir_to_scan(job)
    scan = scan_output(where, job.world_size, reshard=job.deepspeed is not None) if where else None  # reshard: universal
    return LaunchContext.of(os.getcwd(), sys.executable, job_id, os.environ, extra_args, scan, restart, attempt)


def _settle(job) -> None:
    """Wait while the job that holds training.output_dir stops itself (its launcher died), so that
    the plan resumes from the checkpoint it saves on the way (hfscale.launch.attempt.output_lock.settle)."""
    import os
    import posixpath
    import signal

    from hfscale.core.exitcodes import signal_name
    from hfscale.launch.context import output_dir_to_scan
    from hfscale.launch.attempt.output_lock import settle

    where = output_dir_to_scan(job)
    if where is None:
        return

    class GaveUp(Exception):
        pass

    def give_up(signum, _frame):  # set here: a SIGINT ignored by whatever started hfscale would not interrupt
        raise GaveUp(signum)

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, give_up) for s in stops}
    try:
        settle(posixpath.normpath(posixpath.join(os.getcwd(), where)), lambda s: click.echo(s, err=True))
    except GaveUp as e:
        click.echo(f"hfscale: got {signal_name(e.args[0])}; gave up waiting, nothing was started", err=True)
        sys.exit(128 + e.args[0])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("config_file", metavar="CONFIG")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT_ARGS]")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, per-node commands, cleanup) and exit.")
@click.option("--restart", is_flag=True, help="Start at step 0: move the checkpoints in training.output_dir aside "
              "(into restarted-<job id>/ there) instead of resuming from them.")
@click.option("--quiet", "-q", "mode", flag_value="quiet", help="Show errors and failures only (node logs get all).")
@click.option("--verbose", "-v", "mode", flag_value="verbose", help="Show every line the nodes print.")
@click.option("--job-id", hidden=True, help="The run's job id (a supervised Slurm job's batch script passes its own).")
def launch(config_file: str, script_args: tuple[str, ...], dry_run: bool, restart: bool, mode: str | None, job_id: str | None) -> None:
    """Start the training described by CONFIG on its node(s).

    \b
    Every run gets a directory (runner.run_dir/<name>-<job id>) holding the resolved config, the
    generated files, the plan and one log per node. The terminal shows one progress line (rank
    0's step, loss, tokens/s, ETA) and the nodes' errors; library warnings go to the logs only. Arguments after -- go to training.script (a
    flag the YAML determines only with the same value). A relaunch resumes from the newest
    complete checkpoint in training.output_dir. Secrets (tokens, keys, passwords) are masked in
    everything printed or written.

    \b
    Examples:
      hfscale launch job.yaml --dry-run
      hfscale launch job.yaml -- --model_name_or_path ./my-model
      hfscale launch job.yaml --restart
    """
    from hfscale.launch.build import build_plan
    from hfscale.launch.recovery.requeue import first_attempt, in_allocation_of
    from hfscale.launch.spec import NOTHING_TO_TRAIN
    from hfscale.rules.script import extra_args_warnings

    job = _load(config_file)
    for w in extra_args_warnings(job, script_args):  # a plain script's own values after --
        click.echo(f"warning: {w}", err=True)
    if not dry_run:
        _settle(job)
    try:  # a supervised Slurm job's batch script: the job on its allocation's hosts (hfscale.launch.runners.slurm_step)
        plan = build_plan(job := in_allocation_of(job), ctx := _context(job, script_args, restart, job_id))
    except (ConfigError, ValueError) as e:
        click.echo(f"error: {e.render() if isinstance(e, ConfigError) else e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if dry_run:
        return click.echo(plan.render(), nl=False)
    record = plan.render()
    if plan.mode == "done":
        click.echo(f"hfscale: {' '.join(n for n in plan.notes if n.startswith(NOTHING_TO_TRAIN))}; nothing was started",
                   err=True)
        return
    from hfscale.launch.attempt.console import Console
    from hfscale.launch.attempt.execute import execute
    from hfscale.launch.attempt.output_lock import Refused
    from hfscale.launch.recovery.loss_alarms import incidents, told
    from hfscale.launch.recovery.supervisor import supervise

    click.echo(f"hfscale: job {plan.job_id} on {plan.where()}; run directory {plan.run_dir}", err=True)
    try:
        say = lambda s: click.echo(s, err=True)  # noqa: E731
        if job.config.recovery.max_restarts and plan.mode == "stream":
            rc = supervise(job, lambda j, n: _context(j, script_args, restart and n == 0, plan.job_id, n),
                           lambda p: Console(mode or "normal", hosts=p.line_hosts), say, first_attempt(job, plan.run_dir, say))
        else:  # a loss alarm is told, with what a relaunch does (hfscale.launch.recovery.loss_alarms)
            known = incidents(plan.output_dir)
            rc = told(plan.output_dir, known, execute(plan, record, echo=Console(mode or "normal", hosts=plan.line_hosts)), say)
    except Refused as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if plan.mode == "submit":
        what = "handed to the scheduler" if rc == 0 else f"not submitted (exit code {rc})"
        click.echo(f"hfscale: job {plan.job_id} {what}; run directory {plan.run_dir}", err=True)
    elif rc == 0 and mode != "quiet":  # the summary, from the run directory, and what to do next
        from hfscale.cli.finish import finish_lines

        scan = None if restart else ctx.output
        resumed = scan.state.global_step if scan is not None and scan.resume and scan.state else None
        for line in finish_lines(plan.run_dir, job.config.name, resumed):
            click.echo(line)
    else:
        click.echo(f"hfscale: job {plan.job_id} ended with exit code {rc}; logs in {plan.run_dir}/logs", err=True)
    sys.exit(rc)


@main.command()
@click.argument("config_file", metavar="CONFIG")
@click.option("--timeout", default=30.0, type=Number(float, 0, 86_400), show_default=True,
              help="Seconds allowed per host.")
@click.option("--network", is_flag=True, help="Also measure bandwidth and round trip between the hosts (every pair "
              "up to 16 hosts, else a ring) over NCCL's interface, print the matrix and name slow links.")
@click.option("--seconds", default=0.5, type=Number(float, 0, 3600), show_default=True,
              help="With --network: seconds of data each way per pair.")
def preflight(config_file: str, timeout: float, network: bool, seconds: float) -> None:
    """Check every host in parallel: ssh, a clean shell, same versions, GPUs, InfiniBand, master port."""
    from hfscale.launch.attempt.execute import run_probes
    from hfscale.launch.preflight import network as net
    from hfscale.launch.preflight.probes import (bound_s, evaluate, gpu_memory_hint, local_need, probes, refusal,
                                                 render_table, verdict)
    job = _load(config_file)
    why = refusal(job) or (net.refusal(job) if network else None)
    if why:
        click.echo(f"error: {why}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    reports = evaluate(job, run_probes(probes(job, sys.executable), bound_s(job, timeout)), local_need(job))
    click.echo(render_table(reports), nl=False)
    hint = gpu_memory_hint(job, reports)
    if hint:
        click.echo(hint)
    line, ok = verdict(reports)
    click.echo(line, err=not ok)
    if not ok:
        sys.exit(EXIT_UNREACHABLE)
    if network:
        import time

        addrs = net.addresses(job, {r.host: r.facts.addr for r in reports})
        start = time.time() + 3 + len(job.hosts) / 50  # every host's ssh is up before the first round
        cmds = net.commands(job, sys.executable, addrs, job.config.cluster.master_port + 1, start, seconds)
        rounds = len(net.schedule(len(job.hosts)))
        results = run_probes(cmds, start - time.time() + rounds * net.slot_seconds(seconds) + timeout,
                             workers=len(cmds))
        text, ok = net.summary(job, results, addrs)
        click.echo(text, nl=False)
        if not ok:
            sys.exit(EXIT_UNREACHABLE)


@main.command("plan")
@click.argument("config_file", metavar="CONFIG")
@click.option("--gpu-memory", metavar="SIZE", help="Memory of one GPU, e.g. 80GiB (default: cluster.gpu_memory).")
@click.option("--seq-len", type=Number(int, 1, 10_000_000), help="Tokens per sample (default: the script's "
              "--block_size/--max_seq_length, or training.data.block_size).")
@click.option("--model", metavar="PATH", help="The model's config.json or directory (default: the YAML's model).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes).")
@click.option("--no-build", is_flag=True, help="Skip building the model on the meta device (no torch import).")
def plan_cmd(config_file: str, gpu_memory: str | None, seq_len: int | None, model: str | None, as_json: bool,
             no_build: bool) -> None:
    """Memory per GPU of CONFIG's job before a GPU is touched: model states by engine, activations,
    buckets; with a GPU memory, whether it fits and the cheapest change that does."""
    from hfscale.memory import plan_command as sizing
    job = _load(config_file)
    try:
        sz = sizing.sizing(job, model, seq_len, gpu_memory)
    except sizing.SizingError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    built = None
    if not no_build:
        from hfscale.memory.meta_count import built_params

        built, why = built_params(sz.model)
        if why:
            click.echo(f"note: {why}", err=True)
    e, v = sizing.plan_memory(sz)
    if as_json:
        click.echo(json.dumps(sizing.as_json(sz, e, v, built), indent=2))
    else:
        click.echo(sizing.table(sz, e, v, built))


@main.command()
def schema() -> None:
    """Print the JSON Schema of the config (for editor completion)."""
    from hfscale.config.model import HfscaleConfig

    s = HfscaleConfig.model_json_schema()
    s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    s["title"] = "hfscale config"
    click.echo(json.dumps(s, indent=2))


for _command in RUN_COMMANDS:  # the commands about runs that exist (cli_runs)
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()
