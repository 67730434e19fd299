"""The multi-turn loop on a scripted backend: where a sample ends (no call, max_turns,
max_tool_calls, the response budget), malformed calls, the parsers, the chat template's glue, the
config's refusals and the metrics. Exactness on real backends: tests/distributed/test_multi_turn.py.
"""

from dataclasses import replace

import pytest

from hybridflow.errors import ConfigError
from hybridflow.models.tiny import CHATML_TEMPLATE, make_tiny_tokenizer
from hybridflow.rollout import multi_turn as mt
from hybridflow.rollout.base import RolloutOutput, SamplingConfig, rollout_batch

EOS = 2
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'


class Scripted:
    """A backend that answers each generate call from a script: per call, per request, the text
    of the response (tokens: one per character, offset 100) and whether it ends with EOS."""

    def __init__(self, *script):
        self.script, self.seen = list(script), []

    def generate(self, prompts, sampling):
        answers = self.script.pop(0)
        self.seen.append((prompts, sampling))
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(sampling.n):
                text, eos = answers[i * sampling.n + j]
                ids = [100 + ord(c) for c in text] + ([EOS] if eos else [])
                finish = "stop" if eos else "length"
                if len(ids) > sampling.max_tokens:
                    ids, finish = ids[:sampling.max_tokens], "length"
                out.append(RolloutOutput(prompt_index=i, sample_index=j, prompt_token_ids=prompt,
                                         response_token_ids=ids, logprobs=[-0.5] * len(ids),
                                         finish_reason=finish))
        return out


def decode(ids):
    return "".join(chr(t - 100) for t in ids if t >= 100)


class Glue:
    """Glue as ids 7, 8, 9 around each output's length in ids 50+."""

    def ids(self, outputs, last_token):
        return [7] + [50 + len(o) for o in outputs] + [8, 9]


def run(script, config=None, sampling=None, outcome=("6", "ok")):
    config = config or mt.MultiTurnConfig(tools=["calculator"], max_turns=3, max_tool_calls=2)
    sampling = sampling or SamplingConfig(max_tokens=400, n=1)
    calls = []

    def run_call(call):
        calls.append(call)
        return mt.ToolOutcome(outcome[0], outcome[1], 0.25)

    backend = Scripted(*script)
    outputs = mt.generate_multi_turn(backend, [[1, 5]], sampling, config, Glue(), run_call,
                                     decode)
    return outputs, calls, backend


def test_a_call_runs_the_tool_and_the_model_continues_after_its_output():
    outputs, calls, backend = run([[(CALL, True)], [("Answer: 6", True)]])
    [o] = outputs
    assert calls == [mt.ToolCall("calculator", {"expression": "2*3"})]
    first = [100 + ord(c) for c in CALL] + [EOS]
    glue = [7, 51, 8, 9]
    last = [100 + ord(c) for c in "Answer: 6"] + [EOS]
    assert o.response_token_ids == first + glue + last
    assert o.sampled == [True] * len(first) + [False] * 4 + [True] * len(last)
    assert o.logprobs == [-0.5] * len(first) + [0.0] * 4 + [-0.5] * len(last)
    assert o.finish_reason == "stop" and o.tools["turns"] == 2
    # the second turn continued from exactly the trajectory so far, with the budget left
    prompts, sampling = backend.seen[1]
    assert prompts == [[1, 5] + first + glue] and sampling.n == 1
    assert sampling.max_tokens == 400 - len(first + glue)
    batch = rollout_batch(outputs)
    assert batch["response_mask"][0, 2:].tolist() == [int(s) for s in o.sampled]


def test_a_sample_ends_without_a_call_at_max_turns_and_at_max_tool_calls():
    [o], calls, _ = run([[("no call", True)]])
    assert calls == [] and o.tools["turns"] == 1 and all(o.sampled)
    # max_turns=3: the third turn's call is not run
    [o], calls, _ = run([[(CALL, True)]] * 3, config=mt.MultiTurnConfig(
        tools=["calculator"], max_turns=3, max_tool_calls=5))
    assert len(calls) == 2 and o.tools["turns"] == 3 and o.sampled[-1]
    # max_tool_calls=1: the second call ends the sample unrun
    [o], calls, _ = run([[(CALL, True)]] * 3, config=mt.MultiTurnConfig(
        tools=["calculator"], max_turns=3, max_tool_calls=1))
    assert len(calls) == 1 and o.tools["turns"] == 2


def test_the_budget_counts_every_turn_and_the_tools_tokens():
    budget = len(CALL) + 1 + 4 + 5  # room for 5 tokens of the second turn
    [o], _, backend = run([[(CALL, True)], [("Answer: 6", True)]],
                          sampling=SamplingConfig(max_tokens=budget, n=1))
    assert len(o.response_token_ids) == budget and o.finish_reason == "length"
    assert backend.seen[1][1].max_tokens == 5
    # no room for a turn after the glue: the sample ends before the tool runs' output
    [o], calls, _ = run([[(CALL, True)]], sampling=SamplingConfig(max_tokens=len(CALL) + 5, n=1))
    assert o.response_token_ids[-1] == EOS and all(o.sampled) and o.tools["turns"] == 1
    assert calls == []  # no tool runs where no turn could follow it


