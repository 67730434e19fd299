"""Prompt data: files, records, reasoning-gym -> PromptItems; tokenizing; the resumable sampler."""

import itertools
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.data.loader import PromptSampler, tokenize_prompts
from hybridflow.data.prompts import (PromptDataConfig, PromptItem, load_prompts,
                                     prompts_from_records)
from hybridflow.models.tiny import make_tiny_tokenizer

ROWS = [
    {"prompt": "What is 12 + 35?", "answer": "47", "level": 1},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 7 * 8?"},
                  {"role": "assistant", "content": "56"}]},
    {"messages": [{"role": "user", "content": "Count to 3."}], "answer": 3},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check_rows(items):
    assert [i.messages for i in items] == [
        [{"role": "user", "content": "What is 12 + 35?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 8?"}],
        [{"role": "user", "content": "Count to 3."}],
    ]
    assert [i.reference for i in items] == ["47", "56", "3"]
    assert items[0].extra == {"level": 1}


def test_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _check_rows(load_prompts(PromptDataConfig(source=str(path))))


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    rows = [{"messages": [{"role": "user", "content": "What is 12 + 35?"},
                          {"role": "assistant", "content": "#### 47"}], "answer": None},
            {"messages": [{"role": "user", "content": "What is 7 * 8?"}], "answer": "56"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    items = load_prompts(PromptDataConfig(source=str(path), system_prompt="Think."))
    assert items[0].messages == [{"role": "system", "content": "Think."},
                                 {"role": "user", "content": "What is 12 + 35?"}]
    assert [i.reference for i in items] == ["#### 47", "56"]  # a null answer: the chat's


def test_parquet_with_prompt_and_answer_columns(tmp_path):
    path = tmp_path / "gsm.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "solution": ["1", "2"]}), path)
    items = load_prompts(PromptDataConfig(source=str(path), prompt_key="question",
                                          answer_key="solution"))
    assert [(i.messages[0]["content"], i.reference, i.extra) for i in items] == [
        ("a?", "1", {}), ("b?", "2", {})]


def test_assistant_turn_is_removed_even_with_an_answer_column():
    items = prompts_from_records([{"messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "long answer"}],
                                   "answer": "short"}])
    assert items[0].messages == [{"role": "user", "content": "q"}]
    assert items[0].reference == "short"


def test_records_and_datasets(tmp_path):
    _check_rows(prompts_from_records(ROWS))
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "a?", "answer": "1"}, {"prompt": "b?", "answer": "2"}]
    items = prompts_from_records(datasets.Dataset.from_list(rows))
    assert [(i.messages, i.reference) for i in items] == [
        ([{"role": "user", "content": "a?"}], "1"), ([{"role": "user", "content": "b?"}], "2")]


def test_system_prompt_does_not_replace_the_rows_own():
    items = prompts_from_records(ROWS, system_prompt="Think.")
    assert items[0].messages[0] == {"role": "system", "content": "Think."}
    assert items[1].messages[0] == {"role": "system", "content": "Be brief."}


# ------------------------------------------------------------------------------------------------
# bad input: one ConfigError naming the file, the row and the column


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as e:
        load_prompts(PromptDataConfig(source=str(path)))
    assert str(path) in str(e.value) and "not found" in str(e.value)


def test_missing_column_names_file_row_and_column(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"},
                                                   {"prompt": "b", "answer": "2"},
                                                   {"prompt": "c"}])
    with pytest.raises(ConfigError) as e:
        load_prompts(PromptDataConfig(source=str(path), answer_key="answer"))
    assert e.value.field == "data.source"
    assert f"{path}: row 3, column 'answer': missing" in str(e.value)
    assert "data.answer_key" in str(e.value)


def test_missing_prompt_column(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["a?"]}), path)
    with pytest.raises(ConfigError) as e:
        load_prompts(PromptDataConfig(source=str(path)))
    assert str(path) in str(e.value) and "row 1, column 'prompt'" in str(e.value)
    assert "data.prompt_key" in str(e.value)
    with pytest.raises(ConfigError, match="row 1, column 'text': missing"):
        load_prompts(PromptDataConfig(source=str(path), prompt_key="text"))


