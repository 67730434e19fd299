"""The search: every mapping of a run onto its devices that the config contract accepts and the
memory estimate fits, ranked by the cost model's step time.

A mapping is the actor's training layout (tp, pp, dp over the run's devices), its generation
tensor parallelism ``rollout.tp`` and the training micro-batch size; the critics and the reward
and cost models take the actor's layout (every model colocated on every device: DeepSpeed-Chat's
placement, this loop's default). The search over placements, HybridFlow's Algorithm 1, is
``hybridflow.planner.placements``: ``hybridflow plan`` on a declared cluster and
``placement: auto``. The devices are ``cluster.nodes x cluster.gpus_per_node`` when the cluster is
declared, else the actor's world size as configured (on CPU: its processes). A tensor-parallel
group stays inside a node.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from hybridflow.config.sources import model_sources
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.planner.cost import (Prediction, basis_line, check_prices_micro_batches,
                                     predict)
from hybridflow.planner.memory import check_memory_fits, size_to_memory
from hybridflow.planner.rates import Calibration
from hybridflow.training.model import check_model_fits_layout

MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass
class Mapping:
    """One candidate and what the cost model says of it."""

    overrides: dict[str, Any]
    """Config keys -> values that make the run take this mapping (``key=value`` for the CLI)."""
    prediction: Prediction

    def describe(self) -> str:
        o = self.overrides
        mb = o.get("actor.engine.micro_batch_size")
        return (f"actor tp={o['actor.layout.tp']} pp={o['actor.layout.pp']} "
                f"dp={o['actor.layout.dp']}, generation tp={o['rollout.tp']}, "
                + ("the configured token budget" if mb is None else f"micro-batch {mb}"))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def devices(cfg: Any) -> int:
    """The devices the run is mapped onto (see the module docstring)."""
    return cfg.cluster.gpus if cfg.cluster.nodes is not None else cfg.actor.layout.world_size


def candidates(cfg: Any, shape: ModelConfig) -> list[dict[str, Any]]:
    """Every (layout, generation tp, micro-batch) override set over ``devices(cfg)`` whose tp,
    pp and vocabulary split fit the model; the config contract and memory decide the rest."""
    world = devices(cfg)
    per_node = cfg.cluster.gpus_per_node if cfg.cluster.nodes is not None else world
    out = []
    for tp in _divisors(world):
        if per_node % tp or shape.num_kv_heads % tp or shape.num_heads % tp \
                or shape.ffn_hidden_size % tp or shape.vocab_size % tp:
            continue
        for pp in _divisors(world // tp):
            split = pp == cfg.actor.layout.pp and cfg.actor.layout.last_stage_layers is not None
            if shape.num_layers % pp and not split:  # apply keeps the configured split
                continue
            # A role with a token budget has its micro-batches formed by it: no sizes to search
            # where every role has one.
            sized = [r for r in _roles(cfg)
                     if getattr(cfg, r).engine.max_tokens_per_micro_batch is None]
            out += [_overrides(cfg, tp, pp, world // (tp * pp), tg, mb)
                    for tg in _divisors(tp) for mb in (MICRO_BATCHES if sized else (None,))]
    return out


def _roles(cfg: Any) -> tuple[str, ...]:
    """The trained roles a mapping lays out: the actor; the critic too where the algorithm trains
    one, or where reward or cost models share its layout."""
    critic = (cfg.algorithm.spec.critic or cfg.reward_model is not None
              or cfg.cost_model is not None)
    return ("actor", "critic") if critic else ("actor",)


def _overrides(cfg: Any, tp: int, pp: int, dp: int, tg: int, mb: int | None) -> dict[str, Any]:
    """The keys of one mapping; the critics and the reward and cost models take the actor's.
    A role with a token budget (or ``mb`` None) gets no micro-batch key: its micro-batches stay
    as configured."""
    o: dict[str, Any] = {}
    for role in _roles(cfg):
        o |= {f"{role}.layout.tp": tp, f"{role}.layout.pp": pp, f"{role}.layout.dp": dp}
        if role == "actor":
            o["rollout.tp"] = tg
        if mb is not None and getattr(cfg, role).engine.max_tokens_per_micro_batch is None:
            o[f"{role}.engine.micro_batch_size"] = mb
    return o


def apply(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of ``cfg`` with ``overrides`` set and checked by the config contract (raises its
    ConfigError when the combination is refused). A configured ``layout.last_stage_layers`` is
    kept where the mapping keeps the configured pp (it is a split of that pp's stages); other
    pp's are split evenly."""
    c = copy.deepcopy(cfg)
    for role in ("actor", "critic"):
        if f"{role}.layout.tp" in overrides:
            configured = getattr(cfg, role).layout
            sizes = {k: overrides[f"{role}.layout.{k}"] for k in ("tp", "pp", "dp")}
            last = configured.last_stage_layers if sizes["pp"] == configured.pp else None
            getattr(c, role).layout = TrainLayout(**sizes, last_stage_layers=last)
        if f"{role}.engine.micro_batch_size" in overrides:
            getattr(c, role).engine.micro_batch_size = overrides[f"{role}.engine.micro_batch_size"]
    if "rollout.tp" in overrides:
        c.rollout.tp = overrides["rollout.tp"]
    c.__post_init__()
    return c


