"""The ``hfscale`` commands about runs that exist: runs, status, logs, stop, report, export
(thin, like hfscale.cli.commands: parse, call the library, print, map errors to exit codes)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hfscale.core.exitcodes import BAD_INPUT as EXIT_BAD_INPUT


def _run_error(e: Exception | str) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(EXIT_BAD_INPUT)


@click.command("runs")
@click.argument("where", default="runs", metavar="[RUNS_DIR]")
def runs_cmd(where: str) -> None:
    """List the runs in RUNS_DIR (default: runs): name, runner, state, steps, last loss, started."""
    from hfscale.runs import registry as runs
    try:
        click.echo(runs.runs_table(runs.list_runs(where)), nl=False)
    except runs.RunError as e:
        _run_error(e)


@click.command("status")
@click.argument("run", metavar="RUN")
@click.option("--runs-dir", default="runs", show_default=True, help="Where to look for RUN by name or job id.")
def status_cmd(run: str, runs_dir: str) -> None:
    """A run's state, rank 0's numbers, each rank's step, and the last lines of each node log."""
    from hfscale.runs import registry as runs

    try:
        info = runs.run_info(runs.find_run(run, runs_dir))
    except runs.RunError as e:
        _run_error(e)
    from hfscale.runs.status import ask_slurm, status_text

    # a submitted job, or one hfscale stop cancelled: Slurm knows how it went and when it ended
    said = ask_slurm(info) if info.slurm_job and info.state in ("submitted", "stopped") else None
    click.echo(status_text(info, said), nl=False)


@click.command("logs")
@click.argument("run", metavar="RUN")
@click.option("--node", help="One node's log: its host name, or its index in name order.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the nodes write until the run ends.")
@click.option("--runs-dir", default="runs", show_default=True, help="Where to look for RUN by name or job id.")
def logs_cmd(run: str, node: str | None, follow: bool, runs_dir: str) -> None:
    """Print a run's node logs (every line the nodes wrote)."""
    from hfscale.runs import registry as runs
    from hfscale.core.untrusted import printable

    try:
        path = runs.find_run(run, runs_dir)
        logs = runs.pick_log(path, node)
    except runs.RunError as e:
        _run_error(e)
    if follow:
        runs.follow_logs(path, logs, click.echo)
        return
    out = click.get_binary_stream("stdout")
    problems = []
    for log in logs:
        if len(logs) > 1:
            click.echo(f"--- {printable(str(log))}")
        why = runs.print_log(log, out.write)
        out.flush()
        if why is not None:
            click.echo(f"hfscale: {why}; skipped", err=True)
            problems.append(why)
    if problems and len(problems) == len(logs):
        sys.exit(EXIT_BAD_INPUT)


@click.command("stop")
@click.argument("run", metavar="RUN")
@click.option("--runs-dir", default="runs", show_default=True, help="Where to look for RUN by name or job id.")
def stop_cmd(run: str, runs_dir: str) -> None:
    """Stop a run on every host: its launcher stops the nodes (TERM, then KILL after a grace
    period); a Slurm job is cancelled (scancel), a Kubernetes job deleted."""
    from hfscale.runs import registry as runs
    from hfscale.runs.stop import stop

    try:
        sys.exit(stop(runs.run_info(runs.find_run(run, runs_dir)), click.echo))
    except runs.RunError as e:
        _run_error(e)


@click.command("report")
@click.argument("run", metavar="RUN")
@click.option("--out", help="The HTML file (default: <run dir>/report.html).")
@click.option("--runs-dir", default="runs", show_default=True, help="Where to look for RUN by name or job id.")
def report_cmd(run: str, out: str | None, runs_dir: str) -> None:
    """One self-contained HTML page: loss, learning rate, tokens/s, MFU, memory per rank, the
    straggler table, the config and the plan."""
    from hfscale.runs import registry as runs
    from hfscale.runs.report import ReportError, write_report

    try:
        path = write_report(runs.find_run(run, runs_dir), out)
    except (runs.RunError, ReportError) as e:
        _run_error(e)
    click.echo(f"hfscale: wrote {path}")


@click.command("export")
@click.argument("source", metavar="RUN_OR_CHECKPOINT")
@click.option("--out", required=True, help="The Hugging Face model directory to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--config", "model_config", metavar="MODEL_DIR", help="Where the model's config.json is when neither "
              "the checkpoint nor its output_dir has one (FSDP sharded checkpoints).")
@click.option("--runs-dir", default="runs", show_default=True, help="Where to look for a run by name or job id.")
def export_cmd(source: str, out: str, force: bool, model_config: str | None, runs_dir: str) -> None:
    """A consolidated model (safetensors, config, tokenizer) from a ZeRO-1/2/3 or FSDP2 checkpoint,
    a training output_dir (its newest complete checkpoint), or a run (its output_dir)."""
    from hfscale.checkpoints.export import ExportError, export_model
    from hfscale.core.library_output import library_output_to
    from hfscale.runs import registry as runs

    try:
        run = None if Path(source).is_dir() and not runs.is_run_dir(Path(source)) else runs.find_run(source, runs_dir)
    except runs.RunError as e:
        _run_error(e)
    # the libraries' lines (a progress bar, DeepSpeed's 'Detected checkpoint of type') go to a log: the run's, or
    # one beside --out
    log = run / "logs" / "export.log" if run is not None else Path(out).absolute().with_name(f"{Path(out).name}.export.log")
    try:
        with library_output_to(log):
            r = export_model(source if run is None else runs.run_output_dir(run), out, force=force, config=model_config)
    except (runs.RunError, ExportError) as e:
        _run_error(f"{e}" + (f" (the libraries' output: {log})" if log.is_file() and log.stat().st_size else ""))
    click.echo(f"hfscale: {r.summary()}")


RUN_COMMANDS = (runs_cmd, status_cmd, logs_cmd, stop_cmd, report_cmd, export_cmd)
