"""Memory per GPU of an RL run, estimated from its config and its models' shapes: pure arithmetic,
no process, no tensor. ``hybridflow check`` compares it with ``cluster.gpu_memory_gb``; the
auto-mapping planner builds on it.

``estimate_memory(cfg, shapes)`` returns, for every pool of GPUs (the worker groups that share
them: ``hybridflow.config.cluster.gpu_pools``), the bytes each role holds on one GPU in each
phase of an iteration. The phases run one after another, so a GPU's peak is the largest phase
total, not the sum of the phases:

* ``generation``: the actor at the generation layout (its weights gathered by the
  3D-HybridEngine to tp = rollout.tp, pp = 1; beside them the rank's training shards that the
  switch copies instead of keeping resident: ``plan.copied_own_bytes``, none with
  ``hybrid_engine.resident`` and stacked shards) and the KV cache; the actor's grads are released,
  its optimizer state stays unless ``hybrid_engine.offload_optimizer``, the reference's weights
  unless ``ref.offload`` (then the reference holds nothing on the GPU outside its own pass);
* ``inference``: the forward-only passes (old and reference log-probs, values and cost values,
  reward and cost scores), one model at a time; everything resident, plus the largest pass's
  transient; with ``ref.offload`` the reference's pass streams its weights unit by unit
  (``training/streaming.py``) and holds its two largest units (the one running and the one
  prefetched, ``streamed_unit_bytes``; any stage's bound) beside its transient;
* ``actor update`` and, where the algorithm trains them, ``critic update`` and ``cost_critic
  update``: everything resident plus that model's stored activations. The critics (PPO's;
  Safe-RLHF's critic and cost critic) are trained models of ``critic.model``'s shape (default the
  actor's) with a value head, at their placement's layout and ``critic.engine``.

What each role holds (P parameters; t, p, d its layout; b its engine's dtype bytes):

* weights ``P*b/(t*p)``; grads ``P*4/(t*p)`` (Megatron's DDP reduces them in fp32:
  ``grad_reduce_in_fp32``); Adam state ``P*12/(t*p)`` in bf16 (fp32 main weights and two
  moments) or ``P*8/(t*p)`` in fp32 (two moments; SGD's momentum: 8 and 4), divided by d with
  ``engine.optim.distributed`` (Megatron's distributed optimizer shards it over data-parallel
  ranks; the grad buffer stays whole); with ``layout.last_stage_layers`` set, p is replaced by
  ``L / L_max``, L_max the most layers a stage holds (``busiest_stage_share``);
* stored activations of training: what autograd keeps for the backward in the engine's layer
  (Megatron-Core's local spec with SDPA core attention, ``training/attention.py``; our RMSNorm,
  SwiGLU, no dropout), per layer and token of a micro-batch of b sequences of s =
  data.max_prompt_tokens + rollout.sampling.max_tokens tokens, h hidden, f FFN, a heads of
  head_dim d (q = a*d), in the dtype's bytes B:
  ``2*(2*B*h + 4)/t' + (B*(Q + 3f) + 4*a)/t + B*s`` (``layer_activation_bytes``), Q = 4q with
  grouped query heads, 6q with one query head per group. The terms: each of the two norms keeps
  its input, its output (linear_qkv's and linear_fc1's input) and its fp32 reciprocal RMS
  (CUDA's fused ``rms_norm``; t' = t with sequence parallelism, else 1: replicated over TP);
  SDPA keeps the rotated queries, the keys and values repeated to every query head and its
  output (linear_proj's input is a view of it), 4q, and the fp32 logsumexp of each query and
  head; with one query head per group the values are a view of linear_qkv's output, kept whole
  (3q), and the rotated keys a tensor of their own: 6q; the MLP keeps fc1's output [gate; up]
  and fc2's input, 3f (Megatron's fused SwiGLU, torch.compile'd on CUDA, recomputes the rest in
  its backward); and each
  layer converts the [b, 1, s, s] boolean mask to the dtype for SDPA, which keeps it: B*s a
  token, whole on every TP rank. On CUDA, with a mask, SDPA runs the memory-efficient kernel
  (flash takes no mask): it keeps the output and logsumexp, O(s), never the [s, s] scores (the
  unfused attention before d1ebdc9 kept them, fp32 and cast: ``(4 + B)*a*s/t`` a token). On CPU
  the flash CPU kernel keeps the same, but the norms are composite: each keeps its input in
  fp32 (a copy in bf16, the input itself in fp32), the fp32 normalised product and its output,
  ``(8 + B)*h`` a norm, and SwiGLU is unfused: the MLP also keeps the up half plus Megatron's GLU
  offset (a copy) and SiLU's output, 5f (``device="cpu"``; ``tests/unit/test_memory_terms.py`` pins every term
  against the tensors autograd saves there). Korthikanti et al. 2022's
  ``s*b*h*(34 + 5*a*s/h)`` is for GPT's GeLU MLP with dropout and unfused attention; it
  undercounts SwiGLU and overcounts SDPA. Under 1F1B the first pipeline stage holds min(p, m)
  micro-batches in flight (m: micro-batches per optimizer step and data-parallel rank) of its
  L/p layers; the last stage one (of its ``last_stage_layers`` layers when set, the first then
  holding ``(L - last)/(p - 1)``), plus the logits: ``b*r*V/t`` entries of ``B + 8`` bytes (the
  logits, the cross entropy's fp32 copy, turned into the softmax it keeps, and its gradient
  beside them: measured, on an H200 at 0.9B, micro-batches of 8 and 32), r = min(s,
  rollout.sampling.max_tokens + 1) the columns the engine computes them over (``logit_columns``:
  from the column before the first response token). The estimate takes the larger.
  With ``engine.recompute`` (full activation recompute) a micro-batch in flight keeps, of each
  of its layers, only the input: ``B*h`` bytes a token (/t under sequence parallelism), and once
  the boolean mask every layer's checkpoint keeps, ``s`` bytes a token (``checkpoint_bytes``);
  a backward adds one layer's activations (the terms above) while it recomputes that layer. The
  first stage then holds min(p, m) micro-batches of layer inputs plus one layer's activations,
  the last stage one micro-batch's inputs plus the larger of one layer's activations and the
  logits (a backward releases them before it recomputes the stage's last layer). The RoPE tables
  the checkpoints keep, ``4*s*head_dim`` bytes a micro-batch, are left out.
  With ``engine.max_tokens_per_micro_batch`` = T a micro-batch is T tokens at width s' = min(s, T)
  (b = T/s', the widest one the budget allows: the mask grows with s' at a given T), m is at
  most one micro-batch per sequence, and the logits are T entries' (a micro-batch of short
  sequences can be all response);
* with ``actor.lora``: the actor's grads and optimizer state are its adapters' (A parameters)
  alone, its weights ``(P + A)*b/(t*p)``; the reference holds nothing (it is the actor's base);
  in generation the adapted weights' base shards stay beside their merged copies, unless
  ``hybrid_engine.lora_merge`` is in_place (the merge overwrites them; their copy is in host
  memory, which this estimate does not count);
* forward-only passes keep no activations: the logits over the same entries as training's
  (``B + 4`` bytes an entry: the cross entropy's fp32 copy beside them) or, without an LM head,
  one layer's worth, transiently;
* generation: weights ``P*b/tg`` (the training shard is a slice of them under the 3D engine; the
  naive mode keeps it besides), the KV cache ``2*L*(kv_heads/tg)*head_dim*b`` bytes per token of
  prompt + response for the sequences decoded together: the replica's share of the step's
  ``train_batch_size * n`` samples, at most ``MegatronRollout``'s max_batch_size at a time
  (rollout.backend=megatron; held in every phase with ``rollout.keep_cache``). Where its fast
  decoder runs (a GPU at tg = 1) the cache's slots are prompt + response rounded up to the
  decoder's block of 64, and generation also holds the decode transient: the larger of
  the prefill's activations of those sequences' prompts at data.max_prompt_tokens
  (``hybridflow.rollout.fast_decode.prefill_bytes``) and the sampling's buffers over the
  vocabulary (``hybridflow.rollout.megatron.sampling_bytes``); vLLM takes
  ``rollout.kv_cache_mb`` and keeps its own copy of the weights (tg = 1) in every phase; the hf
  backend keeps its own weights, the KV cache of the whole share and every step's logits.

Left out: CUDA context and allocator fragmentation (a few GiB: leave headroom), communication
buffers, the reshard's buckets, embedding and output layers sitting on one pipeline stage only
(the weights are taken evenly over t*p), the generation activations of Megatron's own forward
(the megatron backend at tg > 1: every row's prompt at once, its unfused attention).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.algorithms.specs import TRAINED_CRITICS
from hybridflow.config.cluster import device_memory
from hybridflow.config.placement import ACTOR_SIDE, resolve_placement
from hybridflow.config.sources import critic_shape
from hybridflow.errors import ConfigError
from hybridflow.hybrid_engine.plan import copied_own_bytes, plan_reshard
from hybridflow.hybrid_engine.switch import generation_metas
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import llama_param_metas, stage_layer_counts
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.training.lora import lora_param_counts

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class PoolMemory:
    """One pool of GPUs: the worker groups on it and what one of its GPUs holds per phase."""

    groups: tuple[str, ...]
    """Worker groups sharing these GPUs (actor, critic, cost_critic, reward_model,
    cost_model)."""
    ranks: int
    """Ranks of each group (bundles of the pool)."""
    phases: dict[str, dict[str, dict[str, int]]]
    """phase -> role (actor, rollout, ref, critic, cost_critic, reward_model, cost_model) -> part
    (weights, grads, optimizer, activations, kv cache, ...) -> bytes on one GPU."""

    def role_bytes(self, phase: str, role: str) -> int:
        return sum(self.phases[phase][role].values())

    def total(self, phase: str) -> int:
        return sum(self.role_bytes(phase, role) for role in self.phases[phase])

    @property
    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the fullest phase."""
        return max(((p, self.total(p)) for p in self.phases), key=lambda x: x[1])


