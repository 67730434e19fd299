"""Create Megatron-Core's process groups for a TrainLayout and hand them back explicitly.

Megatron keeps its groups in module state (``parallel_state``); we create them here, check that
they are exactly the ranks our TrainLayout says, and pass the resulting ProcessGroupCollection on
explicitly so that nothing of ours reaches into that state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_patches
from hybridflow.parallel.layout import GenLayout, TrainLayout

# Megatron's order string, innermost first: TP, then PP, then DP, so that the ranks of one TP x PP
# group are consecutive (HybridFlow's p-t-d; the generation micro-DP groups live inside them).
MEGATRON_ORDER = "tp-cp-ep-pp-dp"


def init_megatron_parallel(layout: TrainLayout, seed: int = 1234):
    """Initialise Megatron's groups for ``layout`` on the current default group; returns the
    ProcessGroupCollection. Call once per process, after ``dist.init_process_group``."""
    megatron_patches.apply()
    # deferred: Megatron
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    layout.check_world(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == layout.tp
                and parallel_state.get_pipeline_model_parallel_world_size() == layout.pp
                and parallel_state.get_virtual_pipeline_model_parallel_world_size() == layout.vpp)
        if same:  # e.g. actor and reference in one process share the groups
            return ProcessGroupCollection.use_mpu_process_groups()
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        order=MEGATRON_ORDER,
    )
    rank = dist.get_rank()
    for name, ours in (("tensor", layout.tp_groups()), ("pipeline", layout.pp_groups()),
                       ("data", layout.dp_groups())):
        group = getattr(parallel_state, f"get_{name}_model_parallel_group"
                        if name != "data" else "get_data_parallel_group")()
        theirs = sorted(dist.get_process_group_ranks(group))
        mine = next(g for g in ours if rank in g)
        assert theirs == sorted(mine), f"megatron {name} group {theirs} != layout's {mine}"
    # The inference tracker keeps RNG state on the CPU generator; the CUDA tracker needs a GPU.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available())
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state  # deferred: Megatron
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def generation_process_groups(gen):
    """A ProcessGroupCollection for a model at the generation layout ``gen`` (pg = 1): its TP group
    is this rank's generation TP group (ranks at stride t/tg), its PP and CP groups are the rank
    alone. Collective over the world: every rank creates every group, in the same order."""
    from megatron.core.process_groups_config import ProcessGroupCollection  # deferred: Megatron

    if gen.pp != 1:
        raise ValueError("generation.pp > 1 is not supported by the generation model; use pp=1")
    rank = dist.get_rank()
    tp_group = alone = None
    for ranks in sorted(gen.tp_groups()):
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == rank:
            alone = group
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.pp, pgs.cp, pgs.tp_cp, pgs.mp = tp_group, alone, alone, tp_group, tp_group
    pgs.embd = pgs.pos_embd = None  # one stage: no embedding sharing between stages
    return pgs


def single_replica_generation_groups(seed: int = 1234):
    """Generation groups in which the whole default group is one TP group (one replica, tp = the
    world size), e.g. for a MegatronRollout in a test or a benchmark. Megatron's forward also reads
    state of its own (the attention buffer, the RNG tracker): it is set up for that layout unless
    something (a TrainEngine) already did. Collective over the world."""
    from megatron.core import parallel_state  # deferred: Megatron

    world = dist.get_world_size()
    layout = TrainLayout(tp=world)
    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(layout, seed=seed)
    return generation_process_groups(GenLayout(train=layout, tp=world))
