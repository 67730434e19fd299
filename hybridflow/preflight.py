"""What can be known about an RL run before any process starts: the model's shape against the
layouts, the files the run reads, the reward functions, the reshard plan, and with
the GPU's size known (``cluster.nodes`` or ``ray.gpu_memory_gib``), the memory per GPU.

``check_run(cfg)`` raises a ``ConfigError`` naming the key at fault, or returns a ``RunCheck``
that ``hybridflow check`` prints and ``RLTrainer`` uses (model paths, shapes). It reads config.json
files, safetensors headers, the actor's tokenizer and the prompts, and imports reward modules; it
starts nothing and writes nothing of the run.

A model given as a shape preset (``llama2-7b``, ...: ``hybridflow.models.presets``) has a shape
and no files: everything is checked but what needs its tokenizer (the chat template, prompts
longer than data.max_prompt_tokens), and ``RunCheck.model_dir`` refuses it (training needs the
weights).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from hybridflow.checkpoint import ResumePlan, plan_resume, run_identity
from hybridflow.config.loader import to_yaml
from hybridflow.config.rl import RLConfig
from hybridflow.config.cluster import device_memory
from hybridflow.config.placement import ACTOR_SIDE, resolve_placement
from hybridflow.config.sources import CRITIC, critic_shape, model_names, model_sources
from hybridflow.data.loader import tokenize_prompts
from hybridflow.data.prompts import load_prompts
from hybridflow.errors import ConfigError
from hybridflow.hybrid_engine.switch import generation_metas, switch_recv_bytes
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import load_tokenizer
from hybridflow.models.params import llama_param_metas
from hybridflow.models.source import preset_has_no_weights
from hybridflow.parallel.layout import GenLayout
from hybridflow.planner.memory import (DTYPE_BYTES, MemoryEstimate, check_memory_fits, describe,
                                       estimate_memory)
from hybridflow.rewards import as_reward_fn, math_reward_fn, reasoning_gym_reward_fn
from hybridflow.rollout.multi_turn import ToolGlue
from hybridflow.training.model import check_model_fits_layout
from hybridflow.validation import check_validation
from hybridflow.workers.group import check_ray_address


@dataclass
class RunCheck:
    """The resolved facts of a valid run."""

    checkpoints: dict[str, Path | None]
    """Config key (model, reward_model, cost_model) -> that model's HF checkpoint directory, None
    for a shape preset; the run's models only."""
    model: ModelConfig
    """The actor's shape."""
    reward_fn: Callable | None
    """The reward function, ``fn(prompt_item, response)``; None where a reward model scores."""
    cost_fn: Callable | None
    """The Safe-RLHF cost function, where the run has one."""
    gen: GenLayout
    """The actor's generation layout."""
    reshard_recv_bytes: list[int]
    """Bytes each actor rank receives in one switch to the generation layout (3d mode)."""
    naive_recv_bytes: int
    """The most any actor rank would receive on the naive path (TP all-gather, PP broadcast)."""
    prompts: list
    """``data``'s prompts (PromptItems, not yet tokenized): reading them checks every row."""
    resume: ResumePlan
    """Where the run starts: step 0, or the checkpoint ``resume`` leads to."""
    presets: dict[str, str]
    """Config key -> shape preset name, for the models given as shape presets (no weights)."""
    memory: MemoryEstimate | None
    """Per-GPU memory per pool and phase, where the GPU's size is known (``cluster.nodes`` or
    ``ray.gpu_memory_gib``: ``config.cluster.device_memory``)."""
    notes: list[str]
    """What was not checked, and why (``hybridflow check`` prints them)."""
    shapes: dict[str, ModelConfig]
    """Config key (model, reward_model, cost_model) -> that model's shape."""

    @property
    def model_dir(self) -> Path:
        """The actor's (and reference's) HF checkpoint; training needs the weights, so a
        ConfigError names any model of the run that is a shape preset."""
        self.require_weights()
        return self.checkpoints["model"]

    @property
    def model_dirs(self) -> dict[str, Path]:
        """Config key -> checkpoint of every model the run names (a ConfigError as for
        ``model_dir``)."""
        self.require_weights()
        return dict(self.checkpoints)

    def require_weights(self) -> None:
        """A ConfigError naming the first model of the run that is a shape preset, with the fix."""
        if self.presets:
            field, name = next(iter(self.presets.items()))
            raise preset_has_no_weights(name, field)

    def summary(self, cfg: RLConfig) -> str:
        a = cfg.actor.layout
        where = self.checkpoints["model"] or f"{cfg.model} (shape preset, no weights)"
        lines = [
            f"model: {where} ({self.model.arch}, {self.model.num_layers} layers, "
            f"{self.model.num_heads} heads / {self.model.num_kv_heads} KV, vocab "
            f"{self.model.vocab_size})",
            f"actor: {a} -> {a.world_size} ranks; generation tp={self.gen.tp} -> "
            f"{self.gen.micro_dp} replica(s) per model-parallel group, "
            f"{self.gen.replicas} in all; backend {cfg.rollout.backend}",
        ]
        lines.extend(resolve_placement(cfg).describe())
        recv = self.reshard_recv_bytes
        per_rank = ", ".join(_mib(b) for b in recv) if len(recv) <= 8 else \
            f"{_mib(min(recv))} to {_mib(max(recv))} ({len(recv)} ranks)"
        if cfg.rollout.mode != "sync":
            r = cfg.rollout
            partial = (f", partial rollouts of {r.chunk_tokens} tokens a chunk, responses "
                       f"continued under new weights up to staleness {r.staleness}"
                       if r.partial else "")
            lines.append(f"rollout.mode {r.mode}: the generation pool runs {r.ahead} batch(es) "
                         f"ahead of training{partial}; the actor pushes its full weights to it "
                         f"after every update (weight_sync.verify {cfg.weight_sync.verify})")
        else:
            lines.append(f"3D-HybridEngine ({cfg.hybrid_engine.mode}): bytes received per "
                         f"actor rank per switch: {per_rank} (naive path, a TP all-gather and PP "
                         f"broadcast of every tensor: up to {_mib(self.naive_recv_bytes)})")
        samples = cfg.train_batch_size * cfg.rollout.sampling.n
        held = (f", {cfg.validation.size} held out for validation every "
                f"{cfg.validation.every} steps" if cfg.validation.enabled else "")
        lines.append(f"data: {len(self.prompts)} prompts from {cfg.data.source}{held}")
        lines.append(f"step: {cfg.train_batch_size} prompts x {cfg.rollout.sampling.n} samples = "
                     f"{samples}; actor: {cfg.actor.ppo_epochs} epoch(s) x "
                     f"{cfg.actor.mini_batches} mini-batch(es); {cfg.steps} steps, "
                     f"algorithm {cfg.algorithm.name}")
        if cfg.rollout.multi_turn.enabled:
            lines.append(cfg.rollout.multi_turn.describe())
        lines.append(f"start: {self.resume.describe()}")
        if self.memory is not None:
            lines.extend(describe(cfg, self.memory))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def check_run(cfg: RLConfig, reward_fn: Callable | None = None,
              cost_fn: Callable | None = None) -> RunCheck:
    """Every check that needs more than the config itself; see the module docstring.
    ``reward_fn`` / ``cost_fn``: Python callables that replace the config's ``reward`` / ``cost``
    (the Python API's); the config's are imported here otherwise, once."""
    checkpoints, shapes = model_sources(cfg)
    names = model_names(cfg)
    presets = {key: names[key] for key, path in checkpoints.items() if path is None}
    model = shapes["model"]
    placement = resolve_placement(cfg)
    for place in placement.models.values():
        key = MODEL_KEYS[place.name]
        shape = critic_shape(shapes) if key == CRITIC else shapes[key]
        actor_side = place.name in (*ACTOR_SIDE, "rollout")
        engine = (cfg.actor if actor_side else cfg.critic).engine
        try:
            check_model_fits_layout(shape, place.layout, engine)
        except ConfigError as e:
            field = (place.layout_key + e.field.removeprefix("layout")
                     if e.field.startswith("layout.") else
                     e.under("actor" if actor_side else "critic").field)
            raise ConfigError(field, f"{e.message} (the {place.name}'s shape: "
                              f"{key if key in shapes else 'model'})") from None
        if shape.vocab_size < model.vocab_size:
            raise ConfigError(key, f"its vocabulary ({shape.vocab_size} tokens) is smaller than "
                              f"the actor's ({model.vocab_size}): it reads the actor's token ids; "
                              "use a model with the actor's tokenizer")
    if cfg.pad_token_id >= model.vocab_size:
        raise ConfigError("pad_token_id", f"{cfg.pad_token_id} is not a token of the model "
                                          f"(vocab_size {model.vocab_size})")
    functions = _reward_functions(cfg, {"reward": reward_fn, "cost": cost_fn})
    prompts = load_prompts(cfg.data, vocab_size=model.vocab_size)
    # Every model reads the prompt and the response: the fewest positions bound them.
    positions = min(shape.max_position_embeddings for shape in shapes.values())
    width = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    if cfg.rollout.backend_class.sized_by_max_len and width > positions:
        raise ConfigError("data.max_prompt_tokens", f"the {cfg.rollout.backend} engine holds "
                          f"data.max_prompt_tokens + rollout.sampling.max_tokens = {width} "
                          f"positions, more than the model's {positions} "
                          "(max_position_embeddings); lower either")
    notes = _check_prompts(cfg, prompts, checkpoints["model"], functions["reward"], positions)
    _check_out_dir(cfg)
    _check_local_cpus(cfg)
    if cfg.ray.address != "local":  # before anything starts: ray.init would retry it for minutes
        check_ray_address(cfg.ray.address)
    gen = GenLayout(train=cfg.actor.layout, tp=cfg.rollout.tp)
    recv, naive = _reshard_bytes(model, gen, cfg)
    memory = None
    if device_memory(cfg) is not None:
        memory = estimate_memory(cfg, shapes)
        check_memory_fits(cfg, memory, shapes)
    resume = resume_plan(cfg, model)
    return RunCheck(checkpoints=checkpoints, model=model, gen=gen, reshard_recv_bytes=recv,
                    naive_recv_bytes=naive, prompts=prompts, reward_fn=functions["reward"],
                    cost_fn=functions["cost"], resume=resume, presets=presets, memory=memory,
                    notes=notes, shapes=shapes)


