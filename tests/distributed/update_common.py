"""What the actor-update tests share (imported inside the spawned workers)."""


def update_worker(cfg, engine):
    """An ActorRolloutRefWorker around ``engine`` whose ``update_actor`` runs with ``cfg`` (an
    ActorConfig): the method reads only these; the constructor would also load a checkpoint and
    start a rollout engine."""
    from hybridflow.workers.actor import ActorRolloutRefWorker
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


# A small Llama for gradient-equality tests (the fused or by-row path against Megatron's own).
GRAD_MODEL = dict(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=32)


def weighted_logprob_batch():
    """(batch, loss_fn) of 4 sequences of 16 tokens over GRAD_MODEL's whole vocabulary and a
    loss of their per-token weighted log-probs, seeded: a training step with two micro-batches
    of 2 accumulates gradients once at least."""
    import torch
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, GRAD_MODEL["vocab_size"], (4, 16), generator=g),
             "attention_mask": torch.ones(4, 16, dtype=torch.long),
             "weight": torch.rand(4, 16, generator=g)}

    def loss_fn(logprobs, mb):
        return -(logprobs * mb["weight"]).sum() / 64, {}

    return batch, loss_fn
