"""The entropy bonus across ranks: at TP=2 (with PP=2, and with sequence parallelism) the per-token
entropy, the log-probs beside it and one SGD step on a loss with an entropy term equal the TP=1
result, and the entropy is that of the full gathered logits; an actor update with
``actor.entropy_coef > 0`` leaves the policy with more entropy than one without.

One 4-process launch; the TP=1 reference is the dp=4 layout (TP=1 arithmetic, and
test_training_parity shows dp=4 equals the single process).
"""

import math

import pytest
import torch

from hybridflow.parallel.spawn import spawn
from hybridflow.training.model import shift_right

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)
BATCH, SEQ = 4, 7  # 7: sequence parallelism pads it to a multiple of tp
# Weights large enough for peaked next-token distributions: near the uniform one the entropy's
# gradient vanishes and a wrong one would go unseen.
INIT_STD = 0.6
# (layout, sequence_parallel, micro_batch_size); the first is the reference
LAYOUTS = [(dict(tp=1, pp=1, dp=4), False, 1),
           (dict(tp=2, pp=2, dp=1), False, 2),
           (dict(tp=2, pp=1, dp=2), True, 1)]
COEF = 0.5


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    # Tokens predicted from a real one: a padding position attends to nothing, and what it
    # outputs then depends on the padded length (sequence parallelism's differs).
    predicted = (mask * shift_right(mask)).float()
    response = torch.zeros(BATCH, SEQ)
    response[:, 3:] = 1.0
    return {"input_ids": ids, "attention_mask": mask, "predicted": predicted,
            "response_mask": response, "weight": torch.rand(BATCH, SEQ, generator=g) * predicted}


def run(rank, world):
    from hybridflow.algorithms import entropy_from_logits, entropy_loss
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.micro_batches import to_batch_order

    model = ModelConfig(**MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=INIT_STD)
    batch = make_batch()
    results = {"layouts": []}
    for layout_kw, sp, mbs in LAYOUTS:
        layout = TrainLayout(**layout_kw)
        engine = TrainEngine(model, layout, EngineConfig(
            micro_batch_size=mbs, sequence_parallel=sp,
            optim=OptimConfig(name="sgd", lr=0.1, clip_grad=1.0)))
        engine.load_full_weights(full)
        d, p, t = layout.coords(rank)
        # Without the response mask: the loss reads every predicted position, prompt included,
        # which the engine computes only for a batch without one.
        mine = {k: v.chunk(layout.dp)[d] for k, v in batch.items() if k != "response_mask"}
        full_logits_entropy = shift_right(entropy_from_logits(engine.compute_logits(mine)))
        plain_logprobs = engine.compute_logprobs(mine)
        seen = []

        def loss_fn(logprobs, mb):
            seen.append((logprobs.detach(), mb["entropy"].detach(), mb))
            # Fixed scales keep the objective the same at every layout.
            loss = -(logprobs * mb["weight"]).sum() / 50.0
            return loss + COEF * entropy_loss(mb["entropy"], mb["predicted"],
                                              denominator=50.0), {}

        metrics = engine.train_step(mine, loss_fn, with_entropy=True)
        if p == layout.pp - 1:  # where the loss function ran
            # in the batch's columns: a micro-batch leaves out those no row of the share uses
            logprobs_mbs, entropy_mbs, mbs = zip(*seen)
            step_logprobs = to_batch_order(list(zip(logprobs_mbs, mbs)))
            entropy = to_batch_order(list(zip(entropy_mbs, mbs)))
            # The entropy path's log-probs are the plain path's, and its entropy the full
            # softmax's, on this rank's own share, at the predicted positions (what padding
            # outputs depends on the columns a pass computes).
            assert torch.equal(step_logprobs, plain_logprobs)
            torch.testing.assert_close(entropy * mine["predicted"],
                                       full_logits_entropy * mine["predicted"],
                                       atol=1e-5, rtol=1e-5)
        gathered = [None] * world
        mine_out = ((step_logprobs * mine["predicted"], entropy * mine["predicted"])
                    if p == layout.pp - 1 and t == 0 else None)
        torch.distributed.all_gather_object(gathered, mine_out)
        weights = engine.full_weights()
        if rank == 0:
            shares = [gathered[layout.rank(dd, layout.pp - 1, 0)] for dd in range(layout.dp)]
            results["layouts"].append({
                "logprobs": torch.cat([s[0] for s in shares]),
                "entropy": torch.cat([s[1] for s in shares]),
                "grad_norm": metrics["grad_norm"], "weights": weights,
                "moved": max((weights[k] - full[k]).abs().max().item() for k in full)})
    results["update"] = actor_updates(model, full, batch)
    return results


def actor_updates(model, full, batch):
    """The entropy of the response tokens after one actor update at tp=2, pp=2, without and with
    the entropy bonus, and the update's metrics."""
    from hybridflow.algorithms import entropy_from_logits, masked_mean
    from hybridflow.batch import Batch
    from hybridflow.config.rl import ActorConfig
    from tests.distributed.update_common import update_worker
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    def response_entropy(engine, data):
        entropy = shift_right(entropy_from_logits(engine.compute_logits(data)))
        return masked_mean(entropy, data["response_mask"]).item()

    out = {}
    for coef in (0.0, 1.0):
        cfg = ActorConfig(layout=TrainLayout(tp=2, pp=2, dp=1), entropy_coef=coef,
                          engine=EngineConfig(micro_batch_size=BATCH,
                                              optim=OptimConfig(name="sgd", lr=0.1)))
        engine = TrainEngine(model, cfg.layout, cfg.engine)
        engine.load_full_weights(full)
        data = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        data["old_logprobs"] = engine.compute_logprobs(data)
        data["advantages"] = torch.linspace(-1, 1, BATCH)[:, None].expand(BATCH, SEQ)
        before = response_entropy(engine, data)
        metrics = update_worker(cfg, engine).update_actor(Batch(data)).meta
        out[coef] = {"before": before, "after": response_entropy(engine, data),
                     "metrics": metrics}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run, 4)[0]


@pytest.mark.parametrize("index", range(1, len(LAYOUTS)),
                         ids=[f"{l}-sp{int(s)}" for l, s, _ in LAYOUTS[1:]])
def test_entropy_and_its_step_match_tp1(results, index):
    ref, got = results["layouts"][0], results["layouts"][index]
    assert ref["moved"] > 1e-3
    torch.testing.assert_close(got["entropy"], ref["entropy"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=1e-5, msg=name)


def test_entropy_is_that_of_a_peaked_policy(results):
    entropy = results["layouts"][0]["entropy"][make_batch()["predicted"].bool()]
    assert 0.5 < entropy.mean().item() < 0.6 * math.log(MODEL["vocab_size"]), entropy


def test_entropy_bonus_raises_the_policy_entropy(results):
    without, with_bonus = results["update"][0.0], results["update"][1.0]
    assert without["before"] == pytest.approx(with_bonus["before"])  # same weights and data
    assert with_bonus["after"] > without["after"] + 0.01, results["update"]
    assert with_bonus["after"] > with_bonus["before"]
    # The logged entropy is the training policy's, before the step, over response tokens.
    assert with_bonus["metrics"]["actor/entropy"] == pytest.approx(with_bonus["before"], rel=1e-5)
    assert "actor/entropy" not in without["metrics"]
