"""The command line: user mistakes exit 2 with one line naming the field; nothing is written."""

import pytest

from hybridflow.cli import main
from hybridflow.errors import Interrupted, RunError


@pytest.mark.parametrize("args, message", [
    (["layout.tp=3"], "layout.tp: tp=3 must divide model.num_heads=4"),
    (["layout.tpp=2"], "layout.tpp: not a key of the config"),
    (["missing.yaml"], "CONFIG: missing.yaml: config file not found"),
    (["steps=abc"], "steps: Value 'abc'"),
    (["global_batch_size=15"], "global_batch_size: 15 must be a multiple"),
    (["engine.optim.name=lion"], "engine.optim.name: unknown value 'lion'"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert main(["lm-demo", *args, f"tracking.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_defaults_prints_every_section(capsys):
    assert main(["defaults", "lm-demo"]) == 0
    text = capsys.readouterr().out
    for key in ("model:", "layout:", "engine:", "optim:", "tracking:"):
        assert key in text


@pytest.mark.parametrize("args, message", [
    (["actor.engine.forward_micro_batch_size=0"],
     "actor.engine.forward_micro_batch_size: must be a positive integer or null, got 0"),
    (["train_batch_size=4", "rollout.sampling.n=2", "actor.engine.forward_micro_batch_size=3"],
     "actor.engine.forward_micro_batch_size: 8 samples per step"),
    (["algorithm.name=ppo", "train_batch_size=4", "rollout.sampling.n=2",
      "critic.engine.forward_micro_batch_size=16"],
     "critic.engine.forward_micro_batch_size: 8 samples per step"),
])
def test_train_config_errors_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert main(["train", *args, f"tracking.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("raised, code, line", [
    (lambda: Interrupted(15, "SIGTERM: stopped during step 3; ..."), 143,
     "hybridflow: run stopped: SIGTERM: stopped during step 3; ..."),
    (lambda: Interrupted(2, "SIGINT: stopped during step 3; ..."), 130,
     "hybridflow: run stopped: SIGINT: stopped during step 3; ..."),
    (KeyboardInterrupt, 130, "hybridflow: interrupted (SIGINT)"),
    (lambda: RunError("a fault"), 1, "hybridflow: run stopped: a fault")])
def test_a_run_a_signal_stopped_exits_128_plus_its_number(monkeypatch, capsys, raised, code,
                                                          line):
    """As a shell reports a process that a signal ended (launch/slurm requeues on 143); one
    line."""
    import hybridflow.cli as cli
    jobs = cli._jobs()

    def run(cfg):
        raise raised()
    monkeypatch.setattr(cli, "_jobs", lambda: {**jobs, "train": (jobs["train"][0], run)})
    assert main(["train", "model=tiny-llama"]) == code
    assert capsys.readouterr().err == line + "\n"
