"""The fingerprint maths of the weight-sync check (hybridflow/hybrid_engine/verify.py): the
partials of the training shards add up to the fingerprint of the tensor they make at any TP size
(stacked or not), it is sensitive to what users' faults do, and the switch's
``weight_sync.verify`` option: every, first, off, and bad values refused."""

import pytest
import torch

from hybridflow.config import load_config, RLConfig
from hybridflow.errors import ConfigError
from hybridflow.hybrid_engine.plan import plan_reshard
from hybridflow.hybrid_engine.verify import (SAMPLE, Probe, SyncCheck, WeightSyncError,
                                             fingerprint, locate, sample)
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import (init_full_weights, llama_param_metas,
                                      megatron_qkv_to_vllm, num_layers_of, owner_stage, shard,
                                      stack)
from hybridflow.parallel.layout import GenLayout, TrainLayout

MODEL = ModelConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
METAS = {m.name: m for m in llama_param_metas(MODEL)}
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"
NORM = "decoder.layers.0.input_layernorm.weight"


def full(name, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(METAS[name].shape, generator=g).to(dtype)


@pytest.mark.parametrize("name", [QKV, FC1, PROJ, NORM, "embedding.word_embeddings.weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partials_of_the_shards_add_up_to_the_whole(name, dtype):
    m, w = METAS[name], full(name, dtype)
    whole = fingerprint(w, m)
    if m.tp_dim is None:  # replicated: every rank's tensor is the whole (one of them sends it)
        assert fingerprint(shard(w, m, 2, 1), m, 2, 1) == whole
        return
    for tp in (2, 4):
        parts = [fingerprint(shard(w, m, tp, r), m, tp, r) for r in range(tp)]
        assert sum(parts) == whole  # exact: integer sums in any order
        # a generation shard at tp/2 is the sum of its two training shards', stacked or not
        for g in range(tp // 2):
            gen = shard(w, m, tp // 2, g)
            assert fingerprint(gen, m, tp // 2, g) == parts[2 * g] + parts[2 * g + 1]
            assert fingerprint(stack(gen, m, 2), m, tp // 2, g, blocks=2) == \
                parts[2 * g] + parts[2 * g + 1]


def test_the_sample_is_a_function_of_the_shape_and_spreads():
    a, b = sample((96, 32)), sample((96, 32))
    assert torch.equal(a.coords, b.coords) and torch.equal(a.weights, b.weights)
    assert len(a.weights) == SAMPLE and (a.weights > 0).all() and (a.weights < 2**20).all()
    flat = a.coords[:, 0] * 32 + a.coords[:, 1]
    assert len(set(flat.tolist())) == SAMPLE  # one per run of 96*32/256 = 12 elements
    assert ((flat // 12) == torch.arange(SAMPLE)).all()
    assert len(set(a.coords[:, 1].tolist())) > 16  # not one column
    assert len(sample((5,)).weights) == 5  # small tensors: every element


def test_faults_change_the_fingerprint():
    m, w = METAS[QKV], full(QKV)
    f = fingerprint(w, m)
    top, bottom = shard(w, m, 2, 0), shard(w, m, 2, 1)
    assert fingerprint(torch.cat([bottom, top]), m) != f  # two TP shards swapped
    assert fingerprint(megatron_qkv_to_vllm(w, MODEL, 1), m) != f  # q/k/v blocks permuted
    assert fingerprint(torch.zeros_like(w), m) != f  # left zero
    assert fingerprint(w + 1e-6, m) != f  # the previous version, a small step away
    bits = w.clone()
    k = tuple(sample(m.shape).coords[7].tolist())
    bits[k] = torch.nextafter(bits[k], torch.tensor(1.0))  # one ulp of one sampled element
    assert fingerprint(bits, m) != f
    p = METAS[PROJ]  # row-parallel: its TP shards are column blocks
    wp = full(PROJ)
    left, right = wp.chunk(2, dim=1)
    assert fingerprint(torch.cat([right, left], dim=1), p) != fingerprint(wp, p)


def test_a_probe_sums_several_tensors_per_slot():
    probe = Probe(2)
    for slot, name in enumerate((QKV, FC1)):
        probe.add(name, slot, locate(METAS[name], sample(METAS[name].shape)), METAS[name].shape)
    ws = {QKV: full(QKV), FC1: full(FC1)}
    got = probe(ws, torch.device("cpu")).tolist()
    assert got == [fingerprint(ws[QKV], METAS[QKV]), fingerprint(ws[FC1], METAS[FC1])]


def _switch_alone(tp: int, pp: int, fault=None):
    """What SyncCheck does for every rank of a TP/PP -> 1 switch, without processes: the sum of
    the members' partials (the all-reduce) against the whole model's tensors."""
    metas = llama_param_metas(MODEL)
    gen = GenLayout(train=TrainLayout(tp=tp, pp=pp, dp=1), tp=1)
    plan = plan_reshard(gen, metas, 4, 1 << 20)
    weights = init_full_weights(metas, seed=1)
    checks = [SyncCheck(plan, r, stacked=True) for r in range(tp * pp)]
    sent = sum(c.sent({m.name: shard(weights[m.name], m, tp, gen.train.coords(r)[2])
                       for m in metas
                       if owner_stage(m, pp, num_layers_of(metas)) == gen.train.coords(r)[1]},
                      torch.device("cpu")) for r, c in enumerate(checks))
    held = dict(weights)
    if fault:
        fault(held)
    checks[0].verify(sent, held, None, torch.float32, version=7)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_sync_check_passes_a_correct_switch_and_names_a_fault(tp, pp):
    _switch_alone(tp, pp)

    def swap(ws):
        ws[QKV] = megatron_qkv_to_vllm(ws[QKV], MODEL, 1)
    with pytest.raises(WeightSyncError) as e:
        _switch_alone(tp, pp, swap)
    assert e.value.tensor == QKV and str(e.value).startswith(
        f"weight sync 7: {QKV} (generation shard tp 0, pp 0) arrived with fingerprint")

    def drop(ws):
        del ws[NORM]
    with pytest.raises(WeightSyncError, match=f"{NORM} .* is missing"):
        _switch_alone(tp, pp, drop)

    def wrong_dtype(ws):
        ws[FC1] = ws[FC1].bfloat16()
    with pytest.raises(WeightSyncError, match=f"{FC1} .* arrived as torch.bfloat16"):
        _switch_alone(tp, pp, wrong_dtype)


def test_the_error_survives_pickling():
    import pickle
    e = pickle.loads(pickle.dumps(WeightSyncError(QKV, 1, 0, 3, "is missing")))
    assert (e.tensor, e.gen_tp_rank, e.version) == (QKV, 1, 3) and "weight sync 3" in str(e)


@pytest.mark.parametrize("value", ["every", "first", "off"])
def test_the_config_takes_each_mode(value):
    cfg = load_config(RLConfig, None, ["model=tiny-llama", f"weight_sync.verify={value}"])
    assert cfg.weight_sync.verify == value
    assert load_config(RLConfig, None, ["model=tiny-llama"]).weight_sync.verify == "every"


def test_a_bad_mode_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, ["model=tiny-llama", "weight_sync.verify=sometimes"])
    assert e.value.field == "weight_sync.verify" and "every, first, off" in e.value.message


def test_the_embedding_is_fingerprinted_from_whoever_sends_it():
    """Tied embeddings at PP=2 -> 1: the last stage's copy sends the embedding's last rows
    (``plan_reshard(tied_copy=...)``), so their samples are counted from the copy, once: a copy
    that differs there is what arrives, and what the check expects."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32,
                      tie_embeddings=True)
    metas = llama_param_metas(cfg)
    embed = "embedding.word_embeddings.weight"
    gen = GenLayout(train=TrainLayout(tp=1, pp=2, dp=1), tp=1)
    plan = plan_reshard(gen, metas, 4, 1 << 20, tied_copy="output_layer.weight")
    weights = init_full_weights(metas, seed=1)
    copy = weights[embed].clone()
    copy[plan.tied.row:] += 1  # the copy drifted in the rows it sends
    shards = [{m.name: weights[m.name] for m in metas
               if owner_stage(m, 2, num_layers_of(metas)) == r} for r in range(2)]
    shards[1]["output_layer.weight"] = copy
    checks = [SyncCheck(plan, r, stacked=True) for r in range(2)]
    sent = sum(c.sent(s, torch.device("cpu")) for c, s in zip(checks, shards))
    arrived = dict(weights)
    arrived[embed] = torch.cat([weights[embed][:plan.tied.row], copy[plan.tied.row:]])
    checks[0].verify(sent.clone(), arrived, None, torch.float32, version=1)
    with pytest.raises(WeightSyncError, match=f"weight sync 1: {embed} .* fingerprint"):
        checks[0].verify(sent.clone(), weights, None, torch.float32, version=1)


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_the_push_reads_every_shards_fingerprint_in_one_pass(gen_tp):
    """PushPlan's probes (a receiver's over its shards; the sender's, the same over the full
    tensors' shard views) give what ``fingerprint`` gives tensor by tensor and shard by shard,
    fused q/k/v and [gate; up] included."""
    from hybridflow.hybrid_engine.push import PushPlan

    metas = list(METAS.values())
    plan = PushPlan.build(metas, torch.float32, gen_tp, 1)
    weights = {m.name: torch.randn(m.shape) for m in metas}
    sent = plan.fingerprints(weights)
    for r in range(gen_tp):
        shards = {m.name: shard(weights[m.name], m, gen_tp, r) for m in metas}
        expected = torch.tensor([fingerprint(shards[m.name], m, gen_tp, r) for m in metas])
        assert torch.equal(sent[:, r], expected)
        assert torch.equal(plan.receiver_probe(r)(shards, torch.device("cpu")), expected)