MODEL_KEYS = {"actor": "model", "reference": "model", "critic": CRITIC, "cost_critic": CRITIC,
              "reward_model": "reward_model", "cost_model": "cost_model", "rollout": "model"}
"""Placement model -> the config key of the checkpoint it starts from."""


def resume_plan(cfg: RLConfig, model: ModelConfig) -> ResumePlan:
    """Where the run starts; refuses a run directory of another run, or a checkpoint that does
    not fit (another algorithm, model shape, a truncated file)."""
    return plan_resume(cfg.resume, Path(cfg.tracking.out_dir) / cfg.name,
                       yaml.safe_load(to_yaml(cfg)), run_identity(cfg, model),
                       defaults=yaml.safe_load(to_yaml(RLConfig())))


def _reward_functions(cfg: RLConfig, given: dict[str, Callable | None]
                      ) -> dict[str, Callable | None]:
    """"reward" and "cost" as ``fn(prompt_item, response)``: the ``given`` callable, else the
    config's spec imported (a user's file is executed once, here), else None."""
    out: dict[str, Callable | None] = {}
    for field in ("reward", "cost"):
        spec = given[field] if given[field] is not None else getattr(cfg, field)
        if spec is None or (field == "reward" and cfg.reward_model is not None):
            out[field] = None
            continue
        try:
            out[field] = as_reward_fn(spec, key=field, trust=cfg.reward_trust)
        except ConfigError as e:  # a user module's error may span lines: the CLI prints one
            raise ConfigError(field, " ".join(e.message.split())) from None
    return out


