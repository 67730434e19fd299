"""Rule-based rewards: math answers extracted and compared, reasoning-gym scoring, the registry."""

import pytest

from hybridflow.errors import ConfigError, RunError
from hybridflow.data.prompts import PromptItem, reasoning_gym_prompts
from hybridflow.rewards import (REWARD_FUNCTIONS, as_reward_fn, extract_gym_answer, get_reward_fn,
                                gym_reward)
from hybridflow.rewards.math import answers_match, extract_final_answer, math_reward, parse_number


@pytest.mark.parametrize("response, answer", [
    ("12 + 35 = 47. #### 1,234", "1,234"),
    ("#### 72 clips\nthanks", "72 clips"),
    ("so the answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("first \\boxed{1}, then \\boxed{{2}+{3}}", "{2}+{3}"),
    ("48 / 2 = 24. 48 + 24 = 72.", "72"),
    ("The answer is -4.", "-4"),
    ("10-4", "4"),  # a minus after a digit is a subtraction, not a sign
    ("about 1,000,000 people", "1,000,000"),
    ("it is 3/4", "3/4"),
    ("no number here", None),
    ("", None),
])
def test_extract_final_answer(response, answer):
    assert extract_final_answer(response) == answer


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234), ("$1,234.", 1234), ("\\$5.00", 5), ("-0", 0), ("1e3", 1000), ("50%", 50),
    ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("\\dfrac{3}{4}", 0.75), ("-\\frac{3}{4}", -0.75),
    ("\\frac{-3}{4}", -0.75), (".5", 0.5), ("x+1", None), ("1/0", None), ("", None),
])
def test_parse_number(text, value):
    parsed = parse_number(text)
    assert (parsed is None) if value is None else float(parsed) == value


