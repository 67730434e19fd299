"""The controller's logic without Ray: RLTrainer's steps over stand-in worker groups that answer
like the real ones (same methods, same Batch keys), so what the driver does with the answers --
which prompts it draws, how it scores, which KL it applies, what it logs -- is checked exactly."""

import json
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms import estimate_advantages
from hybridflow.batch import Batch
from hybridflow.config.placement import resolve_placement
from hybridflow.driver.dataflow import Timeline
from hybridflow.driver.groups import ActorGroup, Groups, ScorerGroup
from hybridflow.tracking import CLOCK_KEYS
from hybridflow.trainer import RLTrainer

T = 3  # response tokens per sample


class FakeActor:
    """Answers generate / log-prob calls like ActorRolloutRefWorker's group: every sample is T
    response tokens; the policy's log-prob of a token is -0.5, the reference's
    -0.5 - kl_gap * (the row's index), so sample i is kl_gap * i nats per token from it."""

    name = "actor"

    def __init__(self, kl_gap=0.0, nonfinite_at=()):
        self.kl_gap, self.generated, self.samplings = kl_gap, [], []
        self.nonfinite_at = nonfinite_at  # updates (1-based) whose gradients are not finite
        self.updates = 0
        self.calls = []  # the methods run_by_dp was asked for, in order

    def run(self, method, path):
        """save_state / load_state: the weights, as a file that says which update they are."""
        state = Path(path) / "actor" / "weights"
        if method == "save_state":
            state.parent.mkdir()
            state.write_text(str(self.updates))
        else:
            assert method == "load_state", method
            self.updates = int(state.read_text())

    def run_by_dp(self, method, batch, view="train", sampling=None):
        if method == "generate":
            return self._generate(batch, sampling)
        b = len(batch)
        self.calls.append(method)
        if method == "compute_log_prob":
            return Batch({"old_logprobs": torch.full((b, T), -0.5)})
        if method == "compute_ref_log_prob":
            gap = self.kl_gap * torch.arange(b, dtype=torch.float32)[:, None]
            return Batch({"ref_logprobs": -0.5 - gap.expand(b, T)})
        if method == "update_actor":
            self.updates += 1
            out = Batch(meta={"actor/pg_loss": 0.0, "actor/nonfinite_skipped":
                              float(self.updates in self.nonfinite_at)})
            if "old_logprobs" not in batch:  # on-policy: its forward's, as the worker does
                out.tensors["old_logprobs"] = torch.full((b, T), -0.5)
            return out
        raise AssertionError(method)

    def _generate(self, batch, sampling):
        self.samplings.append(sampling)
        n = 1 if sampling is not None else 2
        rows = [j for j in range(len(batch)) for _ in range(n)]
        self.generated.append([batch["item"][j].messages[-1]["content"] for j in range(len(batch))])
        # 1 prompt token, T response tokens; row r of the output ends in token 10 + r.
        ids = torch.tensor([[7, 8, 9, 10 + r] for r in range(len(rows))])
        response = torch.tensor([[0, 1, 1, 1]] * len(rows), dtype=torch.float32)
        out = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "response_mask": response[:, 1:].contiguous(),
                     "rollout_logprobs": torch.full((len(rows), T), -2.0)},
                    {k: [v[j] for j in rows] for k, v in batch.lists.items()})
        out.tensors["input_ids"] = ids[:, 1:]
        out.tensors["attention_mask"] = torch.ones_like(ids[:, 1:])
        out.lists["finish_reason"] = ["stop"] * len(rows)
        return out


class FakeRewardModel:
    """A reward-model group: scores 10 + the id of the sample's last token."""

    name = "reward_model"

    def run_by_dp(self, method, batch, **_):
        assert method == "compute_scores"
        return Batch({"scores": 10.0 + batch["input_ids"][:, -1].float()})


