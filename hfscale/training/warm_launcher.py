"""A node's launcher whose ranks start warm: forked from it after it did their imports.

    python -m hfscale.training.warm_launcher --preload trainer,deepspeed,builtin \\
        accelerate.commands.launch --config_file ... --module hfscale.training.train --config ...

Every rank of a launch usually starts a fresh interpreter and imports torch, transformers,
deepspeed and accelerate again: 7-9 CPU-seconds a rank here, on every start and every relaunch,
and at a real site thousands of interpreters reading the same files from one shared file system at
once. This runs the node's launcher (``accelerate launch`` or torchrun, unchanged, as ``python -m``
would) with one difference: when the launcher starts its workers (``torch.distributed.run.run``,
which both reach), it first imports the ``--preload`` modules once, then has torch's elastic agent
start each rank with ``start_method="fork"`` and a function entry point (what torchrun's own
``--run-path`` does) instead of a new ``python -u``: each rank is forked from a process that has
already imported what it needs, and runs its script or module as ``python -u`` would (runpy, as
``__main__``, its arguments in ``sys.argv``, the script's folder first on ``sys.path``).

What a rank sees is otherwise the same: torch's agent sets its environment variables (``RANK``,
``LOCAL_RANK``, ... in ``os.environ``), waits for it, stops it, restarts it and reports its exit
code as it would a subprocess's. Differences, and what is done about them:

- each rank gets a session of its own, as torch starts a new interpreter's;
- the signal handlers the launcher installed are set back to a new interpreter's before the entry runs, and the
  process name (``/proc/<pid>/comm``, what ``ps`` and ``pkill python`` read) to the interpreter's; the death
  signal torch gives a forked worker is undone: a rank outlives a launcher that dies, as a new interpreter does;
  its command line (``/proc/<pid>/cmdline``, what ``ps`` and ``pgrep -f`` read) is the one torch would have run;
  the listening sockets it inherited are closed (the rendezvous store's port is not held by a rank), and a rank
  that ends after its launcher died ends at once instead of waiting for it to read its result;
- ``atexit`` hooks run when the entry returns or exits (a forked worker ends with ``os._exit``);
- ``/proc/<pid>/environ`` of a forked rank is the launcher's (the environment a process was
  started with), so it carries ``HFSCALE_JOB_ID`` (hfscale.launch.node.stopping finds it) but not
  ``RANK``: the rank writes ``<run_dir>/stacks/pid-<host>-<pid>`` with its rank for the stack dumps;
- a preload that fails is told on stderr and skipped: the rank imports it itself, or fails as it would.

A launch that starts no worker through ``torch.distributed.run.run`` (accelerate's single-process
launch) is started as without this module.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from hfscale.training.heartbeat import STACKS_DIR  # the standard library only

if TYPE_CHECKING:
    from hfscale.rules.resolved import Job

# what --preload names: what each kind of rank imports first (the modules its engines import as they start included)
PRELOADS: dict[str, tuple[str, ...]] = {
    "accelerate": ("accelerate",),
    "trainer": ("transformers.trainer", "transformers.generation.utils"),
    # its engine's start imports its optimizers (the muon one compiles with torch.compile) and its ops' JIT loader
    "deepspeed": ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.cpp_extension"),
    "builtin": ("hfscale.training.instrument", "datasets.load"),  # hfscale's callbacks, the data's loader
}
PID_FILE_PREFIX = "pid-"  # <run_dir>/stacks/pid-<host>-<pid>: the rank of a forked rank (its environ lacks RANK)
LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run")
PR_SET_PDEATHSIG = 1
_DEFAULT_THREADS = [1]  # torch's threads in the launcher before it kept to one: what a new interpreter takes
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
# the signals torch's elastic agent handles in the launcher; a new interpreter leaves them at the default
_AGENT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_FORK_HELD = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # held from fork_rank's fork until the rank's handlers


def preload_modules(groups: str | list[str]) -> list[str]:
    """The modules of ``--preload``'s groups, comma-separated or a list (PRELOADS); ValueError naming an unknown one."""
    names = [g for g in (groups.split(",") if isinstance(groups, str) else groups) if g]
    unknown = sorted(set(names) - set(PRELOADS))
    if unknown:
        raise ValueError(f"--preload: unknown {', '.join(unknown)} (known: {', '.join(PRELOADS)})")
    return [m for g in names for m in PRELOADS[g]]


def preload_groups(job: Job) -> list[str]:
    """The ``--preload`` groups of ``job``'s ranks: the Trainer for the built-in entry point and Trainer scripts,
    accelerate for a plain script; DeepSpeed where the job uses it; the built-in entry point's own."""
    t = job.config.training
    plain = t.script is not None and t.pass_args == "none"
    return ["accelerate" if plain else "trainer", *(["deepspeed"] if job.deepspeed is not None else []),
            *(["builtin"] if t.script is None else [])]


