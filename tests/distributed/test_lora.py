"""LoRA on the Megatron engine: adapters alone train (the base keeps its bytes, holds no grads or
optimizer state); TP/PP/DP steps equal the single-process step; the adapters off give the base's
log-probs (the reference); the merged weights, through the 3D-HybridEngine too, compute what the
adapted model computes; a checkpoint saved at tp=2/pp=2 loads at tp=1; the HF export is the merged
model and its PEFT adapter, on the base, gives transformers the same logits.

One spawn per world size, several checks each; the tests read the results.
"""

import pytest
import torch

from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_embeddings=True)
BATCH, SEQ, STEPS = 8, 12, 2
LAYOUTS_4 = [dict(tp=2, pp=2, dp=1), dict(tp=2, pp=1, dp=2)]


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask,
            "weight": torch.rand(BATCH, SEQ, generator=g)}


def loss_fn(logprobs, mb):
    # A fixed scale keeps the objective the same at every layout.
    return -(logprobs * mb["weight"] * mb["attention_mask"]).sum() / 100.0, {}


def _full():
    from hybridflow.models.params import init_full_weights, llama_param_metas
    return init_full_weights(llama_param_metas(ModelConfig(**MODEL)), seed=7)


def _lora():
    from hybridflow.training.lora import LoraConfig
    return LoraConfig(rank=4, alpha=8.0)