def make_trainer(tmp_path, *overrides, actor=None, reward_model=False, **kwargs):
    cfg = {"model": "tiny-llama", "rollout": {"backend": "hf", "sampling": {"n": 2}},
           "train_batch_size": 2, "actor": {"engine": {"micro_batch_size": 1}},
           "tracking": {"out_dir": str(tmp_path)}}
    trainer = RLTrainer(cfg, reward_fn=lambda response: 1.0, **dict(overrides), **kwargs)
    # The worker groups, as start_groups would leave them: one pool.
    timeline = Timeline()
    group = ActorGroup(actor or FakeActor(), "actor", timeline)
    trainer.groups = Groups(actor=group, reference=group,
                            placement=resolve_placement(trainer.config), timeline=timeline,
                            scorers={"scores": ScorerGroup(FakeRewardModel(), "actor", timeline)}
                            if reward_model else {})
    return trainer


def fake(trainer):
    """The stand-in worker group behind the trainer's actor."""
    return trainer.groups.actor.group


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


PROMPTS = [{"prompt": f"question {i}"} for i in range(6)]


def test_remax_baseline_is_scored_like_the_samples(tmp_path):
    trainer = make_trainer(tmp_path, algorithm="remax", reward_model=True)
    batch = trainer.score(trainer.generate(PROMPTS[:2]))
    # Samples end in tokens 10, 11 (prompt 0) and 12, 13 (prompt 1); the greedy responses, one
    # per prompt, end in 10 and 11: the reward model scores them 20 and 21 (the rule says 1).
    assert batch["scores"].tolist() == [20.0, 21.0, 22.0, 23.0]
    assert fake(trainer).samplings[-1].temperature == 0.0
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0])[:, None].expand(4, T)
    torch.testing.assert_close(batch["advantages"], expected)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "remax", "reinforce_plus_plus"])
def test_kl_in_reward_acts_for_every_estimator(tmp_path, algorithm):
    advantages = {}
    for kl_in_reward in (False, True):
        extra = {"algorithm.kl_in_reward": True, "algorithm.kl_coef": 0.5} if kl_in_reward else {}
        trainer = make_trainer(tmp_path, actor=FakeActor(kl_gap=0.1), algorithm=algorithm,
                               **extra)
        advantages[kl_in_reward] = trainer.score(trainer.generate(PROMPTS[:2]))["advantages"]
    # Every sample has reward 1: without the KL penalty the sequence estimators see no
    # difference between samples; with it, the samples further from the reference lose.
    if algorithm != "reinforce_plus_plus":
        assert torch.count_nonzero(advantages[False]) == 0
    assert not torch.allclose(advantages[False], advantages[True])
    first = advantages[True][:, 0]
    assert first[0] > first[1] or algorithm == "remax"  # within a prompt: less KL, more advantage


def test_sequence_kl_penalty_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logprobs = torch.tensor([[-1.0, -1.0, 5.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.2, 0.0], [-1.0, -2.0, -1.0]])
    scores = torch.tensor([1.0, 1.0])
    # k1 per token = logprobs - ref: row 0 sums 0.5 + 0.2 = 0.7 (the padded token is ignored),
    # row 1 sums 1.0. With coef 0.5 the scores become 0.65 and 0.5; GRPO over the group of two:
    # mean 0.575, std (unbiased) 0.10607 -> +0.7071, -0.7071.
    adv, _ = estimate_advantages("grpo", scores=scores, mask=mask, logprobs=logprobs,
                                 ref_logprobs=ref, kl_coef=0.5, group_ids=[0, 0])
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.7071, -0.7071]), atol=1e-3, rtol=0)
    assert adv[0, 2] == 0
    plain, _ = estimate_advantages("grpo", scores=scores, mask=mask, logprobs=logprobs,
                                   ref_logprobs=ref, kl_coef=0.0, group_ids=[0, 0])
    assert torch.count_nonzero(plain) == 0
    # REINFORCE++ reads the same penalty per token instead: returns-to-go of -0.5 * kl_t, plus
    # the score on the last token, whitened over the batch.
    tok, _ = estimate_advantages("reinforce_plus_plus", scores=scores, mask=mask,
                                 logprobs=logprobs, ref_logprobs=ref, kl_coef=0.5)
    tok0, _ = estimate_advantages("reinforce_plus_plus", scores=scores, mask=mask,
                                  logprobs=logprobs, ref_logprobs=ref, kl_coef=0.0)
    assert not torch.allclose(tok, tok0)