@dataclass(frozen=True)
class MemoryEstimate:
    pools: tuple[PoolMemory, ...]

    @property
    def peak(self) -> tuple[PoolMemory, str, int]:
        """(pool, phase, bytes) of the fullest GPU."""
        return max(((pool, *pool.peak) for pool in self.pools), key=lambda x: x[2])


def param_count(shape: ModelConfig, head: str = "lm") -> int:
    """Parameters of the model; ``head="value"`` swaps the LM output layer for a scalar head
    (critics, reward and cost models)."""
    return _param_count(tuple(vars(shape).items()), head)


@functools.lru_cache(maxsize=256)
def _param_count(fields: tuple, head: str) -> int:
    # ``param_count`` of the shape of these (name, value) pairs: the planner's search asks it
    # of the same few shapes thousands of times
    shape = ModelConfig(**dict(fields))
    metas = llama_param_metas(shape)
    n = sum(math.prod(m.shape) for m in metas)
    if head == "value":
        n += shape.hidden_size - sum(math.prod(m.shape) for m in metas
                                     if m.name == "output_layer.weight")
    return n


NORM_BYTES = {"cuda": lambda b: 2 * b, "cpu": lambda b: 8 + b}
"""Bytes an RMSNorm keeps per feature (its output, the next linear's input, included), by the
device its kernel runs on: CUDA's fused ``rms_norm`` keeps its input and its output; the CPU's
composite one keeps the input upcast to fp32 (the input itself in fp32), the normalised fp32
product and the output (module docstring)."""