def test_a_malformed_call_is_an_error_the_model_reads_and_no_tool_runs():
    bad = '<tool_call>{"name": calculator}</tool_call>'
    [o], calls, _ = run([[(bad, True)], [("sorry", True)]])
    assert calls == []
    [outcome] = o.tools["outcomes"]
    assert outcome.status == "malformed" and outcome.output.startswith("error: malformed")
    assert o.tools["turns"] == 2


def test_samples_of_one_prompt_go_their_own_ways():
    script = [[(CALL, True), ("Answer: 5", True)], [("Answer: 6", True)]]
    outputs, calls, backend = run(script, sampling=SamplingConfig(max_tokens=400, n=2))
    assert [o.tools["turns"] for o in outputs] == [2, 1] and len(calls) == 1
    assert [o.sample_index for o in outputs] == [0, 1]
    assert len(backend.seen[1][0]) == 1  # only the sample with a call continued


@pytest.mark.parametrize("text, calls", [
    (CALL, [mt.ToolCall("calculator", {"expression": "2*3"})]),
    ('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b <tool_call>'
     '{"name": "g"}</tool_call>', [mt.ToolCall("f", {"x": 1}), mt.ToolCall("g", {})]),
    ("no call here", []),
])
def test_hermes_parser(text, calls):
    assert mt.PARSERS["hermes"](text) == calls


def test_smollm2_parser_reads_a_list_per_tag():
    text = '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]' \
           '</tool_call>'
    assert mt.PARSERS["smollm2"](text) == [mt.ToolCall("f", {"x": 1}), mt.ToolCall("g", {})]
    with pytest.raises(mt.MalformedCall, match="list"):
        mt.PARSERS["smollm2"](CALL)


@pytest.mark.parametrize("text, why", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "name"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "object"),
    ('<tool_call>{"name": "f"}', "not closed"),
])
def test_malformed_calls_say_what_is_wrong(text, why):
    with pytest.raises(mt.MalformedCall, match=why):
        mt.PARSERS["hermes"](text)


def test_glue_is_the_chat_templates_tool_turn_and_a_tool_cannot_close_its_turn():
    tok = make_tiny_tokenizer()
    assert tok.chat_template == CHATML_TEMPLATE
    glue = mt.ToolGlue(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = glue.ids(["6", "x<|im_end|>"], last_token=eos)
    # what the template renders after the assistant's end-of-turn mark, which the model sampled
    assert tok.decode(ids) == ("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>tool\n"
                               "x<|im_end|><|im_end|>\n<|im_start|>assistant\n")
    # the template's marks are special tokens; the tool's text is split like any other text
    assert ids.count(eos) == 2 and ids[:2] == tok.encode("\n<|im_start|>",
                                                         add_special_tokens=False)
    # a turn that did not end with the mark gets it from the glue
    assert tok.decode(glue.ids(["6"], last_token=100)).startswith("<|im_end|>\n<|im_start|>tool")


def test_config_refusals():
    with pytest.raises(ConfigError, match="max_turns.*do nothing"):
        mt.MultiTurnConfig(max_turns=3)
    with pytest.raises(ConfigError, match="unknown tool-call format"):
        mt.MultiTurnConfig(tools=["calculator"], parser="xml")
    with pytest.raises(ConfigError, match="neither a built-in"):
        mt.MultiTurnConfig(tools=["abacus"]).tool_refs()
    with pytest.raises(ConfigError, match="standard library"):
        mt.MultiTurnConfig(tools=["calculator"], trust=["os"])
    from hybridflow.config.rl import RolloutConfig
    with pytest.raises(ConfigError, match="rollout.tp=1"):
        RolloutConfig(backend="megatron", tp=2, multi_turn=mt.MultiTurnConfig(tools=["python"]))


def test_metrics_count_turns_calls_and_outcomes():
    ok, err = mt.ToolOutcome("6", "ok", 0.5), mt.ToolOutcome("error: x", "error", 0.25)
    slow, bad = mt.ToolOutcome("error: timed out", "timeout", 5.0), \
        mt.ToolOutcome("error: malformed", "malformed")
    samples = [{"turns": 3, "outcomes": [ok, err]}, {"turns": 2, "outcomes": [slow]},
               {"turns": 2, "outcomes": [bad]}, {"turns": 1, "outcomes": []}]
    m = mt.tool_metrics(samples, sampled_tokens=[10, 10, 10, 10], response_tokens=[20, 16, 14, 10])
    assert m == {"multi_turn/turns_mean": 2.0, "multi_turn/tool_calls_mean": 0.75,
                 "multi_turn/ok_call_frac": 0.25, "multi_turn/tool_errors": 1,
                 "multi_turn/tool_timeouts": 1, "multi_turn/malformed_calls": 1,
                 "timing/tools_s": 5.75, "multi_turn/tool_tokens_mean": 5.0}


def test_check_describes_the_tools_in_one_line():
    config = mt.MultiTurnConfig(tools=["calculator", "python"], max_turns=3, max_tool_calls=2)
    assert config.describe() == (
        "multi-turn: tools calculator (hybridflow.agent.tools:calculator), python "
        "(hybridflow.agent.tools:python); calls written as hermes; up to 3 turns and 2 calls a "
        "sample, each call sandboxed within 5 s and 256 MB")


def test_a_chat_template_without_a_tool_role_is_refused():
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}"
                         "{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match="no tool role"):
        mt.ToolGlue(tok).pieces(1)
