"""The token budget's split (``engine.max_tokens_per_micro_batch``): sequences grouped by length,
every micro-batch within the budget, every sample once, a too-long sequence refused by name; the
plan the engine follows, whose columns put each sequence's real tokens first and which
``to_batch_order`` undoes; metrics that do not depend on the split; and the run config, which
refuses the micro-batch sizes the budget replaces and stops asking the scorers' split of them."""

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.training.config import EngineConfig
from hybridflow.training.micro_batches import plan_micro_batches, to_batch_order, token_budget_split


def test_groups_by_length_within_the_budget():
    lengths = [5, 1, 9, 3, 3, 8, 2, 10]
    groups = token_budget_split(lengths, budget=12)
    # sorted by length, stable (the two 3s keep their order), packed while rows x longest <= 12
    assert groups == [[1, 6, 3, 4], [0], [5], [2], [7]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 12


def test_multiple_rounds_the_width_up():
    # sequence parallelism at tp=4 pads every width to a multiple of 4
    assert token_budget_split([3, 4, 5, 1], budget=8, multiple=4) == [[3, 0], [1], [2]]
    with pytest.raises(ConfigError, match="8 padded to a multiple of tp.*at least 8"):
        token_budget_split([5], budget=7, multiple=4)


def test_a_sequence_over_the_budget_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        token_budget_split([4, 17, 2], budget=16)
    assert e.value.field == "engine.max_tokens_per_micro_batch"
    assert "17 tokens" in str(e.value) and "at least 17" in str(e.value)


def test_an_empty_sequence_costs_one_token():
    assert token_budget_split([0, 0, 2], budget=4) == [[0, 1], [2]]


def test_config_checks_the_budget():
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        EngineConfig(max_tokens_per_micro_batch=0)
    assert EngineConfig(max_tokens_per_micro_batch=None).max_tokens_per_micro_batch is None


def _batch():
    # left-padded prompts (width 4) + right-padded responses (width 4)
    spans = [(4, 4), (1, 1), (3, 2), (2, 4), (4, 1)]
    mask = torch.zeros(len(spans), 8, dtype=torch.long)
    for i, (p, r) in enumerate(spans):
        mask[i, 4 - p:4 + r] = 1
    ids = torch.arange(mask.numel()).reshape(mask.shape) * mask
    return ids, mask


def test_plan_takes_each_span_from_its_first_real_token():
    ids, mask = _batch()
    plans = plan_micro_batches(mask, EngineConfig(max_tokens_per_micro_batch=10), tp=1,
                               forward_only=True)
    assert [p.rows.tolist() for p in plans] == [[1, 2], [4], [3], [0]]
    assert [(p.width, p.padded_width) for p in plans] == [(5, 5), (5, 5), (6, 6), (8, 8)]
    assert plans[0].starts.tolist() == [3, 1]
    assert sum(p.tokens for p in plans) == 10 + 5 + 6 + 8  # vs 40 padded
    # sequence parallelism at tp=4 pads the computed width, not the kept one
    sp = plan_micro_batches(mask, EngineConfig(max_tokens_per_micro_batch=16,
                                               sequence_parallel=True), tp=4, forward_only=False)
    assert all(p.padded_width % 4 == 0 and p.padded_width - p.width < 4 for p in sp)


def test_fixed_size_plan_is_the_padded_path():
    _, mask = _batch()
    mask = mask[:4]
    plans = plan_micro_batches(mask, EngineConfig(micro_batch_size=2), tp=1, forward_only=False)
    assert [p.rows.tolist() for p in plans] == [[0, 1], [2, 3]]
    assert all(p.width == 8 and not p.starts.any() for p in plans)
    with pytest.raises(ConfigError, match="engine.forward_micro_batch_size"):
        plan_micro_batches(mask, EngineConfig(forward_micro_batch_size=3), tp=1,
                           forward_only=True)


def test_fixed_size_plan_drops_the_columns_no_row_uses():
    # an RL batch's widths: prompts left-padded to max_prompt_tokens (6), responses right-padded
    # to max_tokens (4); these prompts are at most 3 tokens and responses at most 3
    from hybridflow.training.micro_batches import _take, used_columns
    spans = [(3, 3), (1, 2), (2, 1), (3, 0)]
    mask = torch.zeros(len(spans), 10, dtype=torch.long)
    for i, (p, r) in enumerate(spans):
        mask[i, 6 - p:6 + r] = 1
    ids = (torch.arange(mask.numel()).reshape(mask.shape) + 1) * mask
    assert used_columns(mask) == (3, 6)  # columns 3..8
    plans = plan_micro_batches(mask, EngineConfig(micro_batch_size=2), tp=1, forward_only=False)
    assert [p.rows.tolist() for p in plans] == [[0, 1], [2, 3]]
    # every micro-batch the same columns (one shape for the pipeline's sends), rows aligned
    assert all(p.starts.tolist() == [3, 3] and (p.width, p.padded_width) == (6, 6)
               for p in plans)
    assert sum(p.tokens for p in plans) == 4 * 6  # vs 4 * 10 at the batch's width
    pieces = [(_take(ids, p), {"_rows": p.rows, "_starts": p.starts, "_width": 10})
              for p in plans]
    assert torch.equal(pieces[0][0], ids[:2, 3:9])
    assert torch.equal(to_batch_order(pieces), ids)  # nothing real was dropped
    # sequence parallelism at tp=4 pads the computed width only
    sp = plan_micro_batches(mask, EngineConfig(micro_batch_size=2, sequence_parallel=True),
                            tp=4, forward_only=False)
    assert all((p.width, p.padded_width) == (6, 8) for p in sp)
    # a batch without a real token keeps its width
    assert used_columns(torch.zeros(2, 5, dtype=torch.long)) == (0, 5)


def test_to_batch_order_undoes_the_plan():
    from hybridflow.training.micro_batches import _take
    ids, mask = _batch()
    plans = plan_micro_batches(mask, EngineConfig(max_tokens_per_micro_batch=10), tp=1,
                               forward_only=True)
    pieces = []
    for p in plans:
        mb = {"_rows": p.rows, "_starts": p.starts, "_width": 8}
        taken = _take(ids, p)
        # real tokens first: the kept columns hold each row's real tokens from column 0
        assert torch.equal(_take(mask, p)[:, 0], torch.ones(len(p.rows), dtype=torch.long))
        pieces.append((taken, mb))
    assert torch.equal(to_batch_order(pieces), ids)


def test_metrics_sum_the_shares_and_weigh_the_means():
    from hybridflow.training.engine import metric_pair, reduce_metrics
    # two micro-batches of 2 and 6 response tokens: a loss share each, and a fraction over tokens
    rows = [{"pg_loss": metric_pair(torch.tensor(0.25)), "clip_frac": metric_pair((0.5, 2))},
            {"pg_loss": metric_pair(torch.tensor(-0.5)), "clip_frac": metric_pair((0.0, 6))}]
    # what one micro-batch of all 8 tokens reports: the whole loss, 1 clipped token of 8
    # (averaging the micro-batches' would give -0.125 and 0.25)
    assert reduce_metrics(rows) == {"pg_loss": -0.25, "clip_frac": 0.125}
    assert reduce_metrics(rows[:1]) == {"pg_loss": 0.25, "clip_frac": 0.5}
    # a mean over nothing counts nothing
    assert reduce_metrics([{"frac": metric_pair((0.0, 0))}]) == {"frac": 0.0}


def _rl(*overrides):
    from hybridflow.config import RLConfig, load_config
    return load_config(RLConfig, None, list(overrides))


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("size", ["micro_batch_size", "forward_micro_batch_size"])
def test_micro_batch_sizes_beside_a_budget_are_refused(role, size):
    ppo = "algorithm.name=ppo"  # the critic trains
    budget, field = f"{role}.engine.max_tokens_per_micro_batch", f"{role}.engine.{size}"
    with pytest.raises(ConfigError) as e:
        _rl(ppo, f"{budget}=64", f"{field}=4")
    assert e.value.field == field and f"set {budget}=null" in e.value.message, e.value
    # either alone is accepted
    assert getattr(_rl(ppo, f"{budget}=64"), role).engine.max_tokens_per_micro_batch == 64
    assert getattr(getattr(_rl(ppo, f"{field}=4"), role).engine, size) == 4


def test_validation_splits_over_the_scorers_ranks_only_under_a_budget():
    from hybridflow.validation import check_validation
    scored = ["reward_model=llama2-7b", "critic.layout.dp=2", "validation.every=1",
              "validation.size=2"]
    with pytest.raises(ConfigError, match="validation.size.*multiple of 4"):
        check_validation(_rl(*scored), 100)  # dp 2 x the default micro-batch of 2
    check_validation(_rl(*scored, "critic.engine.max_tokens_per_micro_batch=64"), 100)


def _rl_batch():
    """[4, 7] as rollout_batch makes them: prompts left-padded to 4, responses right-padded to 3
    (row 2 has none)."""
    spans = [(4, 3), (2, 1), (1, 0), (3, 2)]
    mask, response = torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 7)
    for i, (p, r) in enumerate(spans):
        mask[i, 4 - p:4 + r] = 1
        response[i, 4:4 + r] = 1
    return mask, response