def search(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration) -> tuple[
        list[Mapping], dict[str, int]]:
    """The mappings that fit, fastest first, and how many candidates each check refused
    ({"config": n, "memory": n})."""
    fits, refused = [], {"config": 0, "memory": 0}
    for overrides in candidates(cfg, shapes["model"]):
        try:
            c = apply(cfg, overrides)
            check_model_fits_layout(shapes["model"], c.actor.layout, c.actor.engine)
        except ConfigError:
            refused["config"] += 1
            continue
        prediction = predict(c, shapes, calib)
        if cfg.cluster.nodes is not None:
            try:
                check_memory_fits(c, prediction.memory)
            except ConfigError:
                refused["memory"] += 1
                continue
        fits.append(Mapping(overrides, prediction))
    fits.sort(key=lambda m: m.prediction.step)
    return fits, refused


def resolve_auto(cfg: Any, shapes: dict[str, ModelConfig]) -> tuple[Any, Mapping | None]:
    """``cfg`` with the keys it leaves to the planner (``layout: auto`` or ``key: auto``) set to
    the fastest mapping that fits, the others as configured, and that mapping; ``(cfg, None)``
    for a manual layout. ConfigError when no mapping fits."""
    free = cfg.planned_keys
    if not free:
        return cfg, None
    calib = load_calibration(cfg)
    check_prices_micro_batches(calib, cfg.cluster.calibration)
    fits, refused = search(cfg, shapes, calib)
    fixed = {k: v for k, v in _configured(cfg).items()
             if k not in free and not k.startswith("critic.")}
    fits = [m for m in fits if all(m.overrides[k] == v for k, v in fixed.items())]
    if not fits:
        kept = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing"
        raise ConfigError("layout" if cfg.layout == "auto" else free[0],
                          f"no mapping onto {devices(cfg)} device(s) with {kept} fits: "
                          f"{refused['config']} refused by the config contract, "
                          f"{refused['memory']} over memory (`hybridflow plan` lists them); "
                          "free more keys, add devices or shrink the batch")
    chosen = apply(cfg, fits[0].overrides)
    chosen.layout, chosen.auto = "manual", []
    return chosen, fits[0]


def plan_layout(cfg: Any, log=print) -> Any:
    """``resolve_auto`` for a run about to start (the trainer, ``hybridflow check``): the model
    shapes looked up, the choice logged in one line; with ``placement: auto`` the placement
    search's fastest placement (``placements.choose_placement``); a micro-batch key alone
    without rates to rank it (``RLConfig.sized_to_memory``) the largest that fits the GPU
    (``memory.size_to_memory``)."""
    if cfg.placement.preset == "auto":
        from hybridflow.planner.placements import choose_placement
        return choose_placement(cfg, model_sources(cfg)[1], load_calibration(cfg), log)
    if not cfg.planned_keys:
        return cfg
    if cfg.sized_to_memory:  # a micro-batch key alone: the largest that fits the GPU
        chosen, line = size_to_memory(cfg, model_sources(cfg)[1])
        log(line)
        return chosen
    chosen, mapping = resolve_auto(cfg, model_sources(cfg)[1])
    log(f"planner ({', '.join(cfg.planned_keys)}): {mapping.describe()}, predicted step "
        f"{mapping.prediction.step:.3g} s; as overrides: "
        + " ".join(f"{k}={v}" for k, v in mapping.overrides.items()))
    return chosen


