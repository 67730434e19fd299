"""Micro-batches by a token budget (``engine.max_tokens_per_micro_batch``) compute what the padded
micro-batches do: at TP=2/PP=2, TP=1/PP=2/DP=2 and TP=2/DP=2 with sequence parallelism, on
sequences of very different lengths (left-padded prompts, right-padded responses), the log-probs
equal the padded path's in the batch's order and width, and one SGD step on a token-mean loss
over response tokens gives the same loss, grad norm and weights -- with other micro-batches
(counts, rows and widths; DP ranks with different counts). An on-policy actor update hands its
log-probs back in the batch's order, and an off-policy one reports the metrics of the padded path
in one micro-batch per rank (losses summed, fractions and means weighted by what they count), the
whole batch's on every DP rank. One 4-process launch.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)
PROMPT, RESPONSE = 8, 8
# (prompt, response) tokens per sample: the first half long and mixed, the second short, so that
# at dp=2 the two ranks form different numbers of micro-batches
SPANS = [(8, 8), (1, 1), (6, 2), (2, 7), (1, 1), (1, 2), (2, 1), (1, 1)]
BUDGET = 18
MICRO_BATCH = 2
NOISE_SEED = 2  # old log-probs = the policy's + 2 N(0, 1) on response tokens (both clips bind)
# (layout, sequence_parallel)
LAYOUTS = [(dict(tp=2, pp=2, dp=1), False), (dict(tp=1, pp=2, dp=2), False),
           (dict(tp=2, pp=1, dp=2), True)]


def make_batch():
    from tests.distributed.update_common import spans_batch
    return spans_batch(SPANS, PROMPT, RESPONSE, MODEL["vocab_size"])


def make_noise():
    g = torch.Generator().manual_seed(NOISE_SEED)
    return 2 * torch.randn(len(SPANS), PROMPT + RESPONSE, generator=g)


def loss_fn(logprobs, mb):
    # token-mean over the global batch's response tokens: the same objective at every split
    denominator = make_batch()["response_mask"].sum()
    loss = -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / denominator
    return loss, {}


def run(rank, world):
    from hybridflow.batch import Batch
    from hybridflow.config.rl import ActorConfig
    from tests.distributed.update_common import update_worker
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    model = ModelConfig(**MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
    out = []
    for layout_kw, sp in LAYOUTS:
        layout = TrainLayout(**layout_kw)
        d, p, _ = layout.coords(rank)
        share = Batch(make_batch()).split(layout.dp)[d].tensors
        result = {"layout": layout_kw, "mask": share["attention_mask"]}
        for budget in (None, BUDGET):
            engine = TrainEngine(model, layout, EngineConfig(
                micro_batch_size=MICRO_BATCH, max_tokens_per_micro_batch=budget,
                sequence_parallel=sp, optim=OptimConfig(name="sgd", lr=0.5, clip_grad=0.0)))
            engine.load_full_weights(full)
            mbs = engine._micro_batches(share, forward_only=False)
            logprobs = engine.compute_logprobs(share)
            metrics = engine.train_step(share, loss_fn)
            result[budget] = {"logprobs": logprobs, "loss": metrics["loss"],
                              "grad_norm": metrics["grad_norm"], "weights": engine.full_weights(),
                              "shapes": [tuple(mb["_ids"].shape) for mb in mbs]}
        # An on-policy update (no old log-probs) under the budget returns its training forward's
        # log-probs in the order of the rank's samples.
        if layout.pp == 2 and layout.dp == 2:
            cfg = ActorConfig(layout=layout, kl_loss_coef=0.0, mini_batches=1,
                              engine=EngineConfig(max_tokens_per_micro_batch=BUDGET,
                                                  optim=OptimConfig(name="sgd", lr=0.5)))
            engine = TrainEngine(model, layout, cfg.engine)
            engine.load_full_weights(full)
            update = update_worker(cfg, engine).update_actor(Batch(dict(share)))
            result["on_policy"] = update.tensors.get("old_logprobs")
            result["last_stage"] = p == layout.pp - 1
            noise = Batch({"z": make_noise()}).split(layout.dp)[d]["z"]
            result["off_policy"] = off_policy_metrics(model, full, layout, share, noise)
        out.append(result)
    return out


def off_policy_metrics(model, full, layout, share, noise):
    """The metrics of one off-policy actor update (clipping, dual clip, KL loss, entropy bonus)
    of the rank's ``share``, padded in one micro-batch (None) and under the budget."""
    from hybridflow.batch import Batch
    from hybridflow.config.rl import ActorConfig
    from tests.distributed.update_common import update_worker
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    out = {}
    for budget in (None, BUDGET):
        cfg = ActorConfig(layout=layout, kl_loss_coef=0.1, entropy_coef=0.01, engine=EngineConfig(
            micro_batch_size=len(share["input_ids"]), max_tokens_per_micro_batch=budget,
            optim=OptimConfig(name="sgd", lr=0.5)))
        engine = TrainEngine(model, layout, cfg.engine)
        engine.load_full_weights(full)
        logprobs = engine.compute_logprobs(share)
        data = dict(share, old_logprobs=logprobs + noise * share["response_mask"],
                    ref_logprobs=logprobs)
        out[budget] = update_worker(cfg, engine).update_actor(Batch(data)).meta
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run, 4)