@pytest.mark.parametrize("bad, column, what", [
    ({"messages": {"role": "user"}, "answer": "1"}, "messages", "got dict"),
    ({"messages": [{"role": "user"}]}, "messages", "turn 0 must be {role: str, content: str}"),
    ({"messages": [], "answer": "1"}, "messages", "non-empty list"),
    ({"messages": [{"role": "assistant", "content": "4"}]}, "messages", "only an assistant turn"),
    ({"prompt": 5, "answer": "1"}, "prompt", "got int"),
    ({"prompt": "  ", "answer": "1"}, "prompt", "the prompt is empty"),
    ({"prompt": "q", "answer": [1, 2]}, "answer", "must be a string or a number"),
])
def test_bad_row_names_file_row_and_column(tmp_path, bad, column, what):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ok", "answer": "1"}, bad])
    with pytest.raises(ConfigError) as e:
        load_prompts(PromptDataConfig(source=str(path)))
    message = str(e.value)
    assert message.startswith(f"data.source: {path}: row 2, column '{column}'"), message
    assert what in message


def test_bad_json_line_and_more_bad_rows(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ConfigError, match=r"row 3: not valid JSON"):
        load_prompts(PromptDataConfig(source=str(path)))
    path = _write_jsonl(tmp_path / "many.jsonl", [{"prompt": "a"}, {"x": 1}, {"x": 2}, {"x": 3}])
    with pytest.raises(ConfigError, match=r"row 2, column 'prompt'.*\(2 more bad rows follow\)"):
        load_prompts(PromptDataConfig(source=str(path)))


def test_records_error_names_the_records():
    with pytest.raises(ConfigError, match=r"^prompts: my_rows: row 2, column 'prompt'"):
        prompts_from_records([{"prompt": "a"}, {"text": "b"}], name="my_rows")


def test_config_checks():
    with pytest.raises(ConfigError, match="^source"):
        PromptDataConfig(source="train.csv")
    # A task's name is checked where the prompts are made (a config needs no reasoning-gym).
    with pytest.raises(ConfigError, match="^data.tasks.*basic_arithmetc"):
        load_prompts(PromptDataConfig(tasks=["basic_arithmetc"]))
    with pytest.raises(ConfigError, match="^task_kwargs.*~data.task_kwargs.gsm_symbolic"):
        PromptDataConfig(tasks=["basic_arithmetic"], task_kwargs={"gsm_symbolic": {}})
    # Options for a task that is not listed: a misspelt listed task is named first.
    with pytest.raises(ConfigError, match=r"^tasks: unknown reasoning-gym datasets "
                                          r"\['chian_sum'\]"):
        PromptDataConfig(tasks=["chian_sum"], task_kwargs={"chain_sum": {}})
    with pytest.raises(ConfigError, match="^max_prompt_tokens"):
        PromptDataConfig(max_prompt_tokens=0)
    with pytest.raises(ConfigError, match="^size"):
        PromptDataConfig(tasks=["basic_arithmetic", "gsm_symbolic"], size=1)


def test_config_from_overrides():
    cfg = load_config(PromptDataConfig, None, ["tasks=[basic_arithmetic,gsm_symbolic]",
                                               "task_kwargs.basic_arithmetic.min_terms=3",
                                               "size=10"])
    assert cfg.task_kwargs == {"basic_arithmetic": {"min_terms": 3}}
    items = load_prompts(cfg)
    assert len(items) == 10
    assert [i.extra["metadata"]["source_dataset"] for i in items] == \
        ["basic_arithmetic"] * 5 + ["gsm_symbolic"] * 5
    assert all(i.extra["metadata"]["num_terms"] >= 3 for i in items[:5])


def test_bad_task_kwargs_is_a_config_error():
    with pytest.raises(ConfigError, match="data.task_kwargs.basic_arithmetic"):
        load_prompts(PromptDataConfig(task_kwargs={"basic_arithmetic": {"no_such_option": 1}}))


# ------------------------------------------------------------------------------------------------
# reasoning-gym prompts


def test_reasoning_gym_prompts_deterministic_for_a_seed():
    def load(seed):
        items = load_prompts(PromptDataConfig(tasks=["basic_arithmetic"], size=8, seed=seed))
        return [(i.messages, i.reference) for i in items]

    first = load(7)
    assert len(first) == 8
    assert first == load(7)
    assert first != load(8)
    item = load_prompts(PromptDataConfig(size=1, system_prompt="Answer in <answer> tags."))[0]
    assert item.messages[0] == {"role": "system", "content": "Answer in <answer> tags."}
    assert item.messages[1] == {"role": "user", "content": item.extra["question"]}
    assert item.reference == item.extra["answer"]


