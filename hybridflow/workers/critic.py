"""The value-head worker, one Ray actor per rank: ``CriticWorker`` holds a trained value model (the
critic, or Safe RLHF's cost critic: values, clipped value loss) or, untrained, a reward or cost
model scoring each sequence at its last token."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.algorithms import value_loss
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError
from hybridflow.models.hf import _weight_map, load_hf_config
from hybridflow.training.engine import TrainEngine
from hybridflow.training.loading import load_hf_into_engine
from hybridflow.training.megatron_ckpt import load_train_state, save_train_state
from hybridflow.training.model import VALUE_HEAD, shift_right
from hybridflow.workers.group import Rendezvous, Worker
from hybridflow.workers.updates import (engine_batch, load_rank_state, ppo_updates,
                                       save_rank_state, train_view)


VALUE_KEYS = {"critic": ("values", "returns"), "cost_critic": ("cost_values", "cost_returns")}
"""A trained value model's role -> the batch keys of its values and of its regression targets
(the reward stream's and the cost stream's: ``ADVANTAGE_ESTIMATORS``)."""


class CriticWorker(Worker):
    """A value-head model on one rank: a trained value model of ``role`` (``VALUE_KEYS``: values,
    clipped value loss; its metrics prefixed ``<role>/``, its checkpoint under ``<role>/``) or,
    with ``trainable=False``, a reward/cost model scoring each sequence at its last token.
    ``critic``: the critic's config (engine, update); ``layout``: this model's (default the
    critic's)."""

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, *, critic,
                 model_dir: str, trainable: bool = True, model_key: str = "model",
                 role: str = "critic", layout=None):
        super().__init__(rank, world_size, rendezvous)
        self.critic_cfg, self.role = critic, role
        self.layout = layout or critic.layout
        self.values_key, self.returns_key = VALUE_KEYS[role]
        model_config = load_hf_config(model_dir)
        self.engine = TrainEngine(model_config, self.layout, critic.engine,
                                  build_optimizer=trainable, head="value")
        load_hf_into_engine(self.engine, model_dir)
        self._load_score_head(model_dir, model_key)
        self.dp_group = self.engine.pg.dp

    def _load_score_head(self, model_dir: str, model_key: str) -> None:
        """A reward model saved as transformers' *ForSequenceClassification keeps its scalar head
        as ``score.weight`` [1, hidden]; an LM checkpoint has none and keeps the fresh head.
        ``model_key``: the config key that named the checkpoint, for the error."""
        from safetensors import safe_open  # deferred: safetensors
        files = _weight_map(Path(model_dir))
        if "score.weight" not in files:
            return
        with safe_open(str(files["score.weight"]), "pt") as f:
            head = f.get_tensor("score.weight")
        for name, param in self.engine.named_local_params():
            if name == VALUE_HEAD:
                if head.shape != param.shape:
                    raise ConfigError(model_key, f"{files['score.weight']}: score.weight has "
                                      f"shape {list(head.shape)}, expected {list(param.shape)} "
                                      "(one label)")
                with torch.no_grad():
                    param.copy_(head)

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        return train_view(self.layout, self.rank)

    def memory_name(self, method: str) -> str:
        """The cost critic's calls are named as its phases (``compute_cost_values``,
        ``update_cost_critic``), apart from the critic's."""
        return method.replace("critic", self.role).replace("values", self.values_key)

    def save_state(self, ckpt_dir: str) -> None:
        """The model's weights, optimizer and RNG states, under its role (see
        ActorRolloutRefWorker's)."""
        save_train_state(self.engine, Path(ckpt_dir) / self.role)
        save_rank_state(Path(ckpt_dir) / f"{self.role}-rank{self.rank:04d}.pt")

    def load_state(self, ckpt_dir: str) -> None:
        load_train_state(self.engine, Path(ckpt_dir) / self.role)
        load_rank_state(Path(ckpt_dir) / f"{self.role}-rank{self.rank:04d}.pt")

    @staticmethod
    def _state_values(raw: torch.Tensor) -> torch.Tensor:
        # The head at position i has read token i; the value of the state *before* token i
        # (what GAE pairs with token i's reward) is the head's output at i - 1.
        return shift_right(raw)

    def compute_values(self, batch: Batch) -> Batch:
        """The value of the state before each token, as ``values`` (the critic) or
        ``cost_values`` (the cost critic)."""
        raw = self.engine.compute_values(engine_batch(batch))
        return Batch({self.values_key: self._state_values(raw)})

    def compute_scores(self, batch: Batch) -> Batch:
        """Reward-model score per sequence: the head's output at the last real token."""
        raw = self.engine.compute_values(engine_batch(batch))
        last = batch["attention_mask"].cumsum(-1).argmax(-1)
        return Batch({"scores": raw[torch.arange(len(last)), last]})

    def update_critic(self, batch: Batch) -> Batch:
        """The value update on the batch's values and targets of this role; its metrics
        (``<role>/vf_loss``, ...) in meta."""
        c, values, returns = self.critic_cfg, self.values_key, self.returns_key

        def loss_for(denom):
            def loss_fn(raw, mb):
                mask = mb["response_mask"]
                loss, m = value_loss(self._state_values(raw), mb[values], mb[returns], mask,
                                     c.value_clip, "token-mean", denom)
                return loss, {f"{self.role}/vf_loss": loss,
                              f"{self.role}/vf_clip_frac": (m["vf_clip_frac"], mask.bool().sum())}
            return loss_fn
        return ppo_updates(self.engine, engine_batch(batch, values, returns, "response_mask"),
                            c, "token-mean", self.dp_group, loss_for, self.role, loss_key=None)