def preload_told(modules: list[str]) -> None:
    """``preload(modules)``, each one that failed told on stderr (the rank imports it itself, or fails as it would)."""
    for message in preload(modules):
        print(f"hfscale: warm start: not preloaded: {message}", file=sys.stderr, flush=True)


def preload(modules: list[str]) -> list[str]:
    """Import ``modules`` here, once, before the ranks are forked; the ones that failed, as messages. A module
    that does not exist (another release of the library) is skipped without a word."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue
            failed.append(f"{name}: {type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - any import error: the rank meets it again itself
            failed.append(f"{name}: {type(e).__name__}: {e}"[:300])
    return failed


def cuda_driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether this process loaded the CUDA driver library (the CUDA runtime loads it when it initializes
    the driver): a process forked after that cannot use CUDA."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any("/libcuda.so" in line for line in f)
    except OSError:
        return True  # cannot tell: not safe to fork


def _fresh_signals() -> None:
    for name in _AGENT_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _outlive_the_launcher() -> None:
    """Undo the death signal torch's forked workers get (PR_SET_PDEATHSIG, SIGINT, when their parent ends): a
    rank started as a new interpreter outlives a launcher that dies (a preemption notice its agent does not
    handle ends the agent, while the rank saves its checkpoint; hfscale's keeper stops an orphan)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _close_listening_sockets() -> None:
    """Close the listening sockets inherited from the launcher (torch's rendezvous store listens on the master
    port): a new interpreter has none of them, and a rank that outlived its launcher kept the port taken."""
    import socket
    import stat

    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if fd <= 2 or not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=fd)
            try:
                listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            finally:
                s.detach()
            if listening:
                os.close(fd)
        except OSError:
            continue


def _end_with_the_launcher(launcher: int) -> None:
    """A forked worker that returned waits for its launcher to read its result before it ends: if the launcher
    is gone (a signal it does not handle ended it), nobody will, so end now, and end later if it goes while
    this waits."""
    if os.getppid() != launcher:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="hfscale-orphan-exit", daemon=True).start()


def _own_session() -> None:
    """A session (and process group) of its own, as torch's subprocess handler starts each rank
    (``start_new_session``): a signal sent to the launcher's group does not reach the rank twice, nor one
    sent to the rank's group (its writers) the launcher."""
    try:
        os.setsid()
    except OSError:  # already a group leader: not a forked worker
        pass


def _own_name() -> None:
    """The process name a new interpreter has (the executable's name: what ``ps``, ``top`` and ``pkill python``
    read), not the one torch's agent gave itself (``pt_elastic``) and this fork inherited."""
    try:
        with open("/proc/self/comm", "w", encoding="utf-8") as f:
            f.write(os.path.basename(sys.executable)[:15])
    except OSError:
        pass


def _own_command_line(argv: list[str]) -> None:
    """``/proc/<pid>/cmdline`` = ``argv``, what a new interpreter's would be (``ps``, ``pgrep -f`` and the tools
    that read it see the rank's command, not its launcher's): written over this process's own argument area
    (``/proc/self/stat`` fields 48-49) as ``setproctitle`` does, when it fits; the rest of the area zeroed."""
    try:
        import ctypes

        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
        text = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
        if start <= 0 or len(text) > end - start:
            return
        ctypes.memmove(start, text, len(text))
        ctypes.memset(start + len(text), 0, end - start - len(text))
    except (OSError, ValueError, IndexError, AttributeError):
        pass


