"""SGLang's engine processes started from one fork server that has imported SGLang once, instead of each spawned
process importing it again (a test harness speed-up; what the processes compute is unchanged).

An `sgl.Engine` under DP attention at DP 2 starts four processes (two schedulers, the DP controller, the
detokenizer), and SGLang starts each with multiprocessing's "spawn": each imports SGLang's scheduler and its
layers, about 20 s of one core on the 2-core CI machine, so four of them cost about 40 s of every engine's start.
This test plugin (`register`, declared by sglang_runs.py like the others) makes SGLang's engine module start them from a
fork server that imported those modules once (`PRELOAD`), in the process that starts them: sglang_runs.py's runner, for
every engine it starts, and each `launch_server` node's main process. Everything a spawned process
would see, the forked one sees too:

- the environment its parent had when it started it (`EnvironmentProcess`): a fork server's children inherit the
  server's environment, while the runner sets each run's variables (and SGLang its own) just before it starts an
  engine;
- the order of imports and plugins: a spawned scheduler imports SGLang's scheduler module to unpickle its target and
  only then loads the `sglang.srt.plugins` (its first step), as the forked one does; nothing in `PRELOAD` loads them;
- a failed scheduler's SIGQUIT: SGLang's processes send it to their parent, which is now the fork server; the fork
  server passes it on to the runner (`forward_sigquit`), whose handler the refusal runs rely on;
- shutdown: SGLang's `Engine.shutdown` kills every descendant of the engine's process, which would take the fork
  server along and make the next engine start a new one (importing again); it is skipped there (`keep_server`).

`SHARDPREP_TEST_SGLANG_START=spawn` leaves SGLang as it is, to compare.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import types

NAME = "shardprep_test_shared_imports"
VARIABLE = "SHARDPREP_TEST_SGLANG_START"
LINE = "shardprep test plugin: SGLang's engine processes start from a fork server"
PRELOAD = ["shared_imports", "sglang.srt.managers.scheduler", "sglang.srt.managers.data_parallel_controller",
           "sglang.srt.managers.detokenizer_manager"]
"""What the fork server imports once: this module (it forwards SIGQUIT there) and the modules of SGLang's process
targets, which a spawned process imports before anything else."""


class EnvironmentProcess(multiprocessing.context.ForkServerProcess):
    """A fork-server process that runs with the environment its parent had when it started it, as a spawned one
    does, and SIGQUIT's default action (the fork server's forwarding is not inherited)."""

    def start(self) -> None:
        self._environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        super().run()


class SpawnFromForkServer(types.ModuleType):
    """SGLang's engine module's `mp`: multiprocessing, with processes started by the fork server and SGLang's
    `set_start_method("spawn")` left out."""

    Process = EnvironmentProcess

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        return None

    def __getattr__(self, name: str) -> object:
        return getattr(multiprocessing, name)


def fork_server_pid() -> int | None:
    return multiprocessing.forkserver._forkserver._forkserver_pid


def keep_server(kill_process_tree):
    """SGLang's `kill_process_tree`, sparing the fork server (its children, the engine's processes, still die)."""

    def kill(parent_pid, include_parent=True, skip_pid=None, **kwargs):
        return kill_process_tree(parent_pid, include_parent, skip_pid or fork_server_pid(), **kwargs)

    return kill


def forward_sigquit(signum: int, frame: object) -> None:
    os.kill(os.getppid(), signal.SIGQUIT)


def register() -> None:
    """The plugin's entry point (SGLang's `load_plugins`, in every SGLang process): `install()` in a main process,
    the one that starts an engine's processes (the runner, a `launch_server` node); not in those processes, which
    multiprocessing started."""
    if multiprocessing.parent_process() is None:
        install()


def install() -> bool:
    """Start SGLang's engine processes from the fork server from now on in this process; False (and nothing
    changed) where `SHARDPREP_TEST_SGLANG_START=spawn`.

    >>> install()  # doctest: +SKIP
    True
    """
    import sglang.srt.entrypoints.engine as engine

    if os.environ.get(VARIABLE, "forkserver") == "spawn" or isinstance(engine.mp, SpawnFromForkServer):
        return False

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    engine.mp = SpawnFromForkServer("multiprocessing")
    engine.kill_process_tree = keep_server(engine.kill_process_tree)
    logging.getLogger("sglang.shardprep").warning(LINE)
    return True


def imported_by_the_fork_server() -> bool:
    """Whether this import is the fork server's preload (multiprocessing.forkserver.main is on the stack)."""
    frame = sys._getframe()
    while frame is not None and frame.f_code is not multiprocessing.forkserver.main.__code__:
        frame = frame.f_back
    return frame is not None


if imported_by_the_fork_server():
    signal.signal(signal.SIGQUIT, forward_sigquit)