MLP_FEATURES = {"cuda": 3, "cpu": 5}
"""Tensors of FFN width the MLP keeps per token, by the device the engine runs on: on CUDA
Megatron's fused SwiGLU (``training.model._compiled_fusions``) keeps fc1's output [gate; up]
(2f) and linear_fc2 its input (f); on CPU the unfused GLU also keeps the up half plus the GLU
offset and SiLU's output (module docstring)."""


def layer_activation_bytes(shape: ModelConfig, seq: int, micro_batch: int, tp: int,
                           sequence_parallel: bool, dtype: str, device: str = "cuda") -> float:
    """Stored activations of one transformer layer for one micro-batch of ``micro_batch``
    sequences of ``seq`` tokens: what autograd keeps for the backward in the engine's layer with
    SDPA attention, its norms on ``device`` ("cuda" or "cpu": the module docstring's terms)."""
    s, b, h, f, a = seq, micro_batch, shape.hidden_size, shape.ffn_hidden_size, shape.num_heads
    B = DTYPE_BYTES[dtype]
    q = a * shape.head_dim
    # the rotated queries, keys and values at every query head, SDPA's output (linear_proj's
    # input is a view of it); with one query head per group the values are a view of
    # linear_qkv's whole output, kept whole, and the rotated keys a tensor of their own
    attention = 4 * q if a > shape.num_kv_heads else 6 * q
    norms = 2 * (NORM_BYTES[device](B) * h + 4) / (tp if sequence_parallel else 1)
    per_token = norms + (B * (attention + MLP_FEATURES[device] * f) + 4 * a) / tp + B * s
    return s * b * per_token


def checkpoint_bytes(shape: ModelConfig, seq: int, micro_batch: int, layers: int, tp: int,
                     sequence_parallel: bool, dtype: str) -> float:
    """What full activation recompute (``engine.recompute``) keeps of one micro-batch of
    ``micro_batch`` sequences of ``seq`` tokens through ``layers`` layers until its backward:
    each layer's input [s, b, h] in the dtype (this rank's split of the sequence under sequence
    parallelism), and the boolean attention mask [b, 1, s, s] every layer's checkpoint keeps (one
    tensor, whole on every TP rank)."""
    split = tp if sequence_parallel else 1
    return (layers * seq * micro_batch * shape.hidden_size * DTYPE_BYTES[dtype] / split
            + micro_batch * seq * seq)


def estimate_memory(cfg: Any, shapes: dict[str, ModelConfig]) -> MemoryEstimate:
    """Bytes per GPU, per pool, phase and role (see the module docstring). ``cfg`` an RLConfig;
    ``shapes``: config key (model, reward_model, cost_model) -> that model's shape."""
    placement = resolve_placement(cfg)
    return MemoryEstimate(pools=tuple(pool_memory(cfg, shapes, placement, pool)
                                      for pool in placement.pools))


def pool_memory(cfg: Any, shapes: dict[str, ModelConfig], placement, pool) -> PoolMemory:
    """One pool's bytes per GPU, per phase and role, its models at ``placement``'s layouts (the
    actor's: ``cfg.actor.layout``). The planner's search asks this of each set of models it
    places, ``placement`` holding that set's pool."""
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    samples = cfg.train_batch_size * cfg.rollout.sampling.n
    groups = tuple(placement.pool_groups(pool))
    resident: dict[str, dict[str, int]] = {}  # role -> part -> bytes, outside its own phase
    generation: dict[str, dict[str, int]] = {}
    forward: dict[str, dict[str, int]] = {}  # role -> what its forward pass adds, by part
    updates: dict[str, tuple[str, int]] = {}  # phase -> (role, its activations)
    for group in groups:
        layout = placement.models[group].layout
        if group == "actor":
            _actor(cfg, shapes["model"], seq, samples, resident, generation, forward,
                   updates, placement.reference_in_actor)
        elif group == "rollout":
            _rollout(cfg, shapes["model"], seq, samples, pool.ranks, resident, generation)
        elif group == "reference":
            _reference(cfg, replace(cfg.actor, layout=layout), shapes["model"], seq,
                       cfg.rollout.sampling.max_tokens, resident, forward)
        else:
            shape = critic_shape(shapes) if group in TRAINED_CRITICS else shapes[group]
            _critic_side(replace(cfg.critic, layout=layout), group, shape, seq, samples,
                         resident, forward, updates)
    phases = {"generation": {role: dict(parts) for role, parts in resident.items()}}
    for role, parts in generation.items():
        phases["generation"].setdefault(role, {}).update(parts)
    if "actor" in phases["generation"]:  # the switch releases the actor's grads
        phases["generation"]["actor"].pop("grads")
        if cfg.hybrid_engine.offload_optimizer:
            phases["generation"]["actor"].pop("optimizer")
    if forward:  # the passes run one after another: the largest one's counts
        role = max(forward, key=lambda r: sum(forward[r].values()))
        phases["inference"] = _with(resident, role, forward[role])
    for name, (role, act) in updates.items():
        phases[name] = _with(resident, role, {"activations": act})
    return PoolMemory(groups=groups, ranks=pool.ranks, phases=phases)


