"""The output layer over the response only (a batch with ``response_mask``) computes what the full
width does where it is read: at TP=2 with sequence parallelism and PP=2, PP=2 with DP=2 under a
token budget, TP=2 with sequence parallelism under a token budget, and TP=2/DP=2, the log-probs
equal the full-width path's at response positions (and are 0 elsewhere), and a training step on a
token-mean loss with an entropy bonus over response tokens gives the same loss, grad norm and
gradients -- while the last stage's output layer computes fewer positions: from each micro-batch's
first response column minus one. One 4-process launch.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32, tie_embeddings=True)
PROMPT, RESPONSE = 9, 7
# (prompt, response) tokens per sample: left-padded prompts, right-padded responses, one empty
SPANS = [(9, 7), (2, 1), (6, 3), (3, 6), (1, 0), (4, 2), (2, 5), (7, 1)]
BUDGET = 24
# (layout, sequence_parallel, max_tokens_per_micro_batch)
CASES = [(dict(tp=2, pp=2, dp=1), True, None), (dict(tp=1, pp=2, dp=2), False, BUDGET),
         (dict(tp=2, pp=1, dp=2), True, BUDGET), (dict(tp=2, pp=1, dp=2), False, None)]
ENTROPY_COEF = 0.05


def make_batch():
    """(the batch without its response mask, the mask): ``weight`` is the mask under another
    name, which the full-width path's loss reads."""
    from tests.distributed.update_common import spans_batch
    batch = spans_batch(SPANS, PROMPT, RESPONSE, MODEL["vocab_size"])
    response = batch.pop("response_mask")
    return batch | {"weight": response.clone()}, response


def loss_fn(logprobs, mb):
    # token-mean over the global batch's response tokens, an entropy bonus beside
    w = mb["weight"]
    denominator = make_batch()[1].sum()
    loss = -(logprobs * mb["advantages"] * w).sum() / denominator
    return loss - ENTROPY_COEF * (mb["entropy"] * w).sum() / denominator, {}


def run(rank, world):
    from hybridflow.batch import Batch
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    model = ModelConfig(**MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
    batch, response = make_batch()
    out = []
    for layout_kw, sp, budget in CASES:
        layout = TrainLayout(**layout_kw)
        d, p, _ = layout.coords(rank)
        engine = TrainEngine(model, layout, EngineConfig(
            micro_batch_size=2, max_tokens_per_micro_batch=budget, sequence_parallel=sp,
            optim=OptimConfig(name="sgd", clip_grad=0.0)))
        rows: list[int] = []  # positions the output layer computed, per micro-batch
        for chunk in engine.chunks:
            if chunk.module.post_process:
                chunk.module.output_layer.register_forward_hook(
                    lambda module, args, output: rows.append(output[0].shape[0]))
        result = {"last_stage": p == layout.pp - 1}
        for name, fields in (("full", {}), ("sliced", {"response_mask": response})):
            share = Batch(batch | fields).split(layout.dp)[d].tensors
            engine.load_full_weights(full)
            rows.clear()
            logprobs = engine.compute_logprobs(share)
            forward_rows = list(rows)
            metrics = engine.train_step(share, loss_fn, with_entropy=True)
            result[name] = {
                "logprobs": logprobs, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                # this rank's gradients, reduced over DP (kept until the next step zeroes them)
                "grads": {n: w.main_grad.clone() for n, w in engine.named_local_params()},
                "rows": forward_rows,
                "expected_rows": [mb["_ids"].shape[1] - mb["_logits_from"]
                                  for mb in engine._micro_batches(share, forward_only=True)],
                "response": share.get("response_mask")}
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run, 4)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=["tp{tp}-pp{pp}-dp{dp}".format(**l) + f"-sp{int(s)}-budget{b}"
                              for l, s, b in CASES])
def test_the_response_output_layer_matches_the_full_width(results, index):
    for per_rank in results:
        r = per_rank[index]
        full, sliced = r["full"], r["sliced"]
        response = sliced["response"].bool()
        torch.testing.assert_close(sliced["logprobs"], torch.where(response, full["logprobs"],
                                                                   0.0), atol=1e-6, rtol=1e-6)
        assert (full["logprobs"][~response] != 0).any()  # the full width computes the prompt
        assert sliced["loss"] == pytest.approx(full["loss"], rel=1e-6, abs=1e-7)
        assert sliced["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
        assert max(g.abs().max().item() for g in full["grads"].values()) > 1e-2
        for name, g in full["grads"].items():
            torch.testing.assert_close(sliced["grads"][name], g, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
        if r["last_stage"]:
            # the feature is on: the output layer computed the response columns (and the one
            # before), fewer than the full width's
            assert sliced["rows"] == sliced["expected_rows"], sliced["rows"]
            assert full["rows"] == full["expected_rows"]
            assert sum(sliced["rows"]) < sum(full["rows"]), (sliced["rows"], full["rows"])
        else:
            assert sliced["rows"] == full["rows"] == []
    layout, _, budget = CASES[index]
    if budget is None:  # fixed micro-batches: every row's response starts at column PROMPT
        last = next(per_rank[index] for per_rank in results if per_rank[index]["last_stage"])
        assert set(last["sliced"]["rows"]) == {RESPONSE + 1}