def _check_prompts(cfg: RLConfig, prompts: list, model_dir: Path | None,
                   reward_fn: Callable | None, positions: int) -> list[str]:
    """The prompts against what reads them: the actor's tokenizer (its chat template,
    data.max_prompt_tokens), the models' ``positions`` (the longest prompt and a whole
    response), train_batch_size, and what a built-in reward needs of each prompt.
    ``model_dir`` None (a shape preset): text prompts are not tokenized; returns that note."""
    source, limit = cfg.data.source, cfg.data.max_prompt_tokens
    notes = []
    if model_dir is None and any(p.prompt_ids is None for p in prompts):
        notes.append(f"model={cfg.model} is a shape preset without a tokenizer: the prompts' "
                     "chat template and length (data.max_prompt_tokens) are not checked")
        kept, dropped = prompts, 0
    else:
        tokenizer = load_tokenizer(model_dir) if model_dir is not None else None
        try:
            kept, dropped = tokenize_prompts(prompts, tokenizer, limit)
            if cfg.rollout.multi_turn.enabled and tokenizer is not None:
                ToolGlue(tokenizer).pieces(1)  # its chat template renders a tool's turn
        except ConfigError as e:  # the tokenizer's: name its checkpoint
            raise ConfigError(e.field, f"{model_dir}: {e.message}") from None
    if not kept:
        raise ConfigError("data.max_prompt_tokens", f"all {len(prompts)} prompts of {source} are "
                                                    f"longer than {limit} tokens (chat template "
                                                    "applied); raise it")
    longest = max((len(p.prompt_ids) for p in kept if p.prompt_ids is not None), default=0)
    response = cfg.rollout.sampling.max_tokens
    if longest + response > positions:
        raise ConfigError("rollout.sampling.max_tokens", f"the longest prompt of {source} "
                          f"({longest} tokens) and a response of up to {response} take "
                          f"{longest + response} positions, more than the model's {positions} "
                          "(max_position_embeddings); lower it or data.max_prompt_tokens")
    if len(kept) < cfg.train_batch_size:
        long = f" ({dropped} longer than data.max_prompt_tokens dropped)" if dropped else ""
        raise ConfigError("train_batch_size", f"is {cfg.train_batch_size} but {source} gives "
                                              f"only {len(kept)} prompts{long}; lower it or add "
                                              "prompts")
    check_validation(cfg, len(kept))
    # The built-in rewards fail on a prompt without what they score against, at its first step.
    if reward_fn is math_reward_fn:
        bad = next((i for i, p in enumerate(prompts, 1) if p.reference is None), None)
        if bad is not None:
            raise ConfigError("data.answer_key", f"{source}: prompt {bad} has no reference "
                                                 "answer, which reward=math needs; name the "
                                                 "answer's column or end each chat with an "
                                                 "assistant turn")
    if reward_fn is reasoning_gym_reward_fn:
        def made_by(p):
            meta = p.extra.get("metadata")
            return isinstance(meta, dict) and meta.get("source_dataset")
        bad = next((i for i, p in enumerate(prompts, 1) if not made_by(p)), None)
        if bad is not None:
            raise ConfigError("reward", f"reward=reasoning_gym scores each prompt with the "
                                        f"reasoning-gym dataset that made it, and prompt {bad} of "
                                        f"{source} has no metadata.source_dataset; use "
                                        "reward=math or your own module:function")
    return notes