def _gather_dp(engine, layout, fn, mine):
    """fn(mine) of every DP rank, in DP order (the whole batch), on every rank."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, fn(mine))
    return torch.cat([out[layout.rank(d, 0, 0)] for d in range(layout.dp)])


def lora_checks(rank, world, layouts, ckpt_dir):
    from hybridflow.hybrid_engine.switch import HybridEngine
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.megatron_ckpt import save_train_state

    model, full, batch = ModelConfig(**MODEL), _full(), make_batch()
    results = []
    for layout_kw in layouts:
        layout = TrainLayout(**layout_kw)
        cfg = EngineConfig(micro_batch_size=2, optim=OptimConfig(name="sgd", lr=0.5))
        engine = TrainEngine(model, layout, cfg, lora=_lora())
        engine.load_full_weights(full)
        d, _, _ = layout.coords(rank)
        per = BATCH // layout.dp
        mine = {k: v[d * per:(d + 1) * per] for k, v in batch.items()}
        r = {}
        # Only the adapters train: Megatron's grad buffers hold exactly them.
        adapters = dict(engine.adapters.named_parameters())
        r["trainable"] = sorted(n for c in engine.chunks for n, p in c.module.named_parameters()
                                if p.requires_grad)
        r["adapter_names"] = sorted(n.rsplit(".", 1)[-1] for n in adapters)
        r["grad_numel"] = (sum(b.grad_data.numel() for c in engine.chunks for b in c.buffers),
                           sum(p.numel() for p in adapters.values()))
        r["base_logprobs"] = _gather_dp(engine, layout, engine.compute_logprobs, mine)
        for _ in range(STEPS):
            engine.train_step(mine, loss_fn)
        r["logprobs"] = _gather_dp(engine, layout, engine.compute_logprobs, mine)
        with engine.adapters.disabled():
            r["ref_logprobs"] = _gather_dp(engine, layout, engine.compute_logprobs, mine)
        r["weights"], r["adapters"] = engine.full_weights(), engine.full_adapters()
        merged = engine.full_weights(merged=True)
        # The merged weights in a plain engine compute what the adapted one does.
        plain = TrainEngine(model, layout, cfg, build_optimizer=False)
        plain.load_full_weights(merged)
        r["merged_logprobs"] = _gather_dp(plain, layout, plain.compute_logprobs, mine)
        # The switch sends the merged weights to generation (one generation TP rank: full).
        hybrid = HybridEngine(engine, gen_tp=1)
        gen = hybrid.to_generation()
        r["switch_diff"] = max((t - merged[n]).abs().max().item() for n, t in gen.tensors.items())
        r["switch_redundant"] = gen.redundant_bytes
        hybrid.to_training()
        r["after_switch"] = _gather_dp(engine, layout, engine.compute_logprobs, mine)
        # Merged in place (with the resident switch; small buckets, so that some shards are whole
        # pieces of them and can move): the same generation weights, the base written back after
        # each switch (the second from the host copy the first took).
        hybrid = HybridEngine(engine, gen_tp=1, lora_merge="in_place", resident=True,
                              bucket_mb=0.05)
        for round_ in range(2):
            gen = hybrid.to_generation()
            r[f"in_place_diff{round_}"] = max((t - merged[n]).abs().max().item()
                                              for n, t in gen.tensors.items())
            r["in_place_redundant"] = gen.redundant_bytes
            hybrid.to_training()
            base = engine.full_weights()
            r[f"in_place_base_equal{round_}"] = all(torch.equal(base[n], w)
                                                    for n, w in r["weights"].items())
        r["base_copy_bytes"] = hybrid.base_copy_bytes
        r["in_place_after"] = _gather_dp(engine, layout, engine.compute_logprobs, mine)
        if ckpt_dir is not None and layout_kw == LAYOUTS_4[0]:
            save_train_state(engine, ckpt_dir)
        # A new base (a checkpoint load): the next switch copies it into the same host memory,
        # and the switch back writes back the new base, not the old.
        held = {n: t.data_ptr() for n, t in hybrid._base.items()}
        new_base = {n: w * 0.5 for n, w in r["weights"].items()}
        engine.load_full_weights(new_base)
        hybrid.drop_base_copy()
        hybrid.to_generation()
        hybrid.to_training()
        base = engine.full_weights()
        r["reloaded_base_equal"] = all(torch.equal(base[n], w) for n, w in new_base.items())
        r["base_copy_reused"] = held == {n: t.data_ptr() for n, t in hybrid._base.items()}
        if rank == 0:
            results.append(r)
    return results


def load_and_export(rank, world, ckpt_dir, out_dir, full_dir):
    """tp=1: load the tp=2/pp=2 checkpoint into a LoRA engine, export it to HF + PEFT; also the
    base weights as an HF checkpoint, for PEFT to load the adapter onto."""
    from hybridflow.models.hf import megatron_to_hf, save_hf_checkpoint
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.loading import export_engine_to_hf
    from hybridflow.training.megatron_ckpt import load_train_state, read_checkpoint_lora

    model = ModelConfig(**MODEL)
    lora = read_checkpoint_lora(ckpt_dir)
    engine = TrainEngine(model, TrainLayout(), EngineConfig(), build_optimizer=False, lora=lora)
    load_train_state(engine, ckpt_dir)
    export_engine_to_hf(engine, out_dir)
    save_hf_checkpoint(full_dir, megatron_to_hf(_full(), model), model)
    ids = make_batch()["input_ids"]
    return {"lora": lora, "adapters": engine.full_adapters(),
            "logits": engine.compute_logits({"input_ids": ids,
                                             "attention_mask": torch.ones_like(ids)})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    ckpt = str(tmp / "ckpt")
    ref = spawn(lora_checks, 1, [dict(tp=1, pp=1, dp=1)], None)[0][0]
    multi = spawn(lora_checks, 4, LAYOUTS_4, ckpt)[0]
    exported = spawn(load_and_export, 1, ckpt, str(tmp / "hf"), str(tmp / "base"))[0]
    return ref, multi, exported, tmp


def test_only_adapters_train(runs):
    ref, multi, _, _ = runs
    for r in [ref, *multi]:
        assert r["trainable"] and all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"])
        assert set(r["adapter_names"]) == {"lora_A", "lora_B"}
        grads, adapters = r["grad_numel"]
        assert grads == adapters > 0  # no grad buffer for any base weight
    full = _full()
    for name, w in ref["weights"].items():  # the base kept its bytes
        assert torch.equal(w, full[name]), name


def test_adapters_start_as_the_base_and_learn(runs):
    ref, _, _, _ = runs
    # B starts at zero: the adapted model is the base until it trains; after two steps it is not,
    # and with the adapters off it is the base again (the reference policy).
    assert (ref["logprobs"] - ref["base_logprobs"]).abs().max() > 1e-3
    torch.testing.assert_close(ref["ref_logprobs"], ref["base_logprobs"], atol=0, rtol=0)
    assert any(t.abs().max() > 0 for n, t in ref["adapters"].items() if n.endswith("lora_B"))


@pytest.mark.parametrize("index", range(len(LAYOUTS_4)), ids=[str(l) for l in LAYOUTS_4])
def test_layouts_match_single_process(runs, index):
    ref, multi, _, _ = runs
    got = multi[index]
    for key in ("base_logprobs", "logprobs", "ref_logprobs"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5, msg=key)
    assert set(got["adapters"]) == set(ref["adapters"])
    for name, t in ref["adapters"].items():
        torch.testing.assert_close(got["adapters"][name], t, atol=1e-5, rtol=1e-5, msg=name)
    for name, w in ref["weights"].items():
        assert torch.equal(got["weights"][name], w), name


def test_merged_weights_compute_the_adapted_policy(runs):
    ref, multi, _, _ = runs
    for r in [ref, *multi]:
        torch.testing.assert_close(r["merged_logprobs"], r["logprobs"], atol=1e-5, rtol=1e-5)
        assert r["switch_diff"] == 0.0  # generation gets exactly the merged weights
        assert r["switch_redundant"] > 0  # the merged copies are reported, not hidden
        torch.testing.assert_close(r["after_switch"], r["logprobs"], atol=0, rtol=0)


def test_merge_in_place_gives_the_same_weights_and_the_base_back(runs):
    ref, multi, _, _ = runs
    for r in [ref, *multi]:
        assert r["in_place_diff0"] == r["in_place_diff1"] == 0.0
        assert r["in_place_base_equal0"] and r["in_place_base_equal1"]
        assert r["base_copy_bytes"] > 0
        assert r["reloaded_base_equal"] and r["base_copy_reused"]
        torch.testing.assert_close(r["in_place_after"], r["logprobs"], atol=0, rtol=0)
        assert r["in_place_redundant"] < r["switch_redundant"]
    # One process: every generation tensor is a training tensor, merged where it lies.
    assert ref["in_place_redundant"] == 0


def test_checkpoint_at_another_layout_and_peft_export(runs):
    import transformers
    peft = pytest.importorskip("peft")
    _, multi, exported, tmp = runs
    assert exported["lora"].rank == 4 and exported["lora"].alpha == 8.0
    for name, t in multi[0]["adapters"].items():  # saved at tp=2/pp=2, loaded at tp=1
        torch.testing.assert_close(exported["adapters"][name], t, atol=0, rtol=0, msg=name)
    ids = make_batch()["input_ids"]
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
        torch.testing.assert_close(merged(ids).logits, exported["logits"], atol=1e-4, rtol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base").eval()
        adapted = peft.PeftModel.from_pretrained(base, tmp / "hf" / "lora").eval()
        torch.testing.assert_close(adapted(ids).logits, exported["logits"], atol=1e-4, rtol=1e-4)


def in_place_on_gpu(rank, world):
    """bf16 on a GPU: the merge in place and the base back through pinned host memory."""
    from hybridflow.hybrid_engine.switch import HybridEngine
    from hybridflow.training.config import EngineConfig, OptimConfig
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.lora import merge_adapters

    engine = TrainEngine(ModelConfig(**MODEL), TrainLayout(),
                         EngineConfig(micro_batch_size=2, dtype="bf16",
                                      optim=OptimConfig(name="adam", lr=1e-2)), lora=_lora())
    engine.load_full_weights(_full())
    for _ in range(STEPS):  # B away from zero
        engine.train_step(make_batch(), loss_fn)
    base = {n: p.detach().clone() for n, p in engine.named_local_params()}
    merged = merge_adapters(base, dict(engine.adapters.named_parameters()),
                            engine.adapters.config.scaling)
    hybrid = HybridEngine(engine, gen_tp=1, lora_merge="in_place", resident=True)
    out = {"changed": sum(not torch.equal(merged[n], base[n]) for n in base)}
    for round_ in range(2):
        gen = hybrid.to_generation()
        out[f"diff{round_}"] = max((t - merged[n]).abs().max().item()
                                   for n, t in gen.tensors.items())
        hybrid.to_training()
        out[f"base_equal{round_}"] = all(torch.equal(p, base[n])
                                         for n, p in engine.named_local_params())
    out["pinned"] = all(t.is_pinned() for t in hybrid._base.values())
    return out


@pytest.mark.gpu
def test_merge_in_place_on_gpu():
    out = spawn(in_place_on_gpu, 1, backend="nccl")[0]
    assert out["changed"] > 0  # the adapters trained, so the merge changes weights
    assert out["diff0"] == out["diff1"] == 0.0
    assert out["base_equal0"] and out["base_equal1"]
    assert out["pinned"]