FEW_SHOT = [{"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "<answer>2</answer>"}]


def test_few_shot_turns_go_after_the_system_turn_of_every_prompt(tmp_path):
    items = load_prompts(PromptDataConfig(size=2, system_prompt="Think.", few_shot=FEW_SHOT))
    for item in items:
        assert item.messages[:3] == [{"role": "system", "content": "Think."}, *FEW_SHOT]
        assert item.messages[3] == {"role": "user", "content": item.extra["question"]}
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "What is 2 + 2?"}\n')
    [item] = load_prompts(PromptDataConfig(source=str(path), few_shot=FEW_SHOT))
    assert item.messages == [*FEW_SHOT, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize("few_shot, why", [
    ("Q: 1+1? A: 2", "must be a list"),
    ([{"role": "user"}], "turn 0 must be {role: str, content: str}"),
    ([FEW_SHOT[0], {"role": "system", "content": "x"}], "turn 1 is a system turn"),
])
def test_bad_few_shot_names_the_turn(few_shot, why):
    with pytest.raises(ConfigError, match=rf"few_shot: {re.escape(why)}"):
        PromptDataConfig(few_shot=few_shot)


# ------------------------------------------------------------------------------------------------
# tokenizing


def test_tokenize_drops_long_prompts_and_counts_them():
    tok = make_tiny_tokenizer()
    items = [PromptItem(messages=[{"role": "user", "content": "What is 12 + 35?"}]),
             PromptItem(messages=[{"role": "user", "content": "The quick brown fox " * 20}]),
             PromptItem(messages=[{"role": "user", "content": "hello"}], reference="x")]
    lengths = [len(tok.apply_chat_template(i.messages, add_generation_prompt=True,
                                           tokenize=False)) for i in items]
    assert lengths[1] > 100  # characters; the long one is long in tokens too
    kept, dropped = tokenize_prompts(items, tok, max_prompt_tokens=40)
    assert dropped == 1
    assert [k.messages for k in kept] == [items[0].messages, items[2].messages]
    assert kept[1].reference == "x" and items[0].prompt_ids is None  # the inputs are not modified
    expected = tok("<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"]
    assert kept[0].prompt_ids == expected
    assert expected[0] == 1 and expected.count(1) == 2  # one bos per turn, none added twice
    # the limit is inclusive
    kept, dropped = tokenize_prompts(items[:1], tok, max_prompt_tokens=len(expected))
    assert (len(kept), dropped) == (1, 0)
    kept, dropped = tokenize_prompts(items[:1], tok, max_prompt_tokens=len(expected) - 1)
    assert (len(kept), dropped) == (0, 1)


def test_tokenize_needs_a_chat_template():
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        tokenize_prompts([PromptItem(messages=[{"role": "user", "content": "a"}])], tok, 10)


# ------------------------------------------------------------------------------------------------
# sampler


def test_sampler_epochs():
    sampler = PromptSampler(10, 3, seed=1)
    epoch0 = list(itertools.islice(sampler, 3))
    assert len(set(sum(epoch0, []))) == 9  # no repeats within an epoch; the last item is skipped
    assert sampler.state_dict()["epoch"] == 0 and sampler.state_dict()["position"] == 3
    epoch1 = list(itertools.islice(sampler, 3))
    assert sampler.epoch == 1 and epoch1 != epoch0  # reshuffled
    unshuffled = PromptSampler(5, 2, shuffle=False)
    assert list(itertools.islice(unshuffled, 4)) == [[0, 1], [2, 3], [0, 1], [2, 3]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_sampler_resume_equals_uninterrupted(stop_after):
    uninterrupted = list(itertools.islice(PromptSampler(11, 4, seed=5), 12))
    first = PromptSampler(11, 4, seed=5)
    head = list(itertools.islice(first, stop_after))
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(11, 4, seed=5)
    resumed.load_state_dict(state)
    tail = list(itertools.islice(resumed, 12 - stop_after))
    assert head + tail == uninterrupted


def test_sampler_rejects_a_different_run():
    state = PromptSampler(11, 4, seed=5).state_dict()
    with pytest.raises(ValueError, match="n_items"):
        PromptSampler(12, 4, seed=5).load_state_dict(state)
    with pytest.raises(ConfigError, match="^train_batch_size: is 4 but only 3 prompts"):
        PromptSampler(3, 4)
