"""Invalid layouts fail with one message naming the field and the fix; valid ones map ranks as
Megatron's tp-pp-dp order does."""

import pytest

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import GenLayout, LayoutError, TrainLayout
from hybridflow.training.config import EngineConfig
from hybridflow.training.model import check_model_fits_layout

MODEL = ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=16)


def test_rank_order_is_tp_innermost_then_pp_then_dp():
    L = TrainLayout(tp=2, pp=2, dp=2)
    assert L.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert L.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert L.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert L.coords(6) == (1, 1, 0)
    assert all(L.rank(*L.coords(r)) == r for r in range(8))


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(LayoutError, match=r"world size 4 != tp\*pp\*dp = 2\*1\*1 = 2.*layout.dp"):
        TrainLayout(tp=2).check_world(4)


@pytest.mark.parametrize("kw, field", [(dict(tp=0), "tp"), (dict(pp=-1), "pp"),
                                        (dict(vpp=2), "vpp"),
                                        (dict(pp=2, last_stage_layers=0), "last_stage_layers")])
def test_bad_sizes(kw, field):
    with pytest.raises(ConfigError) as e:
        TrainLayout(**kw)
    assert e.value.field == field


@pytest.mark.parametrize("kw, message", [
    (dict(last_stage_layers=1), "needs pp > 1"),
    (dict(pp=2, vpp=2, last_stage_layers=1), "not supported together with vpp"),
])
def test_uneven_split_is_refused_without_a_pipeline_or_with_vpp(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainLayout(**kw)
    assert e.value.field == "last_stage_layers"


@pytest.mark.parametrize("layout, message", [
    (TrainLayout(pp=2, last_stage_layers=4), "4 is not between 1 and the model's 4 layers"),
    (TrainLayout(pp=3, last_stage_layers=1), r"remaining 3 of 4 layers evenly; pick one of \[2\]"),
])
def test_uneven_split_that_does_not_fit_the_model_names_the_field(layout, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_model_fits_layout(MODEL, layout, EngineConfig())
    assert e.value.field == "layout.last_stage_layers"


def test_uneven_split_lets_a_pp_that_does_not_divide_the_layers_fit():
    check_model_fits_layout(MODEL, TrainLayout(pp=3, last_stage_layers=2), EngineConfig())
    with pytest.raises(ConfigError, match="or set layout.last_stage_layers"):
        check_model_fits_layout(MODEL, TrainLayout(pp=3), EngineConfig())


@pytest.mark.parametrize("layout, message", [
    (TrainLayout(tp=8), "tp=8 must divide model.num_heads=4"),
    (TrainLayout(tp=4), "tp=4 must divide model.num_kv_heads=2"),
    (TrainLayout(pp=3), r"pp\*vpp=3 must divide model.num_layers=4"),
    (TrainLayout(pp=2, vpp=4), r"pp\*vpp=8 must divide model.num_layers=4"),
])
def test_model_does_not_fit_layout(layout, message):
    with pytest.raises(ConfigError, match=message):
        check_model_fits_layout(MODEL, layout, EngineConfig())


def test_sequence_parallel_needs_tp():
    with pytest.raises(ConfigError, match="engine.sequence_parallel"):
        check_model_fits_layout(MODEL, TrainLayout(), EngineConfig(sequence_parallel=True))


def test_generation_tp_must_divide_training_tp():
    with pytest.raises(ConfigError, match=r"tp: generation tp=3 must divide the training tp=4; "
                                          r"pick one of \[1, 2, 4\]"):
        GenLayout(train=TrainLayout(tp=4), tp=3)


def test_generation_layout_of_the_paper():
    # t=4, tg=2: micro-DP groups {0,1},{2,3}; generation TP groups at stride t/tg = 2.
    g = GenLayout(train=TrainLayout(tp=4), tp=2)
    assert g.micro_dp == 2
    assert g.micro_dp_groups() == [[0, 1], [2, 3]]
    assert sorted(g.tp_groups()) == [[0, 2], [1, 3]]


def test_model_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="^num_kv_heads: 3 does not divide num_heads=4"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="^dtype: unknown value 'fp8'"):
        EngineConfig(dtype="fp8")