def load_calibration(cfg: Any) -> Calibration:
    """The calibration ``cluster.calibration`` names; ConfigError when there is none."""
    if cfg.cluster.calibration is None:
        raise ConfigError("cluster.calibration", "the planner needs the rates of the devices: "
                          "run `hybridflow calibrate --out calibration.json` on one of them and "
                          "set cluster.calibration=calibration.json")
    return Calibration.from_json(cfg.cluster.calibration)


def run_prediction(cfg: Any, shapes: dict[str, ModelConfig]) -> Prediction | None:
    """The cost model's prediction of one iteration of ``cfg`` where ``cluster.calibration`` is
    set (``hybridflow check`` prints it, the trainer logs it beside each step's timings)."""
    return None if cfg.cluster.calibration is None else predict(cfg, shapes,
                                                                load_calibration(cfg))


def plan_lines(cfg: Any, top: int = 5) -> list[str]:
    """What ``hybridflow plan`` prints: on a declared cluster the placement search's table
    (``placements.placement_lines``); else the fastest colocated mappings over the configured
    world size, each phase's predicted seconds and the peak memory per device, then where the
    configured mapping stands."""
    calib = load_calibration(cfg)
    _, shapes = model_sources(cfg)
    if cfg.cluster.nodes is not None:  # the devices are known: every placement
        from hybridflow.planner.placements import placement_lines
        return placement_lines(cfg, shapes, calib, top)
    fits, refused = search(cfg, shapes, calib)
    world = devices(cfg)
    where = (f"{cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node}, "
             f"{cfg.cluster.gpu_memory_gb:g} GiB each" if cfg.cluster.nodes is not None
             else "the configured actor world size; no memory limit without cluster.nodes")
    lines = [f"{cfg.algorithm.name} on {world} device(s) ({where}); rates of "
             f"{calib.device} from {cfg.cluster.calibration} ({calib.measured_at})",
             f"{len(fits)} mapping(s) fit; refused: {refused['config']} by the config "
             f"contract, {refused['memory']} over memory"]
    configured = Mapping(_configured(cfg), predict(cfg, shapes, calib))
    for rank, m in enumerate(fits[:top], 1):
        lines.append(_row(f"{rank}.", m))
    mine = next((k for k, m in enumerate(fits, 1) if m.overrides == configured.overrides), None)
    lines.append(_row("configured" + (f" (rank {mine})" if mine else " (not among them)"),
                      configured))
    if fits:
        lines.append("the fastest: " + " ".join(f"{k}={v}" for k, v in fits[0].overrides.items()))
    lines.append(basis_line(configured.prediction, cfg.cluster.calibration))
    return lines



def _configured(cfg: Any) -> dict[str, Any]:
    """The configured mapping's keys."""
    a, c = cfg.actor, cfg.critic
    o = _overrides(cfg, a.layout.tp, a.layout.pp, a.layout.dp, cfg.rollout.tp,
                   a.engine.micro_batch_size)
    if "critic.layout.tp" in o:  # the critic as configured, which may differ from the actor
        o |= {"critic.layout.tp": c.layout.tp, "critic.layout.pp": c.layout.pp,
              "critic.layout.dp": c.layout.dp}
        if "critic.engine.micro_batch_size" in o:
            o["critic.engine.micro_batch_size"] = c.engine.micro_batch_size
    return o


def _row(label: str, m: Mapping) -> str:
    p = m.prediction
    phases = ", ".join(f"{k} {v:.3g}" for k, v in p.phases.items())
    return (f"{label} {m.describe()}: step {p.step:.3g} s ({phases}); peak "
            f"{p.peak_bytes / 2**30:.2f} GiB per device")
