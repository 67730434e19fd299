"""The placement search (HybridFlow, arXiv 2409.19256, section 6, Algorithm 1): every way of
placing a run's models on the cluster's devices that the memory estimate fits, priced by the
cost model, fastest first.

A placement is a partition of the run's models (``placement.run_models``) into colocated sets,
each set a pool of its own (its models share its devices and take turns), the devices each set
gets, each model's training layout on them and the actor's generation tp. Enumerated:

* partitions: every set partition of the models (2 models: 2; 4: 15; 5: 52; 6: 203). With
  ``actor.lora`` the reference is the actor's base: only partitions that keep them together;
* devices: a set takes n ranks, 1 to a node's less one (part of one node; the parts must pack
  into whole nodes beside the other sets: first fit, largest first) or whole nodes, the sets'
  ranks adding up to the cluster's; counts where no layout of the set fits memory are skipped
  (from the smallest count that fits to what the other sets leave);
* layouts: for each model every (tp, pp, dp) over its set's n ranks with tp dividing the ranks
  a node holds of the pool and the model's heads, kv heads, FFN and vocabulary, pp its layers
  (even stages), and the step's samples splitting over dp as the config contract asks
  (micro-batch sizes as configured); for the actor each generation tp dividing tp that the
  rollout backend runs;
* a set's layouts: the combination with the least total time of its models' calls whose memory
  fits ``cluster.gpu_memory_gb`` (``memory.pool_memory``), tried from the fastest combination
  up, at most ``SET_TRIES`` of them.

Price: each model's calls are ``cost.model_terms`` at its layout, its collectives spanning its
pool's nodes; within a set the calls add up; a placement's step is ``cost.staged_step`` over its
sets (the stages in turn, each as long as its busiest set). ``ref.offload``'s stream is in the
reference's calls; ``hybrid_engine.offload_optimizer``'s host copies are left out of the
ranking; the rows printed are ``cost.predict`` of the config each placement makes, which counts
them.
"""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.specs import TRAINED_CRITICS
from hybridflow.config.loader import make_config
from hybridflow.config.placement import (LAYOUT_KEYS, ModelPlace, Placement, PlacementConfig,
                                         Pool, run_models)
from hybridflow.config.sources import critic_shape
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.planner.cost import (Fabric, Prediction, at_layout, basis_line,
                                     check_prices_micro_batches, model_terms, predict,
                                     stage_times, staged_step)
from hybridflow.planner.memory import GIB, pool_memory
from hybridflow.planner.rates import Calibration

SET_TRIES = 64
"""Layout combinations of one set tried against its memory, fastest first, before the set is
taken not to fit at that device count."""


@dataclass(frozen=True)
class SetChoice:
    """One set of colocated models on its devices, at the layouts the search chose."""

    models: tuple[str, ...]
    nodes: int
    per_node: int
    """Ranks on each of its nodes."""
    layouts: dict[str, TrainLayout]
    gen_tp: int | None
    """The actor's generation tp, where the actor is in the set."""
    lane: dict[str, float]
    """Phase -> seconds of the set's calls."""
    peak: int
    """Bytes on one of its GPUs in its fullest phase."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def name(self) -> str:
        """Its pool's name: its first model."""
        return self.models[0]

    def describe(self) -> str:
        lays = ", ".join(f"{m} {_short(self.layouts[m])}"
                         + (f" gen tp={self.gen_tp}" if m == "actor" else "")
                         for m in self.models)
        return (f"{'+'.join(self.models)} on {self.ranks} ({self.nodes}x{self.per_node}): "
                f"{lays}; peak {self.peak / GIB:.1f} GiB")


