"""What the actor-update tests share (imported inside the spawned workers)."""


def update_worker(cfg, engine):
    """An ActorRolloutRefWorker around ``engine`` whose ``update_actor`` runs with ``cfg`` (an
    ActorConfig): the method reads only these; the constructor would also load a checkpoint and
    start a rollout engine."""
    from hybridflow.controller.workers import ActorRolloutRefWorker
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.actor_cfg, worker.actor, worker.dp_group = cfg, engine, engine.pg.dp
    return worker