def check_memory_fits(cfg: Any, estimate: MemoryEstimate,
                      shapes: dict[str, ModelConfig] | None = None) -> None:
    """A ConfigError where a GPU's peak exceeds the GPU's memory (``device_memory``; nothing is
    checked where it is unknown), naming the phase, the estimate against the memory and the key
    to change; with ``shapes`` (the run's model shapes) also each single change of
    ``fitting_changes`` predicted to make it fit."""
    known = device_memory(cfg)
    if known is None:
        return
    gib, source = known
    for pool in estimate.pools:
        phase, total = pool.peak
        if total <= gib * GIB:
            continue
        roles = pool.phases[phase]
        role = max(roles, key=lambda r: pool.role_bytes(phase, r))
        parts = ", ".join(f"{r} {pool.role_bytes(phase, r) / GIB:.1f}" for r in roles
                          if pool.role_bytes(phase, r))
        key, fix = _fix(cfg, role, roles[role])
        changes = fitting_changes(cfg, shapes, gib) if shapes is not None else []
        raise ConfigError(key, f"the {phase} phase needs an estimated {total / GIB:.1f} GiB per "
                               f"GPU on the GPUs of {' + '.join(pool.groups)} ({parts} GiB), "
                               f"more than {source}={gib:g} GiB; the largest part is {role}'s: "
                               f"{fix}" + (
                                   "; predicted to fit with any one of: " + ", ".join(
                                       f"{k}={_yaml(v)} ({peak / GIB:.1f} GiB)"
                                       for k, v, peak in changes) if changes else
                                   "; no single change of micro-batch, token budget, recompute, "
                                   "offload, LoRA or layout is predicted to fit"))


HEADROOM = 0.9
"""``size_to_memory`` chooses a setting whose estimated peak is at most this share of the GPU's
memory: the rest for what the estimate leaves out (the CUDA context, the allocator's
fragmentation) and its error (within 10% of the allocator's peak on the runs docs/planner.md
lists)."""