@dataclass
class PlacementPlan:
    """One placement and its predicted step."""

    sets: tuple[SetChoice, ...]
    step: float = field(init=False)

    def __post_init__(self):
        self.step = staged_step(self.lanes)

    @property
    def lanes(self) -> dict[str, dict[str, float]]:
        return {s.name: s.lane for s in self.sets}

    @property
    def kind(self) -> str:
        """colocate (one set), split (the actor and reference apart from the rest), standalone
        (a set per model), or the sets."""
        if len(self.sets) == 1:
            return "colocate"
        if all(len(s.models) == 1 for s in self.sets):
            return "standalone"
        if len(self.sets) == 2 and {"actor", "reference"} in [set(s.models) for s in self.sets]:
            return "split"
        return " | ".join("+".join(s.models) for s in self.sets)

    def overrides(self, cfg: Any) -> dict[str, Any]:
        """Config keys -> values that make ``cfg`` run this placement."""
        o: dict[str, Any] = {"placement.preset": None}
        for s in self.sets:
            o[f"placement.pools.{s.name}.nodes"] = s.nodes
            o[f"placement.pools.{s.name}.devices_per_node"] = s.per_node
        for s in self.sets:
            for m in s.models:
                o[f"placement.models.{m}"] = s.name
        for s in self.sets:
            for m, lay in s.layouts.items():
                key = LAYOUT_KEYS.get(m, f"placement.layouts.{m}")
                o |= {f"{key}.tp": lay.tp, f"{key}.pp": lay.pp, f"{key}.dp": lay.dp}
                if m in LAYOUT_KEYS and getattr(cfg, m).layout.last_stage_layers is not None:
                    o[f"{key}.last_stage_layers"] = None
            if s.gen_tp is not None:
                o["rollout.tp"] = s.gen_tp
        return o


def partitions(models: list[str] | tuple[str, ...]) -> list[tuple[tuple[str, ...], ...]]:
    """Every partition of ``models`` into non-empty sets, each set in ``models``' order, the sets
    by their first model's place."""
    if not models:
        return [()]
    first, rest = models[0], models[1:]
    out = []
    for p in partitions(rest):
        out.append(((first,),) + p)
        for i, s in enumerate(p):
            out.append(((first,) + s,) + p[:i] + p[i + 1:])
    order = {m: k for k, m in enumerate(models)}
    return [tuple(sorted(p, key=lambda s: order[s[0]])) for p in out]


def device_counts(nodes: int, per_node: int) -> list[int]:
    """The ranks a set may take: part of one node (1 to ``per_node`` - 1) or whole nodes."""
    return list(range(1, per_node)) + [per_node * k for k in range(1, nodes + 1)]


