"""The reshard plan, checked without processes: the all-gathers are simulated by concatenating the
members' segments, and every rank's generation tensors must equal ``shard(full, tg, g)``."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from hybridflow.hybrid_engine.plan import Piece, copied_own_bytes, plan_reshard
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import (ParamMeta, llama_param_metas, num_layers_of,
                                      owner_stage, shard, stack, stacked_layout,
                                      stage_layer_counts, stage_layers, unshard, unstack)
from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import GenLayout, LayoutError, TrainLayout

LLAMA = ModelConfig(arch="llama", vocab_size=256, hidden_size=128, ffn_hidden_size=128,
                    num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16)
QWEN2 = ModelConfig(arch="qwen2", vocab_size=256, hidden_size=128, ffn_hidden_size=128,
                    num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, qkv_bias=True,
                    tie_embeddings=True)
MODELS = {"llama": LLAMA, "qwen2": QWEN2}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _gen_layouts(max_mp: int = 8) -> list[GenLayout]:
    out = []
    for t in (1, 2, 4):
        for p in (1, 2, 4):
            if t * p > max_mp:
                continue
            for d in (1, 2):
                train = TrainLayout(tp=t, pp=p, dp=d)
                out += [GenLayout(train=train, tp=tg, pp=pg)
                        for tg in _divisors(t) for pg in _divisors(p)]
    # Uneven splits of the 4 layers (layout.last_stage_layers): 3/1, 1/3, and 1/1/2 at a pp that
    # does not divide them; generation stages then merge stages of different sizes.
    for t in (1, 2):
        for p, last in ((2, 1), (2, 3), (3, 2)):
            train = TrainLayout(tp=t, pp=p, last_stage_layers=last)
            out += [GenLayout(train=train, tp=tg, pp=pg)
                    for tg in _divisors(t) for pg in _divisors(p)]
    return out


LAYOUTS = _gen_layouts()


def _layout_id(g: GenLayout) -> str:
    last = "" if g.train.last_stage_layers is None else f"l{g.train.last_stage_layers}"
    return f"t{g.train.tp}p{g.train.pp}{last}d{g.train.dp}-tg{g.tp}pg{g.pp}"


def _full_weights(metas: list[ParamMeta], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g) for m in metas}


def _train_shards(train: TrainLayout, metas: list[ParamMeta], full: dict[str, torch.Tensor]
                  ) -> list[dict[str, torch.Tensor]]:
    """What each rank holds in training: the shards of its own stage's parameters."""
    num_layers = num_layers_of(metas)
    out = []
    for rank in range(train.world_size):
        _, pp_rank, tp_rank = train.coords(rank)
        out.append({m.name: shard(full[m.name], m, train.tp, tp_rank) for m in metas
                    if owner_stage(m, train.pp, num_layers, train.last_stage_layers) == pp_rank})
    return out