def size_to_memory(cfg: Any, shapes: dict[str, ModelConfig]) -> tuple[Any, str]:
    """``cfg`` with its ``auto`` micro-batch key (``RLConfig.SIZE_KEYS``) set to the largest
    value whose estimated peak fits ``HEADROOM`` of the GPU's memory (``device_memory``), and
    the line that says so. Micro-batch sizes are powers of two up to a data-parallel rank's
    share of a mini-batch; token budgets the widest sequence times a power of two, up to that
    share. ConfigError where even the smallest does not fit."""
    (key,) = cfg.auto
    gib, source = device_memory(cfg)
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    share = max(1, cfg.train_batch_size * cfg.rollout.sampling.n
                // (cfg.actor.layout.dp * cfg.actor.mini_batches))
    sizes = [2 ** k for k in range(share.bit_length()) if 2 ** k <= share]
    values = sizes if key.endswith("micro_batch_size") else [seq * m for m in sizes]
    c = copy.deepcopy(cfg)
    c.auto = []
    best = None
    for value in values:
        candidate = _with_key(c, key, value)
        _, phase, peak = estimate_memory(candidate, shapes).peak
        if peak > HEADROOM * gib * GIB:
            break  # the estimate grows with the micro-batch
        best = (value, candidate, peak)
    if best is None:
        raise ConfigError(key, f"auto: even {values[0]} is estimated at {peak / GIB:.1f} GiB per "
                               f"GPU (the {phase} phase), above {HEADROOM:.0%} of {source}="
                               f"{gib:g} GiB; `hybridflow check` with a value names the changes "
                               "predicted to fit")
    value, chosen, peak = best
    return chosen, (f"{key} auto -> {value}: predicted peak {peak / GIB:.1f} GiB of {source}="
                    f"{gib:g} GiB, the largest of {values[0]}-{values[-1]} within "
                    f"{HEADROOM:.0%} of it" + ("" if key.endswith("max_tokens_per_micro_batch")
                                               else " (no cluster.calibration to rank them by "
                                                    "time)"))


def fitting_changes(cfg: Any, shapes: dict[str, ModelConfig], gib: float
                    ) -> list[tuple[str, Any, int]]:
    """The single-key changes of ``cfg`` whose estimated peak fits ``gib`` GiB a GPU, each as
    (key, value, peak bytes): the largest smaller micro-batch or token budget of each trained
    role, its ``engine.recompute`` and ``engine.optim.offload``, ``ref.offload``,
    ``hybrid_engine.offload_optimizer``, LoRA of rank 16 on the actor, and twice the actor's tp or
    pp at half its dp. Changes the config contract refuses are left out."""
    out = []
    for key, values in _change_candidates(cfg, shapes):
        for value in values:  # the mildest change first
            try:
                c = _with_key(cfg, key, value)
                peak = estimate_memory(c, shapes).peak[2]
            except ConfigError:
                continue
            if peak <= gib * GIB:
                out.append((key, value, peak))
                break
    return out


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _change_candidates(cfg: Any, shapes: dict[str, ModelConfig]) -> list[tuple[str, list]]:
    """(key, values to try, mildest first) for ``fitting_changes``."""
    out = []
    for section in ("actor", "critic") if cfg.algorithm.spec.critic else ("actor",):
        eng = getattr(cfg, section).engine
        if eng.max_tokens_per_micro_batch is not None:
            seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
            budget, values = eng.max_tokens_per_micro_batch, []
            while budget // 2 >= seq:  # a budget holds the longest sequence
                budget //= 2
                values.append(budget)
            out.append((f"{section}.engine.max_tokens_per_micro_batch", values))
        else:
            out.append((f"{section}.engine.micro_batch_size",
                        [m for m in (32, 16, 8, 4, 2, 1) if m < eng.micro_batch_size]))
        if not eng.recompute:
            out.append((f"{section}.engine.recompute", [True]))
        if not eng.optim.offload:
            out.append((f"{section}.engine.optim.offload", [True]))
    if not cfg.ref.offload and not cfg.actor.lora.enabled:
        out.append(("ref.offload", [True]))
    if not cfg.hybrid_engine.offload_optimizer:
        out.append(("hybrid_engine.offload_optimizer", [True]))
    if not cfg.actor.lora.enabled:
        out.append(("actor.lora.rank", [16]))
    lay, shape, place = cfg.actor.layout, shapes["model"], cfg.placement
    if lay.dp % 2 == 0 and place.preset in (None, "colocate") and not place.layouts:
        if all(n % (lay.tp * 2) == 0 for n in (shape.num_heads, shape.num_kv_heads,
                                               shape.ffn_hidden_size, shape.vocab_size)):
            out.append(("actor.layout.tp", [lay.tp * 2]))
        if shape.num_layers % (lay.pp * 2) == 0:
            out.append(("actor.layout.pp", [lay.pp * 2]))
    return out


def _with_key(cfg: Any, key: str, value: Any) -> Any:
    """A copy of ``cfg`` with the dotted ``key`` set (a layout's tp or pp at half its dp), checked
    by the config contract (its ConfigError where refused): each section on the key's path
    checks itself again, innermost first, then the whole."""
    c = copy.deepcopy(cfg)
    *path, last = key.split(".")
    sections = [c]
    for part in path:
        sections.append(getattr(sections[-1], part))
    if key in ("actor.layout.tp", "actor.layout.pp"):
        lay = c.actor.layout
        c.actor.layout = TrainLayout(**{"tp": lay.tp, "pp": lay.pp, "dp": lay.dp // 2,
                                        last: value})
        sections.pop()  # the new layout checked itself
    else:
        setattr(sections[-1], last, value)
    for section in reversed(sections):
        check = getattr(section, "__post_init__", None)  # a dataclass without checks has none
        if check is not None:
            check()
    return c


PHASE_CALLS = {"generation": ("generate",),
               "inference": ("compute_log_prob", "compute_ref_log_prob", "compute_values",
                             "compute_scores")}
"""Phase of the estimate -> the worker methods that run in it; each trained model's update
(``update_actor``, ``update_critic``) runs in its group's ``<group> update`` phase."""


def out_of_memory_notes(cfg: Any, estimate: MemoryEstimate) -> dict[str, dict[str, str]]:
    """group -> worker method -> what a CUDA out-of-memory error in that method on that group's
    GPUs adds to its one line (``WorkerGroup.memory_notes``): the method's phase, the estimate
    for it against the GPU's memory where the config knows it, and the key to turn (``_fix``'s,
    for the phase's largest role)."""
    known = device_memory(cfg)
    of = "" if known is None else f" of {known[1]}={known[0]:g}"
    notes: dict[str, dict[str, str]] = {}
    for pool in estimate.pools:
        for group in pool.groups:
            update = "update_actor" if group == "actor" else "update_critic"
            for phase, calls in {**PHASE_CALLS, f"{group} update": (update,)}.items():
                if not pool.phases.get(phase) or not pool.total(phase):
                    continue  # nothing of this group's on these GPUs then (a streamed reference)
                roles = pool.phases[phase]
                role = max(roles, key=lambda r: pool.role_bytes(phase, r))
                key, fix = _fix(cfg, role, roles[role])
                note = (f"the {phase} phase, estimated at {pool.total(phase) / GIB:.1f} GiB per "
                        f"GPU{of} ({role}'s the largest part); {key}: {fix}")
                notes.setdefault(group, {}).update(dict.fromkeys(calls, note))
    return notes


def describe(cfg: Any, estimate: MemoryEstimate) -> list[str]:
    """Lines for ``hybridflow check``: each pool's per-GPU estimate per phase (``cfg``'s GPU
    size known: ``device_memory``)."""
    gib, source = device_memory(cfg)
    lines = []
    for pool in estimate.pools:
        phases = ", ".join(f"{p} {pool.total(p) / GIB:.1f}" for p in pool.phases)
        phase, total = pool.peak
        roles = ", ".join(f"{r} {pool.role_bytes(phase, r) / GIB:.1f}"
                          for r in pool.phases[phase] if pool.role_bytes(phase, r))
        lines.append(f"memory per GPU of {' + '.join(pool.groups)} ({pool.ranks} GPUs), estimate "
                     f"in GiB of {source}={gib:g}: {phases}; peak {phase}: "
                     f"{roles}")
    return lines


# ------------------------------------------------------------------------------------------------
def _with(resident: dict[str, dict[str, int]], role: str, parts: dict[str, int]
          ) -> dict[str, dict[str, int]]:
    out = {r: dict(held) for r, held in resident.items()}
    out.setdefault(role, {}).update(parts)
    return out


def busiest_stage_share(num_layers: int, layout) -> float:
    """The most layers a pipeline stage of ``layout`` holds, over ``num_layers / pp``: 1 for an
    even split, more with ``layout.last_stage_layers`` (17 of 30 at pp=2: 1.13). The estimates
    spread a model's parameters over the stages with their layers."""
    counts = stage_layer_counts(num_layers, layout.pp, layout.last_stage_layers)
    return max(counts) * layout.pp / num_layers


def busiest_rank_split(num_layers: int, layout) -> float:
    """Into how many parts a rank of the busiest pipeline stage divides a model's parameters (its
    layers' share of them, split over tp): tp * pp for an even split, less with
    ``layout.last_stage_layers`` (tp * pp / ``busiest_stage_share``)."""
    return layout.tp * layout.pp / busiest_stage_share(num_layers, layout)


def _train_state(n: int, layout, engine, num_layers: int, largest: int = 0) -> dict[str, int]:
    """Weights, fp32 grads and optimizer state per GPU of a trained model of ``n`` parameters
    and ``num_layers`` layers, on its busiest pipeline stage; with ``engine.optim.offload`` the
    weights alone, and the fp32 copies of two gradients of its ``largest`` parameter (elements)
    in flight to the host."""
    mp = busiest_rank_split(num_layers, layout)
    b = DTYPE_BYTES[engine.dtype]
    if engine.optim.offload:
        return {"weights": int(n * b / mp), "grads": 2 * 4 * largest, "optimizer": 0}
    per_param = {("adam", "bf16"): 12, ("adam", "fp32"): 8, ("sgd", "bf16"): 8,
                 ("sgd", "fp32"): 4}[(engine.optim.name, engine.dtype)]
    optimizer = n * per_param / mp / (layout.dp if engine.optim.distributed else 1)
    return {"weights": int(n * b / mp), "grads": int(n * 4 / mp), "optimizer": int(optimizer)}


def _micro_batch_shape(eng, seq: int, forward: bool) -> tuple[int, float]:
    """(width, sequences) of the largest micro-batch: with a token budget, the one of the full
    width ``seq`` (or the budget, if shorter) filled to the budget -- the attention mask SDPA
    keeps grows with width x tokens, so for a given token count the widest costs most."""
    if eng.max_tokens_per_micro_batch is not None:
        width = min(seq, eng.max_tokens_per_micro_batch)
        return width, eng.max_tokens_per_micro_batch / width
    if forward:
        return seq, eng.forward_micro_batch_size or eng.micro_batch_size
    return seq, eng.micro_batch_size


def logit_columns(width: int, response: int) -> int:
    """Columns of a sequence of ``width`` whose logits (and cross entropy) an LM head computes
    in an RL pass (``TrainEngine``, the batch's ``response_mask`` given): from the column before
    the first response token to the end, ``response`` + 1 of them at most, never more than
    ``width``."""
    return min(width, response + 1)


def _logit_tokens(eng, width: int, micro_batch: float, response: int) -> float:
    """Positions whose logits the largest micro-batch computes: ``logit_columns`` of each of its
    sequences; under a token budget the budget itself (a micro-batch of short sequences can be
    all response)."""
    if eng.max_tokens_per_micro_batch is not None:
        return eng.max_tokens_per_micro_batch
    return micro_batch * logit_columns(width, response)


def _training_activations(shape: ModelConfig, part, seq: int, samples: int,
                          response: int | None) -> int:
    """The stored activations of the largest training micro-batch on its busiest stage;
    ``response``: the response tokens of an LM head's logits (None: a value head, none)."""
    lay, eng = part.layout, part.engine
    width, b = _micro_batch_shape(eng, seq, forward=False)
    # Micro-batches per rank and mini-batch; under a budget at most one per sequence.
    micro = max(1, samples // (lay.dp * part.mini_batches
                               * (1 if eng.max_tokens_per_micro_batch else b)))
    layer = layer_activation_bytes(shape, width, b, lay.tp, eng.sequence_parallel, eng.dtype)
    layers = stage_layer_counts(shape.num_layers, lay.pp, lay.last_stage_layers)
    logits = (0 if response is None
              else _logits(shape, _logit_tokens(eng, width, b, response), lay.tp, eng.dtype))
    # Under 1F1B stage 0 keeps min(pp, micro) micro-batches of its layers, the last stage one
    # (and the logits); the stages between keep fewer than stage 0 of as many layers.
    if not eng.recompute:
        first = layers[0] * layer * min(lay.pp, micro)
        last = layers[-1] * layer + logits
        return int(max(first, last))
    # With recompute the micro-batches in flight keep their layers' inputs, and a backward adds
    # one layer's activations while it recomputes it; on the last stage the logits are released
    # before its last layer is recomputed.
    def kept(n):
        return checkpoint_bytes(shape, width, b, n, lay.tp, eng.sequence_parallel, eng.dtype)
    first = kept(layers[0]) * min(lay.pp, micro) + layer
    last = kept(layers[-1]) + max(layer, logits)
    return int(max(first, last))


