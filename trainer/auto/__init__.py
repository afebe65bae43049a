"""Zero-code instrumentation: `gpuwatch run -- COMMAND…` measures a training job nobody edited.

How it gets into the ranks: `gpuwatch run` prepends SITE_DIRECTORY, which holds a single `sitecustomize.py`, to
PYTHONPATH and sets ENABLE_VARIABLE; every Python process the command starts inherits both (torchrun's ranks, an
`srun`'s tasks), and Python's `site` module imports that sitecustomize at start-up. It calls `install`, which puts a
finder at the front of `sys.meta_path` that waits for `import torch` and imports nothing itself: a process that never
imports torch pays one string comparison per import, and nothing else. Once torch has been imported, the finder's
loader hands over to `gpuwatch.trainer.auto.instrument`, which hooks what PyTorch exposes globally (optimizer step
hooks, module forward pre-hooks, `Tensor.backward`, the `torch.distributed` collectives) and stays idle until the
process initialises a process group.

Two kinds of process are left alone: torchrun's launcher (`is_launcher`), which imports torch but trains nothing,
so its hooks would only sit idle; and a rank whose interpreter ignores PYTHONPATH or `site` (`python -I`, `-E`,
`-S`), which never imports the sitecustomize and runs unmeasured: there is no other way in that needs no change to
the job. A rank unmeasured, for that or any reason, does not go unsaid: each process notes how far its
instrumentation got (gpuwatch.trainer.auto.status), and `gpuwatch run` ends with one line that counts the ranks
measured and says where the others stopped.

This module is imported at every Python start under `gpuwatch run`, so it imports nothing but the standard library
(no torch; of gpuwatch only its status module, itself standard library only).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from gpuwatch.trainer.auto.status import STATUS_VARIABLE, note

#: "1" turns the injected sitecustomize on; without it the sitecustomize only hands over to the next one.
ENABLE_VARIABLE = "GPUWATCH_AUTO"
#: The directory `gpuwatch run` puts first on PYTHONPATH: it holds sitecustomize.py and nothing else.
SITE_DIRECTORY = Path(__file__).resolve().parent / "site"
#: The variables the Monitor reads for the agent's socket, the job id and the run log (see hooks.Monitor).
SOCKET_VARIABLE, JOB_VARIABLE, RUN_LOG_VARIABLE = "GPUWATCH_SOCKET", "GPUWATCH_JOB", "GPUWATCH_RUN_LOG"
#: The job's parallel layout given to `gpuwatch run --layout tp,pp,dp` (see gpuwatch.trainer.auto.layout).
LAYOUT_VARIABLE = "GPUWATCH_LAYOUT"
#: The most arguments of a process's command line noted with its "site" event, and the most characters of each:
#: enough for a launcher's options (its --nproc-per-node). Not redacted as a hello's command is
#: (telemetry.captured_command would be one more import at every start): the status directory is the user's own
#: (mode 0700), removed when the command ends, and the same text is in /proc/PID/cmdline meanwhile.
NOTED_ARGS, NOTED_ARG_CHARS = 32, 200
#: Where a launcher's job id comes from when the job has none of gpuwatch's (hooks.identity.JOB_VARIABLES).
LAUNCHER_JOB_VARIABLES = ("SLURM_JOB_ID",)

log = logging.getLogger("gpuwatch.trainer.auto")


def instrumented_environment(environ: Mapping[str, str], *, socket_path: str | None = None, job: str | None = None,
                             run_log: str | None = None, layout: str | None = None, status: str | None = None,
                             new_job: str) -> dict[str, str]:
    """The command's environment under `gpuwatch run`: `environ` with SITE_DIRECTORY first on PYTHONPATH (the
    existing entries kept after it), ENABLE_VARIABLE set, the Monitor's variables for what was given, and
    STATUS_VARIABLE for the run's `status` directory (see gpuwatch.trainer.auto.status). A job with no id of its own
    (GPUWATCH_JOB, a Slurm job id) gets `new_job`, the same on every rank: without it each rank would have to agree
    on one by a collective at start-up, and a rank's first forward is no place for that."""
    env = dict(environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIRECTORY), *([path] if path else [])])
    env[ENABLE_VARIABLE] = "1"
    for name, value in ((SOCKET_VARIABLE, socket_path), (JOB_VARIABLE, job), (RUN_LOG_VARIABLE, run_log),
                        (LAYOUT_VARIABLE, layout), (STATUS_VARIABLE, status)):
        if value is not None:
            env[name] = value
    if not any(env.get(name) for name in (JOB_VARIABLE, *LAUNCHER_JOB_VARIABLES)):
        env[JOB_VARIABLE] = new_job
    return env


