"""Multi-turn rollouts are token-exact on both backends (vLLM on CPU, Megatron-Core): every sampled
run of a trajectory is what the backend returned for exactly that prefix, with its log-probs; the
tokens between runs are the template's glue around the tool outputs; the trainer's mask covers the
sampled tokens only; and the training engine recomputes the behaviour log-probs at the same
weights as closely as in the single-turn tests.

The tiny random model writes no tool calls, so a test parser reads one in every turn that ends
with a stop token (a third of the vocabulary stops a turn), and an echo tool answers in-process:
the sandbox has tests of its own (tests/unit/test_sandbox.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.parallel.spawn import spawn
from hybridflow.rollout.base import SamplingConfig, rollout_batch
from tests.distributed.rollout_common import CFG, MAX_MODEL_LEN, PROMPTS, logprob_pairs, train_engine

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=40, n=2, seed=3,
                          stop_token_ids=tuple(range(3, CFG.vocab_size, 3)))


class Recorder:
    """A backend whose ``generate`` calls are kept: (prompts, outputs) each."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def generate(self, prompts, sampling):
        outputs = self.backend.generate(prompts, sampling)
        self.calls.append(([list(p) for p in prompts], outputs))
        return outputs


def multi_turn(backend, ckpt):
    """(outputs, recorded calls, the glue's ids per trajectory turn) of a multi-turn batch."""
    from transformers import AutoTokenizer

    from hybridflow.rollout import multi_turn as mt

    mt.PARSERS.setdefault("every_turn", lambda text: [mt.ToolCall("echo", {"text": text[-8:]})])
    config = mt.MultiTurnConfig(tools=["calculator"], parser="every_turn", max_turns=4,
                                max_tool_calls=3)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    glue = mt.ToolGlue(tokenizer)
    recorder = Recorder(backend)
    outputs = mt.generate_multi_turn(
        recorder, PROMPTS, SAMPLING, config, glue,
        lambda call: mt.ToolOutcome(f"echo: {call.arguments['text']}", "ok", 0.0),
        lambda ids: tokenizer.decode(ids))
    return outputs, recorder.calls, glue


def check_exact(outputs, calls, glue) -> dict[str, int]:
    """Assert the module docstring's exactness of ``outputs`` against the recorded ``calls``;
    returns counts that show the check was not vacuous."""
    by_prefix: dict[tuple, list] = {}
    for prompts, outs in calls:
        for o in outs:
            by_prefix.setdefault(tuple(prompts[o.prompt_index]), []).append(o)
    turns = glued = 0
    for o in outputs:
        ids, sampled = o.response_token_ids, o.sampled
        assert len(ids) == len(sampled) == len(o.logprobs) <= SAMPLING.max_tokens
        assert sampled[-1]  # a trajectory ends on the model's turn
        outcomes = iter(o.tools["outcomes"])
        start = 0
        while start < len(ids):
            end = start
            while end < len(ids) and sampled[end] == sampled[start]:
                end += 1
            if sampled[start]:
                # what the backend sampled for exactly this prefix, whole or cut at the budget
                prefix = tuple(o.prompt_token_ids + ids[:start])
                candidates = by_prefix[prefix]
                if start == 0:
                    candidates = [c for c in candidates if c.sample_index == o.sample_index]
                [turn] = [c for c in candidates if c.response_token_ids[:end - start]
                          == ids[start:end]]
                assert end - start == len(turn.response_token_ids) or end == SAMPLING.max_tokens
                assert o.logprobs[start:end] == turn.logprobs[:end - start]
                turns += 1
            else:  # the tool's output in the template's tool role, then the next turn's opening
                assert ids[start:end] == glue.ids([next(outcomes).output], ids[start - 1])
                assert o.logprobs[start:end] == [0.0] * (end - start)
                glued += 1
            start = end
    batch = rollout_batch(outputs)
    for b, o in enumerate(outputs):
        width = batch["input_ids"].shape[1] - max(len(x.response_token_ids) for x in outputs)
        row = batch["response_mask"][b, width:width + len(o.sampled)]
        assert row.tolist() == [int(s) for s in o.sampled]
        got = batch["rollout_logprobs"][b, width:width + len(o.sampled)]
        assert got.tolist() == pytest.approx(o.logprobs, abs=0)
    return {"turns": turns, "glued": glued, "samples": len(outputs)}


def megatron_and_engine(rank, world, ckpt, vllm_outputs=None):
    """In a fresh process: the Megatron backend's multi-turn batch with its exactness counts, the
    training engine's recomputation of its (and vLLM's, where given) behaviour log-probs, and the
    device the backend decoded on with whether its fast decoder (CUDA graphs) ran."""
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.rollout.megatron import MegatronRollout

    engine = train_engine(load_hf_state_dict(ckpt))
    backend = MegatronRollout(ckpt, max_model_len=MAX_MODEL_LEN)
    outputs, calls, glue = multi_turn(backend, ckpt)
    pairs = {"megatron": logprob_pairs(engine, outputs)}
    if vllm_outputs is not None:
        pairs["vllm"] = logprob_pairs(engine, vllm_outputs)
    return check_exact(outputs, calls, glue), pairs, backend.device.type, backend.fast_decode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_checkpoint
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", CFG, seed=0))


@pytest.fixture(scope="module")
def vllm_batch(ckpt):
    pytest.importorskip("vllm")
    from hybridflow.rollout.vllm import VLLMRollout
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
        with VLLMRollout(ckpt, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=16 << 20) as engine:
            return multi_turn(engine, ckpt)


@pytest.fixture(scope="module")
def megatron_results(ckpt, vllm_batch):
    return spawn(megatron_and_engine, 1, ckpt, vllm_batch[0])[0]


def test_vllm_trajectories_are_what_was_sampled(vllm_batch):
    counts = check_exact(*vllm_batch)
    assert counts["glued"] >= counts["samples"] and counts["turns"] > counts["samples"], counts


def test_megatron_trajectories_are_what_was_sampled(megatron_results):
    counts = megatron_results[0]
    assert counts["glued"] >= counts["samples"] and counts["turns"] > counts["samples"], counts


@pytest.mark.parametrize("backend", ["vllm", "megatron"])
def test_training_engine_recomputes_the_behaviour_logprobs(megatron_results, backend):
    rollout_lp, train_lp = megatron_results[1][backend]
    assert rollout_lp.numel() > 20
    torch.testing.assert_close(rollout_lp, train_lp, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_megatron_on_a_gpu_is_exact_and_the_engine_agrees(ckpt):
    """The Megatron backend's GPU path (its fast decoder, CUDA graphs) in the multi-turn loop."""
    counts, pairs, device, fast = spawn(megatron_and_engine, 1, ckpt)[0]
    assert device == "cuda" and fast
    assert counts["glued"] >= counts["samples"] and counts["turns"] > counts["samples"], counts
    rollout_lp, train_lp = pairs["megatron"]
    assert rollout_lp.numel() > 20
    torch.testing.assert_close(rollout_lp, train_lp, atol=1e-4, rtol=0)