def _forward_transient(shape: ModelConfig, part, seq: int, response: int | None) -> int:
    """A forward-only pass's largest transient: an LM head's logits (``response``: its response
    tokens), or without one (None) one layer's activations."""
    lay, eng = part.layout, part.engine
    width, b = _micro_batch_shape(eng, seq, forward=True)
    if response is not None:
        return int(_logits(shape, _logit_tokens(eng, width, b, response), lay.tp, eng.dtype,
                           training=False))
    return int(layer_activation_bytes(shape, width, b, lay.tp, eng.sequence_parallel, eng.dtype))


def _logits(shape: ModelConfig, tokens: float, tp: int, dtype: str, training: bool = True
            ) -> float:
    # The logits of ``tokens`` positions in the model's dtype, the cross entropy's fp32 copy
    # and, training, the softmax and gradient it keeps (the module docstring).
    return tokens * shape.vocab_size / tp * (DTYPE_BYTES[dtype] + (8 if training else 4))


def _actor(cfg, shape: ModelConfig, seq: int, samples: int, resident, generation, forward,
           updates, with_ref: bool) -> None:
    """The actor's group: the policy, its rollout engine and, ``with_ref``, the reference."""
    actor, r = cfg.actor, cfg.rollout
    backend = r.backend_class
    n, b = param_count(shape), DTYPE_BYTES[actor.engine.dtype]
    resident["actor"] = _train_state(n, actor.layout, actor.engine, shape.num_layers,
                                     largest=shape.vocab_size * shape.hidden_size)
    response = r.sampling.max_tokens
    forward["actor"] = {"forward transient": _forward_transient(shape, actor, seq, response)}
    if with_ref:  # the actor's shape and layout: its pass's transient is the actor's
        _reference(cfg, actor, shape, seq, response, resident, forward)
    updates["actor update"] = ("actor", _training_activations(shape, actor, seq, samples,
                                                              response))
    if r.mode != "sync":  # a generation pool of its own generates (``_rollout``)
        return
    gen = GenLayout(train=actor.layout, tp=r.tp)
    gen_weights = {"generation weights": int(n * b / (gen.tp * gen.pp))}
    if cfg.hybrid_engine.mode == "3d":  # the training shards the generation ones copy stay
        # Stacked shards where the backend takes them by default (the estimate is a GPU's).
        blocks = backend.stacks_shards(True, r.tp)
        gen_weights["weights"] = _copied_shard_bytes(
            tuple(vars(shape).items()), actor.layout.tp, actor.layout.pp,
            actor.layout.last_stage_layers, r.tp, b, cfg.hybrid_engine.resident_for(actor, r),
            blocks)
    if actor.lora.enabled:
        # The frozen base holds no grads or optimizer state, the adapters do; the reference is
        # the base itself. Generation takes merged copies of the adapted weights' shards, so
        # those base shards stay beside the generation storage (lora_merge copy).
        adapted, a = lora_param_counts(shape, actor.lora)
        mp = busiest_rank_split(shape.num_layers, actor.layout)
        adapters = _train_state(a, actor.layout, actor.engine, shape.num_layers)
        resident["actor"] = dict(adapters, weights=int(n * b / mp) + adapters["weights"])
        resident["ref"] = {}
        if cfg.hybrid_engine.mode == "3d" and cfg.hybrid_engine.lora_merge == "copy":
            gen_weights["weights"] = int(adapted * b / mp) + adapters["weights"]
        elif cfg.hybrid_engine.mode == "3d":  # merged in place: the base is in host memory
            gen_weights["weights"] += adapters["weights"]
    generation["actor"] = gen_weights
    resident["rollout"], generation["rollout"] = _engine(
        cfg, shape, seq, math.ceil(samples / gen.replicas), gen.tp)


