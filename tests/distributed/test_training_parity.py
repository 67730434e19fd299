"""A training step at TP/PP/VPP/DP/SP, uneven pipeline stages and the distributed optimizer equals
the single-process step.

Each layout starts from the same full weights and sees the same global batch; the loss is a sum
over tokens with a fixed scale, so every layout minimises the same objective. SGD keeps the
comparison exact up to float reduction order; the distributed optimizer supports only Adam, so those
layouts take one Adam step with a large epsilon (the first step is otherwise about sign(grad), which
amplifies that noise).
"""

import pytest
import torch

from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=64)
BATCH, SEQ = 8, 12
# (layout, sequence_parallel, distributed optimizer, (micro_batch_size, forward_micro_batch_size),
# head); the forward passes' micro-batches differ from the training step's in most rows
LAYOUTS_4 = [
    (dict(tp=2, pp=2, dp=1), False, False, (2, 4), "lm"),
    (dict(tp=2, pp=1, dp=2), False, True, (2, None), "lm"),
    (dict(tp=2, pp=1, dp=2), True, False, (4, 2), "lm"),
    (dict(tp=1, pp=2, dp=2, vpp=2), False, False, (1, 2), "lm"),
    (dict(tp=1, pp=1, dp=4), False, True, (1, 2), "lm"),
    (dict(tp=2, pp=2, dp=1), False, False, (2, 8), "value"),
    # uneven stages: 3 layers, then 1 and the output layer (layout.last_stage_layers)
    (dict(tp=1, pp=2, dp=2, last_stage_layers=1), False, False, (2, 4), "lm"),
]


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[5, -4:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask,
            "weight": torch.rand(BATCH, SEQ, generator=g)}


def loss_fn(logprobs, mb):
    # A fixed scale (not a per-rank token count) keeps the objective the same for every layout.
    mask = mb["attention_mask"]
    w = mb["weight"] * mask
    # a share of a sum (the tokens) and a mean over the real tokens, with its count
    return -(logprobs * w).sum() / 100.0, {"tokens": mask.sum(),
                                           "weight": (w.sum() / mask.sum(), mask.sum())}


def value_loss_fn(values, mb):
    return ((values - mb["weight"]) ** 2 * mb["attention_mask"]).sum() / 100.0, {}


def run_layouts(rank, world, layouts, qwen):
    from hybridflow.models.params import init_full_weights, llama_param_metas, stage_layers
    from hybridflow.errors import ConfigError
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine

    model = ModelConfig(**MODEL, arch="qwen2" if qwen else "llama", qkv_bias=qwen,
                        tie_embeddings=qwen)
    full = init_full_weights(llama_param_metas(model), seed=7)
    batch = make_batch()
    results = []
    for layout_kw, sp, dist_opt, (mbs, forward_mbs), head in layouts:
        layout = TrainLayout(**layout_kw)
        optim = (OptimConfig(name="adam", lr=1e-3, adam_eps=1e-3, clip_grad=1.0, distributed=True)
                 if dist_opt else OptimConfig(name="sgd", lr=0.5, clip_grad=1.0))
        engine = TrainEngine(model, layout, EngineConfig(
            micro_batch_size=mbs, forward_micro_batch_size=forward_mbs, sequence_parallel=sp,
            optim=optim), head=head)
        engine.load_full_weights(full)
        d, pp_rank, _ = layout.coords(rank)
        # The layers Megatron built on this rank must be the ones the reshard plan and the
        # checkpoint code take it to hold (models.params.stage_layers).
        held = sorted({int(n.split(".")[2]) for n, _ in engine.named_local_params()
                       if n.startswith("decoder.layers.")})
        split_ok = layout.vpp is not None or held == list(stage_layers(
            model.num_layers, layout.pp, pp_rank, layout.last_stage_layers))
        splits = [None] * world
        torch.distributed.all_gather_object(splits, (rank, held, split_ok))
        per = BATCH // layout.dp
        mine = {k: v[d * per:(d + 1) * per] for k, v in batch.items()}
        per_token = engine.compute_logprobs if head == "lm" else engine.compute_values
        if forward_mbs is not None:  # forward passes split by their own size, and say so
            short = {k: v[:forward_mbs - 1] for k, v in mine.items()}
            with pytest.raises(ConfigError, match="engine.forward_micro_batch_size"):
                per_token(short)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, per_token(mine))
        metrics = engine.train_step(mine, loss_fn if head == "lm" else value_loss_fn)
        if head == "lm":  # on every rank, the whole batch's, whatever the micro-batches
            mask = batch["attention_mask"]
            assert metrics["tokens"] == float(mask.sum()), metrics
            expected = float((batch["weight"] * mask).sum() / mask.sum())
            assert metrics["weight"] == pytest.approx(expected, rel=1e-6), (metrics, expected)
        weights = engine.full_weights()
        if rank == 0:  # the loss is the objective: every DP rank's share summed
            first_of_each_dp = [gathered[layout.rank(dd, 0, 0)] for dd in range(layout.dp)]
            results.append({"layers": splits,
                            "logprobs": torch.cat(first_of_each_dp), "loss": metrics["loss"],
                            "grad_norm": metrics["grad_norm"], "weights": weights,
                            "moved": max((weights[k] - full[k]).abs().max().item()
                                         for k in full if k in weights)})
    return results


@pytest.fixture(scope="module", params=[False, True], ids=["llama", "qwen2-tied-bias"])
def runs(request):
    one = dict(tp=1, pp=1, dp=1)
    sgd, adam, value = spawn(run_layouts, 1, [(one, False, False, (4, None), "lm"),
                                              (one, False, True, (4, None), "lm"),
                                              (one, False, False, (4, None), "value")],
                             request.param)[0]
    multi = spawn(run_layouts, 4, LAYOUTS_4, request.param)[0]
    return {(False, "lm"): sgd, (True, "lm"): adam, (False, "value"): value}, multi


@pytest.mark.parametrize("index", range(len(LAYOUTS_4)),
                         ids=[f"{l}-sp{int(s)}-distopt{int(o)}-{h}" for l, s, o, _, h in LAYOUTS_4])
def test_step_matches_single_process(runs, index):
    refs, multi = runs
    _, _, dist_opt, _, head = LAYOUTS_4[index]
    ref, got = refs[dist_opt, head], multi[index]
    assert all(ok for _, _, ok in got["layers"]), got["layers"]  # (rank, layers held, as planned)
    assert ref["moved"] > 1e-4  # the step did change the weights
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=1e-5)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=1e-5, msg=name)
    assert set(got["weights"]) == set(ref["weights"])