def test_the_output_layer_starts_one_column_before_the_first_response_token():
    from hybridflow.training.micro_batches import first_logit_column, response_starts
    mask, response = _rl_batch()
    starts = response_starts(response, mask.shape)
    assert starts.tolist() == [4, 4, 7, 4]  # 7: no response
    fixed = plan_micro_batches(mask, EngineConfig(micro_batch_size=2), tp=1, forward_only=True)
    # the label at column 3 is the first response token: columns 3..6, 4 of the 7
    assert [first_logit_column(starts, p) for p in fixed] == [3, 3]
    # under a budget each row's span starts at column 0: its response at 4 - (4 - p) = p
    budget = plan_micro_batches(mask, EngineConfig(max_tokens_per_micro_batch=7), tp=1,
                                forward_only=True)
    assert [p.rows.tolist() for p in budget] == [[2, 1], [3], [0]]
    assert [first_logit_column(starts, p) for p in budget] == [1, 2, 3]
    # a micro-batch without a response computes its last column only (here its only one: the
    # row's one prompt token, column 3, is the only column it uses)
    alone = plan_micro_batches(mask[2:3], EngineConfig(micro_batch_size=1), tp=1,
                               forward_only=True)
    assert (alone[0].starts.tolist(), alone[0].width) == ([3], 1)
    assert first_logit_column(starts[2:3], alone[0]) == 0


def test_a_response_mask_of_another_shape_is_refused_by_name():
    from hybridflow.errors import ArgumentError
    from hybridflow.training.micro_batches import response_starts
    mask, response = _rl_batch()
    with pytest.raises(ArgumentError, match="response_mask"):
        response_starts(response[:, :5], mask.shape)