@pytest.mark.parametrize("response, reference, reward", [
    ("Natalia sold 48 + 24 clips. #### 1,234", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("\\boxed{3/4}", "0.75", 1.0),
    ("\\boxed{0.75}", "3/4", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("The answer is -4.", "-4", 1.0),
    ("The answer is 4.", "-4", 0.0),
    ("The answer is -4.", "4", 0.0),
    ("#### -0", "0", 1.0),
    ("#### $18.", "18", 1.0),
    ("#### 1e3", "1000", 1.0),
    ("#### 1000.0000001", "1000", 1.0),  # within 1e-6 relative
    ("#### 1000.01", "1000", 0.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("no number at all", "5", 0.0),
    ("", "5", 0.0),
    ("12 then 5", "5", 1.0),  # the last number counts
    ("5 then 12", "5", 0.0),
    ("48 / 2 = 24. 48 + 24 = 72. #### 72", "In April 48, in May 24. 48 + 24 = 72\n#### 72", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
])
def test_math_reward(response, reference, reward):
    assert math_reward(response, reference) == reward


def test_math_reward_format_bonus():
    assert math_reward("#### 7", "8", format_bonus=0.1) == 0.1
    assert math_reward("\\boxed{7}", "8", format_bonus=0.1) == 0.1
    assert math_reward("7", "8", format_bonus=0.1) == 0.0  # no explicit format, no bonus
    assert math_reward("#### 8", "8", format_bonus=0.1) == 1.0


def test_answers_match_tolerance_is_relative():
    assert answers_match("1000000.5", "1000000")
    assert not answers_match("0.0015", "0.001")


# ------------------------------------------------------------------------------------------------
# reasoning-gym


def _gym_items(task, n=4, seed=3):
    return reasoning_gym_prompts([task], size=n, seed=seed)


def test_extract_gym_answer():
    assert extract_gym_answer("think... <answer> -61 </answer>") == "-61"
    assert extract_gym_answer("<answer>1</answer> no, <answer>2</answer>") == "2"
    assert extract_gym_answer("so \\boxed{42}") == "42"
    assert extract_gym_answer("it is 5, no 7.", reference="7") == "7"
    assert extract_gym_answer("thinking\nyes\n", reference="no") == "yes"
    assert extract_gym_answer("   ") is None


def test_reasoning_gym_basic_arithmetic_scores():
    fn = get_reward_fn("reasoning_gym")
    for item in _gym_items("basic_arithmetic"):
        answer = item.extra["answer"]
        assert item.reference == answer
        assert fn(item, f"Let me compute.\n<answer>{answer}</answer>") == 1.0
        assert fn(item, f"so \\boxed{{{answer}}}") == 1.0
        assert fn(item, f"the result is {answer}") == 1.0
        wrong = str(int(answer) + 1)
        assert fn(item, f"<answer>{wrong}</answer>") == 0.0
        assert fn(item, "I do not know") == 0.0


def test_reasoning_gym_gsm_symbolic_scores():
    fn = get_reward_fn("reasoning_gym")
    for item in _gym_items("gsm_symbolic", n=2):
        answer = item.extra["answer"]
        assert fn(item, f"<answer>{answer}</answer>") == 1.0
        assert fn(item, f"... so {answer} in total") == 1.0
        # gsm_symbolic's own scorer gives 0.01 for a wrong number, 0 for no number.
        assert fn(item, f"<answer>{int(answer) + 1}</answer>") == pytest.approx(0.01)
        assert fn(item, "<answer>many</answer>") == 0.0


def test_reasoning_gym_reward_takes_dicts_and_file_rows():
    item = _gym_items("basic_arithmetic", n=1)[0]
    as_dict = {"messages": item.messages, "reference": item.reference, "extra": item.extra}
    assert get_reward_fn("reasoning_gym")(as_dict, f"<answer>{item.reference}</answer>") == 1.0
    # A row loaded from a file keeps its metadata in extra and its answer as the reference.
    row = {"reference": item.reference, "extra": {"metadata": item.extra["metadata"]}}
    assert get_reward_fn("reasoning_gym")(row, f"<answer>{item.reference}</answer>") == 1.0
    assert gym_reward(item.extra, "<answer>nonsense</answer>") == 0.0


def test_reasoning_gym_reward_without_source_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="source_dataset"):
        get_reward_fn("reasoning_gym")({"reference": "3", "extra": {}}, "3")
    with pytest.raises(ConfigError, match="not a reasoning-gym dataset"):
        gym_reward({"answer": "3", "metadata": {"source_dataset": "no_such_task"}}, "3")


# ------------------------------------------------------------------------------------------------
# registry and user callables


def test_registry_math():
    fn = get_reward_fn("math")
    assert fn(PromptItem(messages=[], reference="72"), "#### 72") == 1.0
    assert fn({"reference": "72"}, "#### 71") == 0.0
    with pytest.raises(ConfigError, match="reference"):
        fn({"reference": None}, "#### 72")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        get_reward_fn("maths")
    assert e.value.field == "reward"
    for name in REWARD_FUNCTIONS:
        assert name in str(e.value)


def test_as_reward_fn_by_name_is_the_registered_function():
    assert as_reward_fn("math") is REWARD_FUNCTIONS["math"]


def test_user_callable_of_the_response():
    fn = as_reward_fn(lambda response: float(len(response) > 3))  # a bool is refused
    assert fn({"reference": None}, "long answer") == 1.0
    assert fn({"reference": None}, "no") == 0.0

    def with_default(response, bonus=0.5):
        return bonus if "yes" in response else 0

    assert as_reward_fn(with_default)({}, "yes") == 0.5


def test_user_callable_of_prompt_and_response():
    def exact(prompt_item, response):
        return float(response.strip() == prompt_item["reference"])

    fn = as_reward_fn(exact)
    assert fn({"reference": "7"}, " 7 ") == 1.0
    assert fn({"reference": "7"}, "8") == 0.0
    assert fn.__name__ == "exact"

    class Scorer:
        def __call__(self, prompt_item, response):
            return len(prompt_item["messages"])

    assert as_reward_fn(Scorer())({"messages": [1, 2]}, "x") == 2.0


def test_user_callable_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(response):\n    return 1.0 if 'ok' in response else 0.0\n")
    fn = as_reward_fn(f"{path}:score")
    assert fn({}, "ok") == 1.0 and fn({}, "no") == 0.0
    assert as_reward_fn("hybridflow.rewards:math_reward_fn")({"reference": "5"}, "#### 5") == 1.0
    with pytest.raises(ConfigError, match="has no 'nope'"):
        as_reward_fn(f"{path}:nope")
    with pytest.raises(ConfigError, match="not found"):
        as_reward_fn(f"{tmp_path / 'missing.py'}:score")


def test_user_callable_bad_signature_or_return():
    with pytest.raises(ConfigError, match=r"\(response\) or \(prompt_item, response\)"):
        as_reward_fn(lambda a, b, c: 0.0)
    with pytest.raises(RunError, match="must return a number"):  # found while running
        as_reward_fn(lambda response: "great")({}, "x")
    with pytest.raises(ConfigError, match="callable"):
        as_reward_fn(3)
