"""The reference policy in a worker group of its own, one Ray actor per rank: ``ReferenceWorker``,
for a placement that puts the reference on other devices or at another layout than the actor's
(otherwise it lives in the actor's processes: ``ActorRolloutRefWorker``)."""

from __future__ import annotations

from dataclasses import replace

from hybridflow.batch import Batch
from hybridflow.models.hf import load_hf_config
from hybridflow.training.engine import TrainEngine
from hybridflow.training.loading import load_hf_into_engine
from hybridflow.workers.group import Rendezvous, Worker
from hybridflow.workers.updates import reference_log_probs, train_view


class ReferenceWorker(Worker):
    """The frozen initial policy at ``layout``, with the actor's engine settings (``engine``:
    dtype, micro-batches; sequence parallelism only where its tp > 1); ``ref``: the RefConfig."""

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, *, layout, engine,
                 ref, model_dir: str):
        super().__init__(rank, world_size, rendezvous)
        self.layout = layout
        engine = replace(engine, sequence_parallel=engine.sequence_parallel and layout.tp > 1)
        self.engine = TrainEngine(load_hf_config(model_dir), layout, engine,
                                  build_optimizer=False)
        load_hf_into_engine(self.engine, model_dir)
        if ref.offload:
            self.engine.stream_weights()

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        return train_view(self.layout, self.rank)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return reference_log_probs(self.engine, batch)