def _engine(cfg, shape: ModelConfig, seq: int, share: int, tp: int) -> tuple[dict, dict]:
    """What the rollout backend holds on a GPU of a generation replica at generation TP ``tp``
    that generates ``share`` samples of ``seq`` tokens (``backend.memory``): resident, and in
    generation."""
    r, b = cfg.rollout, DTYPE_BYTES[cfg.actor.engine.dtype]
    per_token = 2 * shape.num_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * b
    return r.backend_class.memory(r, shape=shape, tp=tp, dtype_bytes=b,
                                  prompt=cfg.data.max_prompt_tokens,
                                  weight_bytes=int(param_count(shape) * b), share=share,
                                  seq=seq, kv_per_token=per_token,
                                  logit_bytes=shape.vocab_size * (b + 4))


def _rollout(cfg, shape: ModelConfig, seq: int, samples: int, replicas: int, resident,
             generation) -> None:
    """A generation pool of its own (rollout.mode one_step_off, async): each rank a replica
    holding the full weights, pushed to it, and what its backend holds beside them."""
    resident["rollout"], generation["rollout"] = _engine(cfg, shape, seq,
                                                         math.ceil(samples / replicas), 1)
    pushed = int(param_count(shape) * DTYPE_BYTES[cfg.actor.engine.dtype])
    resident["rollout"] = {"pushed weights": pushed, **resident["rollout"]}