def _check_local_cpus(cfg: RLConfig) -> None:
    """A local Ray (of this machine, not a cluster the config describes) has ray.num_cpus CPUs,
    else this machine's: every rank's ray.cpus_per_worker must fit in them, as the workers' start
    would find (``ResourcePool``)."""
    if cfg.ray.address != "local" or cfg.cluster.nodes is not None:
        return
    ranks = sum(pool.ranks for pool in resolve_placement(cfg).pools)
    cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    need = ranks * cfg.ray.cpus_per_worker
    if need > cpus:
        raise ConfigError("ray.cpus_per_worker", f"{ranks} ranks x {cfg.ray.cpus_per_worker:g} "
                          f"CPU = {need:g} CPU, but a local Ray has {cpus} (ray.num_cpus, or "
                          "this machine's); lower it (0 lets ranks share the CPUs) or shrink the "
                          "layouts")


def _check_out_dir(cfg: RLConfig) -> None:
    """The run folder can be made: the nearest existing parent is a writable folder."""
    parent = Path(cfg.tracking.out_dir).absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError("tracking.out_dir", f"{parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("tracking.out_dir", f"{parent} is not writable; choose another folder")
    # os.access says yes to root everywhere, and some file systems take no folders (/proc): make
    # one there and remove it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hybridflow-check-", dir=parent))
    except OSError as e:
        raise ConfigError("tracking.out_dir", f"cannot make a folder in {parent} ({e.strerror}); "
                                              "choose another folder") from None
    name_max = os.pathconf(parent, "PC_NAME_MAX")
    if len(cfg.name.encode()) > name_max:
        raise ConfigError("name", f"is {len(cfg.name.encode())} bytes long, and a folder name on "
                                  f"the file system of {parent} takes at most {name_max}; "
                                  "choose a shorter name")
    run_dir = Path(cfg.tracking.out_dir) / cfg.name
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("name", f"{run_dir} exists and is not a folder; choose another name")


def _reshard_bytes(model: ModelConfig, gen: GenLayout, cfg: RLConfig) -> tuple[list[int], int]:
    """Bytes each actor rank receives in one switch (the configured mode), and the most any rank
    would receive on the naive path."""
    # The parameters as the switch reshards them (a tied embedding's last-stage copy included).
    metas = generation_metas(llama_param_metas(model), model.tie_embeddings, gen)
    dtype_bytes = DTYPE_BYTES[cfg.actor.engine.dtype]
    recv = switch_recv_bytes(gen, metas, dtype_bytes, cfg.hybrid_engine.mode,
                             int(cfg.rollout.bucket_mb * 2**20), model.tie_embeddings)
    return recv, max(switch_recv_bytes(gen, metas, dtype_bytes, "naive"))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
