"""What the planner reads of a machine: its measured rates (``Calibration``, the JSON file
``hybridflow calibrate`` writes) and the efficiencies of one model's passes (``PassProfile``).
Data types only: ``calibrate.py`` and ``profile.py`` measure them."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hybridflow.errors import ArgumentError, ConfigError, check_float, check_int
from hybridflow.models.config import ModelConfig

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
    host_adam: float | None = None
    """Parameters/s of torch's fused AdamW over fp32 state in host memory on all the host's
    cores: the step of ``engine.optim.offload``'s host optimizer. None in files written before
    it was measured. Optional in the file."""
    inter_node: float | None = None
    """Bytes/s one node sends to the others, for collectives whose group spans nodes: what
    its link carries while each of its GPUs crosses at once (``calibrate`` measures it on a Ray
    cluster of two nodes or more, ``hybridflow.planner.internode``; a file may carry the
    cluster's stated rate); None where not known. ``cluster.inter_node_gb_s`` takes its place
    where set. Optional in the file."""
    passes: list[PassProfile] = dataclasses.field(default_factory=list)
    """The efficiencies of one model's passes (``hybridflow calibrate --config CONFIG``), one
    per model shape and dtype; without one for a run's model the cost model's seconds are floors.
    Optional in the file."""
    micro_batches: MicroBatchCosts | None = None
    """What a micro-batch and a pipeline stage cost beyond their arithmetic (``calibrate``
    measures them on a probe model); None in files written before they were measured: then,
    without a pass profile of the run's model, the cost model's seconds are floors alone, which
    favour the smallest micro-batch, and the planner refuses to choose from them. Optional in
    the file."""

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
        check_float("inter_node", self.inter_node, low=0, low_open=True, none_ok=True)
        check_float("host_adam", self.host_adam, low=0, low_open=True, none_ok=True)
        if not isinstance(self.passes, list):
            raise ArgumentError("passes", f"must be a list of pass profiles, got {self.passes!r}")
        self.passes = [p if isinstance(p, PassProfile) else _profile_from(p)
                       for p in self.passes]
        if isinstance(self.micro_batches, dict):
            self.micro_batches = _costs_from(self.micro_batches)
        elif not isinstance(self.micro_batches, (MicroBatchCosts, type(None))):
            raise ArgumentError("micro_batches", f"must be null or the micro-batch costs, got "
                                                 f"{self.micro_batches!r}")
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
        optional = {"passes", "inter_node", "micro_batches", "host_adam"}
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


def _costs_from(data: dict) -> MicroBatchCosts:
    """MicroBatchCosts from its JSON object; ArgumentError naming the field when it is not one."""
    names = {f.name for f in dataclasses.fields(MicroBatchCosts)}
    if set(data) != names:
        raise ArgumentError("micro_batches", f"must have exactly the fields "
                                             f"{', '.join(sorted(names))}, got {data!r}"[:300])
    return MicroBatchCosts(**data)


@dataclass(kw_only=True)
class MicroBatchCosts:
    """The seconds a micro-batch costs beyond its arithmetic, and what a pipeline stage adds, as
    ``calibrate`` measures them on a probe model (``hybridflow.planner.overhead``): the host's
    work per micro-batch (Python, kernel launches, Megatron's schedule), which floors leave out
    and which makes small micro-batches slow, and the point-to-point transfers of pipeline
    parallelism. A pass profile of the run's model (``PassProfile``) holds the host's work in
    its efficiencies; these serve every model that has none, and the pipeline terms every
    model at pp > 1 (a profile is measured at pp = 1)."""

    forward_base_s: float
    """Host seconds of one forward-only micro-batch that do not grow with the layers (the
    embedding, the output layer and loss's launches, the schedule's step)."""
    forward_layer_s: float
    """Host seconds one transformer layer adds to a forward-only micro-batch."""
    train_base_s: float
    """The same for a training micro-batch (forward and backward, the actor's loss function and
    its backward included: the probe trains with it)."""
    train_layer_s: float
    """The same per layer for a training micro-batch."""
    forward_stage_s: float | None
    """Seconds a pipeline stage boundary adds to a forward-only micro-batch beyond its layers'
    host work, at pp = 2 on the probe (the schedule's send and receive calls and their latency;
    its activations are a few KiB); None where the node has one device."""
    train_stage_s: float | None
    """The same for a training micro-batch (activations forward, their gradients back)."""
    p2p: float | None
    """Bytes/s of one point-to-point send between two ranks (what a stage boundary moves of a
    real model's activations); None where the node has one device."""

    def __post_init__(self):
        for name in ("forward_base_s", "forward_layer_s", "train_base_s", "train_layer_s"):
            check_float(name, getattr(self, name), low=0)
        for name in ("forward_stage_s", "train_stage_s"):
            check_float(name, getattr(self, name), low=0, none_ok=True)
        check_float("p2p", self.p2p, low=0, low_open=True, none_ok=True)

    def host(self, kind: str, layers: int) -> float:
        """Host seconds of one micro-batch of ``kind`` ("forward", "train") on a stage of
        ``layers`` layers: the base and the layers' share."""
        return getattr(self, f"{kind}_base_s") + layers * getattr(self, f"{kind}_layer_s")

    def stage(self, kind: str, pp: int, activation_bytes: float) -> float:
        """Seconds pipeline parallelism adds to one micro-batch of ``kind`` on its busiest stage:
        the boundary's fixed seconds and ``activation_bytes`` (one micro-batch's activations)
        at the point-to-point rate, once per boundary the stage has (1 at pp = 2, 2 in the
        middle of a longer pipeline), twice in training (activations forward, gradients
        back: ``train_stage_s`` was measured with both). ConfigError where not measured."""
        fixed = getattr(self, f"{kind}_stage_s")
        if fixed is None or self.p2p is None:
            raise ConfigError(FIELD, f"has no pipeline costs (calibrated on one device), and "
                                     f"this layout has pp={pp}: run `hybridflow calibrate` on a "
                                     "node with two devices or more")
        boundaries = 1 if pp == 2 else 2
        directions = 2 if kind == "train" else 1
        return boundaries * (fixed + directions * activation_bytes / self.p2p)


@dataclass(kw_only=True)
class PassProfile:
    """The measured efficiencies of one model's passes on this machine."""

    shape: dict[str, Any]
    """The model's ``ModelConfig`` fields: the cost model uses a profile for this shape only."""
    dtype: str
    """The engines' dtype it was measured in ("fp32", "bf16")."""
    seq: int
    """Tokens per sequence it was measured at (prompt + response)."""
    micro_batches: list[int]
    """The micro-batch sizes b measured, ascending."""
    backend: str
    """The rollout backend whose ``generate`` was measured."""
    forward: list[float]
    """Per size in ``micro_batches``: the floor seconds of a forward pass over b sequences / the
    measured seconds of one such micro-batch (0 < x, usually < 1)."""
    train: list[float]
    """The same for a training micro-batch's forward + backward."""
    optimizer: float
    """Adam's floor / the optimizer step measured (in files without ``train_fixed_s``: / the
    whole of t(b) - T(b), the training step's fixed cost included)."""
    generate: float
    """The generation floor / the measured ``generate`` call."""
    weight_load: float
    """The weights' bytes at the copy bandwidth / the measured ``load_from_switch`` of the whole
    model (above 1 where the backend takes the tensors without a copy)."""
    tp: int = 1
    """The tensor-parallel size the passes were measured at (generation always at tp = 1)."""
    forward_fixed_s: float = 0.0
    """Seconds of a forward-only pass that do not grow with its micro-batches (module
    docstring), at ``tp``; 0 in files written before it was measured."""
    train_fixed_s: float = 0.0
    """The same for a training step, the optimizer's step left out; 0 in files written before it
    was measured (their ``optimizer`` holds it)."""
    lora: dict[str, Any] | None = None
    """The LoRA adapters the passes trained (``lora_key``: ``actor.lora``'s rank and
    target_modules); None: full fine-tuning."""

    def __post_init__(self):
        if not isinstance(self.shape, dict):
            raise ArgumentError("shape", f"must be a model shape's fields, got {self.shape!r}")
        check_int("seq", self.seq)
        if not isinstance(self.micro_batches, list) or not self.micro_batches:
            raise ArgumentError("micro_batches", f"must be a list of sizes, got "
                                                 f"{self.micro_batches!r}")
        for b in self.micro_batches:
            check_int("micro_batches", b)
        if self.micro_batches != sorted(set(self.micro_batches)):
            raise ArgumentError("micro_batches", f"must ascend without repeats, got "
                                                 f"{self.micro_batches}")
        for name in ("forward", "train"):
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != len(self.micro_batches):
                raise ArgumentError(name, f"must hold one efficiency per micro-batch size "
                                          f"{self.micro_batches}, got {values!r}")
            for v in values:
                check_float(name, v, low=0, low_open=True)
        for name in ("optimizer", "generate", "weight_load"):
            check_float(name, getattr(self, name), low=0, low_open=True)
        check_int("tp", self.tp)
        for name in ("forward_fixed_s", "train_fixed_s"):
            check_float(name, getattr(self, name), low=0)
        if self.lora is not None:
            if not isinstance(self.lora, dict) or set(self.lora) != {"rank", "target_modules"}:
                raise ArgumentError("lora", f"must be null or {{rank, target_modules}}, got "
                                            f"{self.lora!r}")
            from hybridflow.training.lora import LoraConfig  # deferred: it imports torch
            self.lora = lora_key(LoraConfig(**self.lora))

    def efficiency(self, kind: str, micro_batch: float) -> float:
        """``kind``'s (forward or train) efficiency at ``micro_batch`` sequences: linear in
        log2(b) between the measured sizes, the nearest one's outside them."""
        sizes, values = self.micro_batches, getattr(self, kind)
        if micro_batch <= sizes[0]:
            return values[0]
        for (b0, e0), (b1, e1) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
            if micro_batch <= b1:
                w = math.log2(micro_batch / b0) / math.log2(b1 / b0)
                return e0 + w * (e1 - e0)
        return values[-1]

    def matches(self, shape: ModelConfig, dtype: str, lora=None) -> bool:
        """Measured on ``shape`` in ``dtype``, with ``lora``'s adapters (a LoraConfig; None or
        rank 0: full fine-tuning)."""
        return (self.shape == dataclasses.asdict(shape) and self.dtype == dtype
                and self.lora == lora_key(lora))

    def describe(self) -> str:
        def table(kind):
            return ", ".join(f"{b}: {e:.0%}" for b, e in zip(self.micro_batches,
                                                             getattr(self, kind)))
        adapters = ("" if self.lora is None else f", LoRA rank {self.lora['rank']} on "
                    f"{'/'.join(self.lora['target_modules'])}")
        return (f"efficiencies at tp={self.tp}, pp=dp=1{adapters}, {self.seq} tokens per "
                f"sequence, by micro-batch size: forward {table('forward')}; training "
                f"{table('train')}; optimizer "
                f"{self.optimizer:.1%}, generate ({self.backend}) {self.generate:.1%}, weight "
                f"load {self.weight_load:.1%}; fixed seconds a pass: forward "
                f"{self.forward_fixed_s:.3g}, training {self.train_fixed_s:.3g}")


def lora_key(lora) -> dict[str, Any] | None:
    """What of a LoraConfig a profile is kept under: the adapters' rank and targets (their
    FLOPs and their number of matmuls); None for None or rank 0 (full fine-tuning)."""
    if lora is None or not lora.enabled:
        return None
    return {"rank": lora.rank, "target_modules": list(lora.target_modules)}