def packs(counts: list[int], nodes: int, per_node: int) -> bool:
    """Whether sets of ``counts`` ranks fill ``nodes`` nodes of ``per_node``: the whole-node sets
    on nodes of their own, the parts of nodes packed first fit, largest first, into the rest."""
    free = nodes - sum(c // per_node for c in counts if c % per_node == 0)
    bins: list[int] = []
    for c in sorted((c for c in counts if c % per_node), reverse=True):
        for i, room in enumerate(bins):
            if room >= c:
                bins[i] -= c
                break
        else:
            bins.append(per_node - c)
    return len(bins) <= free and sum(counts) == nodes * per_node


def allocations(sets: int, nodes: int, per_node: int, allowed=None) -> list[tuple[int, ...]]:
    """Every tuple of ranks, one per set, from ``device_counts`` (``allowed[i]``: set i's, where
    given) that ``packs`` on the cluster."""
    total = nodes * per_node
    options = [allowed[i] if allowed else device_counts(nodes, per_node) for i in range(sets)]
    out: list[tuple[int, ...]] = []

    def walk(i: int, left: int, chosen: tuple[int, ...]) -> None:
        if i == sets - 1:
            if left in options[i] and packs([*chosen, left], nodes, per_node):
                out.append((*chosen, left))
            return
        for c in options[i]:
            if c < left:
                walk(i + 1, left - c, (*chosen, c))
    walk(0, total, ())
    return out


class Search:
    """The search over one config (module docstring); caches each model's price at a layout and
    each set's choice at a device count."""

    def __init__(self, cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration):
        c = cfg.cluster
        if c.nodes is None or not cfg.ray.gpus_per_worker or \
                c.gpus_per_node % cfg.ray.gpus_per_worker:
            raise ConfigError("cluster.nodes", "the placement search maps the models onto the "
                              "cluster's devices: set cluster.nodes and cluster.gpus_per_node "
                              "(and ray.gpus_per_worker dividing gpus_per_node)")
        self.cfg, self.shapes, self.calib = cfg, shapes, calib
        self.nodes, self.per_node = c.nodes, int(c.gpus_per_node // cfg.ray.gpus_per_worker)
        self.limit = c.gpu_memory_gb * GIB
        self.models = run_models(cfg)
        self.samples = cfg.train_batch_size * cfg.rollout.sampling.n
        self._prices: dict[tuple, dict[str, float]] = {}
        self._memory: dict[tuple, int] = {}
        self._sets: dict[tuple, SetChoice | None] = {}

    # ---- one model ------------------------------------------------------------------------
    def shape(self, model: str) -> ModelConfig:
        if model in ("actor", "reference"):
            return self.shapes["model"]
        return critic_shape(self.shapes) if model in TRAINED_CRITICS else self.shapes[model]

    def layouts(self, model: str, ranks: int, per_node: int) -> list[TrainLayout]:
        """The layouts of ``model`` over ``ranks`` whose TP groups stay in a node of
        ``per_node`` ranks and that the model and the batch split into (module docstring)."""
        shape, part = self.shape(model), self._part(model)
        eng, trains = part.engine, model in ("actor",) + TRAINED_CRITICS
        budget = eng.max_tokens_per_micro_batch is not None
        forward = 1 if budget else eng.forward_micro_batch_size or eng.micro_batch_size
        out = []
        for tp in _divisors(min(ranks, per_node)):
            if per_node % tp or any(n % tp for n in (shape.num_heads, shape.num_kv_heads,
                                                     shape.ffn_hidden_size, shape.vocab_size)):
                continue
            if eng.sequence_parallel and tp == 1:
                continue
            for pp in _divisors(ranks // tp):
                dp = ranks // (tp * pp)
                if ranks % (tp * pp) or shape.num_layers % pp or self.samples % (dp * forward):
                    continue
                if trains and self.samples % (dp * part.mini_batches
                                              * (1 if budget else eng.micro_batch_size)):
                    continue
                out.append(TrainLayout(tp=tp, pp=pp, dp=dp))
        return out

    def _part(self, model: str):
        return self.cfg.actor if model in ("actor", "reference") else self.cfg.critic

    def options(self, model: str, ranks: int, nodes: int, per_node: int
                ) -> list[tuple[float, TrainLayout, int | None]]:
        """(seconds of its calls, layout, generation tp) of ``model`` on a set of ``nodes`` x
        ``per_node`` ranks, fastest first; those whose memory alone does not fit left out."""
        out = []
        for lay in self.layouts(model, ranks, per_node):
            for tg in (self.generation_tps(lay) if model == "actor" else (None,)):
                if tg is not None and self.cfg.train_batch_size % GenLayout(train=lay,
                                                                            tp=tg).replicas:
                    continue
                if self.memory((model,), {model: lay}, tg, nodes, per_node) > self.limit:
                    continue
                out.append((sum(self.price(model, lay, tg, per_node).values()), lay, tg))
        return sorted(out, key=lambda o: o[0])

    def generation_tps(self, lay: TrainLayout) -> list[int]:
        """The actor's generation tps at ``lay``: divisors of its tp, up to what the rollout
        backend runs (``max_tp``)."""
        most = self.cfg.rollout.backend_class.max_tp
        return [tg for tg in _divisors(lay.tp) if most is None or tg <= most]

    def price(self, model: str, lay: TrainLayout, tg: int | None, per_node: int
              ) -> dict[str, float]:
        """Phase -> seconds of ``model``'s calls at ``lay`` (and generation tp ``tg``) on a pool
        of ``per_node`` ranks a node (``cost.model_terms``)."""
        key = (model, lay, tg, per_node)
        if key not in self._prices:
            cfg = self._placed({model: lay}, tg)
            terms = model_terms(cfg, self.shapes, self.calib, model,
                                Fabric.of(cfg, self.calib, per_node))
            self._prices[key] = {p: sum(t.values()) for p, t in terms.items()}
        return self._prices[key]

    def memory(self, models: tuple[str, ...], layouts: dict[str, TrainLayout], tg: int | None,
               nodes: int, per_node: int) -> int:
        """Bytes on one GPU of a set of ``models`` at ``layouts`` in its fullest phase."""
        key = (models, tuple(layouts[m] for m in models), tg, nodes, per_node)
        if key not in self._memory:
            cfg = self._placed(layouts, tg)
            pool = Pool("set", nodes, per_node, models)
            others = TrainLayout()
            places = {m: ModelPlace(m, "set" if m in models else "elsewhere",
                                    layouts.get(m, others), "")
                      for m in self.models}
            placement = Placement((pool,), places)
            self._memory[key] = pool_memory(cfg, self.shapes, placement, pool).peak[1]
        return self._memory[key]

    def _placed(self, layouts: dict[str, TrainLayout], tg: int | None) -> Any:
        """A shallow, unchecked copy of the config with ``layouts`` and generation tp ``tg``: what
        the cost model and the memory estimate read."""
        c = copy.copy(self.cfg)
        for m in LAYOUT_KEYS:
            if m in layouts:
                setattr(c, m, at_layout(getattr(self.cfg, m), layouts[m]))
        c.placement = copy.copy(self.cfg.placement)
        c.placement.layouts = {m: lay for m, lay in layouts.items() if m not in LAYOUT_KEYS}
        if tg is not None:
            c.rollout = copy.copy(self.cfg.rollout)
            c.rollout.tp = tg
        return c

    # ---- one set --------------------------------------------------------------------------
    def best_set(self, models: tuple[str, ...], ranks: int) -> SetChoice | None:
        """The fastest layouts of ``models`` on ``ranks`` whose memory fits; None where none
        does."""
        key = (models, ranks)
        if key in self._sets:
            return self._sets[key]
        nodes, per_node = (ranks // self.per_node, self.per_node) if ranks >= self.per_node \
            else (1, ranks)
        tied = self.cfg.actor.lora.enabled and "reference" in models  # the actor's base
        free = [m for m in models if not (tied and m == "reference")]
        opts = [self.options(m, ranks, nodes, per_node) for m in free]
        choice = None
        if all(opts):
            heap = [(sum(o[0][0] for o in opts), (0,) * len(opts))]
            seen, tries = set(heap[0][1]), 0
            while heap and tries < SET_TRIES:
                _, idx = heapq.heappop(heap)
                tries += 1
                picked = {m: opts[i][k] for i, (m, k) in enumerate(zip(free, idx))}
                layouts = {m: o[1] for m, o in picked.items()}
                tg = picked["actor"][2] if "actor" in picked else None
                if tied:
                    layouts["reference"] = layouts["actor"]
                peak = self.memory(models, layouts, tg, nodes, per_node)
                if peak <= self.limit:
                    lane: dict[str, float] = {}
                    for m in models:
                        for p, s in self.price(m, layouts[m], tg if m == "actor" else None,
                                               per_node).items():
                            lane[p] = lane.get(p, 0.0) + s
                    choice = SetChoice(models, nodes, per_node, layouts, tg, lane, peak)
                    break
                for i in range(len(opts)):
                    nxt = idx[:i] + (idx[i] + 1,) + idx[i + 1:]
                    if nxt[i] < len(opts[i]) and nxt not in seen:
                        seen.add(nxt)
                        heapq.heappush(heap, (sum(opts[j][nxt[j]][0]
                                                  for j in range(len(opts))), nxt))
        self._sets[key] = choice
        return choice

    # ---- placements ----------------------------------------------------------------------
    def run(self, top: int = 5) -> tuple[list[PlacementPlan], int]:
        """The ``top`` fastest placements, and how many placements were priced."""
        counts = device_counts(self.nodes, self.per_node)
        best: list[tuple[float, int, PlacementPlan]] = []
        priced = 0
        for part in partitions(self.models):
            if self.cfg.actor.lora.enabled and not any({"actor", "reference"} <= set(s)
                                                       for s in part):
                continue
            allowed = [[c for c in counts if self.best_set(s, c) is not None] for s in part]
            for alloc in allocations(len(part), self.nodes, self.per_node, allowed):
                sets = [self.best_set(s, c) for s, c in zip(part, alloc)]
                step = sum(stage_times({s.name: s.lane for s in sets}).values())
                priced += 1
                entry = (-step, priced, sets)
                if len(best) < top:
                    heapq.heappush(best, entry)
                elif -step > best[0][0]:
                    heapq.heapreplace(best, entry)
        plans = [PlacementPlan(tuple(sets)) for _, _, sets in sorted(best, key=lambda e: -e[0])]
        return plans, priced


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _short(layout: TrainLayout) -> str:
    return f"tp={layout.tp} pp={layout.pp} dp={layout.dp}"


@dataclass
class Ranked:
    """A placement the config contract accepts: the config it makes and its prediction."""

    plan: PlacementPlan
    config: Any
    prediction: Prediction


def ranked(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration, top: int = 5
           ) -> tuple[list[Ranked], int, int]:
    """The ``top`` fastest placements whose config passes every check of the contract, each
    predicted as ``hybridflow check`` predicts it; how many placements were priced and how many
    of the fastest the contract refused."""
    from hybridflow.config import RLConfig  # deferred: the config package imports the planner
    plans, priced = Search(cfg, shapes, calib).run(top=3 * top + 5)
    out, refused = [], 0
    bare = copy.copy(cfg)  # the placement written anew: none of the configured pools stays
    bare.placement = PlacementConfig()
    for plan in plans:
        try:
            chosen = make_config(RLConfig, bare, plan.overrides(cfg))
        except ConfigError:
            refused += 1
            continue
        out.append(Ranked(plan, chosen, predict(chosen, shapes, calib)))
    out.sort(key=lambda r: r.prediction.step)
    return out[:top], priced, refused


def choose_placement(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration, log=print
                     ) -> Any:
    """``cfg`` with ``placement: auto`` resolved: the fastest placement's config (its pools,
    models and layouts written out), the choice logged in one line. ConfigError where none
    fits."""
    check_prices_micro_batches(calib, cfg.cluster.calibration)
    best, priced, refused = ranked(cfg, shapes, calib, top=1)
    if not best:
        raise ConfigError("placement", f"auto: no placement of {', '.join(run_models(cfg))} on "
                          f"{cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} fits "
                          f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g} ({priced} "
                          f"priced, {refused} refused by the config contract); add nodes or "
                          "shrink the batch")
    r = best[0]
    log(f"planner (placement: auto): {r.plan.kind}, predicted step {r.prediction.step:.3g} s: "
        + "; ".join(s.describe() for s in r.plan.sets) + "; as overrides: "
        + " ".join(f"{k}={'null' if v is None else v}" for k, v in r.plan.overrides(cfg).items()))
    return r.config


def placement_lines(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration,
                    top: int = 5) -> list[str]:
    """``hybridflow plan``'s table on a declared cluster: the ``top`` fastest placements, each
    with its step, its stages, and per set its devices, layouts and peak memory per GPU; then
    the configured placement's prediction (none for ``placement: auto``)."""
    best, priced, refused = ranked(cfg, shapes, calib, top)
    c = cfg.cluster
    lines = [f"{cfg.algorithm.name} with {', '.join(run_models(cfg))} on {c.nodes} node(s) x "
             f"{c.gpus_per_node} ({c.gpu_memory_gb:g} GiB each); rates of {calib.device} from "
             f"{c.calibration} ({calib.measured_at})",
             f"{priced} placement(s) priced (partitions x devices, each set at its fastest "
             f"layouts that fit); {refused} of the fastest refused by the config contract"]
    for rank, r in enumerate(best, 1):
        stages = ", ".join(f"{k} {v:.3g}" for k, v in stage_times(r.prediction.lanes).items())
        lines.append(f"{rank}. {r.plan.kind}: step {r.prediction.step:.3g} s ({stages}); peak "
                     f"{r.prediction.peak_bytes / GIB:.1f} GiB per GPU")
        lines += [f"     {s.describe()}" for s in r.plan.sets]
    if not best:
        lines.append(f"no placement fits cluster.gpu_memory_gb={c.gpu_memory_gb:g}: add nodes "
                     "or shrink the batch")
    if cfg.placement.preset != "auto":
        try:
            mine = predict(cfg, shapes, calib)
            where = next((k for k, r in enumerate(best, 1)
                          if r.prediction.step >= mine.step - 1e-9 * mine.step), None)
            lines.append(f"configured: step {mine.step:.3g} s, peak "
                         f"{mine.peak_bytes / GIB:.1f} GiB per GPU"
                         + (f" (rank {where} or after)" if where else " (after these)"))
        except ConfigError as e:
            lines.append(f"configured: not predicted ({e})")
    if best:
        lines.append("the fastest: " + " ".join(
            f"{k}={'null' if v is None else v}" for k, v in best[0].plan.overrides(cfg).items()))
    if best:
        lines.append(basis_line(best[0].prediction, c.calibration))
    return lines