@pytest.mark.parametrize("index", range(len(LAYOUTS)),
                         ids=["tp{tp}-pp{pp}-dp{dp}".format(**l) + f"-sp{int(s)}"
                              for l, s in LAYOUTS])
def test_budget_matches_the_padded_path(results, index):
    initial = None
    counts = set()
    for per_rank in results:
        r = per_rank[index]
        padded, budget = r[None], r[BUDGET]
        # the feature is on: other micro-batches, each within the budget
        assert len(budget["shapes"]) != len(padded["shapes"]), (padded["shapes"],
                                                                budget["shapes"])
        assert all(b * s <= BUDGET for b, s in budget["shapes"]), budget["shapes"]
        counts.add(len(budget["shapes"]))
        # the batch's order and full width, 0 at padding, equal to the padded path's
        assert budget["logprobs"].shape == r["mask"].shape
        assert (padded["logprobs"][r["mask"] == 0] == 0).all()
        torch.testing.assert_close(budget["logprobs"], padded["logprobs"], atol=1e-5, rtol=1e-5)
        assert budget["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
        assert budget["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-4)
        if initial is None:
            from hybridflow.models.config import ModelConfig
            from hybridflow.models.params import init_full_weights, llama_param_metas
            initial = init_full_weights(llama_param_metas(ModelConfig(**MODEL)), seed=3, std=0.3)
        moved = max((padded["weights"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-3
        for name, w in padded["weights"].items():
            torch.testing.assert_close(budget["weights"][name], w, atol=1e-5, rtol=1e-5,
                                       msg=name)
        if "on_policy" in r:
            if r["last_stage"]:
                torch.testing.assert_close(r["on_policy"], padded["logprobs"], atol=1e-5,
                                           rtol=1e-5)
            else:
                assert r["on_policy"] is None
    layout = LAYOUTS[index][0]
    if layout["dp"] == 2:  # the DP ranks formed different numbers of micro-batches
        assert len(counts) == 2, counts
    if layout["pp"] == 2:  # pipeline stages passed activations of several shapes
        shapes = results[0][index][BUDGET]["shapes"]
        assert len({b for b, _ in shapes}) > 1 and len({s for _, s in shapes}) > 1, shapes


def test_update_metrics_do_not_depend_on_the_split(results):
    index = next(i for i, (l, _) in enumerate(LAYOUTS) if l["pp"] == 2 and l["dp"] == 2)
    batch = make_batch()
    response = batch["response_mask"]
    # approx_kl = the mean of old - new log-probs over the whole batch's response tokens
    approx_kl = float((make_noise() * response).sum() / response.sum())
    padded0 = results[0][index]["off_policy"][None]
    for per_rank in results:
        metrics = per_rank[index]["off_policy"]
        padded, budget = metrics[None], metrics[BUDGET]
        assert set(budget) == set(padded)
        for key, value in padded.items():
            assert budget[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            # every DP rank (and stage) reports the whole batch's
            assert value == pytest.approx(padded0[key], rel=1e-5, abs=1e-6), key
        assert padded["actor/approx_kl"] == pytest.approx(approx_kl, rel=1e-4)
        # both clips bind on some tokens and not on others: how they are weighed shows
        for key in ("actor/clip_frac", "actor/dual_clip_frac"):
            assert 0 < padded[key] < 1, (key, padded[key])
