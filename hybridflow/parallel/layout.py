"""Parallel layouts as plain values: which global rank holds which shard.

Training layout ``p-t-d`` (Megatron's order with TP innermost): the ranks of one TP x PP
model-parallel group are consecutive, ``rank = d * (p*t) + pp_rank * t + tp_rank``.

Generation layout ``pg-tg-dg-d`` (HybridFlow, arXiv 2409.19256, section 5): inside each training
model-parallel group of ``p*t`` ranks there are ``dg = (p*t) / (pg*tg)`` generation replicas
(micro-DP groups). A rank keeps its training shard and becomes

    gen tp rank = tp_rank // (t/tg),    gen pp rank = pp_rank // (p/pg)

so generation TP (PP) groups take ranks at stride ``t/tg`` (``p/pg``), and the ranks that share a
generation shard -- the micro-DP group -- are those whose training shards concatenate into it.
A generation stage holds the layers of the ``p/pg`` training stages it merges, so it follows the
training split, ``last_stage_layers`` included (the rollout backends generate at pg = 1).
One all-gather per micro-DP group builds the generation weights with no redundant copy.

Everything here is pure: no process is started and no group is created.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.errors import ConfigError, check_int


class LayoutError(ValueError):
    """A layout that cannot exist (sizes that do not divide, a world of the wrong size)."""


@dataclass(frozen=True, kw_only=True)
class TrainLayout:
    """Megatron training layout: tensor (tp), pipeline (pp, with optional virtual stages vpp) and
    data (dp) parallel sizes."""

    tp: int = 1
    """Tensor-parallel size t."""
    pp: int = 1
    """Pipeline-parallel size p."""
    dp: int = 1
    """Data-parallel size d."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None for none."""
    last_stage_layers: int | None = None
    """Transformer layers on the last pipeline stage, the other stages splitting the rest evenly
    (Megatron-Core's num_layers_in_last_pipeline_stage); None: every stage holds num_layers / pp.
    The last stage also computes the output layer and the loss, so with a large vocabulary it is
    the slowest and the others wait for it: fewer layers there balance the stages. It also
    lets a pp that does not divide the layers train (30 layers at pp=4: 8, 8, 8 and 6)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            check_int(name, getattr(self, name))
        check_int("vpp", self.vpp, none_ok=True)
        if self.pp == 1 and (self.vpp or 1) > 1:
            raise ConfigError("vpp", "virtual pipeline stages need pp > 1; set vpp to null or "
                                     "raise pp")
        # What needs the model's layer count is checked against it: models.params'
        # stage_layer_counts, through the engine's check_model_fits_layout.
        check_int("last_stage_layers", self.last_stage_layers, none_ok=True)
        if self.last_stage_layers is not None and self.pp == 1:
            raise ConfigError("last_stage_layers", "needs pp > 1 (one stage holds every layer); "
                                                   "set last_stage_layers to null or raise pp")
        if self.last_stage_layers is not None and self.vpp is not None:
            # Megatron would split each stage's layers over its virtual chunks; the reshard and
            # the cost model do not model that (nor does the reshard support vpp at all).
            raise ConfigError("last_stage_layers", "is not supported together with vpp (virtual "
                                                   "pipeline stages); set one of them to null")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size}")
        d, rest = divmod(rank, self.model_parallel_size)
        p, t = divmod(rest, self.tp)
        return d, p, t

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.model_parallel_size + pp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for t in range(self.tp)]
                for d in range(self.dp) for p in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        mp = self.model_parallel_size
        return [list(range(d * mp, (d + 1) * mp)) for d in range(self.dp)]

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} != tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = "
                f"{self.world_size}; change layout.dp (or tp/pp) so that they multiply to "
                f"{world_size}, or launch {self.world_size} processes")

    def __str__(self) -> str:
        v = f", vpp={self.vpp}" if self.vpp else ""
        if self.last_stage_layers is not None:
            v += f", last_stage_layers={self.last_stage_layers}"
        return f"tp={self.tp}, pp={self.pp}, dp={self.dp}{v}"


@dataclass(frozen=True, kw_only=True)
class GenLayout:
    """Generation layout derived from a training layout: generation tensor (tp) and pipeline (pp)
    sizes; the number of micro-DP replicas per training model-parallel group follows."""

    train: TrainLayout
    """The training layout the actor lives in between generations."""
    tp: int = 1
    """Generation tensor-parallel size tg; must divide the training tp."""
    pp: int = 1
    """Generation pipeline-parallel size pg; must divide the training pp."""

    def __post_init__(self) -> None:
        check_int("tp", self.tp)
        check_int("pp", self.pp)
        if self.train.tp % self.tp:
            raise ConfigError("tp", f"generation tp={self.tp} must divide the training tp="
                                    f"{self.train.tp}; pick one of {_divisors(self.train.tp)}")
        if self.train.pp % self.pp:
            raise ConfigError("pp", f"generation pp={self.pp} must divide the training pp="
                                    f"{self.train.pp}; pick one of {_divisors(self.train.pp)}")

    @property
    def tp_stride(self) -> int:
        """t/tg: training TP shards concatenated into one generation TP shard."""
        return self.train.tp // self.tp

    @property
    def pp_stride(self) -> int:
        """p/pg: training stages merged into one generation stage."""
        return self.train.pp // self.pp

    @property
    def micro_dp(self) -> int:
        """dg = (p*t) / (pg*tg): generation replicas inside one training model-parallel group."""
        return self.tp_stride * self.pp_stride

    @property
    def replicas(self) -> int:
        """All generation replicas: dg * d."""
        return self.micro_dp * self.train.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, gen_pp_rank, gen_tp_rank) of a global rank."""
        d, p, t = self.train.coords(rank)
        micro = (p % self.pp_stride) * self.tp_stride + t % self.tp_stride
        return d * self.micro_dp + micro, p // self.pp_stride, t // self.tp_stride

    def micro_dp_groups(self) -> list[list[int]]:
        """Ranks that hold pieces of the same generation shard, ordered so that the all-gathered
        pieces come out in (pp_rank, tp_rank) order: each group gathers one generation shard."""
        L, out = self.train, []
        for d in range(L.dp):
            for gp in range(self.pp):
                for gt in range(self.tp):
                    out.append([L.rank(d, gp * self.pp_stride + i, gt * self.tp_stride + j)
                                for i in range(self.pp_stride) for j in range(self.tp_stride)])
        return out

    def tp_groups(self) -> list[list[int]]:
        """Generation TP groups: ranks at stride t/tg inside a training TP group."""
        return self._groups_along(2)

    def pp_groups(self) -> list[list[int]]:
        """Generation PP groups: ranks at stride p/pg, in stage order."""
        return self._groups_along(1)

    def _groups_along(self, axis: int) -> list[list[int]]:
        """Ranks that differ only in coordinate ``axis`` of (replica, pp, tp), ordered by it."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.train.world_size):
            c = self.coords(r)
            groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        return [sorted(g, key=lambda r: self.coords(r)[axis]) for g in groups.values()]

    def __str__(self) -> str:
        return f"tp={self.tp}, pp={self.pp}, micro-dp={self.micro_dp}"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
