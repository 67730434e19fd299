"""Measure the rates of this machine that the planner's cost model needs, and keep them in a
JSON file: ``hybridflow calibrate --out FILE`` writes it, ``Calibration.from_json`` reads it.
Besides the rates, what a micro-batch and a pipeline stage cost beyond their arithmetic
(``hybridflow.planner.overhead``, on a probe model).

Every rate is a median over repeats after a warm-up. On CPU the matmul and the copy run on one
thread, as each of our CPU workers does; the collectives run in ``size`` local processes started by
``hybridflow.parallel.spawn`` (gloo on CPU, NCCL on GPU, one GPU per process). Given a Ray
cluster (``hybridflow calibrate --config CONFIG ray.address=auto``), also the rate between two of
its nodes (``hybridflow.planner.internode``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from hybridflow.planner.rates import COLLECTIVES, GiB, MiB, Calibration
from hybridflow.planner.timing import collective_times, slowest_median, timed_median

if TYPE_CHECKING:
    from hybridflow.workers.group import RayConfig


def calibrate(quick: bool = False, log: Callable[[str], None] = print,
              cluster: RayConfig | None = None) -> Calibration:
    """Measure this machine's rates, logging one line per measurement.

    ``quick`` uses small sizes and few repeats (a few seconds on CPU, for tests); its rates are
    rough: the small CPU copy fits in cache and the small messages pay the latency. With
    ``cluster`` (the ``ray`` section of a config whose address is a cluster's), then the
    inter-node rate between two of the cluster's nodes (``internode``); on a cluster of one
    node, none, and the line says so.
    """
    # Imported here: reading a Calibration (the planner does) needs no torch.
    import torch

    from hybridflow.parallel.spawn import spawn

    on_gpu = torch.cuda.is_available()
    warmup, repeats = (1, 3) if quick else (3, 10)
    if on_gpu:
        devices = torch.cuda.device_count()
        matmul_n = {"bf16": 2048 if quick else 8192, "fp32": 1024 if quick else 4096}
        copy_bytes = 64 * MiB if quick else GiB
        message = 64 * MiB if quick else GiB
        group_sizes = [s for s in (2, 4, 8) if s <= devices]
        inner = 2 if quick else 10  # calls per timed sample: one sync amortised over them
    else:
        devices = 1
        matmul_n = {"fp32": 256 if quick else 1024}
        copy_bytes = 4 * MiB if quick else 256 * MiB
        message = MiB if quick else 16 * MiB
        group_sizes = [2]  # our CPU machines have 2 cores
        inner = 1
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    threads = "" if on_gpu else " (1 thread)"

    def median_seconds(fn: Callable[[], object]) -> float:
        return timed_median(fn, sync, warmup=warmup, repeats=repeats, inner=inner)

    matmul_flops = {}
    for dtype, n in matmul_n.items():
        matmul_flops[dtype] = matmul_rate(device, dtype, n, warmup=warmup, repeats=repeats,
                                          inner=inner)
        log(f"matmul {dtype} {n}^3{threads}: {_si(matmul_flops[dtype], 'FLOP/s')}")

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)  # pages touched
    dst = torch.empty_like(src)
    with _one_thread(on_gpu):
        memory_bandwidth = 2 * copy_bytes / median_seconds(lambda: dst.copy_(src))
    log(f"copy {_bytes(copy_bytes)}{threads}: {_si(memory_bandwidth, 'B/s')} (read + write)")
    del src, dst

    host_to_device = None
    if on_gpu:
        host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        dst = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        host_to_device = copy_bytes / median_seconds(lambda: dst.copy_(host, non_blocking=True))
        log(f"host -> device {_bytes(copy_bytes)} (pinned): {_si(host_to_device, 'B/s')}")
        del host, dst

    with _one_thread(on_gpu):  # a GPU rank's host optimizer runs on its cores, a CPU rank's on one
        host_adam = host_adam_rate(copy_bytes // 4, median_seconds)
        log(f"host Adam, {_bytes(copy_bytes)} of fp32 parameters ({torch.get_num_threads()} "
            f"threads): {_si(host_adam, 'parameters/s')}")

    rates: dict[str, dict[int, float]] = {name: {} for name in COLLECTIVES}
    backend = "nccl" if on_gpu else "gloo"
    for size in group_sizes:
        per_rank = spawn(_time_collectives, size, message, warmup, repeats, on_gpu)
        for name in COLLECTIVES:
            seconds = slowest_median([times[name] for times in per_rank])
            received = message * (size - 1) // size if name == "all_gather" else message
            rates[name][size] = received / seconds
            log(f"{name} {size} ranks, {_bytes(message)} message ({backend}): "
                f"{_si(rates[name][size], 'B/s')} received per rank")

    from hybridflow.planner.overhead import micro_batch_costs
    dtype = "bf16" if on_gpu else "fp32"
    costs = micro_batch_costs(on_gpu, devices, matmul_flops[dtype], dtype, message, warmup,
                              repeats)
    log(f"micro-batch host work (probe model, {dtype}): forward {_ms(costs.forward_base_s)} + "
        f"{_ms(costs.forward_layer_s)} a layer, training {_ms(costs.train_base_s)} + "
        f"{_ms(costs.train_layer_s)} a layer")
    if costs.p2p is not None:
        log(f"pipeline stage per micro-batch (probe at pp=2, {backend}): forward "
            f"{_ms(costs.forward_stage_s)}, training {_ms(costs.train_stage_s)}; send "
            f"{_bytes(message)}: {_si(costs.p2p, 'B/s')}")

    inter_node = None if cluster is None else _inter_node(cluster, message, warmup, repeats,
                                                          log)
    return Calibration(
        device=torch.cuda.get_device_name(0) if on_gpu else "cpu", devices=devices,
        matmul_flops=matmul_flops, memory_bandwidth=memory_bandwidth,
        all_gather=rates["all_gather"], broadcast=rates["broadcast"],
        host_to_device=host_to_device, host_adam=host_adam, inter_node=inter_node,
        torch=torch.__version__,
        micro_batches=costs,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def host_adam_rate(n: int, median_seconds: Callable[[Callable[[], object]], float]) -> float:
    """Parameters/s of torch's fused AdamW stepping ``n`` fp32 parameters in host memory (the
    host optimizer's step, ``training/host_optimizer.py``)."""
    import torch  # deferred: as calibrate's

    param = torch.nn.Parameter(torch.zeros(n), requires_grad=False)
    param.grad = torch.full((n,), 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-6, fused=True)
    return n / median_seconds(optimizer.step)


def _inter_node(cluster: RayConfig, message: int, warmup: int, repeats: int,
                log: Callable[[str], None]) -> float | None:
    """The inter-node rate of ``cluster`` (``measure_inter_node``), logged in one line; None
    on a cluster of one node."""
    from hybridflow.planner.internode import measure_inter_node  # deferred: torch, Ray
    found = measure_inter_node(cluster, message, warmup, repeats)
    if found is None:
        log(f"inter-node: not measured: the Ray cluster at {cluster.address} has one node; set "
            "cluster.inter_node_gb_s for a multi-node plan")
        return None
    log(f"inter-node, 2 nodes ({found.ips[0]}, {found.ips[1]}), {found.pairs} pair(s) at once, "
        f"{_bytes(found.message)} message ({found.backend}): {_si(found.rate, 'B/s')} a node "
        "sends")
    return found.rate


def _time_collectives(rank: int, world_size: int, message: int, warmup: int, repeats: int,
                      on_gpu: bool) -> dict[str, list[float]]:
    """One rank's seconds per all-gather (``message`` bytes of output) and per broadcast
    (``message`` bytes from rank 0), each over ``warmup + repeats`` iterations, warm-up dropped.
    Run by ``spawn``: the default group is gloo; on GPU the timed one is a NCCL group over it."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    if on_gpu:
        torch.cuda.set_device(rank)
        group = dist.new_group(backend="nccl")
        device, sync = torch.device("cuda", rank), torch.cuda.synchronize
    else:
        group, device, sync = None, torch.device("cpu"), (lambda: None)
    from hybridflow.hybrid_engine.execute import broadcast_gather  # deferred: it imports torch

    out = torch.empty(message, dtype=torch.uint8, device=device)
    shard = torch.ones(message // world_size, dtype=torch.uint8, device=device)
    # On gloo the reshard gathers by broadcasts (gloo's all-gather is slower): time that.
    gather = dist.all_gather_into_tensor if on_gpu else broadcast_gather
    ops = {"all_gather": lambda: gather(out, shard, group=group),
           "broadcast": lambda: dist.broadcast(out, src=0, group=group)}
    # the default (gloo) group's barrier: host-side, no GPU work
    return {name: collective_times(op, sync, dist.barrier, warmup=warmup, repeats=repeats)
            for name, op in ops.items()}


def matmul_rate(device, dtype: str, n: int, *, warmup: int = 3, repeats: int = 10,
                inner: int = 1) -> float:
    """FLOP/s of one n x n by n x n ``torch.matmul`` in ``dtype`` ("fp32", "bf16") on ``device``
    (a torch.device; on CPU with one thread, as each of our CPU workers runs): the median of
    ``repeats`` samples of ``inner`` calls after ``warmup``."""
    import torch  # deferred: torch
    on_gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    a, b = (torch.randn(n, n, dtype=_torch_dtype(dtype), device=device) for _ in range(2))
    c = torch.empty_like(a)
    with _one_thread(on_gpu):
        seconds = timed_median(lambda: torch.matmul(a, b, out=c), sync, warmup=warmup,
                               repeats=repeats, inner=inner)
    return 2 * n**3 / seconds


def _torch_dtype(name: str):
    import torch  # deferred: torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


@contextmanager
def _one_thread(on_gpu: bool):
    """On CPU, torch on one thread for the block (each of our CPU workers runs one); the previous
    thread count is restored after."""
    import torch  # deferred: torch
    if on_gpu:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _si(value: float, unit: str) -> str:
    """``1.234e12, "FLOP/s"`` -> ``"1.234 TFLOP/s"``."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _bytes(n: int) -> str:
    """``16 << 20`` -> ``"16 MiB"``."""
    return f"{n // GiB} GiB" if n % GiB == 0 else f"{n / MiB:g} MiB"
