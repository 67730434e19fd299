"""An on-policy actor update (one epoch of one mini-batch) takes the old log-probs from its own
training forward, detached, instead of a forward pass of their own: at TP=2/PP=2 and at TP=1/PP=2
with DP=2 the log-probs it hands back equal the separate pass's, and the step it takes equals the
step taken with them (weights and metrics). Without old log-probs an update of several
mini-batches is refused. One 4-process launch.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, max_position_embeddings=32)
BATCH, SEQ = 8, 9
LAYOUTS = [dict(tp=2, pp=2, dp=1), dict(tp=1, pp=2, dp=2)]


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    response = torch.zeros(BATCH, SEQ)
    response[:, 4:] = 1.0
    response[3, 7:] = 0.0  # a response that ended early
    advantages = torch.randn(BATCH, 1, generator=g).expand(BATCH, SEQ).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response,
            "advantages": advantages}


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
    for layout_kw in LAYOUTS:
        layout = TrainLayout(**layout_kw)
        d, p, t = layout.coords(rank)
        # This DP rank's share, in micro-batches of 2: several per rank, so their order counts.
        share = Batch(make_batch()).split(layout.dp)[d].tensors
        # "output": the rank whose result the controller collects (tp rank 0 of the last stage)
        result = {"layout": layout_kw, "last_stage": p == layout.pp - 1,
                  "output": p == layout.pp - 1 and t == 0}
        for mode in ("separate", "on_policy", "refused"):
            cfg = ActorConfig(layout=layout, kl_loss_coef=0.0, mini_batches=1,
                              engine=EngineConfig(micro_batch_size=2,
                                                  optim=OptimConfig(name="sgd", lr=0.5)))
            engine = TrainEngine(model, layout, cfg.engine)
            engine.load_full_weights(full)
            data = dict(share)
            if mode == "separate":
                data["old_logprobs"] = engine.compute_logprobs(data)
                result["separate_logprobs"] = data["old_logprobs"]
            if mode == "refused":  # two mini-batches: the second is off-policy
                cfg.mini_batches = 2
            worker = update_worker(cfg, engine)
            if mode == "refused":
                try:
                    worker.update_actor(Batch(data))
                    result["refused"] = None
                except ValueError as e:
                    result["refused"] = str(e)
                continue
            update = worker.update_actor(Batch(data))
            result[mode] = {"metrics": update.meta, "returned": update.tensors.get("old_logprobs"),
                            "weights": engine.full_weights()}
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run, 4)


@pytest.mark.parametrize("index", range(len(LAYOUTS)),
                         ids=["tp{tp}-pp{pp}-dp{dp}".format(**l) for l in LAYOUTS])
def test_on_policy_update_equals_the_separate_pass(results, index):
    full = make_batch()
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    initial = init_full_weights(llama_param_metas(ModelConfig(**MODEL)), seed=3, std=0.3)
    for rank, per_layout in enumerate(results):
        r = per_layout[index]
        sep, onp = r["separate"], r["on_policy"]
        assert sep["returned"] is None  # given old log-probs, the update hands none back
        if r["last_stage"]:
            # the training forward's log-probs, in the order of this rank's sequences
            torch.testing.assert_close(onp["returned"], r["separate_logprobs"], atol=1e-6,
                                       rtol=1e-6)
            assert onp["returned"].shape == (BATCH // r["layout"]["dp"], SEQ)
        else:
            assert onp["returned"] is None
        # The same step: the ratio is 1 either way and its gradient that of the log-probs.
        moved = max((sep["weights"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-2
        for name, w in sep["weights"].items():
            torch.testing.assert_close(onp["weights"][name], w, atol=1e-6, rtol=1e-6, msg=name)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/approx_kl", "actor/clip_frac"):
            assert onp["metrics"][key] == pytest.approx(sep["metrics"][key], abs=1e-6), key
        assert onp["metrics"]["actor/clip_frac"] == 0.0
        assert "ppo_epochs = mini_batches = 1" in r["refused"]
    # Each layout's output ranks together return every sample once.
    dp = LAYOUTS[index]["dp"]
    returned = [per_layout[index]["on_policy"]["returned"] for per_layout in results
                if per_layout[index]["output"]]
    assert len(returned) == dp and sum(len(x) for x in returned) == len(full["input_ids"])
