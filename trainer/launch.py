"""Starting ranks: a fork-based launcher for one machine, or a single rank under torchrun.

Why fork: on a 2-core machine 8 ranks of `gpuwatch train` are up and training in about 2 s with fork,
against 11-16 s with `spawn` or `torchrun`, which re-import torch in every process. Each forked child calls
`torch.set_num_threads(1)`: 8 ranks then do not oversubscribe a laptop's cores, and a child never
enters the parent's OpenMP pool (which is not fork-safe). Fork is also unsafe once CUDA is
initialised, so the parent never touches CUDA: each child picks its own device after the fork.

Rendezvous: the parent binds a listening socket to a port the OS picks (port 0) before forking,
and rank 0 serves the TCPStore on that very socket (`master_listen_fd`): no window in which
another process can take the port. (A store served by the parent itself hung about one launch in
ten: its server thread's sockets leak into the children forked after it.)

Failure: a rank that raises sends its error to the parent and exits 1; the parent kills the other
ranks (they may wait in a collective forever) and raises RankFailed naming the rank. Its peers
usually fail a moment later with connection errors, so the parent waits briefly and reports the
rank that failed first. A rank that dies without a word (a signal, the OOM killer) counts too.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpuwatch.trainer.config import ConfigError

T = TypeVar("T")
RankFunction = Callable[..., T]  # called as fn(device, *args) once the default process group exists
HOST = "127.0.0.1"
FAILURE_GRACE_S = 2.0
STORE_TIMEOUT = timedelta(seconds=60)


class RankFailed(RuntimeError):
    """A rank raised or died; `details` holds its message or traceback."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed: {details}")
        self.rank = rank
        self.details = details


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """`auto` takes this rank's GPU when CUDA works, else the CPU; `cuda` without a GPU is an error."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda, but CUDA is not available here (use --device cpu or auto)")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()}; start fewer "
            "ranks per node (NCCL cannot share one GPU between ranks) or use --device cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def run_rank(
    fn: RankFunction[T], args: tuple, device: str = "auto", connect: Callable[[], dist.Store] | None = None
) -> T:
    """Join the job as the rank described by RANK/WORLD_SIZE/LOCAL_RANK, call fn(device, *args), leave.

    Under torchrun the rendezvous comes from MASTER_ADDR/MASTER_PORT (env://); the local launcher
    passes `connect`, which returns its store. gloo on CPU, NCCL on CUDA: the same code either way.
    The device is checked first, so a rank without one fails before its peers wait for it.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    chosen = resolve_device(device, int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if chosen.type == "cuda" else "gloo"
    options: dict[str, Any] = {"rank": rank, "world_size": world_size, "timeout": timedelta(minutes=10)}
    if connect is not None:
        options["store"] = connect()
    if chosen.type == "cuda":
        options["device_id"] = chosen  # eager NCCL init: a wrong GPU mapping fails here, not mid-step
    dist.init_process_group(backend, **options)
    result = fn(chosen, *args)
    dist.destroy_process_group()  # not on failure: the process exits, and peers must not fail first
    return result


def launch(
    fn: RankFunction[T], world_size: int, *args: Any, device: str = "auto", timeout: float | None = None
) -> list[T]:
    """Fork `world_size` ranks on this machine, run fn(device, *args) in each, return results by rank.

    Raises RankFailed when any rank fails (the others are killed) and TimeoutError after `timeout`
    seconds. Results travel back pickled, so return plain data (numbers, lists, CPU tensors). Plain
    pickle, not multiprocessing's: that one hands tensors over in shared memory, which is gone once
    the child exits.
    """
    context = mp.get_context("fork")
    processes, readers = [], []
    try:
        with socket.create_server((HOST, 0), backlog=world_size) as listener:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_child, args=(writer, rank, world_size, listener, device, fn, args), name=f"rank{rank}"
                )
                process.start()
                writer.close()  # the child holds the only writer: EOF here means it died
                processes.append(process)
                readers.append(reader)
        return _collect(processes, readers, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


def _child(
    writer, rank: int, world_size: int, listener: socket.socket, device: str, fn: RankFunction, args: tuple
) -> None:
    torch.set_num_threads(1)
    port = listener.getsockname()[1]
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=HOST, MASTER_PORT=str(port),
    )
    def connect() -> dist.Store:  # rank 0 serves the store on the socket the parent bound
        if rank == 0:
            return dist.TCPStore(HOST, port, world_size, is_master=True, master_listen_fd=listener.fileno(),
                                 wait_for_workers=False, timeout=STORE_TIMEOUT)
        listener.close()
        return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=STORE_TIMEOUT)

    try:
        writer.send_bytes(pickle.dumps(("ok", run_rank(fn, args, device, connect))))
        code = 0
    except BaseException as error:
        details = str(error) if isinstance(error, ConfigError) else traceback.format_exc()
        writer.send_bytes(pickle.dumps(("error", (time.monotonic(), details))))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the parent's atexit handlers (pytest's among them), inherited by fork


def _collect(processes: list, readers: list, timeout: float | None) -> list:
    """Results by rank; on failure, the rank that failed first (its peers' connection errors follow). A rank killed
    before it could report (a signal) counts as first: its peers' errors about the broken connection may reach the
    parent before the parent sees the dead rank's end."""
    results: list = [None] * len(processes)
    failures: dict[int, tuple[float, str]] = {}  # rank -> (time.monotonic() of the failure, details)
    silent: set[int] = set()  # ranks that ended without reporting
    pending = set(range(len(processes)))
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        if failures:  # give the others a moment to report, so the first failure is the one shown
            deadline = min(deadline or math.inf, min(when for when, _ in failures.values()) + FAILURE_GRACE_S)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        waitables = [readers[rank] for rank in pending] + [processes[rank].sentinel for rank in pending]
        ready = set(mp.connection.wait(waitables, timeout=remaining))
        if not ready:
            break
        for rank in sorted(pending):
            if readers[rank] not in ready and processes[rank].sentinel not in ready:
                continue
            try:
                status, payload = pickle.loads(readers[rank].recv_bytes())
            except EOFError:
                processes[rank].join()
                status, payload = "error", (time.monotonic(), _silent_exit(processes[rank].exitcode))
                silent.add(rank)
            if status == "error":
                failures[rank] = payload
            else:
                results[rank] = payload
            pending.discard(rank)
    if failures:
        first = min(failures, key=lambda rank: (rank not in silent, failures[rank][0]))
        raise RankFailed(first, failures[first][1])
    if pending:
        raise TimeoutError(f"ranks {sorted(pending)} still running after {timeout} s")
    return results


def _silent_exit(exitcode: int | None) -> str:
    """Why a rank ended without reporting, in words: a negative exit code is the signal that killed it."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        hint = (": the kernel's out-of-memory killer sends it when memory runs out (see `dmesg`), or another "
                "process killed it" if -exitcode == signal.SIGKILL else "")
        return f"was killed by {name} before reporting{hint}"
    return f"exited with code {exitcode} before reporting"
