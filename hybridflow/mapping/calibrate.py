"""Measure the rates of this machine that the planner's cost model needs, and keep them in a
JSON file: ``hybridflow calibrate --out FILE`` writes it, ``Calibration.from_json`` reads it.

Every rate is a median over repeats after a warm-up. On CPU the matmul and the copy run on one
thread, as each of our CPU workers does; the collectives run in ``size`` local processes started by
``hybridflow.parallel.spawn`` (gloo on CPU, NCCL on GPU, one GPU per process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from hybridflow.errors import ArgumentError, ConfigError, check_float, check_int
from hybridflow.mapping.profile import PassProfile

MiB = 1 << 20
GiB = 1 << 30
DTYPES = ("fp32", "bf16")
COLLECTIVES = ("all_gather", "broadcast")
FIELD = "cluster.calibration"
"""The config key that names a calibration file: what a bad file's ConfigError names."""


@dataclass(kw_only=True)
class Calibration:
    """The measured rates of one machine (one node), as ``calibrate`` returns them."""

    device: str
    """"cpu", or the GPU's name as torch reports it (``"NVIDIA H200"``)."""
    devices: int
    """GPUs on this node; 1 on CPU."""
    matmul_flops: dict[str, float]
    """dtype name ("fp32", "bf16") -> FLOP/s of one large square ``torch.matmul`` (2 n^3 FLOP).
    On CPU fp32 only, on one thread."""
    memory_bandwidth: float
    """Bytes/s of one large copy on the device, read and write both counted (on CPU one thread)."""
    all_gather: dict[int, float]
    """Group size -> bytes each rank receives per second in an all-gather, (size-1)/size of the
    output (nccl-tests' bus bandwidth), done as the 3D-HybridEngine gathers: NCCL's all-gather,
    on gloo one broadcast per member (``hybridflow.hybrid_engine.execute``). Empty on a one-GPU
    node."""
    broadcast: dict[int, float]
    """Group size -> bytes each non-root rank receives per second in a broadcast, the whole
    message. Empty on a one-GPU node."""
    host_to_device: float | None
    """Bytes/s of a copy from pinned host memory to the GPU; None on CPU."""
    torch: str
    """torch version the rates were measured with."""
    measured_at: str
    """When they were measured: ISO 8601 date-time, UTC."""
    passes: list[PassProfile] = dataclasses.field(default_factory=list)
    """The efficiencies of one model's passes (``hybridflow calibrate --config CONFIG``), one
    per model shape and dtype; without one for a run's model the cost model's seconds are floors.
    Optional in the file."""

    def __post_init__(self):
        if not isinstance(self.device, str) or not self.device:
            raise ArgumentError("device", f"must be 'cpu' or a GPU name, got {self.device!r}")
        check_int("devices", self.devices)
        if not isinstance(self.matmul_flops, dict) or not self.matmul_flops:
            raise ArgumentError("matmul_flops", f"must map dtype names ({', '.join(DTYPES)}) to "
                                              f"FLOP/s, got {self.matmul_flops!r}")
        for dtype, rate in self.matmul_flops.items():
            if dtype not in DTYPES:
                raise ArgumentError("matmul_flops", f"unknown dtype {dtype!r}; use one of "
                                                  f"{', '.join(DTYPES)}")
            check_float(f"matmul_flops.{dtype}", rate, low=0, low_open=True)
        check_float("memory_bandwidth", self.memory_bandwidth, low=0, low_open=True)
        for name in COLLECTIVES:
            rates = getattr(self, name)
            if not isinstance(rates, dict):
                raise ArgumentError(name, f"must map group sizes to bytes/s, got {rates!r}")
            for size, rate in rates.items():
                check_int(f"{name} group size", size, low=2)
                check_float(f"{name}.{size}", rate, low=0, low_open=True)
        check_float("host_to_device", self.host_to_device, low=0, low_open=True, none_ok=True)
        if not isinstance(self.passes, list):
            raise ArgumentError("passes", f"must be a list of pass profiles, got {self.passes!r}")
        self.passes = [p if isinstance(p, PassProfile) else _profile_from(p)
                       for p in self.passes]
        if not isinstance(self.torch, str):
            raise ArgumentError("torch", f"must be a version string, got {self.torch!r}")
        try:
            datetime.fromisoformat(self.measured_at)
        except (TypeError, ValueError):
            raise ArgumentError("measured_at", f"must be an ISO 8601 date-time, got "
                                             f"{self.measured_at!r}") from None

    def profile(self, shape, dtype: str, tp: int = 1, lora=None) -> PassProfile | None:
        """The pass profile of a model shape (``ModelConfig``) in ``dtype`` measured at ``tp``,
        else the one at tp = 1 (the cost model scales it and adds TP's communication), else
        None. The newest first. With ``lora`` (a LoraConfig of rank > 0), one measured with
        those adapters, else full fine-tuning's (the cost model's LoRA floors over its
        efficiencies: optimistic where the host bounds a micro-batch)."""
        for key in ((lora, None) if lora is not None and lora.enabled else (None,)):
            found = [p for p in reversed(self.passes) if p.matches(shape, dtype, key)]
            profile = next((p for p in found if p.tp == tp), None) or next(
                (p for p in found if p.tp == 1), None)
            if profile is not None:
                return profile
        return None

    def to_json(self, path: str | os.PathLike) -> None:
        """Write to ``path`` atomically: a reader sees the old file or the new one, never half."""
        path = Path(path)
        text = json.dumps(dataclasses.asdict(self), indent=2) + "\n"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open() honours the umask
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Calibration":
        """Read a file ``to_json`` wrote. A missing, unreadable or incomplete file raises a
        ConfigError (field cluster.calibration) naming the file and the command that writes it."""
        path = Path(path)
        fix = f"run `hybridflow calibrate --out {path}` on the machine to plan for"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(FIELD, f"{path}: file not found; {fix}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(FIELD, f"{path}: cannot read it ({e}); {fix}") from None
        if not isinstance(data, dict):
            raise ConfigError(FIELD, f"{path}: not a JSON object; {fix}")
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {"passes"}
        for what, keys in (("missing", names - optional - data.keys()),
                           ("unknown", data.keys() - names)):
            if keys:
                raise ConfigError(FIELD, f"{path}: {what} field(s) "
                                                 f"{', '.join(sorted(keys))}; {fix}")
        try:
            for name in COLLECTIVES:  # JSON object keys are strings; the group sizes are ints
                if isinstance(data[name], dict):
                    data[name] = {int(k) if k.isdigit() else k: v for k, v in data[name].items()}
            return cls(**data)
        except (ConfigError, ArgumentError) as e:  # a field's value (check_* or our own checks)
            name = e.field if isinstance(e, ConfigError) else e.name
            raise ConfigError(FIELD, f"{path}: {name}: {e.message}; {fix}") from None


def calibrate(quick: bool = False, log: Callable[[str], None] = print) -> Calibration:
    """Measure this machine's rates, logging one line per measurement.

    ``quick`` uses small sizes and few repeats (a few seconds on CPU, for tests); its rates are
    rough: the small CPU copy fits in cache and the small messages pay the latency.
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

    rates: dict[str, dict[int, float]] = {name: {} for name in COLLECTIVES}
    backend = "nccl" if on_gpu else "gloo"
    for size in group_sizes:
        per_rank = spawn(_time_collectives, size, message, warmup, repeats, on_gpu)
        for name in COLLECTIVES:
            # An iteration lasts as long as its slowest rank.
            seconds = statistics.median(map(max, zip(*(times[name] for times in per_rank))))
            received = message * (size - 1) // size if name == "all_gather" else message
            rates[name][size] = received / seconds
            log(f"{name} {size} ranks, {_bytes(message)} message ({backend}): "
                f"{_si(rates[name][size], 'B/s')} received per rank")

    return Calibration(
        device=torch.cuda.get_device_name(0) if on_gpu else "cpu", devices=devices,
        matmul_flops=matmul_flops, memory_bandwidth=memory_bandwidth,
        all_gather=rates["all_gather"], broadcast=rates["broadcast"],
        host_to_device=host_to_device, torch=torch.__version__,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _profile_from(data) -> PassProfile:
    """A PassProfile from its JSON object; ArgumentError naming the field when it is not one."""
    names = {f.name for f in dataclasses.fields(PassProfile)}
    # Those with a default came later: files written before them lack them.
    required = {f.name for f in dataclasses.fields(PassProfile)
                if f.default is dataclasses.MISSING}
    if not isinstance(data, dict) or not required <= set(data) <= names:
        raise ArgumentError("passes", f"each entry must have exactly the fields "
                                      f"{', '.join(sorted(names))}, got {data!r}"[:300])
    return PassProfile(**data)


def _time_collectives(rank: int, world_size: int, message: int, warmup: int, repeats: int,
                      on_gpu: bool) -> dict[str, list[float]]:
    """One rank's seconds per all-gather (``message`` bytes of output) and per broadcast
    (``message`` bytes from rank 0), each over ``warmup + repeats`` iterations, warm-up dropped.
    Run by ``spawn``: the default group is gloo; on GPU the timed one is a NCCL group over it."""
    import torch
    import torch.distributed as dist

    if on_gpu:
        torch.cuda.set_device(rank)
        group = dist.new_group(backend="nccl")
        device, sync = torch.device("cuda", rank), torch.cuda.synchronize
    else:
        group, device, sync = None, torch.device("cpu"), (lambda: None)
    from hybridflow.hybrid_engine.execute import broadcast_gather

    out = torch.empty(message, dtype=torch.uint8, device=device)
    shard = torch.ones(message // world_size, dtype=torch.uint8, device=device)
    # On gloo the reshard gathers by broadcasts (gloo's all-gather is slower): time that.
    gather = dist.all_gather_into_tensor if on_gpu else broadcast_gather
    ops = {"all_gather": lambda: gather(out, shard, group=group),
           "broadcast": lambda: dist.broadcast(out, src=0, group=group)}
    times: dict[str, list[float]] = {}
    for name, op in ops.items():
        times[name] = []
        for _ in range(warmup + repeats):
            sync()
            dist.barrier()  # the default (gloo) group: a host-side barrier, no GPU work
            start = time.perf_counter()
            op()
            sync()
            times[name].append(time.perf_counter() - start)
        del times[name][:warmup]
    return times


def matmul_rate(device, dtype: str, n: int, *, warmup: int = 3, repeats: int = 10,
                inner: int = 1) -> float:
    """FLOP/s of one n x n by n x n ``torch.matmul`` in ``dtype`` ("fp32", "bf16") on ``device``
    (a torch.device; on CPU with one thread, as each of our CPU workers runs): the median of
    ``repeats`` samples of ``inner`` calls after ``warmup``."""
    import torch
    on_gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    a, b = (torch.randn(n, n, dtype=_torch_dtype(dtype), device=device) for _ in range(2))
    c = torch.empty_like(a)
    with _one_thread(on_gpu):
        seconds = timed_median(lambda: torch.matmul(a, b, out=c), sync, warmup=warmup,
                               repeats=repeats, inner=inner)
    return 2 * n**3 / seconds


def timed_median(fn: Callable[[], object], sync: Callable[[], None], *, warmup: int,
                    repeats: int, inner: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples of ``inner`` calls each."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


@contextmanager
def _one_thread(on_gpu: bool):
    """On CPU, torch on one thread for the block (each of our CPU workers runs one); the previous
    thread count is restored after."""
    import torch
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


def _bytes(n: int) -> str:
    """``16 << 20`` -> ``"16 MiB"``."""
    return f"{n // GiB} GiB" if n % GiB == 0 else f"{n / MiB:g} MiB"
