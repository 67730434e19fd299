"""What every rollout (generation) backend takes and returns, the facts it declares, and the
registry that picks one.

A backend generates from token-id prompts and takes new weights in place, without a restart:

* ``generate(prompt_token_ids, sampling) -> list[RolloutOutput]``, prompt-major: the ``n``
  samples of prompt 0, then those of prompt 1, ...;
* ``update_weights_hf(weights)``: full (unsharded) HF-named tensors, e.g. what the
  3D-HybridEngine's gather + convert produce; any subset of the model, as long as each fused
  parameter's parts come together (q, k, v; gate, up);
* ``load_from_switch(tensors)``: the generation-layout Megatron shards the 3D-HybridEngine's
  switch leaves on this rank (by default converted to HF names for ``update_weights_hf``);
* ``sleep()`` / ``wake()``: free and restore what generation holds between calls (the KV cache);
* ``close()``.

Sampling is decided by seeds alone, never by the process's global RNG (which ``generate`` leaves
untouched): ``sampling.seed`` when given, else ``call_seed(seed, k)`` for the backend's k-th
``generate`` call, ``seed`` being its constructor's. The ranks of one generation TP group must
sample the same tokens, so they are all built with the same seed: one per replica, not per rank.

Each backend declares what the config, the planner and the switch need to know of it as class
attributes (``max_tp``, ``copies_weights``, ``reads``, ``builds_from_shape``; ``keeps_cache`` and
``stacks_shards`` for a device and generation TP; ``memory`` for the planner), and builds itself
from a ``RolloutSetup`` (``build``): nothing outside the backend's module branches on its name.

Log-probs are always the model's own: ``log softmax(logits)`` at temperature 1, before top-k/top-p,
of the token that was sampled -- the quantity the training engine recomputes for PPO's ratio
(``TrainEngine.compute_logprobs``), not the log-prob under the tempered/truncated distribution the
token was actually drawn from.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from hybridflow.errors import ArgumentError, ConfigError, check_float, check_int
from hybridflow.hybrid_engine.convert import to_hf
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import hf_param_shapes, hf_sources, megatron_name_for_hf
from hybridflow.models.params import megatron_param_names


@dataclass(kw_only=True)
class SamplingConfig:
    """How to sample responses; the same meaning in every backend."""

    temperature: float = 1.0
    """Softmax temperature; 0 samples greedily (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest most likely tokens whose probability reaches top_p; 1
    keeps all."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_tokens: int = 64
    """Most tokens generated per sample (the stop token included)."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Seed of the sampling RNG (prompt i's samples use seed + i*n + j where a backend seeds per
    sample); None: a seed derived from the backend's own and its count of calls (``call_seed``)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample besides the model's EOS; the stop token is kept in the response."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS (stop_token_ids still stop), e.g. for benchmarks."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)
        check_float("temperature", self.temperature, low=0)
        check_float("top_p", self.top_p, low=0, high=1, low_open=True)
        check_int("top_k", self.top_k, low=0)
        check_int("max_tokens", self.max_tokens)
        check_int("n", self.n)
        check_int("seed", self.seed, low=0, none_ok=True)
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ConfigError("stop_token_ids", f"must be non-negative token ids, got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_ids(self, eos_token_ids: Iterable[int]) -> list[int]:
        """The token ids that end a sample: the model's EOS (unless ignore_eos) and
        stop_token_ids."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return sorted(set(eos) | set(self.stop_token_ids))


@dataclass(kw_only=True)
class RolloutOutput:
    """One sampled response."""

    prompt_index: int
    """Index of its prompt in the ``generate`` call."""
    sample_index: int
    """Which of the prompt's ``n`` samples (0..n-1)."""
    prompt_token_ids: list[int]
    """The prompt, unpadded."""
    response_token_ids: list[int]
    """Generated tokens, the stop token (if any) included."""
    logprobs: list[float]
    """Per response token: log p(token | prompt, earlier tokens) under the raw model (temperature
    1, no top-k/top-p), as the training engine computes it."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_tokens reached)."""
    sampled: list[bool] | None = None
    """Per response token: whether it was sampled (a multi-turn response also holds the tokens
    appended for tool outputs and template glue, whose log-prob is 0); None: all were."""
    tools: dict[str, Any] | None = None
    """A multi-turn sample's turns and tool outcomes (``multi_turn.generate_multi_turn``)."""


@dataclass(kw_only=True)
class RolloutSetup:
    """What a worker (or the planner's profile) knows when it starts a backend; each backend's
    ``build`` takes what it needs of it."""

    model_dir: str | os.PathLike | None
    """The HF checkpoint directory (config, EOS ids, weights); None for a bare shape, which only
    a backend that ``builds_from_shape`` takes."""
    shape: ModelConfig
    """The model's architecture."""
    dtype: str
    """The engine's dtype ("fp32", "bf16")."""
    max_model_len: int
    """Prompt + response tokens at most."""
    seed: int
    """Decides the samples of calls without ``sampling.seed``: one per generation replica."""
    load_weights: bool = True
    """Load the checkpoint's weights at start; False where they arrive from the switch first."""
    kv_cache_mb: float = 256.0
    """``rollout.kv_cache_mb``, for a backend that ``reads`` it."""
    keep_cache: bool = False
    """``rollout.keep_cache``, for a backend that ``keeps_cache``."""
    pg_collection: Any = None
    """The generation process groups, for a backend with generation TP; None: one replica."""
    cpu_core: int = 0
    """The core a CPU engine that pins its threads binds them to."""


class RolloutBackend(ABC):
    """A generation engine that takes new weights in place (see the module docstring)."""

    max_tp: int | None = 1
    """The largest generation tensor-parallel size it runs (None: any); 1 is one replica per
    process."""
    copies_weights: bool = True
    """Whether ``load_from_switch`` copies the tensors into an engine of its own. A backend that
    computes on the switch's tensors themselves lets the switch keep the training shards
    resident (``hybrid_engine.resident``'s default)."""
    reads: tuple[str, ...] = ()
    """The ``rollout.*`` options only some backends read that this one does."""
    builds_from_shape: bool = False
    """Whether it starts from a bare shape (random or later weights), without a checkpoint."""
    sized_by_max_len: bool = False
    """Whether its engine is sized for ``max_model_len`` (data.max_prompt_tokens +
    rollout.sampling.max_tokens) positions and refuses more than the model has."""

    model_config: ModelConfig
    """The architecture generated with; every backend sets it in its constructor."""
    tp: int = 1
    """Generation tensor-parallel size: the TP layout of the shards ``load_from_switch`` takes."""
    takes_stacked: bool = False
    """Whether ``load_from_switch`` takes stacked generation shards (``plan_reshard(blocks=True)``:
    row-parallel weights and fc1 as ``[s, *training shard]``), which the switch then builds
    without copying any training shard."""
    _calls: int = 0
    """Generate calls so far: with the seed, decides the next call's draws (see call_seed)."""

    @classmethod
    def build(cls, setup: RolloutSetup) -> "RolloutBackend":
        """The backend for ``setup``: by default the checkpoint's engine at ``setup``'s dtype,
        length and seed."""
        return cls(setup.model_dir, dtype=setup.dtype, max_model_len=setup.max_model_len,
                   seed=setup.seed)

    @classmethod
    def keeps_cache(cls, cuda: bool, tp: int) -> bool:
        """Whether ``rollout.keep_cache`` acts: its KV cache (and graphs) can stay across the
        switch back to training, on a CUDA device or not, at generation TP ``tp``."""
        return False

    @classmethod
    def stacks_shards(cls, cuda: bool, tp: int) -> bool:
        """Whether its ``load_from_switch`` takes stacked shards (``takes_stacked``) when built
        as the workers build it."""
        return False

    @classmethod
    def memory(cls, rollout, *, shape: ModelConfig, tp: int, dtype_bytes: int, prompt: int,
               weight_bytes: int, share: int, seq: int, kv_per_token: int, logit_bytes: int
               ) -> tuple[dict[str, int], dict[str, int]]:
        """The bytes per GPU its engine holds beyond the generation weights, as (resident:
        through every phase, generation: during generate calls only), part by part; for the
        planner's memory model. ``rollout``: the RolloutConfig; ``shape``: the model's; ``tp``:
        generation TP; ``dtype_bytes``: an activation's bytes; ``prompt``: the most prompt
        tokens; ``weight_bytes``: the whole model's; ``share``: sequences one replica generates;
        ``seq``: prompt + response tokens;
        ``kv_per_token``: a token's KV-cache bytes on one GPU; ``logit_bytes``: one position's
        logits over the vocabulary (kept with their fp32 copy)."""
        raise NotImplementedError(f"{cls.__name__} declares no memory model")

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
                 ) -> list[RolloutOutput]:
        """``sampling.n`` samples per prompt, prompt-major."""

    @abstractmethod
    def update_weights_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors; bad names/shapes or a fused parameter with a part missing
        raise ConfigError before anything is loaded."""

    def load_from_switch(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the generation-layout Megatron shards this rank holds after the 3D-HybridEngine's
        switch (Megatron names, global layer indices). By default they are converted to full
        HF-named tensors for ``update_weights_hf``, which needs them unsharded (tp = 1)."""
        self.update_weights_hf(to_hf(tensors, self.model_config, self.tp))

    @abstractmethod
    def sleep(self) -> None:
        """Free the memory generation holds between calls (KV cache); a no-op where none is held
        or the platform cannot (logged once)."""

    @abstractmethod
    def wake(self) -> None:
        """Undo ``sleep``."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine; the object is unusable afterwards."""

    def state_dict(self) -> dict[str, int]:
        """What decides the backend's future draws besides its seed (for checkpoints)."""
        return {"calls": self._calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._calls = int(state["calls"])

    @property
    def capture_seconds(self) -> float:
        """Host seconds spent capturing CUDA graphs so far (0 for a backend that captures none
        itself)."""
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The plug point: backend name -> "module:Class", imported on first use (vLLM alone takes 15-30 s
# to import, and is absent on machines that generate with Megatron-Core).
ROLLOUT_BACKENDS: dict[str, str | type[RolloutBackend]] = {
    "vllm": "hybridflow.rollout.vllm:VLLMRollout",
    "megatron": "hybridflow.rollout.megatron:MegatronRollout",
    "hf": "hybridflow.rollout.hf:HFRollout",
}


def rollout_backend(name: str) -> type[RolloutBackend]:
    """The backend class registered as ``name``."""
    if name not in ROLLOUT_BACKENDS:
        raise ConfigError("rollout.backend", f"unknown backend {name!r}; one of "
                                             f"{sorted(ROLLOUT_BACKENDS)}")
    entry = ROLLOUT_BACKENDS[name]
    if isinstance(entry, str):
        module, cls = entry.split(":")
        try:
            entry = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            hint = " (install the [vllm] extra)" if name == "vllm" else ""
            raise ConfigError("rollout.backend", f"backend {name!r} cannot be imported: {e}"
                                                 f"{hint}") from e
    return entry


# ------------------------------------------------------------------------------------------------
# helpers the backends share


def eos_token_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The EOS ids of an HF checkpoint: generation_config.json's eos_token_id (an id or a list),
    else config.json's; () when neither has one."""
    for file in ("generation_config.json", "config.json"):
        path = Path(model_dir) / file
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def call_seed(seed: int, call: int) -> int:
    """The sampling seed of a backend's ``call``-th ``generate`` call (0-based) when
    ``sampling.seed`` is None: a fixed function of the backend's seed and the call, far from the
    seeds of neighbouring calls and backends (not ``seed + call``: the seeds of backends built with
    seed and seed+1 would overlap). In [0, 2**31), leaving room for per-prompt offsets."""
    digest = hashlib.blake2b(f"{seed}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def check_prompts(prompt_token_ids: list[list[int]], max_tokens: int, max_model_len: int,
                  vocab_size: int | None = None) -> None:
    """Prompts are non-empty lists of token ids that leave room for ``max_tokens``."""
    if not prompt_token_ids:
        raise ArgumentError("prompt_token_ids", "no prompts given")
    for i, p in enumerate(prompt_token_ids):
        if len(p) == 0:
            raise ArgumentError(f"prompt_token_ids[{i}]", "is empty")
        if len(p) + max_tokens > max_model_len:
            raise ArgumentError("max_tokens", f"prompt {i} has {len(p)} tokens; with "
                                f"max_tokens={max_tokens} it exceeds max_model_len={max_model_len}")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in p):
            raise ArgumentError(f"prompt_token_ids[{i}]", f"holds ids outside [0, {vocab_size})")


def rollout_batch(outputs: list[RolloutOutput], pad_token_id: int = 0,
                  prompt_width: int | None = None, response_width: int | None = None
                  ) -> dict[str, torch.Tensor]:
    """Rollout outputs -> the tensors training works on, one row per sample, [B, P + R]: the
    prompt left-padded to P, the response right-padded to R (the longest in ``outputs`` unless
    given: fixed widths let batches of several generation replicas be concatenated).

    ``input_ids``, ``attention_mask`` (1 = real token), ``response_mask`` (1 = sampled response
    token: a multi-turn response's tool and glue tokens are 0, as the padding is), and
    ``rollout_logprobs`` (the backend's log-probs at the sampled positions, 0 elsewhere),
    aligned so that ``rollout_logprobs[b, i]`` compares with ``TrainEngine.compute_logprobs``'s
    ``out[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``.
    """
    width = prompt_width or max(len(o.prompt_token_ids) for o in outputs)
    resp = response_width or max(len(o.response_token_ids) for o in outputs)
    shape = (len(outputs), width + resp)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    mask, response = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for b, o in enumerate(outputs):
        p, r = len(o.prompt_token_ids), len(o.response_token_ids)
        ids[b, width - p:width] = torch.tensor(o.prompt_token_ids)
        ids[b, width:width + r] = torch.tensor(o.response_token_ids, dtype=torch.long)
        mask[b, width - p:width + r] = 1
        response[b, width:width + r] = 1 if o.sampled is None else torch.tensor(o.sampled)
        logprobs[b, width:width + r] = torch.tensor(o.logprobs, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response,
            "rollout_logprobs": logprobs}


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], mask [B, P] 1 = real token), prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def group_hf_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """Check HF-named tensors against ``cfg`` and group them by the Megatron parameter they make.

    Returns {Megatron name: {HF name: tensor}} in model order, leaving out tensors that carry no
    weights (RoPE inv_freq, the lm_head of a tied model). Raises ConfigError naming the tensor for
    an unknown name, a wrong shape, a name given twice, or a fused parameter with a part missing
    (a partly loaded fused module would silently keep uninitialised rows in vLLM).
    """
    shapes = hf_param_shapes(cfg)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        mg = megatron_name_for_hf(name, cfg)
        if mg is None:
            continue
        want, why = shapes[name]
        if tuple(tensor.shape) != want:
            raise ArgumentError(f"weights[{name}]", f"has shape {list(tensor.shape)}, expected "
                                                    f"{list(want)} for {why}")
        if name in groups.setdefault(mg, {}):
            raise ArgumentError(f"weights[{name}]", "given twice in one update")
        groups[mg][name] = tensor
    for mg, parts in groups.items():
        missing = [n for n in hf_sources(mg, cfg) if n not in parts]
        if missing:
            raise ArgumentError(f"weights[{missing[0]}]",
                                f"missing: {mg} is fused from {hf_sources(mg, cfg)}, which must be "
                                f"updated together (got only {sorted(parts)})")
    order = {n: i for i, n in enumerate(megatron_param_names(cfg))}
    return dict(sorted(groups.items(), key=lambda kv: order[kv[0]]))
