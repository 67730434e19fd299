"""The cost model: seconds of each phase of one RL iteration, from a config, its models' shapes and
the rates ``hybridflow calibrate`` measured. Pure arithmetic, no process, no tensor; the memory
side is ``hybridflow.planner.memory``'s estimate.

Every phase runs after the previous one (the single controller drives them in turn), so the step
is their sum. Per phase, with N a model's parameters in matmuls (all but an untied input
embedding), T = samples x (prompt + response) tokens (the engines compute every position of the
padded batch), L layers, h hidden, s = prompt + response, b the dtype's bytes, R the matmul rate
of that dtype, B the device copy bandwidth, G(n) the all-gather rate in a group of n:

* ``reshard``: the bytes the 3D-HybridEngine's plan makes the busiest rank receive (its own
  ``plan_reshard``, the paper's Table 2 volume for evenly split models) / G(micro-DP group size);
* ``weight_load``: the rollout backend taking the switch's tensors, the rank's generation weights
  ``N_all b / tg`` at B;
* ``generate``: per replica (the samples split over ``GenLayout.replicas``), the prefill
  ``2 N prompt share / tg`` FLOPs at R, then ``response`` decode steps, each the slower of its
  FLOPs (``2 N share / tg``) at R and its bytes at B: the weight shard ``N b / tg`` and the KV cache
  so far, ``2 L (kv_heads / tg) head_dim b`` per token;
* ``back_to_train``: the grad buffers given back zeroed, 4 bytes per trained parameter of the
  rank written at B;
* forward-only passes (old and reference log-probs, values and cost values, reward and cost
  scores): per sequence ``2 N_stage s`` plus attention's ``4 L_stage h s^2`` on the busiest
  pipeline stage (``L_stage``: its layers, ``L / p`` or as ``layout.last_stage_layers`` splits
  them; ``N_stage``: its parameters in matmuls, the output layer's on the last; an LM head's
  output layer, ``h V``, over r = min(s, response + 1) positions only, ``2 h V r``: the engine
  computes it from the column before the first response token, ``TrainEngine``), over the data-
  and tensor-parallel ranks at R, plus the micro-batch costs below (``host``, ``pipeline``),
  plus the pipeline bubble ``bubble``: under 1F1B the busiest stage runs m + p - 1 micro-batch
  slots for its m micro-batches (m per data-parallel rank), so ``(p - 1) / m`` of its compute,
  host and pipeline seconds are added (the bubble's share of the pass, (p - 1) / (m + p - 1)),
  plus the TP all-reduces of the activations, ``2 L`` of ``tokens h b`` per pass and rank at
  G(t);
* updates (actor, the critics): three times the forward's FLOPs per epoch (the backward is
  twice the forward) with the bubble of the training micro-batches, the TP all-reduces twice
  (forward and backward); with ``engine.recompute`` the transformer layers' forward once more
  (``recompute_flops``: four forwards of the layers, the output layer's three), their TP
  all-reduces a third time, and per micro-batch their weights read once more and a forward's
  host work of their layers (``host``, ``weights`` below), a pass profile's training efficiency
  dividing them as it divides the rest; the data-parallel gradient all-reduce (``2 (d-1)/d`` of
  the fp32 grads per optimizer step, at G(d) / 2, an all-reduce moving twice an all-gather's
  bytes) and Adam's step (28 bytes read and written per trained parameter at B). Safe-RLHF's
  cost critic is the critic's twin (its shape, layout and engine): its phases ``cost_values``
  and ``update_cost_critic`` cost what ``values`` and ``update_critic`` do.

Micro-batches are of the configured sizes, or with ``engine.max_tokens_per_micro_batch`` = T of
``T // s`` sequences (``micro_batch_rows``): the model counts every sequence at its full length s,
so it takes the budget's fewest sequences a micro-batch and no padding either way (a real batch's
shorter sequences pack more rows into a budget, and the padded path computes the batch's own
width). Padding is priced at the maximum: fixed-size micro-batches run at the width of the
step's whole batch (``rollout_batch``: the longest prompt, left-padded, then the longest
response), whatever their size, so s = ``max_prompt_tokens + max_tokens`` bounds it and the
micro-batch size does not change it. The planner keeps a configured budget and does not search
that role's micro-batch sizes.

Micro-batch costs (``calib.micro_batches``, ``rates.MicroBatchCosts``, measured by ``hybridflow
calibrate`` on a probe model, ``hybridflow.planner.overhead``): per micro-batch of a pass

* ``host``: the host's work (Python, launches, Megatron's schedule) on the busiest stage,
  ``base + L_stage x per layer`` seconds of its kind (forward-only or training), m of them;
  left out where a pass profile prices the model (its efficiencies hold it);
* ``weights``: the busiest rank's weights streamed from memory, m times, at B
  (``weight_bytes_a_micro_batch``: ``N_stage b / t`` in a forward; in training twice that and
  the fp32 grad buffer's 8 bytes a trained parameter): a micro-batch's GEMMs are too small to
  hide them; left out beside a pass profile, as ``host``;
* ``pipeline`` (p > 1): what the busiest stage's boundaries add, each the boundary's measured
  seconds plus a micro-batch's activations ``rows s h b`` at the point-to-point rate (both
  ways in training), m of them: 1 boundary at p = 2, 2 in a longer pipeline's middle.

Without them and without a pass profile the seconds are floors alone, which tie every
micro-batch size at p = 1 and put the smallest first at p > 1 (its bubble is the least):
``placement: auto`` and ``auto`` keys refuse to choose from such a file
(``check_prices_micro_batches``); ``hybridflow plan`` ranks and says so.

Alone these are floors: no kernel reaches R or B, and the host works per micro-batch. With a pass
profile of the model in the calibration (``hybridflow.planner.profile``, measured by
``hybridflow calibrate --config``), the compute term (and so the bubble's share of it) is
divided by the forward's or the training step's measured efficiency at the pass's micro-batch
size (the host's work per micro-batch included), and the optimizer, ``generate`` and
``weight_load`` by theirs. A
profile measured at the layout's tp holds what a TP rank adds per micro-batch (its all-reduces
and the waits for its peers): it replaces the TP all-reduce term. A profile's seconds a pass
costs however many micro-batches it has (``forward_fixed_s``, ``train_fixed_s``) are added once
per pass (``fixed``): once per forward-only phase, once per optimizer step of an update. From a
profile at tp = 1 serving another tp they are a lower bound (every rank does that host work;
at tp > 1 the TP ranks' collectives and waits outside the micro-batches come on top, which one
process does not see: ``calibrate --config`` profiles at the config's tp). Not
modelled: the controller's own work between phases and the switch's packing of its buckets
(docs/planner.md has the measured gaps).
``Prediction`` keeps each phase apart so that the trainer can log them beside what it measures.

LoRA (``actor.lora``, ``hybridflow.training.lora``), with A the adapters' parameters, W_a the
adapted base weights' (``lora_param_counts``) and r the rank, both spread evenly over t p as the
memory estimate spreads them (the adapters' TP-replicated halves, A of a column-parallel layer
and B of a row-parallel one, count as split: each is r rows or columns beside a whole weight):

* ``update_actor``: the frozen base computes no weight gradient, so its matmuls cost the forward
  and the input gradients, twice the forward's ``2 N_stage s`` instead of three times; attention
  has no weights (its backward, input gradients alone, is twice its forward), so it stays at
  three times ``4 (L / p) h s^2``; the adapters add ``6 (A / p) s`` (forward, input and weight
  gradients of their own matmuls). A pass profile measured with the same adapters
  (``calibrate --config`` of the LoRA config) divides it by its own training efficiency. Without
  one, full fine-tuning's training efficiency divides it, not the forward's: a LoRA micro-batch
  is a training micro-batch of the same model (autograd graph through every layer, loss,
  backward schedule, host work per micro-batch), which the forward-only pass under ``no_grad``
  does not measure, and the weight-gradient GEMMs it drops have the shapes of the input-gradient
  GEMMs it keeps, so they run at about the same efficiency. That is optimistic where a
  micro-batch is launch-bound (the host's work, inside the efficiency, shrinks with the floor
  here: -34% for 7B on one H200, docs/planner.md) and for the adapters' rank-r matmuls. The
  data-parallel all-reduce, Adam and ``back_to_train``'s zeroed grad buffers are the adapters'
  alone (A trained parameters);
* the old log-probs are the actor's forward with its adapters on, ``2 (A / p) s`` more per
  sequence; the reference is the same actor with them off (``Adapters.disabled``): the base
  model's forward, no model of its own;
* ``reshard`` adds ``merge``: each rank merges its adapted shards, ``W + scaling B A`` in fp32
  (``merge_adapters``), ``2 r W_a / (t p)`` FLOPs at the fp32 matmul rate (a column-parallel
  shard takes its rows of B, a row-parallel one its columns of A: the product is 1/t of the
  whole's) plus ``(24 + 2 b)`` bytes per element of those shards at B (``MERGE_BYTES``);
* ``back_to_train`` with ``hybrid_engine.lora_merge: in_place`` adds ``restore_base``: the
  adapted base shards written back from their host copy, ``W_a b / (t p)`` bytes at the
  calibration's ``host_to_device`` rate (on CPU, where it is null and the copy is one of host
  memory, at B). The host copy itself is taken once, at the first switch, and is not counted.

Offload (``ref.offload``, ``hybrid_engine.offload_optimizer``) moves bytes between the GPU and
host memory at the calibration's ``host_to_device`` rate (on CPU, at B). ``ref_logprobs`` adds
``host_stream``: the reference streams its weights from host memory unit by unit in each forward
micro-batch (``training/streaming.py``), so a pass copies the busiest rank's weights ``W b /
(t p)`` once per micro-batch of a data-parallel rank, m of them, and sends nothing back (the
host copy is the truth). The code overlaps each unit's copy with the previous unit's kernels;
how much that hides is not measured yet, so the copy is priced in full on top of the pass (an
upper bound). ``reshard`` adds ``optimizer_out`` and ``back_to_train`` ``optimizer_in``, the
actor's optimizer state (the memory estimate's bytes) sent to host memory for generation and
brought back.

The host optimizer (``engine.optim.offload``) prices each optimizer step's ``optimizer`` as the
trained parameters over the calibration's ``host_adam`` rate plus their fp32 main weights' copy
up at ``host_to_device``; with m > 1 micro-batches a step, the host's m - 1 adds of fp32 gradients
and its norm of their sum, at that rate scaled by their bytes against Adam's (``HOST_ADD_SHARE``,
``HOST_NORM_SHARE``), as if nothing hid them (the host adds while the GPU computes the next
micro-batch: an upper bound). The gradients' copies down run beside the backward and are not
priced.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.specs import TRAINED_CRITICS
from hybridflow.config.placement import Placement, model_layout, resolve_placement
from hybridflow.config.sources import critic_shape
from hybridflow.errors import ConfigError
from hybridflow.hybrid_engine.switch import generation_metas, switch_recv_bytes
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import (llama_param_metas, num_layers_of, owner_stage,
                                      stage_layer_counts)
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.planner.memory import (DTYPE_BYTES, MemoryEstimate, busiest_rank_split,
                                      busiest_stage_share, estimate_memory, logit_columns,
                                      param_count, reference_weight_bytes)
from hybridflow.planner.rates import Calibration
from hybridflow.training.lora import lora_param_counts

ADAM_BYTES = 28
HOST_ADD_SHARE = 12 / ADAM_BYTES
"""An fp32 add of a parameter's gradients on the host (8 bytes read, 4 written) against fused
Adam's step of it (``ADAM_BYTES``): 0.62 s against 1.44 s over 6.7B on the H100 machine's 16
cores (2026-12-07), 0.43 both ways."""
HOST_NORM_SHARE = 4 / ADAM_BYTES
"""The host's norm of a parameter's fp32 gradients (``torch.dot``: 4 bytes read) against Adam."""
"""Bytes Adam reads and writes per parameter in a step: fp32 param, grad, two moments read; param
and moments written."""

MERGE_BYTES = 24
"""Bytes the LoRA merge (``merge_adapters``) moves per element of an adapted weight besides the
weight's own read and write (2 b): the fp32 product B A written, scaled in place (read, written),
added to W (read, and the sum written), read once more into W's dtype."""