def _note_rank() -> None:
    """``<run_dir>/stacks/pid-<host>-<pid>`` = this rank and this process's start time (/proc/<pid>/stat field 22):
    hfscale.launch.node.stopping.dump_script reads it. The host (``$HFSCALE_HOST``, the launch's name for this
    node) keeps the nodes of a run directory every node shares apart: pids repeat from one node to the next."""
    run_dir, rank, host = os.environ.get("HFSCALE_RUN_DIR"), os.environ.get("RANK"), os.environ.get("HFSCALE_HOST", "")
    if not run_dir or rank is None or not rank.isdigit() or not host or not set(host) <= _HOST_CHARS:
        return
    folder = os.path.join(run_dir, STACKS_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{PID_FILE_PREFIX}{host}-{os.getpid()}")
        from hfscale.core.pid_identity import start_time

        with open(path + ".tmp", "w", encoding="ascii") as f:
            f.write(f"{rank} {start_time(os.getpid()) or 0}\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the stack dump then names this rank by pid only


def forked_rank(*argv: str) -> None:
    """A rank's entry in the forked worker: ``argv`` as torch gives it for ``python`` (``-u``, then
    ``-m MODULE`` or ``SCRIPT``, then the arguments). Runs it as ``python -u`` would, then the
    ``atexit`` hooks; a ``SystemExit`` keeps its code (torch's agent reports it as the exit code)."""
    launcher = os.getppid()
    _fresh_signals()
    _own_session()
    _outlive_the_launcher()
    _close_listening_sockets()
    _own_name()
    _note_rank()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None:
        # the launcher kept to one thread (below); OpenMP read OMP_NUM_THREADS when the launcher loaded it,
        # before torch's agent set it for the ranks: the threads a new interpreter would take
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _DEFAULT_THREADS[0])
    args = list(argv[1:]) if argv and argv[0] == "-u" else list(argv)
    _own_command_line([os.getenv("PYTHON_EXEC", sys.executable), *argv])
    real_exit, me = os._exit, os.getpid()

    def _exit(code: int) -> None:
        # torch's agent takes a forked worker for done when it returned, not when it ended: an os._exit of the
        # entry's main thread (hfscale.training.shutdown.exit_cleanly, a script's own) ends it as sys.exit would,
        # where a forked worker ends anyway, without the interpreter's finalization
        if os.getpid() == me and threading.current_thread() is threading.main_thread():
            raise SystemExit(code)
        real_exit(code)

    os._exit = _exit  # type: ignore[assignment]
    try:
        if args and args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise  # the exit code, as torch's agent reports it
    finally:
        os._exit = real_exit  # multiprocessing ends this process with it after the return
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # noqa: SLF001 - what a new interpreter runs at its end
    _end_with_the_launcher(launcher)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Imports with Python's cyclic garbage collector off, and what they made frozen after (``gc.freeze``): the
    collector otherwise runs hundreds of times while half a million objects are created and kept (an eighth of the
    imports' CPU here), and each forked rank's full collections would walk, and so copy, every page the
    launcher's imports wrote. Modules are kept for the process's life: nothing frozen was garbage."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def warm_up(modules: list[str]) -> bool:
    """Make this process one that ranks can be forked from: ``modules`` imported (what failed told on stderr),
    torch on one thread. False, told, where the CUDA driver got loaded: then start the ranks as new interpreters."""
    # torch.cuda.is_available() asks NVML, not the CUDA driver, which a forked process could not use again
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # nor a pool of OpenMP threads (GNU OpenMP's is not there after a fork: a parallel region would wait on
    # it for ever): the launcher runs whatever its imports compute on one thread, each rank sets its own
    with _collector_paused():
        import torch

        _DEFAULT_THREADS[0] = torch.get_num_threads()
        torch.set_num_threads(1)
        preload_told(modules)
    if cuda_driver_loaded():
        print("hfscale: warm start: off: the CUDA driver was initialized while importing "
              f"{', '.join(modules)}, and forked ranks could not use it: the ranks start as new interpreters",
              file=sys.stderr, flush=True)
        return False
    return True


def fork_rank(argv: list[str], env: dict[str, str]) -> int:
    """A rank forked from this (warmed-up) process, as ``python *argv`` with environment ``env`` would start;
    its pid. It ends with its entry's exit code, 1 after a traceback for an exception, as an interpreter does."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_HELD)  # the parent's handlers are not the rank's
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return pid
    code = 1
    try:
        _fresh_signals()  # before the signals held come in (forked_rank sets them again, for torch's agent's forks)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.environ.clear()
        os.environ.update(env)
        forked_rank(*argv)
        code = 0
    except SystemExit as e:  # forked_rank returns for 0 and None: a code, or a message and 1, as sys.exit's
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forking(original: Callable[..., Any], modules: list[str]) -> Callable[..., Any]:
    """torch.distributed.run's ``elastic_launch``: workers started as ``python ...`` are forked instead."""
    from dataclasses import replace

    def elastic_launch(config: Any, entrypoint: Any) -> Any:
        if entrypoint != os.getenv("PYTHON_EXEC", sys.executable) or not warm_up(modules):
            return original(config=config, entrypoint=entrypoint)
        return original(config=replace(config, start_method="fork"), entrypoint=forked_rank)

    return elastic_launch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hfscale.training.warm_launcher")
    p.add_argument("--preload", default="", help=f"what to import before the ranks are forked, comma-separated: "
                   f"{', '.join(PRELOADS)}")
    p.add_argument("launcher", choices=LAUNCHERS, help="the node's launcher, run as python -m would")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    try:
        modules = preload_modules(a.preload)
    except ValueError as e:
        p.error(str(e))
    with _collector_paused():
        import torch.distributed.launcher.api as api
        import torch.distributed.run as run

    # both names: torch.distributed.run's run() reads its own; the api module's for anything imported after
    run.elastic_launch = api.elastic_launch = _forking(api.elastic_launch, modules)
    sys.argv = [a.launcher, *a.args]
    launcher = importlib.import_module(a.launcher)
    launcher.main()  # both launchers' command-line entry: it parses sys.argv


if __name__ == "__main__":
    main()