def parse_layout(text: str, world_size: int | None = None) -> tuple[int, int, int]:
    """`--layout`'s "tp,pp,dp": three positive integers, whose product is `world_size` where that is known. A
    ValueError says in one line what is wrong: a wrong layout would make diagnosis compare the wrong ranks."""
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"--layout takes tp,pp,dp: three positive integers such as 2,1,4 (got {text!r})")
    tp, pp, dp = (int(part) for part in parts)
    if world_size is not None and tp * pp * dp != world_size:
        raise ValueError(f"--layout {text}: tp × pp × dp = {tp * pp * dp}, but WORLD_SIZE is {world_size}")
    return tp, pp, dp


#: The launchers that import torch but train nothing themselves: their ranks are instrumented, not they.
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def is_launcher(argv: Sequence[str]) -> bool:
    """Whether a process started as `argv` (`sys.orig_argv`: the interpreter's own arguments included) is torchrun's
    launcher (`torchrun …`, `python -m torch.distributed.run …`), which would only carry the hooks idle."""
    script = next((argument for argument in argv[1:] if not argument.startswith("-")), "")
    module = next((after for before, after in itertools.pairwise(argv) if before == "-m"), "")
    return os.path.basename(script) in LAUNCHERS or module in LAUNCHERS


def install() -> None:
    """Instrument this process once torch is imported (at once if it already is); never torchrun's launcher. Either
    way the process notes that it loaded gpuwatch's start-up code, with its command line (the launcher's tells how
    many ranks it starts), for `gpuwatch run`'s end-of-run line."""
    argv = getattr(sys, "orig_argv", ())
    launcher = is_launcher(argv)
    note("site", argv=[argument[:NOTED_ARG_CHARS] for argument in argv[:NOTED_ARGS]], launcher=launcher)
    if launcher:
        return
    if "torch" in sys.modules:
        _instrument()
    elif not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def _instrument() -> None:
    """Hook torch's global entry points; a failure is logged, noted for `gpuwatch run`'s end-of-run line, and leaves
    the process as it was."""
    try:
        from gpuwatch.trainer.auto import instrument

        instrument.install()
    except Exception as error:
        log.warning("gpuwatch run: could not instrument this process (it runs on, unmeasured)", exc_info=True)
        note("failure", where="instrumenting torch", error=f"{type(error).__name__}: {error}")


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself. For `torch`, it asks the finders after it and has the loader they give run
    `_instrument` once torch's own module code has run; only then does it take itself off `sys.meta_path`.

    It stays in place through look-ups that load nothing: `import transformers` first asks
    `importlib.util.find_spec("torch")`, whose spec is thrown away, and the real `import torch` comes later. Should
    torch be loaded past it all the same (a finder put in front of this one later), the first import after torch
    is whole instruments the process."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            if _loaded_whole("torch"):
                _instrument_once(self)
            return None
        spec = next((found for finder in sys.meta_path if finder is not self
                     and (found := _find(finder, fullname, path, target)) is not None), None)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def exec_then_instrument(module: ModuleType) -> None:
            load(module)
            _instrument_once(self)

        loader.exec_module = exec_then_instrument  # type: ignore[method-assign]
        return spec


def _find(finder: object, fullname: str, path: Sequence[str] | None,
          target: ModuleType | None) -> importlib.machinery.ModuleSpec | None:
    find = getattr(finder, "find_spec", None)
    return find(fullname, path, target) if find is not None else None


def _loaded_whole(name: str) -> bool:
    """Whether module `name` is imported and its code has run to the end (importlib marks a module whose code
    is still running `__spec__._initializing`)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _instrument_once(finder: _AfterTorchImport) -> None:
    """Instrument this process, the first time only: the finder leaves `sys.meta_path` first."""
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
        _instrument()