@dataclass
class Prediction:
    """What the cost model predicts for one iteration of a config."""

    phases: dict[str, float]
    """Phase -> seconds (the trainer's ``timing/<phase>_s`` names)."""
    memory: MemoryEstimate
    """Bytes per GPU, per pool, phase and role (``hybridflow.planner.memory``)."""
    terms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Phase -> the terms its seconds add up from (flops, bubble, tp_comm, ...), for ``plan``."""
    profiled: bool = False
    """Whether the calibration had the model's pass profile (its efficiencies divide the
    floors)."""
    micro_batch_costs: bool = False
    """Whether the calibration had the micro-batch costs (``rates.MicroBatchCosts``): the host's
    work per micro-batch and a pipeline stage's; without them or a profile the seconds are
    floors alone."""
    lanes: dict[str, dict[str, float]] = field(default_factory=dict)
    """Pool -> phase -> seconds of the calls its models make (a phase of two pools, the reward
    and cost models' ``reward``, split between them); empty: one lane, the phases in turn."""

    @property
    def step(self) -> float:
        """The iteration's seconds: ``staged_step`` of the lanes (the stages in turn, each as
        long as its busiest pool); with one pool, the sum of the phases."""
        return staged_step(self.lanes) if self.lanes else sum(self.phases.values())

    def describe(self, source: str) -> str:
        """One line: the predicted step and its phases (``source``: where the rates came from)."""
        phases = ", ".join(f"{k} {v:.3g}" for k, v in self.phases.items())
        return (f"predicted (cost model, rates of {source}; {self.kind}): step "
                f"{self.step:.3g} s = {phases}")

    @property
    def kind(self) -> str:
        if self.profiled:
            return "measured efficiencies" + ("" if self.micro_batch_costs else
                                              ", no pipeline transfers")
        return "floors and micro-batch costs" if self.micro_batch_costs else "floors alone"

    @property
    def peak_bytes(self) -> int:
        """The largest per-GPU memory of any pool and phase."""
        return max(pool.peak[1] for pool in self.memory.pools)


PHASES = ("reshard", "weight_load", "generate", "back_to_train", "old_logprobs", "ref_logprobs",
          "values", "cost_values", "reward", "update_critic", "update_cost_critic",
          "update_actor")
"""Every phase, in the order ``Prediction.phases`` lists them."""
STAGES = (("collect", ("reshard", "weight_load", "generate", "back_to_train")),
          ("prepare", ("reward", "old_logprobs", "ref_logprobs", "values", "cost_values")),
          ("update", ("update_critic", "update_cost_critic", "update_actor")))
"""The stages of an iteration (``hybridflow.driver.step``) and their phases: a stage starts when
the previous one has ended; inside it the pools' calls run at the same time, one pool's one
after another (``dataflow.at_once``). The reward is priced in ``prepare``, where it runs unless
dynamic sampling scores in ``collect`` (then after the generation, alone: no shorter)."""


def staged_step(lanes: dict[str, dict[str, float]]) -> float:
    """Seconds of an iteration whose pools make the calls ``lanes`` (pool -> phase ->
    seconds): per stage, the largest of the pools' sums of their phases in it; the stages
    added."""
    return sum(stage_times(lanes).values())


def stage_times(lanes: dict[str, dict[str, float]]) -> dict[str, float]:
    """Stage -> its seconds: the busiest pool's sum of its phases in the stage."""
    return {stage: max((sum(calls.get(p, 0.0) for p in phases) for calls in lanes.values()),
                       default=0.0)
            for stage, phases in STAGES}


@dataclass(frozen=True)
class Fabric:
    """Where a pool's ranks sit, for the span of its collectives: rank r on node
    ``r // per_node``."""

    per_node: int
    """The pool's ranks on each of its nodes."""
    inter_node: float | None
    """Bytes/s a node sends to the others (``cluster.inter_node_gb_s``, else the calibration's
    ``inter_node``); None: not known."""

    @classmethod
    def of(cls, cfg: Any, calib: Calibration, per_node: int) -> "Fabric":
        gb = cfg.cluster.inter_node_gb_s
        return cls(per_node, gb * 1e9 if gb is not None else calib.inter_node)


def collective_rate(calib: Calibration, fabric: Fabric, groups: list[list[int]],
                    what: str) -> float:
    """Bytes received per rank per second in a collective that every group of ``groups`` (pool
    ranks, all of one size n) runs at once: inside a node the calibration's all-gather rate of
    n ranks (``gather_rate``); a group across nodes is held to the inter-node rate, shared by
    the crossing groups that have a rank on the same node (a ring pushes its whole stream
    through each node's link): ``min(gather_rate(n), inter_node / k)``, k the most crossing
    groups on one node. ``what`` names the collective in the ConfigError raised where a group
    crosses nodes and no inter-node rate is known."""
    n = len(groups[0])
    intra = gather_rate(calib, n)
    on = Counter(node for g in groups for node in {r // fabric.per_node for r in g}
                 if len({r // fabric.per_node for r in g}) > 1)
    if not on:
        return intra
    if fabric.inter_node is None:
        raise ConfigError("cluster.inter_node_gb_s", f"the {what} of {n} ranks spans nodes "
                          f"({fabric.per_node} ranks of its pool on a node), and no inter-node "
                          "rate is known: set it (GB/s a node sends to the others; 200 Gb/s is "
                          "25) or give the calibration file an inter_node rate (bytes/s)")
    return min(intra, fabric.inter_node / max(on.values()))


def stage_matmul_params(shape: ModelConfig, pp: int = 1, head: str = "lm",
                        last: int | None = None) -> list[int]:
    """Parameters that take part in matmuls on each of ``pp`` pipeline stages: the layers' and the
    final norm's, and the output layer's on the last stage (the input embedding is only indexed;
    a tied one is counted once, as the output layer; a value head replaces the output layer with
    a [1, h] one). ``last``: the layout's ``last_stage_layers`` (None: an even split)."""
    return list(_stage_matmul_params(tuple(vars(shape).items()), pp, head, last))


@functools.lru_cache(maxsize=1024)
def _stage_matmul_params(fields: tuple, pp: int, head: str, last: int | None) -> tuple[int, ...]:
    # ``stage_matmul_params`` of the shape of these (name, value) pairs, cached: the planner's
    # search prices the same shapes at many layouts
    shape = ModelConfig(**dict(fields))
    out = [0] * pp
    for m in llama_param_metas(shape):
        if m.position != "pre" and m.name != "output_layer.weight":
            out[owner_stage(m, pp, shape.num_layers, last)] += m.numel
    out[-1] += shape.hidden_size * (1 if head == "value" else shape.vocab_size)
    return tuple(out)


def matmul_params(shape: ModelConfig, head: str = "lm") -> int:
    """Parameters that take part in matmuls (``stage_matmul_params`` of one stage)."""
    return stage_matmul_params(shape, 1, head)[0]


def attention_flops(shape: ModelConfig, seq: int, pp: int = 1,
                    last: int | None = None) -> list[int]:
    """FLOPs of attention's two products (scores, weighted values) for one sequence of ``seq``
    tokens on each of ``pp`` pipeline stages: ``4 L_s h seq^2``, L_s the stage's layers
    (``models.params.stage_layer_counts``; ``last`` as ``stage_matmul_params``')."""
    return [4 * layers * shape.hidden_size * seq * seq
            for layers in stage_layer_counts(shape.num_layers, pp, last)]


def _stage_flops(shape: ModelConfig, head: str, seq: int, pp: int, last: int | None,
                 adapters: int | None, response: int | None) -> list[tuple[float, float, float]]:
    """Per pipeline stage, one sequence's forward FLOPs: (matmuls, attention, LoRA adapters). The
    adapters spread over the stages with the layers they sit in."""
    matmuls = [2 * n * seq for n in stage_matmul_params(shape, pp, head, last)]
    if head == "lm" and response is not None:
        matmuls[-1] -= 2 * shape.hidden_size * shape.vocab_size * (
            seq - logit_columns(seq, response))
    layers = stage_layer_counts(shape.num_layers, pp, last)
    lora = [0.0 if adapters is None else 2 * adapters * n / shape.num_layers * seq
            for n in layers]
    return list(zip(matmuls, attention_flops(shape, seq, pp, last), lora))


def forward_flops(shape: ModelConfig, head: str, seq: int, pp: int = 1,
                  adapters: int | None = None, response: int | None = None,
                  last: int | None = None) -> float:
    """FLOPs of one sequence of ``seq`` tokens through the busiest of ``pp`` pipeline stages: for
    each stage ``2 N_stage seq`` in the matmuls plus attention's ``4 L_stage h seq^2`` (its layers:
    ``L / pp``, or with ``last``, the layout's ``last_stage_layers``, that many on the last stage
    and the rest split evenly); with LoRA adapters of ``adapters`` parameters (switched on) their
    ``2 (adapters L_stage / L) seq`` too. ``response``: the sequence's response tokens, where an
    LM head's output layer runs over ``logit_columns`` of it only (``TrainEngine`` given the
    batch's response mask); None: over every position."""
    return max(sum(stage) for stage in _stage_flops(shape, head, seq, pp, last, adapters,
                                                     response))


def train_flops(shape: ModelConfig, head: str, seq: int, pp: int = 1,
                adapters: int | None = None, response: int | None = None,
                last: int | None = None, recompute: bool = False) -> float:
    """FLOPs of one sequence's training pass (forward and backward) through the busiest of ``pp``
    pipeline stages: three forwards (the backward's input and weight gradients are each a
    forward's matmuls; attention's backward is twice its forward). With LoRA adapters of
    ``adapters`` parameters the frozen base computes no weight gradient: its matmuls twice the
    forward's, attention still three times, the adapters three times theirs. ``recompute``
    (``engine.recompute``): the stage's transformer layers run their forward once more in the
    backward (``recompute_flops``). ``response``, ``last``: as ``forward_flops``'s."""
    stages = _stage_flops(shape, head, seq, pp, last, adapters, response)
    again = (recompute_flops(shape, seq, pp, adapters, last) if recompute
             else [0.0] * len(stages))
    if adapters is None:
        return max(3 * (m + a) + r for (m, a, _), r in zip(stages, again))
    return max(2 * m + 3 * a + 3 * lora + r for (m, a, lora), r in zip(stages, again))


def recompute_flops(shape: ModelConfig, seq: int, pp: int = 1, adapters: int | None = None,
                    last: int | None = None) -> list[float]:
    """Per pipeline stage, what full activation recompute adds to one sequence's training pass:
    the forward of the stage's transformer layers (their matmuls ``2 N_layer L_stage seq``,
    attention's ``4 L_stage h seq^2`` and the adapters' share, as ``forward_flops``), not of the
    embedding, the final norm or the output layer, which Megatron does not checkpoint."""
    layers = stage_layer_counts(shape.num_layers, pp, last)
    per_layer = _layer_params(tuple(vars(shape).items()))
    return [2 * per_layer * n * seq + a + lora for n, (_, a, lora)
            in zip(layers, _stage_flops(shape, "lm", seq, pp, last, adapters, None))]


@functools.lru_cache(maxsize=256)
def _layer_params(fields: tuple) -> int:
    # The parameters of one transformer layer of the shape of these (name, value) pairs.
    return sum(m.numel for m in llama_param_metas(ModelConfig(**dict(fields))) if m.layer == 0)


def _rate(calib: Calibration, dtype: str) -> float:
    if dtype not in calib.matmul_flops:
        raise ConfigError("cluster.calibration", f"has no {dtype} matmul rate (measured on "
                          f"{calib.device}); calibrate on the cluster's devices")
    return calib.matmul_flops[dtype]


def _profile(calib: Calibration, shape: ModelConfig, part):
    """The pass profile for a model of ``shape`` trained or run as ``part`` (cfg.actor,
    cfg.critic): at its dtype and tp, with the actor's LoRA adapters where it has them."""
    return calib.profile(shape, part.engine.dtype, part.layout.tp, getattr(part, "lora", None))


def gather_rate(calib: Calibration, n: int) -> float:
    """All-gather bytes received per rank per second in a group of n (> 1): the measured size
    nearest below n (the rate falls as groups grow), or the smallest measured."""
    sizes = sorted(calib.all_gather)
    if not sizes:
        raise ConfigError("cluster.calibration", f"has no all-gather rate (measured on one "
                          f"{calib.device}), and this mapping has groups of {n}; calibrate on a "
                          "node with several devices")
    below = [k for k in sizes if k <= n]
    return calib.all_gather[below[-1] if below else sizes[0]]


def _forward(shape: ModelConfig, part, samples: int, seq: int, calib: Calibration,
             head: str, micro_batch: int, kind: str = "forward",
             adapters: int | None = None, response: int | None = None) -> dict[str, float]:
    """Seconds of one pass of ``kind`` (forward-only, or a training pass: forward and backward)
    of a model over ``samples``, by term (``adapters``: LoRA's adapter parameters, switched on;
    ``response``: the response tokens an LM head's output layer runs over; see ``forward_flops``
    and ``train_flops``); with a profile of the model in ``calib``, over
    ``kind``'s efficiency at the rank's micro-batch size: a profile measured at the layout's tp
    at b sequences, with the TP all-reduces inside it (no ``tp_comm`` term); one at tp = 1 at
    b / tp sequences (a TP rank's matmuls are 1/tp of the whole's), the TP all-reduces added
    (twice in a training pass: forward and backward). Either's fixed seconds of such a pass are
    ``fixed`` (module docstring)."""
    lay, eng = part.layout, part.engine
    b, rate = DTYPE_BYTES[eng.dtype], _rate(calib, eng.dtype)
    per_rank_samples = samples / lay.dp
    recompute = kind == "train" and eng.recompute
    if kind == "train":
        flops = train_flops(shape, head, seq, lay.pp, adapters, response, lay.last_stage_layers,
                            recompute)
    else:
        flops = forward_flops(shape, head, seq, lay.pp, adapters, response, lay.last_stage_layers)
    share = busiest_stage_share(shape.num_layers, lay)  # 1 but for an uneven split
    compute = flops * per_rank_samples / (lay.tp * rate)
    m = max(1, math.ceil(per_rank_samples / micro_batch))
    # forward, backward and with recompute the forward again
    passes = 1 if kind == "forward" else 3 if recompute else 2
    tp_bytes = (passes * 2 * shape.num_layers * per_rank_samples * seq
                * shape.hidden_size * b * share / lay.pp)
    terms = {"compute": compute, "host": 0.0, "weights": 0.0, "pipeline": 0.0, "bubble": 0.0,
             "tp_comm": (2 * (lay.tp - 1) / lay.tp * tp_bytes / gather_rate(calib, lay.tp)
                         if lay.tp > 1 else 0.0),
             "fixed": 0.0}
    profile = _profile(calib, shape, part)
    rows = min(micro_batch, per_rank_samples)
    if profile is not None:
        if profile.tp == lay.tp:  # measured at this tp: its all-reduces are in the efficiency
            efficiency = profile.efficiency(kind, rows)
            terms["tp_comm"] = 0.0
        else:
            efficiency = profile.efficiency(kind, rows / lay.tp)
        terms["fixed"] = getattr(profile, f"{kind}_fixed_s")
        terms["compute"] /= efficiency
    costs = calib.micro_batches
    if costs is not None:
        if profile is None:  # a profile's efficiencies hold these already
            layers = max(stage_layer_counts(shape.num_layers, lay.pp, lay.last_stage_layers))
            # a recompute is a forward of the layers: their share of a forward's host work
            terms["host"] = m * (costs.host(kind, layers)
                                 + (layers * costs.forward_layer_s if recompute else 0.0))
            terms["weights"] = m * weight_bytes_a_micro_batch(
                shape, lay, head, b, kind, adapters, recompute) / calib.memory_bandwidth
        if lay.pp > 1:
            terms["pipeline"] = m * costs.stage(kind, lay.pp, rows * seq * shape.hidden_size * b)
    # 1F1B: m + p - 1 micro-batch slots of the busiest stage, p - 1 of them idle
    terms["bubble"] = (lay.pp - 1) / m * sum(terms[k] for k in ("compute", "host", "weights",
                                                                "pipeline"))
    return terms


def weight_bytes_a_micro_batch(shape: ModelConfig, lay: TrainLayout, head: str, b: int,
                               kind: str, adapters: int | None = None,
                               recompute: bool = False) -> float:
    """Bytes the busiest rank streams from memory for its weights in one micro-batch: its
    matmul weights (``stage_matmul_params`` / tp) read once in a forward; in training read
    again for the input gradients, and the fp32 grad buffer of what it trains read and written
    by the weight-gradient GEMMs that accumulate into it (8 bytes a parameter; LoRA: the
    adapters' alone); with ``recompute`` the layers' weights read once more. A micro-batch's
    GEMMs have a few thousand rows or fewer, too few to hide these bytes behind their FLOPs
    (weights larger than the caches come from memory at every micro-batch), so the cost model
    adds them, at the copy bandwidth, to the floor's FLOPs."""
    weights = max(stage_matmul_params(shape, lay.pp, head, lay.last_stage_layers)) / lay.tp
    if kind == "forward":
        return weights * b
    trained = weights if adapters is None else adapters / (lay.tp * lay.pp)
    again = 0.0
    if recompute:
        layers = max(stage_layer_counts(shape.num_layers, lay.pp, lay.last_stage_layers))
        again = _layer_params(tuple(vars(shape).items())) * layers / lay.tp * b
    return 2 * weights * b + 8 * trained + again


def micro_batch_rows(engine, seq: int, forward: bool) -> int:
    """Sequences in one micro-batch of a pass as the cost model counts them (every sequence
    ``seq`` tokens long): the configured micro-batch size (``forward``: the forward-only one, if
    set), or with ``engine.max_tokens_per_micro_batch`` = T the ``T // seq`` full-length
    sequences the budget packs (at least one)."""
    if engine.max_tokens_per_micro_batch is not None:
        return max(1, engine.max_tokens_per_micro_batch // seq)
    if forward:
        return engine.forward_micro_batch_size or engine.micro_batch_size
    return engine.micro_batch_size


def _update(shape: ModelConfig, part, samples: int, seq: int, calib: Calibration, head: str,
            fabric: Fabric, adapters: int | None = None, response: int | None = None
            ) -> dict[str, float]:
    """Seconds of a model's update (``part.ppo_epochs`` passes of ``part.mini_batches`` optimizer
    steps, each a training pass of its own), by term. ``adapters``: LoRA's adapter parameters,
    then the only trained ones (else every parameter is); ``response``: as ``_forward``'s; the
    data-parallel all-reduce at its groups' span on ``fabric`` (``collective_rate``)."""
    lay, eng = part.layout, part.engine
    per_step = samples / part.mini_batches
    fwd = _forward(shape, part, per_step, seq, calib, head, micro_batch_rows(eng, seq, False),
                   "train", adapters, response)
    steps = part.ppo_epochs * part.mini_batches
    trained = param_count(shape, head) if adapters is None else adapters
    # The busiest stage's rank: the one the others wait for.
    per_rank = trained / busiest_rank_split(shape.num_layers, lay)
    grads = 4 * per_rank
    dp = (2 * (lay.dp - 1) / lay.dp * grads
          / (collective_rate(calib, fabric, lay.dp_groups(), "data-parallel all-reduce") / 2)
          if lay.dp > 1 else 0.0)
    profile = _profile(calib, shape, part)
    adam = ADAM_BYTES * per_rank / calib.memory_bandwidth / (
        profile.optimizer if profile is not None else 1.0)
    if eng.optim.offload:  # module docstring
        if calib.host_adam is None:
            raise ConfigError("cluster.calibration", "has no host Adam rate (host_adam), which "
                              "engine.optim.offload's step is priced at; measure it with "
                              "hybridflow calibrate")
        m = math.ceil(per_step / lay.dp / micro_batch_rows(eng, seq, False))
        host = 1 + (m - 1) * HOST_ADD_SHARE + (HOST_NORM_SHARE if m > 1 else 0.0)
        adam = host * per_rank / calib.host_adam + 4 * per_rank / _host_rate(calib)
    terms = {k: steps * v for k, v in fwd.items() if k != "fixed"}  # every pass's terms
    return {**terms, "dp_allreduce": steps * dp, "fixed": steps * fwd["fixed"],
            "optimizer": steps * adam}


def generation_floor(shape: ModelConfig, dtype: str, calib: Calibration, share: int,
                     prompt: int, response: int, tg: int) -> dict[str, float]:
    """Seconds of one generation replica of tensor parallelism ``tg`` over ``share`` samples of
    ``prompt`` + ``response`` tokens, without efficiencies: the prefill's FLOPs at the matmul
    rate, then each decode step the slower of its FLOPs and its bytes (weights, KV cache)."""
    b, rate = DTYPE_BYTES[dtype], _rate(calib, dtype)
    n = matmul_params(shape)
    kv_token = 2 * shape.num_layers * max(1, shape.num_kv_heads // tg) * shape.head_dim * b
    decode = 0.0
    for step in range(1, response):
        flops = 2 * n * share / tg
        bytes_read = n * b / tg + share * (prompt + step) * kv_token
        decode += max(flops / rate, bytes_read / calib.memory_bandwidth)
    return {"prefill": 2 * n * share * prompt / tg / rate, "decode": decode}


def weights_bytes(shape: ModelConfig, dtype: str, tg: int) -> int:
    """Bytes of one rank's generation weights at generation tp ``tg`` (pp 1): what the switch
    hands the rollout backend."""
    return _weights_bytes(tuple(vars(shape).items()), dtype, tg)


@functools.lru_cache(maxsize=256)
def _weights_bytes(fields: tuple, dtype: str, tg: int) -> int:
    shape = ModelConfig(**dict(fields))
    return sum(math.prod(m.shard_shape(tg)) for m in llama_param_metas(shape)) * DTYPE_BYTES[dtype]


def _weight_load(cfg: Any, shape: ModelConfig, calib: Calibration) -> dict[str, float]:
    """The rollout backend taking the switch's tensors: their bytes at the copy bandwidth, over
    the profile's efficiency."""
    dtype = cfg.actor.engine.dtype
    profile = _profile(calib, shape, cfg.actor)
    return {"copy": weights_bytes(shape, dtype, cfg.rollout.tp) / calib.memory_bandwidth
            / (profile.weight_load if profile is not None else 1.0)}


def _back_to_train(cfg: Any, shape: ModelConfig, calib: Calibration,
                   lora: tuple[int, int] | None) -> dict[str, float]:
    """The grad buffers given back, zeroed: 4 bytes per trained parameter of the rank written;
    with LoRA (``lora``: ``lora_param_counts``) the adapters' only, and merged in place the
    adapted base shards written back from host memory (``restore_base``)."""
    lay = cfg.actor.layout
    mp = busiest_rank_split(shape.num_layers, lay)
    trained = param_count(shape) if lora is None else lora[1]
    terms = {"zero_grads": 4 * trained / mp / calib.memory_bandwidth}
    if lora is not None and cfg.hybrid_engine.lora_merge == "in_place":
        terms["restore_base"] = (lora[0] * DTYPE_BYTES[cfg.actor.engine.dtype] / mp
                                 / _host_rate(calib))
    return terms


def _host_rate(calib: Calibration) -> float:
    """Bytes/s between the device and pinned host memory; on CPU, where the calibration has no
    such rate and the copy is one in host memory, the copy bandwidth."""
    return calib.host_to_device or calib.memory_bandwidth


def _stream(shape: ModelConfig, part, samples: int, micro_batch: int, calib: Calibration
            ) -> float:
    """Seconds the streamed reference (``ref.offload``) copies its weights in one pass: the
    busiest rank's, once per forward micro-batch, none of it hidden (module docstring)."""
    lay = part.layout
    m = max(1, math.ceil(samples / lay.dp / micro_batch))
    weights = reference_weight_bytes(shape, lay, DTYPE_BYTES[part.engine.dtype])
    return m * weights / _host_rate(calib)


def _offload_optimizer(cfg: Any, memory: MemoryEstimate, calib: Calibration,
                       terms: dict[str, dict[str, float]]) -> None:
    """Adds ``hybrid_engine.offload_optimizer``'s host copies to ``terms`` (module docstring),
    their bytes read from the memory estimate of the actor's GPUs."""
    pool = next(p for p in memory.pools if "actor" in p.groups)
    if cfg.hybrid_engine.offload_optimizer:
        state = pool.phases["actor update"]["actor"].get("optimizer", 0)
        terms["reshard"]["optimizer_out"] = state / _host_rate(calib)
        terms["back_to_train"]["optimizer_in"] = state / _host_rate(calib)


def _generate(cfg: Any, shape: ModelConfig, calib: Calibration) -> dict[str, float]:
    gen = GenLayout(train=cfg.actor.layout, tp=cfg.rollout.tp)
    dtype = cfg.actor.engine.dtype
    terms = generation_floor(shape, dtype, calib,
                             math.ceil(cfg.train_batch_size * cfg.rollout.sampling.n / gen.replicas),
                             cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_tokens, gen.tp)
    profile = _profile(calib, shape, cfg.actor)
    if profile is not None:
        terms = {k: v / profile.generate for k, v in terms.items()}
    return terms


def switch_bytes(gen, metas: list, dtype_bytes: int, mode: str = "3d",
                 bucket_bytes: int = 256 * 2**20, tie_embeddings: bool = False
                 ) -> tuple[int, int]:
    """(bytes the busiest rank receives in one switch, bytes of the largest generation shard):
    the paper's Table 2 "communication volume" and "peak memory" of the generation weights, from
    our own reshard plan (``mode`` "3d") or verl's per-tensor path ("naive")."""
    layers, train = num_layers_of(metas), gen.train
    # A generation stage merges pp_stride consecutive training stages, whichever their split.
    storage = max(sum(math.prod(m.shard_shape(gen.tp)) for m in metas
                      if owner_stage(m, train.pp, layers, train.last_stage_layers)
                      // gen.pp_stride == stage)
                  for stage in range(gen.pp)) * dtype_bytes
    return max(switch_recv_bytes(gen, metas, dtype_bytes, mode, bucket_bytes,
                                 tie_embeddings)), storage


@functools.lru_cache(maxsize=1024)
def _switch_recv(fields: tuple, t: int, p: int, last: int | None, tg: int, b: int, mode: str,
                 bucket: int) -> int:
    """``switch_bytes``' received bytes for a shape (``fields``: its (name, value) pairs) at a
    training layout's model-parallel sizes (the data-parallel size does not change them) and
    generation tp: the planner asks for the same ones at many device counts."""
    shape = ModelConfig(**dict(fields))
    gen = GenLayout(train=TrainLayout(tp=t, pp=p, last_stage_layers=last), tp=tg)
    metas = generation_metas(llama_param_metas(shape), shape.tie_embeddings, gen)
    return switch_bytes(gen, metas, b, mode, bucket, shape.tie_embeddings)[0]


def _reshard(cfg: Any, shape: ModelConfig, calib: Calibration,
             lora: tuple[int, int] | None, fabric: Fabric) -> dict[str, float]:
    """The switch's all-gather, at its micro-DP groups' span on ``fabric``; with LoRA (``lora``:
    ``lora_param_counts``) each rank's merge of its adapted shards first (module docstring)."""
    lay = cfg.actor.layout
    gen = GenLayout(train=lay, tp=cfg.rollout.tp)
    b = DTYPE_BYTES[cfg.actor.engine.dtype]
    recv = _switch_recv(tuple(vars(shape).items()), lay.tp, lay.pp, lay.last_stage_layers, gen.tp,
                        b, cfg.hybrid_engine.mode, int(cfg.rollout.bucket_mb * 2**20))
    terms = {"all_gather": recv / collective_rate(calib, fabric, gen.micro_dp_groups(),
                                                  "reshard's all-gather")
             if gen.micro_dp > 1 else 0.0}
    if lora is not None:
        # this rank's adapted shards (the busiest stage's)
        adapted = lora[0] / busiest_rank_split(shape.num_layers, gen.train)
        terms["merge"] = (2 * cfg.actor.lora.rank * adapted / _rate(calib, "fp32")
                          + (MERGE_BYTES + 2 * b) * adapted / calib.memory_bandwidth)
    return terms


def model_terms(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration, model: str,
                fabric: Fabric) -> dict[str, dict[str, float]]:
    """Phase -> terms of the calls of one ``model`` of the run (MODELS), at its layout as ``cfg``
    places it (``placement.model_layout``; the actor's generation at ``rollout.tp``), its
    collectives spanning its pool as ``fabric`` says. ``hybrid_engine.offload_optimizer``'s host
    copies are not in it (``predict`` adds them); ``ref.offload``'s stream is."""
    response = cfg.rollout.sampling.max_tokens  # the actor's output layer runs over these
    seq = cfg.data.max_prompt_tokens + response
    samples = cfg.train_batch_size * cfg.rollout.sampling.n
    layout, _ = model_layout(cfg, model)
    if model in ("actor", "reference"):
        part = cfg.actor if layout == cfg.actor.layout else at_layout(cfg.actor, layout)
        shape, fwd_mb = shapes["model"], micro_batch_rows(cfg.actor.engine, seq, True)
    else:
        part = cfg.critic if layout == cfg.critic.layout else at_layout(cfg.critic, layout)
        shape = critic_shape(shapes) if model in TRAINED_CRITICS else shapes[model]
        fwd_mb = micro_batch_rows(cfg.critic.engine, seq, True)
    if model == "reference":  # with LoRA: the actor with its adapters off, the base's forward
        terms = _forward(shape, part, samples, seq, calib, "lm", fwd_mb, response=response)
        if cfg.ref.offload:
            terms["host_stream"] = _stream(shape, part, samples, fwd_mb, calib)
        return {"ref_logprobs": terms}
    if model in ("reward_model", "cost_model"):  # both inside the trainer's reward phase
        return {"reward": _forward(shape, part, samples, seq, calib, "value", fwd_mb)}
    if model in TRAINED_CRITICS:
        name = "values" if model == "critic" else "cost_values"
        return {name: _forward(shape, part, samples, seq, calib, "value", fwd_mb),
                f"update_{model}": _update(shape, part, samples, seq, calib, "value", fabric)}
    lora = lora_param_counts(shape, cfg.actor.lora) if cfg.actor.lora.enabled else None
    adapters = None if lora is None else lora[1]
    terms = {"reshard": _reshard(cfg, shape, calib, lora, fabric),
             "weight_load": _weight_load(cfg, shape, calib),
             "generate": _generate(cfg, shape, calib),
             "back_to_train": _back_to_train(cfg, shape, calib, lora)}
    if not cfg.old_logprobs_from_update:  # else the update's own forward gives them
        terms["old_logprobs"] = _forward(shape, part, samples, seq, calib, "lm", fwd_mb,
                                         adapters=adapters, response=response)
    terms["update_actor"] = _update(shape, part, samples, seq, calib, "lm", fabric, adapters,
                                    response)
    return terms


def at_layout(part, layout: TrainLayout):
    """A shallow copy of ``part`` (an actor or critic section) at ``layout``, unchecked: the
    cost model reads its engine and batch sizes, and the layout here."""
    out = copy.copy(part)
    out.layout = layout
    return out


def predict(cfg: Any, shapes: dict[str, ModelConfig], calib: Calibration,
            placement: Placement | None = None) -> Prediction:
    """Seconds of every phase of one iteration of ``cfg`` (an RLConfig) and its memory per GPU.
    ``shapes``: config key (model, reward_model, cost_model) -> the model's shape. Each model's
    calls are priced at its own layout on its own pool (``placement``, default
    ``resolve_placement(cfg)``); the step composes them by stage (``staged_step``)."""
    placement = placement or resolve_placement(cfg)
    pools = {pool.name: pool for pool in placement.pools}
    by_model = {m: model_terms(cfg, shapes, calib, m,
                               Fabric.of(cfg, calib, pools[placed.pool].devices_per_node))
                for m, placed in placement.models.items()}
    memory = estimate_memory(cfg, shapes)
    # the optimizer's offloaded phases (reshard, back_to_train) each have one model: their terms
    # are that model's, changed in place
    _offload_optimizer(cfg, memory, calib,
                       {p: t for phases in by_model.values() for p, t in phases.items()})
    terms: dict[str, dict[str, float]] = {}
    lanes: dict[str, dict[str, float]] = {}
    for m, phases in by_model.items():
        lane = lanes.setdefault(placement.models[m].pool, {})
        for phase, t in phases.items():
            whole = terms.setdefault(phase, {})
            for k, v in t.items():
                whole[k] = whole.get(k, 0.0) + v
            lane[phase] = lane.get(phase, 0.0) + sum(t.values())
    terms = {p: terms[p] for p in PHASES if p in terms}
    return Prediction(phases={k: sum(v.values()) for k, v in terms.items()},
                      memory=memory, terms=terms, lanes=lanes,
                      profiled=_profile(calib, shapes["model"], cfg.actor) is not None,
                      micro_batch_costs=calib.micro_batches is not None)


def check_prices_micro_batches(calib: Calibration, path) -> None:
    """ConfigError where the planner would choose from floors alone: ``calib`` (read from
    ``path``) has no micro-batch costs (a file written before ``calibrate`` measured them).
    Floors price neither the host's work per micro-batch nor a pipeline stage's transfers, so
    they favour the smallest micro-batch and deep pipelines: on the quickstart they put
    micro-batch 1 first, and tie every micro-batch size at pp = 1."""
    if calib.micro_batches is None:
        raise ConfigError("cluster.calibration", f"{path} has no micro-batch costs (written "
                          "before `hybridflow calibrate` measured the host's work per "
                          "micro-batch and a pipeline stage's), and floors alone favour the "
                          "smallest micro-batch: the planner does not choose from them; rerun "
                          f"`hybridflow calibrate --out {path}` on the machine to plan for "
                          "(with --config to profile the model again)")


def basis_line(prediction: Prediction, path) -> str:
    """``hybridflow plan``'s last line: what its seconds rest on (``Prediction.kind``)."""
    if not prediction.micro_batch_costs:
        return ("predicted seconds are " + ("at the model's measured efficiencies, without a "
                                            "pipeline stage's transfers" if prediction.profiled
                                            else "FLOORS ALONE, which favour the smallest "
                                            "micro-batch and deep pipelines")
                + f": {path} has no micro-batch costs (`hybridflow calibrate` measures them; "
                "an older file, or rates stated by hand, has none), so `auto` refuses to choose "
                "from it (docs/planner.md)")
    return ("predicted seconds are " + (
        "at the calibrated rates and the model's measured efficiencies, with a pipeline "
        "stage's costs" if prediction.profiled else
        "floors at the calibrated rates plus the calibrated host work per micro-batch and a "
        "pipeline stage's costs; `hybridflow calibrate --config CONFIG` measures the model's "
        "efficiencies") + " (docs/planner.md)")