def _simulate(plan, shards: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Every micro-DP group's all-gathers, done by concatenating the packed segments; returns per
    rank its generation tensors, read out of a simulated flat storage as the plan prescribes."""
    results: list[dict[str, torch.Tensor]] = [{} for _ in shards]
    for group in plan.groups():
        st = plan.ranks[group[0]].stage
        gathered = []
        for bucket in st.buckets:
            segments = []
            for member, rank in enumerate(group):
                seg = torch.full((bucket.seg_numel,), float("nan"))
                for p in bucket.pieces[member]:
                    src = shards[rank][p.name].reshape(-1)
                    seg[p.dst:p.dst + p.numel] = src[p.offset:p.offset + p.numel]
                segments.append(seg)
            gathered.append(torch.cat(segments))
        storage = torch.full((st.storage_numel,), float("nan"))
        for b, bucket in enumerate(st.buckets):
            if bucket.storage_offset is not None:
                storage[bucket.storage_offset:bucket.storage_offset + bucket.numel] = gathered[b]
        for name, gp in st.params.items():
            if gp.mode in ("concat", "rearrange"):
                parts = [gathered[c.bucket][c.member * st.buckets[c.bucket].seg_numel + c.offset:]
                         [:c.numel].view(c.shape) for c in gp.chunks]
                storage[gp.storage_offset:gp.storage_offset + gp.numel] = (
                    torch.cat(parts, dim=gp.cat_dim).reshape(-1))
        for rank in group:
            for name, gp in st.params.items():
                if gp.mode == "alias":
                    results[rank][name] = shards[rank][name]
                else:
                    results[rank][name] = storage[gp.storage_offset:][:gp.numel].view(gp.shape)
    return results


def _check_storage_disjoint(st) -> None:
    regions = [(b.storage_offset, b.numel) for b in st.buckets if b.storage_offset is not None]
    regions += [(p.storage_offset, p.numel) for p in st.params.values()
                if p.mode in ("concat", "rearrange")]
    regions.sort()
    end = 0
    for start, size in regions:
        assert start == end, "storage regions must tile the storage"
        end = start + size
    assert end == st.storage_numel


@pytest.mark.parametrize("blocks", [False, True], ids=["standard", "stacked"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gen", LAYOUTS, ids=_layout_id)
def test_simulated_gather_matches_generation_shards(gen: GenLayout, model: str,
                                                    blocks: bool) -> None:
    metas = llama_param_metas(MODELS[model])
    full = _full_weights(metas)
    shards = _train_shards(gen.train, metas, full)
    # A small bucket (several per stage) and min_view_bytes between the row sizes: both packed
    # and solo buckets occur.
    plan = plan_reshard(gen, metas, dtype_bytes=4, bucket_bytes=96 * 1024, min_view_bytes=64 * 1024,
                        blocks=blocks)
    results = _simulate(plan, shards)
    num_layers = num_layers_of(metas)
    s = gen.tp_stride
    for rank, got in enumerate(results):
        _, gen_pp, gen_tp = gen.coords(rank)
        expected = [m for m in metas if owner_stage(m, gen.train.pp, num_layers,
                                                    gen.train.last_stage_layers)
                    // gen.pp_stride == gen_pp]
        assert list(got) == [m.name for m in expected], f"rank {rank} covers the wrong parameters"
        for m in expected:
            want = shard(full[m.name], m, gen.tp, gen_tp)
            gp = plan.stages[gen_pp].params[m.name]
            if blocks and s > 1 and stacked_layout(m):  # the s training shards, stacked
                assert gp.blocks == s and got[m.name].shape == (s, *m.shard_shape(gen.train.tp))
                assert torch.equal(got[m.name], torch.stack(
                    [shard(full[m.name], m, gen.train.tp, gen_tp * s + j) for j in range(s)]))
                got[m.name] = unstack(got[m.name], m)
            else:
                assert gp.blocks == 1
            assert torch.equal(got[m.name], want), f"rank {rank}: {m.name} differs"
    for st in plan.stages:
        _check_storage_disjoint(st)


@pytest.mark.parametrize("gen", LAYOUTS, ids=_layout_id)
def test_stacked_shards_leave_nothing_to_copy(gen: GenLayout) -> None:
    """With ``blocks`` every TP-split shard can be resident (its generation tensor a view), at the
    same traffic: only norms are still copied, where TP and PP merge at once."""
    metas = llama_param_metas(LLAMA)
    standard = plan_reshard(gen, metas, dtype_bytes=2, bucket_bytes=96 * 1024)
    stacked = plan_reshard(gen, metas, dtype_bytes=2, bucket_bytes=96 * 1024, blocks=True)
    num_layers = num_layers_of(metas)
    for rank in range(gen.train.world_size):
        assert stacked.ranks[rank].recv_bytes == standard.ranks[rank].recv_bytes
        modes = {p.mode for p in stacked.ranks[rank].stage.params.values()}
        copied = copied_own_bytes(stacked, rank)
        if gen.tp_stride > 1 and gen.pp_stride > 1:  # the replicated parameters of its stage
            stage = gen.train.coords(rank)[1]
            assert copied == 2 * sum(m.numel for m in metas if m.tp_dim is None and owner_stage(
                m, gen.train.pp, num_layers, gen.train.last_stage_layers) == stage)
        else:
            assert modes <= {"alias", "view"} and copied == 0


def test_llama_7b_tp_and_pp_merges_copy_nothing_when_stacked() -> None:
    """The issue's figures: a Llama-7B TP=2 -> TP=1 switch copies 6.28 GiB of a rank's own shards
    without resident parameters, 4.53 GiB with them in the standard layout (fc1 in two halves,
    row-parallel weights interleaved); stacked, 0; and
    PP=2 -> TP=1 (one shard per stage, every tensor a view) 0 either way."""
    cfg = ModelConfig(arch="llama", vocab_size=32000, hidden_size=4096, ffn_hidden_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128)
    metas = llama_param_metas(cfg)
    tp2 = GenLayout(train=TrainLayout(tp=2), tp=1, pp=1)
    pp2 = GenLayout(train=TrainLayout(pp=2), tp=1, pp=1)
    copied = {(name, blocks): max(copied_own_bytes(plan_reshard(g, metas, 2, 256 << 20,
                                                                 blocks=blocks), r)
                                  for r in range(2))
              for name, g in (("tp2", tp2), ("pp2", pp2)) for blocks in (False, True)}
    per_layer = 4096 * 4096 // 2 + 3 * 11008 * 4096 // 2  # linear_proj, fc1, fc2 halves
    assert copied[("tp2", False)] == 2 * 32 * per_layer
    assert round(copied[("tp2", False)] / 2**30, 2) == 4.53
    # not resident at all (the vllm backend's default): the whole shard but the norms (aliases)
    whole = copied_own_bytes(plan_reshard(tp2, metas, 2, 256 << 20), 0, resident=False)
    assert round(whole / 2**30, 2) == 6.28
    assert copied[("tp2", True)] == copied[("pp2", False)] == copied[("pp2", True)] == 0


def _even_metas(cfg: ModelConfig) -> list[ParamMeta]:
    """Only TP-split layer parameters: every byte is divided evenly over TP and PP."""
    return [m for m in llama_param_metas(cfg) if m.position == "layer" and m.tp_dim is not None]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_recv_bytes_is_the_paper_formula_for_an_even_model(model: str) -> None:
    metas = _even_metas(MODELS[model])
    M = 2 * sum(m.numel for m in metas)
    for gen in (g for g in LAYOUTS if g.train.last_stage_layers is None):  # even splits
        t, p, tg, pg = gen.train.tp, gen.train.pp, gen.tp, gen.pp
        plan = plan_reshard(gen, metas, dtype_bytes=2, bucket_bytes=1 << 20)
        formula = Fraction(t * p - tg * pg, tg * pg * t * p) * M
        for r in plan.ranks:
            assert r.recv_bytes == formula, (str(gen), r.rank)
            assert r.padding_bytes == 0, (str(gen), r.rank)
            assert r.send_bytes == (0 if gen.micro_dp == 1 else M // (t * p))


@pytest.mark.parametrize("gen", LAYOUTS, ids=_layout_id)
def test_pieces_fill_the_start_of_each_segment(gen: GenLayout) -> None:
    """A member's ``extent`` (what the executor broadcasts on gloo) is its payload: its pieces
    tile the start of its segment, so no gap and no padding goes on the wire."""
    for model in MODELS.values():
        for blocks in (False, True):
            plan = plan_reshard(gen, llama_param_metas(model), dtype_bytes=4,
                                bucket_bytes=96 * 1024, min_view_bytes=64 * 1024, blocks=blocks)
            for st in plan.stages:
                for b in st.buckets:
                    for k in range(b.members):
                        assert b.extent(k) == b.payload(k) <= b.seg_numel, (str(gen), k)


def test_recv_send_padding_by_hand() -> None:
    """t=2, p=2 -> tg=1, pg=1 (one group of 4). Embedding [16,4] on stage 0; per layer a
    column-parallel W [8,4] and a replicated norm [4]; layers 0 (stage 0) and 1 (stage 1).

    Payload per member (elements): the embedding row [32, 32, 0, 0] (stage-1 members pad 32),
    the W row [16]*4, the norm row [2]*4 (each TP peer sends half of its stage's norm).
    rank 0 (stage 0): recv = 32 + 3*16 + 3*2 = 86 (= gen 136 - own 52 + 2 of its own norm that
    its TP peer sends), padding = 2*32 = 64.  rank 2 (stage 1): recv = 2*32 + 48 + 6 = 118,
    padding = 32. send: 50 for stage 0, 18 for stage 1. All times 4 bytes.
    """
    metas = [ParamMeta(name="emb", shape=(16, 4), tp_dim=0, layer=None, position="pre")]
    for i in range(2):
        metas += [ParamMeta(name=f"layers.{i}.w", shape=(8, 4), tp_dim=0, layer=i,
                            position="layer"),
                  ParamMeta(name=f"layers.{i}.norm", shape=(4,), tp_dim=None, layer=i,
                            position="layer")]
    gen = GenLayout(train=TrainLayout(tp=2, pp=2), tp=1, pp=1)
    for bucket_bytes in (64, 1 << 20):
        plan = plan_reshard(gen, metas, dtype_bytes=4, bucket_bytes=bucket_bytes)
        got = [(r.send_bytes, r.recv_bytes, r.padding_bytes) for r in plan.ranks]
        assert got == [(200, 344, 256), (200, 344, 256), (72, 472, 128), (72, 472, 128)]
        # What the executor's broadcasts send: the payload, no padding.
        assert [4 * sum(b.extent(k) for b in plan.stages[0].buckets)
                for k in range(4)] == [200, 200, 72, 72]


def test_modes_views_and_fc1_rearrangement() -> None:
    metas = llama_param_metas(LLAMA)
    layer = "decoder.layers.0."

    def modes(t, p, tg, pg, min_view_bytes=0):
        plan = plan_reshard(GenLayout(train=TrainLayout(tp=t, pp=p), tp=tg, pp=pg), metas,
                            dtype_bytes=4, bucket_bytes=1 << 20, min_view_bytes=min_view_bytes)
        return {n.removeprefix(layer): gp.mode for n, gp in plan.stages[0].params.items()}

    # Only PP merges (t/tg = 1): every gathered tensor is a view.
    assert set(modes(2, 2, 2, 1).values()) == {"view"}
    # TP merge within one stage: dim-0 splits (fc1 too, as a gate and an up bucket) are views,
    # row-parallel weights are concatenated, norms are the training tensors.
    m = modes(4, 1, 1, 1)
    assert m["self_attention.linear_qkv.weight"] == m["mlp.linear_fc1.weight"] == "view"
    assert m["embedding.word_embeddings.weight"] == m["output_layer.weight"] == "view"
    assert m["self_attention.linear_proj.weight"] == m["mlp.linear_fc2.weight"] == "concat"
    assert m["input_layernorm.weight"] == "alias"
    # TP and PP merges together: the stages' fc1s interleave; gathered as a gate and an up row
    # they are joined in order, packed they need the local [gate; up] re-arrangement.
    m = modes(2, 2, 1, 1)
    assert m["mlp.linear_fc1.weight"] == "concat"
    assert m["self_attention.linear_qkv.weight"] == "view"
    assert modes(2, 2, 1, 1, min_view_bytes=1 << 30)["mlp.linear_fc1.weight"] == "rearrange"
    # Nothing to merge: everything is the training tensor.
    assert set(modes(2, 2, 2, 2).values()) == {"alias"}


def test_shard_unshard_roundtrip_and_fc1_order() -> None:
    m = ParamMeta(name="fc1", shape=(8, 3), tp_dim=0, tp_chunks=2, layer=0, position="layer")
    full = torch.arange(24.0).view(8, 3)
    shards = [shard(full, m, 4, r) for r in range(4)]
    # rank 1 holds [gate rows 1; up rows 5]
    assert torch.equal(shards[1], full[[1, 5]])
    assert torch.equal(unshard(shards, m), full)
    for g in range(2):
        assert torch.equal(unshard(shards[2 * g:2 * g + 2], m), shard(full, m, 2, g))
    row = ParamMeta(name="proj", shape=(2, 4), tp_dim=1, layer=0, position="layer")
    full = torch.arange(8.0).view(2, 4)
    assert torch.equal(unshard([shard(full, row, 2, r) for r in range(2)], row), full)


def test_pipeline_split() -> None:
    assert stage_layers(4, 2, 1) == range(2, 4)
    with pytest.raises(ValueError, match="layout.pp"):
        stage_layers(4, 3, 0)
    metas = llama_param_metas(LLAMA)
    stages = {m.name: owner_stage(m, 4, 4) for m in metas}
    assert stages["embedding.word_embeddings.weight"] == 0
    assert stages["output_layer.weight"] == stages["decoder.final_layernorm.weight"] == 3
    assert stages["decoder.layers.2.mlp.linear_fc2.weight"] == 2
    assert "output_layer.weight" not in {m.name for m in llama_param_metas(QWEN2)}


def test_uneven_pipeline_split_is_megatrons() -> None:
    """``last`` (layout.last_stage_layers) on the last stage, the rest split evenly: the layer
    offsets Megatron-Core's get_transformer_layer_offset gives num_layers_in_last_pipeline_stage."""
    assert stage_layer_counts(30, 2, 13) == [17, 13]
    assert stage_layer_counts(30, 4, 6) == [8, 8, 8, 6]  # a pp that does not divide 30
    assert stage_layer_counts(4, 2) == [2, 2]
    assert [stage_layers(30, 4, r, last=6) for r in range(4)] == [
        range(0, 8), range(8, 16), range(16, 24), range(24, 30)]
    assert [stage_layers(4, 2, r, last=3) for r in range(2)] == [range(0, 1), range(1, 4)]
    # the last stage holding more layers than the others
    metas = llama_param_metas(LLAMA)
    for pp, last in ((2, 1), (2, 3), (3, 2)):
        for m in metas:
            stage = owner_stage(m, pp, 4, last)
            if m.layer is not None:
                assert m.layer in stage_layers(4, pp, stage, last), (pp, last, m.name)
        by_name = {m.name: owner_stage(m, pp, 4, last) for m in metas}
        assert by_name["embedding.word_embeddings.weight"] == 0
        assert by_name["output_layer.weight"] == pp - 1
    assert owner_stage(next(m for m in metas if m.layer == 1), 2, 4, last=3) == 1
    assert owner_stage(next(m for m in metas if m.layer == 0), 2, 4, last=3) == 0
    assert owner_stage(next(m for m in metas if m.layer == 2), 2, 4, last=1) == 0
    assert owner_stage(next(m for m in metas if m.layer == 3), 2, 4, last=1) == 1


@pytest.mark.parametrize("pp, last, message", [
    (1, 2, "needs layout.pp > 1"),
    (2, 0, "between 1 and"),
    (2, 4, "between 1 and"),
    (3, 1, r"split the remaining 3 of 4 layers evenly; pick one of \[2\]"),
])
def test_uneven_split_errors_name_the_field(pp, last, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        stage_layer_counts(4, pp, last)
    assert e.value.field == "layout.last_stage_layers"
    with pytest.raises(ConfigError, match="layout.last_stage_layers") as e:
        owner_stage(llama_param_metas(LLAMA)[1], pp, 4, last)
    assert e.value.field == "layout.last_stage_layers"


def test_bad_layouts_name_the_field() -> None:
    with pytest.raises(ConfigError, match="^tp: generation tp"):
        GenLayout(train=TrainLayout(tp=4), tp=3)
    with pytest.raises(ConfigError, match="^pp: generation pp"):
        GenLayout(train=TrainLayout(pp=4), pp=3)
    metas = llama_param_metas(LLAMA)  # 256 qkv rows do not split 3 ways
    with pytest.raises(LayoutError, match="layout.tp"):
        plan_reshard(GenLayout(train=TrainLayout(tp=3)), metas, 2, 1 << 20)
    with pytest.raises(ValueError, match="layout.pp"):
        plan_reshard(GenLayout(train=TrainLayout(pp=3)), metas, 2, 1 << 20)
    with pytest.raises(LayoutError, match="layout.vpp"):
        plan_reshard(GenLayout(train=TrainLayout(pp=2, vpp=2)), metas, 2, 1 << 20)


def test_stack_is_the_training_shards_and_unstack_its_inverse() -> None:
    metas = [m for m in llama_param_metas(LLAMA) if stacked_layout(m)]
    assert {m.name.split(".")[-2] for m in metas} == {"linear_proj", "linear_fc1", "linear_fc2"}
    full = _full_weights(metas)
    for m in metas:
        for s in (2, 4):
            stacked = stack(full[m.name], m, s)
            assert torch.equal(stacked, torch.stack([shard(full[m.name], m, s, j)
                                                     for j in range(s)]))
            assert torch.equal(unstack(stacked, m), full[m.name])


EMBED, TIED = "embedding.word_embeddings.weight", "output_layer.weight"


@pytest.mark.parametrize("blocks", [False, True], ids=["standard", "stacked"])
@pytest.mark.parametrize("t, p, last", [(1, 2, None), (2, 2, None), (1, 4, None), (1, 2, 3)])
def test_the_tied_copy_sends_part_of_the_embedding(t: int, p: int, last, blocks: bool) -> None:
    """Tied embeddings, PP -> one generation stage: the last stage's copy of the embedding sends
    its last rows, the first stage its first rows; the embedding's all-gather carries no padding
    at PP=2 (half at PP=4: the middle stages hold no copy), nothing else changes, and every rank
    gets the full weights."""
    metas = llama_param_metas(QWEN2)
    gen = GenLayout(train=TrainLayout(tp=t, pp=p, dp=1, last_stage_layers=last), tp=t)
    full = _full_weights(metas)
    shards = _train_shards(gen.train, metas, full)
    embed = next(m for m in metas if m.name == EMBED)
    for rank, own in enumerate(shards):
        if gen.train.coords(rank)[1] == p - 1:
            own[TIED] = shard(full[EMBED], embed, t, gen.train.coords(rank)[2]).clone()
    old = plan_reshard(gen, metas, 4, 1 << 20, min_view_bytes=1024, blocks=blocks)
    plan = plan_reshard(gen, metas, 4, 1 << 20, min_view_bytes=1024, blocks=blocks,
                        tied_copy=TIED)
    rows, cols = embed.shard_shape(t)
    assert plan.tied is not None and plan.tied.row == (rows + 1) // 2
    st = plan.stages[0]
    (b,) = [b for b in st.buckets if any(x.name == EMBED for x in b.pieces[0])]
    assert b.pieces[0] == (Piece(EMBED, 0, plan.tied.row * cols, 0),)
    assert b.pieces[p - 1] == (Piece(TIED, plan.tied.row * cols, (rows - plan.tied.row) * cols,
                                     0),)
    assert b.seg_numel == plan.tied.row * cols  # half the shard: nobody pads a whole one
    assert st.params[EMBED].mode == ("view" if p == 2 else "concat")
    e = 4 * rows * cols
    for rank, (rp, was) in enumerate(zip(plan.ranks, old.ranks)):
        first, lst = rp.member == 0, rp.member == p - 1
        # who already held the embedding (or its copy) now receives the other half of it
        assert rp.recv_bytes - was.recv_bytes == (e // 2 if first else -e // 2 if lst else 0)
        # the embedding's padding: (p - 1) whole segments before (p - 2 for the other ranks),
        # the middle stages' half segments now
        pad_before = e * (p - 1 if first else p - 2)
        pad_after = e // 2 * (p - 2 - (0 if first or lst else 1))
        assert was.padding_bytes - rp.padding_bytes == pad_before - pad_after, rank
    _check_storage_disjoint(st)
    got = _simulate(plan, shards)
    num_layers = num_layers_of(metas)
    for rank, tensors in enumerate(got):
        assert list(tensors) == [m.name for m in metas], rank
        for m in metas:
            w = tensors[m.name]
            if w.dim() == len(m.shape) + 1:
                w = unstack(w, m)
            assert torch.equal(w, shard(full[m.name], m, t, gen.coords(rank)[2])), m.name
    assert owner_stage(embed, p, num_layers, last) == 0


def test_the_tied_copy_is_left_alone_where_it_cannot_help() -> None:
    """No split where the generation pipeline keeps stages (the copy is a generation parameter
    there), with TP merges (the halves would interleave), or without pipeline parallelism."""
    metas = llama_param_metas(QWEN2)
    for t, p, tg in [(2, 2, 1), (1, 1, 1), (2, 1, 1)]:
        gen = GenLayout(train=TrainLayout(tp=t, pp=p, dp=1), tp=tg)
        plan = plan_reshard(gen, metas, 4, 1 << 20, min_view_bytes=1024, tied_copy=TIED)
        assert plan.tied is None
        assert plan.ranks == plan_reshard(gen, metas, 4, 1 << 20, min_view_bytes=1024).ranks
    with pytest.raises(ValueError, match="tied_copy 'embedding.word_embeddings.weight'"):
        plan_reshard(GenLayout(train=TrainLayout(tp=1, pp=2, dp=1), tp=1), metas, 4, 1 << 20,
                     tied_copy=EMBED)
