"""Run a function on N local processes joined in one torch.distributed group (gloo on CPU).

Used by the tests and the CPU demos; on a cluster the processes come from torchrun or Ray instead.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import shutil
import socket
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.parallel.host import cpu_rank_settings


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (loopback by default; "" for every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, queue,
            backend: str) -> None:
    # One thread per worker: several workers share two cores, and oversubscription is slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    # Megatron announces its fallbacks (no TE/apex) and uses a deprecated all-gather name once
    # per process; with several workers that buries the output that matters.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    cpu_rank_settings()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        # A file store and gloo on loopback: nothing of ours listens beyond this machine.
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with the
        # worker before the parent reads them.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the worker's traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_POLL_S = 1.0
"""How often ``spawn`` looks for a worker that died without a word (killed, crashed)."""


def _lost(procs, results: dict[int, Any], dead: set[int], deadline: float) -> list[str]:
    """Why ``spawn`` must stop waiting: a worker that ended without putting its result (a signal,
    a crash in C; its exit code says which), or the time limit; nothing while all may still
    answer. A worker that ends well has put its result in the queue's pipe before it exits, so
    one seen ended (``dead``, updated here) at two polls in a row with nothing read between is
    lost."""
    if time.monotonic() > deadline:
        return [f"no result within spawn's timeout from ranks "
                f"{sorted(set(range(len(procs))) - set(results))}"]
    for rank, p in enumerate(procs):
        if rank not in results and p.exitcode is not None:
            if rank in dead:
                return [f"rank {rank}: the process ended (exit code {p.exitcode}) without a "
                        "result (a negative code is the signal that killed it: -9 is SIGKILL, "
                        "often the kernel's out-of-memory killer)"]
            dead.add(rank)
    return []


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600,
          backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes with a default group of
    ``backend`` set up (gloo; "nccl" puts rank r on GPU r).

    ``fn`` must be importable (module level). Returns the per-rank results in rank order; raises
    RuntimeError carrying the first failing worker's traceback, or naming a worker that died
    without one, as soon as that is seen.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="hybridflow-spawn-")
    procs = [ctx.Process(target=_worker, args=(r, world_size, f"{store_dir}/store", fn, args,
                                               queue, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline, dead = time.monotonic() + timeout, set()
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=_POLL_S)
            except queue_module.Empty:
                errors.extend(_lost(procs, results, dead, deadline))
                continue
            dead.clear()
            if ok:
                results[rank] = pickle.loads(value)
            else:  # the others may be stuck in a collective with the failed rank
                # a rank killed first is the cause of a collective's error in another one
                errors.extend(f"rank {r}: killed by signal {-p.exitcode}" for r, p in
                              enumerate(procs) if p.exitcode is not None and p.exitcode < 0)
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            if errors:
                p.terminate()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