@functools.lru_cache(maxsize=256)
def _copied_shard_bytes(fields: tuple, t: int, p: int, last: int | None, tg: int, b: int,
                        resident: bool, blocks: bool) -> int:
    """The most bytes of its own training shards a rank keeps beside its generation weights (the
    reshard plan's ``copied_own_bytes``): 0 with every shard resident. ``fields``: the model
    shape's (name, value) pairs, hashable for the cache."""
    shape = ModelConfig(**dict(fields))
    gen = GenLayout(train=TrainLayout(tp=t, pp=p, last_stage_layers=last), tp=tg)
    metas = generation_metas(llama_param_metas(shape), shape.tie_embeddings, gen)
    plan = plan_reshard(gen, metas, b, 256 << 20, blocks=blocks)
    return max(copied_own_bytes(plan, rank, resident) for rank in range(gen.train.world_size))


def _reference(cfg, part, shape: ModelConfig, seq: int, response: int, resident, forward
               ) -> None:
    """The reference: ``part`` the actor's config at its layout; ``response``: the response
    tokens its logits cover. Its weights stay on the GPU, or with ``ref.offload`` its pass holds
    the two largest units it streams (the one running and the one prefetched; an upper bound
    for every pipeline stage) and nothing stays between passes."""
    b = DTYPE_BYTES[part.engine.dtype]
    forward["ref"] = {"forward transient": _forward_transient(shape, part, seq, response)}
    if cfg.ref.offload:
        resident["ref"] = {}
        forward["ref"]["streamed units"] = sum(sorted(streamed_unit_bytes(shape, part.layout.tp,
                                                                          b))[-2:])
    else:
        resident["ref"] = {"weights": reference_weight_bytes(shape, part.layout, b)}


def reference_weight_bytes(shape: ModelConfig, layout, b: int) -> int:
    """The reference's weights on a rank of its busiest pipeline stage, ``b`` bytes a parameter."""
    return int(param_count(shape) * b / busiest_rank_split(shape.num_layers, layout))


def streamed_unit_bytes(shape: ModelConfig, tp: int, b: int) -> list[int]:
    """Bytes on one TP rank of each unit a streamed engine copies in turn
    (``training/streaming.py``): the embedding, each layer, the final norm with the output
    layer (with tied embeddings, the table it reads)."""
    units: dict = {}
    for m in llama_param_metas(shape):
        key = m.layer if m.position == "layer" else m.position
        units[key] = units.get(key, 0) + math.prod(m.shape) // (1 if m.tp_dim is None else tp)
    if shape.tie_embeddings:
        units["post"] = units.get("post", 0) + units["pre"]
    return [n * b for n in units.values()]


def _critic_side(critic, group: str, shape: ModelConfig, seq: int, samples: int, resident,
                 forward, updates) -> None:
    """A value-head group: ``critic`` the critic's config at the group's layout."""
    n = param_count(shape, head="value")
    if group in TRAINED_CRITICS:
        resident[group] = _train_state(n, critic.layout, critic.engine, shape.num_layers,
                                       largest=shape.vocab_size * shape.hidden_size)
        updates[f"{group} update"] = (group, _training_activations(shape, critic, seq, samples,
                                                                   None))
    else:
        b = DTYPE_BYTES[critic.engine.dtype]
        resident[group] = {"weights": int(n * b / busiest_rank_split(shape.num_layers,
                                                                      critic.layout))}
    forward[group] = {"forward transient": _forward_transient(shape, critic, seq, None)}


def _fix(cfg, role: str, parts: dict[str, int]) -> tuple[str, str]:
    """(key, how) to shrink ``role``'s share of a GPU; ``parts`` its bytes by part."""
    nodes = cfg.cluster.gpus_per_node
    model = {"ref": "reference", "rollout": "actor"}.get(role, role)
    section = "actor" if model in ACTOR_SIDE else "critic"
    eng = getattr(cfg, section).engine
    place = resolve_placement(cfg).models[model]
    lay, key = place.layout, place.layout_key
    if role == "rollout" and "kv_cache_mb" in cfg.rollout.backend_class.reads:
        return "rollout.kv_cache_mb", "lower it, or use rollout.backend=megatron"
    if role == "rollout" and cfg.rollout.tp < lay.tp:
        return "rollout.tp", (f"raise it (up to actor.layout.tp={lay.tp}) to split the "
                              "generation weights and KV cache over more GPUs")
    if role == "ref" and not cfg.ref.offload:
        return "ref.offload", "set it to true, or raise actor.layout.tp or pp"
    if max(parts, key=parts.get) == "activations":
        if eng.max_tokens_per_micro_batch is not None:
            return f"{section}.engine.max_tokens_per_micro_batch", "lower it: the stored " \
                                                                   "activations grow with it"
        if eng.micro_batch_size > 1:
            return f"{section}.engine.micro_batch_size", "lower it: the stored activations grow " \
                                                         "with it"
        if section == "actor" and lay.tp > 1 and not eng.sequence_parallel:
            return "actor.engine.sequence_parallel", "set it to true: it splits the stored " \
                                                     "activations over tp"
        if not eng.recompute:
            return f"{section}.engine.recompute", "set it to true: each layer then keeps only " \
                                                  "its input for the backward"
    if lay.tp * 2 <= nodes:
        return f"{key}.tp", (f"raise it (tp={lay.tp} now; up to cluster.gpus_per_node={nodes}) or "
                             f"{key}.pp, lowering {key}.dp to keep the world size")
    return f"{key}.pp", (f"raise it (pp={lay.pp} now), lowering {key}.dp to keep the world size; "
                         "it shrinks weights, grads and optimizer state, not the stored "
                         "activations (under 1F1B the first stage keeps pp micro-batches of its "
                         "layers)")