def test_prompt_order_follows_data_shuffle_and_data_seed(tmp_path):
    runs = iter(range(100))

    def order(*overrides):
        trainer = make_trainer(tmp_path / f"runs{next(runs)}", *[(k, v) for k, v in overrides],
                               steps=3)
        trainer.fit(PROMPTS)
        return [q for step in fake(trainer).generated for q in step]

    in_order = order(("data.shuffle", False))
    assert in_order == [f"question {i}" for i in range(6)]
    seed_1, seed_2 = order(("data.seed", 1)), order(("data.seed", 2))
    assert sorted(seed_1) == sorted(in_order) and seed_1 != in_order and seed_1 != seed_2
    assert order(("data.seed", 1), ("seed", 5)) == seed_1  # the run's seed is the samplers'


def test_logged_metrics_name_what_they_measure(tmp_path):
    trainer = make_trainer(tmp_path, steps=1)
    trainer.fit(PROMPTS)
    row = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert "entropy" not in row
    assert row["rollout/neg_logprob"] == pytest.approx(2.0)  # -log p of the sampled tokens


def test_a_reward_file_is_imported_once(tmp_path):
    # check_run imports the config's reward to check it; the trainer scores with that same import
    # (a user's file with side effects at import must not run twice).
    counter, reward = tmp_path / "imports", tmp_path / "my_reward.py"
    reward.write_text(f"open({str(counter)!r}, 'a').write('x')\n\n"
                      "def f(response):\n    return 2.0\n")
    trainer = RLTrainer({"model": "tiny-llama", "rollout": {"backend": "hf"},
                         "reward": f"{reward}:f", "tracking": {"out_dir": str(tmp_path)}})
    assert counter.read_text() == "x"
    assert trainer.reward_fn(None, "any") == 2.0 and trainer.cost_fn is None


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_gradients_stop_with_a_checkpoint_or_are_skipped(tmp_path, mode):
    from hybridflow.errors import RunError
    trainer = make_trainer(tmp_path, ("on_nonfinite", mode), ("checkpoint.every", 5), steps=3,
                           actor=FakeActor(nonfinite_at=(2,)))
    run = tmp_path / "rl"
    if mode == "stop":
        with pytest.raises(RunError, match="non-finite gradients at step 2 .*step_000002"):
            trainer.fit(PROMPTS)
        # The state after step 2 (whose bad update the engine did not apply) is saved and
        # loadable: the same command resumes from it.
        assert (run / "checkpoints" / "step_000002" / "actor" / "weights").read_text() == "2"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 1.0]
        again = make_trainer(tmp_path, ("on_nonfinite", mode), ("checkpoint.every", 5),
                             steps=3, actor=FakeActor())
        assert again.checked.resume.step == 2
        again.fit(PROMPTS)
        assert fake(again).updates == 3
    else:
        trainer.fit(PROMPTS)  # goes on; the counter says what was skipped
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 1.0, 0.0]


