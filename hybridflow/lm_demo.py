"""A short Megatron-Core training run on this machine: a tiny Llama learns to copy a sequence.

It exercises the training engine at a real TP x PP x DP layout over gloo, with nothing to
download: the task is synthetic (``<bos> x1..xk <sep> x1..xk``, loss on the copy only), so the
loss must fall towards zero and the copy accuracy rise towards one if training works.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hybridflow.config.loader import to_yaml
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import init_full_weights, llama_param_metas
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn
from hybridflow.tracking import Tracker, TrackingConfig
from hybridflow.training.config import EngineConfig, OptimConfig
from hybridflow.training.engine import TrainEngine
from hybridflow.training.model import check_model_fits_layout

BOS, SEP = 1, 2
FIRST_SYMBOL = 3


@dataclass(kw_only=True)
class LMDemoConfig:
    """The copy-task training demo."""

    name: str = "lm-demo"
    """Run name: writes <tracking.out_dir>/<name>/."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab_size=256, hidden_size=128, ffn_hidden_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position_embeddings=64))
    """The model, trained from random weights."""
    layout: TrainLayout = field(default_factory=lambda: TrainLayout(tp=2, pp=2, dp=1))
    """Training layout; world size = tp * pp * dp local processes."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        micro_batch_size=4, optim=OptimConfig(name="adam", lr=3e-3, clip_grad=1.0)))
    """Engine (micro-batching, precision, optimizer)."""
    steps: int = 60
    """Optimizer steps."""
    global_batch_size: int = 16
    """Sequences per step over all data-parallel ranks."""
    copy_length: int = 8
    """Symbols to copy; the sequence is 2 * copy_length + 2 tokens."""
    symbols: int = 32
    """Distinct symbols the copied tokens are drawn from."""
    seed: int = 0
    """Seed of the weights and the data."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Where the run writes config.yaml and metrics.jsonl."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {self.steps}")
        per_rank, rest = divmod(self.global_batch_size, self.layout.dp)
        if rest or per_rank % self.engine.micro_batch_size:
            raise ConfigError("global_batch_size", f"{self.global_batch_size} must be a multiple "
                              f"of layout.dp * engine.micro_batch_size = {self.layout.dp} * "
                              f"{self.engine.micro_batch_size}")
        if FIRST_SYMBOL + self.symbols > self.model.vocab_size:
            raise ConfigError("symbols", f"{self.symbols} symbols do not fit model.vocab_size="
                              f"{self.model.vocab_size}")
        if 2 * self.copy_length + 2 > self.model.max_position_embeddings:
            raise ConfigError("copy_length", "the sequence is longer than "
                              "model.max_position_embeddings")
        check_model_fits_layout(self.model, self.layout, self.engine)


def copy_batch(cfg: LMDemoConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``global_batch_size`` copy sequences; ``loss_mask`` marks the copied half."""
    n, k = cfg.global_batch_size, cfg.copy_length
    symbols = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + cfg.symbols, (n, k), generator=generator)
    ids = torch.cat([torch.full((n, 1), BOS), symbols, torch.full((n, 1), SEP), symbols], dim=1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, k + 2:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def run_worker(rank: int, world: int, cfg: LMDemoConfig, run_dir: str) -> dict[str, float]:
    engine = TrainEngine(cfg.model, cfg.layout, cfg.engine)
    engine.load_full_weights(init_full_weights(llama_param_metas(cfg.model), seed=cfg.seed))
    dp_rank, _, _ = cfg.layout.coords(rank)
    per_rank = cfg.global_batch_size // cfg.layout.dp
    tokens = cfg.global_batch_size * cfg.copy_length

    def loss_fn(logprobs, mb):
        # Token-mean over the global batch: every copied token weighs the same on any layout.
        nll = -(logprobs * mb["loss_mask"]).sum() / tokens
        return nll, {}

    tracker = bar = None
    if rank == 0:
        tracker = Tracker(run_dir, to_yaml(cfg), cfg.tracking, cfg.name)
        bar = tqdm(total=cfg.steps, desc=f"lm-demo [{cfg.layout}]", unit="step")
    generator = torch.Generator().manual_seed(cfg.seed)
    first = last = None
    for step in range(1, cfg.steps + 1):
        batch = copy_batch(cfg, generator)
        mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
        start = time.perf_counter()
        metrics = engine.train_step(mine, loss_fn)
        loss = metrics["loss"]  # the global token-mean, summed over the DP ranks' shares
        row = {"loss": loss, "grad_norm": metrics["grad_norm"],
               "timing/step_s": time.perf_counter() - start}
        if step in (1, cfg.steps) or step % 10 == 0:
            row["copy_accuracy"] = copy_accuracy(engine, mine)
        first = row if first is None else first
        last = row
        if tracker:
            tracker.log(step, row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
    if tracker:
        bar.close()
        tracker.close()
    return {"first_loss": first["loss"], "last_loss": last["loss"],
            "first_copy_accuracy": first["copy_accuracy"],
            "last_copy_accuracy": last["copy_accuracy"]}


def copy_accuracy(engine: TrainEngine, batch: dict[str, torch.Tensor]) -> float:
    """Fraction of copied tokens the model predicts greedily (teacher-forced), this DP rank."""
    logits = engine.compute_logits(batch)
    predicted = logits[:, :-1].argmax(-1)
    target, mask = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:].bool()
    return (predicted[mask] == target[mask]).float().mean().item()


def run(cfg: LMDemoConfig) -> dict[str, float]:
    """Train on ``layout.world_size`` local gloo processes; returns first/last loss and accuracy."""
    run_dir = Path(cfg.tracking.out_dir) / cfg.name
    print(f"lm-demo: {cfg.layout.world_size} processes at {cfg.layout}, writing {run_dir}/")
    result = spawn(run_worker, cfg.layout.world_size, cfg, str(run_dir))[0]
    print(f"lm-demo: loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}, "
          f"copy accuracy {result['first_copy_accuracy']:.2f} -> "
          f"{result['last_copy_accuracy']:.2f} ({run_dir / 'metrics.jsonl'})")
    return result
