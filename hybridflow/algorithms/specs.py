"""The one table of algorithm facts: what each ``algorithm.name`` needs and reads.

The config's checks, the planner, the checkpoint's roles and the driver read these facts instead of
comparing names. Adding an algorithm is one entry here and its estimator in
``advantages.ADVANTAGE_ESTIMATORS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.errors import ArgumentError, ConfigError


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """What one RL algorithm of the loop is made of."""

    estimator: str
    """Its key in ``ADVANTAGE_ESTIMATORS``."""
    critic: bool = False
    """Trains a value model (the critic worker group) whose values the estimator reads."""
    token_level: bool = False
    """Reads per-token rewards: the KL-in-reward penalty lands on each token. Otherwise one score
    per sequence, from which the penalty summed over the response is taken."""
    groups: bool = False
    """Compares the samples of one prompt (rollout.sampling.n >= 2)."""
    filters_groups: bool = False
    """A group whose samples all scored alike gets zero advantages: DAPO's dynamic sampling can
    drop it and draw again."""
    greedy_baseline: bool = False
    """Each prompt's greedy response, scored as the samples are, is the baseline (ReMax)."""
    cost: bool = False
    """Reads a cost per sample (function or model) beside the reward: the estimator gets a
    per-token cost stream beside the reward's (the cost on the last token, the KL penalty's
    opposite on every token: ``safe_rlhf_token_rewards``) and a Lagrange multiplier lambda that
    the step's mean cost drives against algorithm.cost_limit (Safe RLHF)."""
    cost_critic: bool = False
    """Trains a second value model on the cost stream (the cost_critic worker group: the
    critic's layout, engine and optimizer, started from the same checkpoint) whose values the
    estimator reads beside the critic's. Needs ``critic`` and ``cost``."""
    reads: tuple[str, ...] = ()
    """The ``algorithm.*`` options it reads beyond those every algorithm reads (KL in reward,
    overlong shaping): any other set away from its default is refused as inert."""

    def __post_init__(self) -> None:
        if self.cost_critic and not (self.critic and self.cost):
            raise ArgumentError("cost_critic", "a cost critic learns the values of a cost "
                                               "stream beside a critic's: set critic and cost too")


TRAINED_CRITICS = ("critic", "cost_critic")
"""The facts that each train a value model of that name (a worker group, a checkpoint part);
reward and cost models only score."""


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(estimator="grpo", groups=True, filters_groups=True,
                          reads=("norm_by_std",)),
    "ppo": AlgorithmSpec(estimator="gae", critic=True, token_level=True, reads=("gamma", "lam")),
    "remax": AlgorithmSpec(estimator="remax", greedy_baseline=True),
    "rloo": AlgorithmSpec(estimator="rloo", groups=True, filters_groups=True),
    "reinforce_plus_plus": AlgorithmSpec(estimator="reinforce_plus_plus", token_level=True,
                                         reads=("gamma",)),
    "safe_rlhf": AlgorithmSpec(estimator="safe_rlhf", critic=True, cost=True, cost_critic=True,
                               token_level=True, reads=("gamma", "lam", "cost_limit",
                                                        "lagrange_init", "lagrange_lr")),
}
"""``algorithm.name`` -> its facts."""

# Options only some algorithms read: every one of them must be in some entry's ``reads``.
OPTIONAL_OPTIONS = ("gamma", "lam", "norm_by_std", "cost_limit", "lagrange_init", "lagrange_lr")


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The facts of ``name``; a ConfigError on ``algorithm.name`` for an unknown one."""
    if name not in ALGORITHMS:
        raise ConfigError("algorithm.name", f"unknown algorithm {name!r}; one of "
                                            f"{', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def readers(option: str) -> str:
    """The algorithms that read ``algorithm.<option>``, in the table's order: "a or b"."""
    return " or ".join(name for name, spec in ALGORITHMS.items() if option in spec.reads)


def having(fact: str, conjunction: str = "or") -> str:
    """The algorithms whose ``fact`` (an AlgorithmSpec flag) is true, in the table's order:
    "a or b" (or "a and b")."""
    return f" {conjunction} ".join(name for name, spec in ALGORITHMS.items()
                                   if getattr(spec, fact))