def test_a_resumed_run_continues_the_sampler_and_controllers(tmp_path):
    """Resuming restores the prompt order and the adaptive KL coefficient where they were."""
    overrides = (("algorithm.kl_in_reward", True), ("algorithm.kl_target", 0.01),
                 ("checkpoint.every", 2))
    whole = make_trainer(tmp_path / "a", *overrides, steps=4, actor=FakeActor(kl_gap=0.1))
    whole.controllers.kl = whole_kl = _adaptive(whole)
    whole.fit(PROMPTS)
    first = make_trainer(tmp_path / "b", *overrides, steps=2, actor=FakeActor(kl_gap=0.1))
    first.controllers.kl = _adaptive(first)
    first.fit(PROMPTS)
    second = make_trainer(tmp_path / "b", *overrides, steps=4, actor=FakeActor(kl_gap=0.1))
    second.controllers.kl = _adaptive(second)
    second.fit(PROMPTS)
    assert fake(first).generated + fake(second).generated == fake(whole).generated
    assert second.controllers.kl.value == whole_kl.value != 0.001
    rows = lambda d: [{k: v for k, v in json.loads(line).items() if not k.startswith(CLOCK_KEYS)}
                      for line in (d / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows(tmp_path / "b") == rows(tmp_path / "a")


def _adaptive(trainer):
    from hybridflow.algorithms import AdaptiveKLController
    a = trainer.config.algorithm
    return AdaptiveKLController(init_coef=a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)


def test_a_second_fit_sees_where_the_first_left_the_run(tmp_path, capsys):
    trainer = make_trainer(tmp_path, steps=2)
    assert len(trainer.fit(PROMPTS)) == 2
    assert trainer.fit(PROMPTS) == [] and "is complete" in capsys.readouterr().out


def test_a_finished_checkpoint_resumed_into_a_new_folder_names_the_checkpoint(tmp_path, capsys):
    first = make_trainer(tmp_path, ("checkpoint.every", 2), steps=2)
    first.fit(PROMPTS)
    checkpoint = tmp_path / "rl" / "checkpoints" / "step_000002"
    again = make_trainer(tmp_path, ("name", "again"), ("resume", str(checkpoint)), steps=2)
    capsys.readouterr()
    assert again.fit(PROMPTS) == []
    out = capsys.readouterr().out
    # The new folder holds nothing: what reached steps is the checkpoint.
    assert f"{checkpoint} is complete" in out and "again is complete" not in out, out
    assert not (tmp_path / "again").exists()


def test_a_first_sigterm_asks_for_a_stop_and_a_second_stops_the_run_where_it_is(capsys):
    import os
    import signal

    from hybridflow.driver.loop import StopOnSignals
    from hybridflow.errors import Interrupted
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as e:
        with StopOnSignals(grace_s=0) as stop:
            stop.steps_running, stop.where = True, "step 3"
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and "SIGTERM: stopping after this step" in \
                capsys.readouterr().out
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the second SIGTERM did not stop the run")
    assert e.value.signum == signal.SIGTERM
    assert str(e.value).startswith("SIGTERM: stopped during step 3 at a second SIGTERM; "), e.value
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_step_that_outlasts_the_sigterm_grace_is_stopped_where_it_is(capsys):
    """A step that does not end (a wait, a reward function that never returns) is interrupted
    ray.stop_timeout_s after the first SIGTERM."""
    import os
    import signal
    import time

    from hybridflow.driver.loop import StopOnSignals
    from hybridflow.errors import Interrupted
    with pytest.raises(Interrupted) as e:
        with StopOnSignals(grace_s=0.2) as stop:
            stop.steps_running, stop.where = True, "step 4"
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(600)
    assert e.value.signum == signal.SIGTERM
    assert str(e.value).startswith("SIGTERM: stopped during step 4, which did not end within "
                                   "ray.stop_timeout_s=0.2s of the SIGTERM; "), e.value


@pytest.mark.parametrize("sig, steps_running", [("SIGINT", True), ("SIGINT", False),
                                                ("SIGTERM", False)])
def test_sigint_and_a_sigterm_before_the_steps_stop_the_run_at_once(sig, steps_running):
    import os
    import signal
    import time

    from hybridflow.driver.loop import StopOnSignals
    from hybridflow.errors import Interrupted
    signum = getattr(signal, sig)
    with pytest.raises(Interrupted) as e:
        with StopOnSignals(grace_s=240) as stop:
            stop.steps_running = steps_running
            os.kill(os.getpid(), signum)
            time.sleep(600)
    assert e.value.signum == signum
    assert str(e.value).startswith(f"{sig}: stopped during the workers' start; "), e.value


# --------------------------------------------------------------------------------- DAPO
class RecordingActor(FakeActor):
    """A FakeActor that keeps what each update trained on: (prompt, group) per sample, and the
    advantages."""

    def __init__(self):
        super().__init__()
        self.trained = []

    def run_by_dp(self, method, batch, view="train", sampling=None):
        if method == "update_actor":
            self.trained.append(([(i.messages[-1]["content"], g)
                                  for i, g in zip(batch["item"], batch["group"])],
                                 batch["advantages"][:, 0].tolist()))
        return super().run_by_dp(method, batch, view, sampling)


def _dapo_trainer(path, *overrides, equal=(0, 2, 4), **kwargs):
    """Over PROMPTS in order, two prompts a step: prompt i's two samples get the same reward when
    i is in ``equal``, else 0 and 1 (the parity of the response's last character)."""
    from hybridflow.rewards import as_reward_fn

    def reward(item, response):
        i = int(item.messages[-1]["content"].split()[-1])
        return 1.0 if i in equal else float(ord(response[-1]) % 2)
    trainer = make_trainer(path, ("algorithm.dynamic_sampling", True), ("data.shuffle", False),
                           *overrides, actor=RecordingActor(), **kwargs)
    trainer.reward_fn = as_reward_fn(reward)
    return trainer


def _metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(CLOCK_KEYS)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dynamic_sampling_trains_on_groups_whose_rewards_differ(tmp_path):
    trainer = _dapo_trainer(tmp_path, steps=2)
    trainer.fit(PROMPTS)
    q = [f"question {i}" for i in range(6)]
    # Step 1 draws 0, 1 (0 all-equal) then 2, 3 (2 all-equal); step 2 draws 4, 5, then the next
    # epoch's 0, 1: the sampler moves on by every prompt drawn.
    assert fake(trainer).generated == [q[0:2], q[2:4], q[4:6], q[0:2]]
    (first, adv1), (second, adv2) = fake(trainer).trained
    assert first == [(q[1], 0), (q[1], 0), (q[3], 1), (q[3], 1)]  # groups renumbered
    assert second == [(q[5], 0), (q[5], 0), (q[1], 1), (q[1], 1)]
    assert all(a != 0 for a in adv1 + adv2)  # no zero-advantage sample is trained on
    rows = _metrics(tmp_path / "rl")
    for row in rows:
        assert (row["dapo/rounds"], row["dapo/prompts_drawn"], row["dapo/groups_dropped"],
                row["dapo/filled_with_equal"]) == (2, 4, 2, 0)
    # Off, the same run trains on whatever the one draw gives, zero advantages included.
    off = _dapo_trainer(tmp_path / "off", ("algorithm.dynamic_sampling", False), steps=1)
    row = off.fit(PROMPTS)[0]
    assert fake(off).trained[0][1][:2] == [0.0, 0.0] and "dapo/rounds" not in row


def test_dynamic_sampling_cuts_surplus_and_fills_a_shortfall(tmp_path):
    # Surplus: round 2 brings two varied groups where one is missing; the later one is cut.
    trainer = _dapo_trainer(tmp_path / "a", equal=(0,), steps=1)
    row = trainer.fit(PROMPTS)[0]
    assert [p for p, _ in fake(trainer).trained[0][0]] == ["question 1"] * 2 + ["question 2"] * 2
    assert (row["dapo/rounds"], row["dapo/prompts_drawn"], row["dapo/groups_dropped"],
            row["dapo/filled_with_equal"]) == (2, 4, 1, 0)
    # Shortfall: one round allowed; the set-aside group fills the batch, after the varied one.
    trainer = _dapo_trainer(tmp_path / "b", ("algorithm.max_sampling_rounds", 1), steps=1)
    row = trainer.fit(PROMPTS)[0]
    assert fake(trainer).trained[0][0] == [("question 1", 0)] * 2 + [("question 0", 1)] * 2
    assert (row["dapo/rounds"], row["dapo/prompts_drawn"], row["dapo/groups_dropped"],
            row["dapo/filled_with_equal"]) == (1, 2, 0, 1)


def test_a_resumed_run_with_dynamic_sampling_continues_identically(tmp_path):
    whole = _dapo_trainer(tmp_path / "a", ("checkpoint.every", 2), steps=4)
    whole.fit(PROMPTS)
    first = _dapo_trainer(tmp_path / "b", ("checkpoint.every", 2), steps=2)
    first.fit(PROMPTS)
    second = _dapo_trainer(tmp_path / "b", ("checkpoint.every", 2), steps=4)
    second.fit(PROMPTS)
    assert fake(first).generated + fake(second).generated == fake(whole).generated
    assert fake(first).trained + fake(second).trained == fake(whole).trained
    assert _metrics(tmp_path / "b" / "rl") == _metrics(tmp_path / "a" / "rl")


def test_overlong_penalty_is_added_to_the_scores(tmp_path):
    # Every response is T = 3 tokens; with max_tokens 4 and a buffer of 2, the free length is 2:
    # (2 - 3) / 2 * 0.5 = -0.25 on top of the reward 1.
    trainer = make_trainer(tmp_path, ("rollout.sampling.max_tokens", 4),
                           ("algorithm.overlong_buffer", 2), ("algorithm.overlong_penalty", 0.5),
                           steps=1)
    row = trainer.fit(PROMPTS)[0]
    assert row["reward/overlong_penalty_mean"] == pytest.approx(-0.25)
    assert row["reward/mean"] == pytest.approx(0.75)


def test_rollout_training_mismatch_is_logged_every_step(tmp_path):
    # FakeActor's rollout engine gives -2.0 per token, its training engine -0.5.
    trainer = make_trainer(tmp_path / "t1", steps=2)
    trainer.fit(PROMPTS)
    rows = [json.loads(line) for line in (tmp_path / "t1" / "rl" / "metrics.jsonl").read_text()
            .splitlines()]
    for row in rows:
        assert row["mismatch/abs_diff_mean"] == pytest.approx(1.5)
        assert row["mismatch/abs_diff_max"] == pytest.approx(1.5)
        assert row["mismatch/kl"] == pytest.approx(4.481689 - 1 - 1.5)  # k3, e^1.5 - 1 - 1.5
        assert row["mismatch/ratio_outside_frac"] == 1.0  # e^1.5 = 4.5 > 2
    # Tempered sampling: the tokens were not drawn from the raw model, k3 is no KL estimate.
    tempered = make_trainer(tmp_path / "t2", ("rollout.sampling.temperature", 0.7), steps=1)
    tempered.fit(PROMPTS)
    row = json.loads((tmp_path / "t2" / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert "mismatch/kl" not in row and row["mismatch/abs_diff_mean"] == pytest.approx(1.5)


@pytest.mark.parametrize("overrides,separate", [
    ((), False),
    (("actor.mini_batches=2", "actor.engine.micro_batch_size=1"), True),
    (("actor.ppo_epochs=2",), True),
    (("algorithm.kl_in_reward=true",), True),
    (("actor.rollout_correction.mode=tis",), True)])
def test_old_logprobs_come_from_an_on_policy_update(tmp_path, overrides, separate):
    # One epoch of one mini-batch: the update's forward gives the old log-probs (no pass of
    # their own); a second update, the reward's KL or a rollout correction needs them first.
    trainer = make_trainer(tmp_path, *(o.split("=") for o in overrides), steps=1)
    assert trainer.config.old_logprobs_from_update is not separate
    row = trainer.fit(PROMPTS[:2])[0]
    calls = fake(trainer).calls
    assert calls.count("compute_log_prob") == (1 if separate else 0)
    if separate:
        assert calls.index("compute_log_prob") < calls.index("update_actor")
    assert ("timing/old_logprobs_s" in row) is separate
    # The step's metrics read them either way: k1 to the reference (gap 0) and the mismatch
    # with the rollout's -2.
    assert row["kl"] == 0.0 and row["mismatch/abs_diff_mean"] == pytest.approx(1.5)
