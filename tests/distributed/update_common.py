"""What the actor-update tests share (imported inside the spawned workers)."""


def update_worker(cfg, engine):
    """An ActorRolloutRefWorker around ``engine`` whose ``update_actor`` runs with ``cfg`` (an
    ActorConfig): the method reads only these; the constructor would also load a checkpoint and
    start a rollout engine."""
    from hybridflow.controller.workers import ActorRolloutRefWorker
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.actor_cfg, worker.actor, worker.dp_group = cfg, engine, engine.pg.dp
    return worker


def spans_batch(spans, prompt: int, response: int, vocab_size: int):
    """An RL batch as ``rollout_batch`` lays it out, [len(spans), prompt + response]: each
    (p, r) of ``spans`` a prompt of p random tokens left-padded to ``prompt``, a response of r
    right-padded to ``response``; ``input_ids``, ``attention_mask``, ``response_mask`` (float)
    and per-sequence ``advantages`` spread over the columns, all seeded."""
    import torch
    g = torch.Generator().manual_seed(0)
    n, s = len(spans), prompt + response
    mask = torch.zeros(n, s, dtype=torch.long)
    response_mask = torch.zeros(n, s)
    for i, (p, r) in enumerate(spans):
        mask[i, prompt - p:prompt + r] = 1
        response_mask[i, prompt:prompt + r] = 1.0
    ids = torch.randint(1, vocab_size, (n, s), generator=g) * mask
    advantages = torch.randn(n, 1, generator=g).expand(n, s).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
            "advantages": advantages}
