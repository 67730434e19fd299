"""`hybridflow calibrate`: the measured rates have the right shape, the file round-trips, and a
missing or broken file or a bad --out ends with one message that says how to fix it. No test
compares a rate with an absolute speed: those vary from machine to machine."""

import json
import math

import pytest

from hybridflow.cli import main
from hybridflow.errors import ConfigError
from hybridflow.planner.calibrate import calibrate
from hybridflow.planner.rates import Calibration


LOG: list[str] = []  # the lines the one measurement below logged


@pytest.fixture(scope="module")
def measured() -> Calibration:
    return calibrate(quick=True, log=LOG.append)


def test_quick_calibration_on_cpu_has_every_rate(measured):
    assert measured.device == "cpu" and measured.devices == 1
    assert list(measured.matmul_flops) == ["fp32"]
    assert list(measured.all_gather) == [2] and list(measured.broadcast) == [2]
    assert measured.host_to_device is None
    rates = [*measured.matmul_flops.values(), measured.memory_bandwidth,
             *measured.all_gather.values(), *measured.broadcast.values()]
    assert all(math.isfinite(r) and r > 0 for r in rates), rates


def test_quick_calibration_on_cpu_has_the_micro_batch_costs(measured):
    costs = measured.micro_batches
    seconds = [costs.forward_base_s, costs.forward_layer_s, costs.train_base_s,
               costs.train_layer_s, costs.forward_stage_s, costs.train_stage_s]
    assert all(math.isfinite(s) and s >= 0 for s in seconds), seconds
    assert math.isfinite(costs.p2p) and costs.p2p > 0  # two CPU ranks: a pipeline measured


def test_calibrate_logs_one_line_per_measurement(measured):
    assert [line.split()[0] for line in LOG] == ["matmul", "copy", "host", "all_gather",
                                                 "broadcast", "micro-batch", "pipeline"]
    assert all(line.endswith(("FLOP/s", "(read + write)", "received per rank", "a layer",
                              "B/s", "parameters/s")) for line in LOG)
    assert measured.host_adam > 0


def test_json_round_trip(measured, tmp_path):
    path = tmp_path / "c.json"
    measured.to_json(path)
    assert Calibration.from_json(path) == measured
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temp file left behind


def _broken(tmp_path, text: str):
    path = tmp_path / "c.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing.json", "file not found"),
    (lambda tmp: _broken(tmp, "{not json"), "cannot read it"),
    (lambda tmp: _broken(tmp, "[]"), "not a JSON object"),
])
def test_from_json_of_a_missing_or_unreadable_file_says_how_to_make_one(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        Calibration.from_json(path)
    assert e.value.field == "cluster.calibration"
    assert f"{path}: {message}" in e.value.message
    assert f"run `hybridflow calibrate --out {path}`" in e.value.message


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("broadcast"), "missing field(s) broadcast"),
    (lambda d: d.update(extra=1), "unknown field(s) extra"),
    (lambda d: d["matmul_flops"].update(fp32=-1.0), "matmul_flops.fp32: must be a finite number"),
    (lambda d: d["all_gather"].update(two=1.0), "all_gather group size: must be an integer >= 2"),
])
def test_from_json_of_an_incomplete_file_names_the_field(measured, tmp_path, edit, message):
    path = tmp_path / "c.json"
    measured.to_json(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        Calibration.from_json(path)
    assert e.value.field == "cluster.calibration" and message in e.value.message
    assert f"run `hybridflow calibrate --out {path}`" in e.value.message


def test_cli_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {out}"
    assert Calibration.from_json(out).device == "cpu"


def test_cli_bad_out_directory_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "nowhere" / "c.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # stopped before measuring anything
    assert captured.err.strip() == (f"hybridflow: error: --out: {out}: directory {out.parent} "
                                    "does not exist; create it or choose another FILE")
    assert list(tmp_path.iterdir()) == []


def test_cli_profiles_a_configs_model(tmp_path, capsys):
    # --config: the model's passes measured at the actor's tp; the cost model then uses them.
    from hybridflow.config import RLConfig, load_config
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.cost import predict
    out = tmp_path / "c.json"
    run = ["model=tiny-llama", "rollout.backend=megatron", "train_batch_size=2",
           "rollout.sampling.n=2", "data.max_prompt_tokens=16", "rollout.sampling.max_tokens=8",
           "actor.engine.micro_batch_size=2", f"tracking.out_dir={tmp_path}"]
    assert main(["calibrate", "--quick", "--out", str(out), "--config", *run]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == "profiling tiny-llama's passes (fp32, tp=1)..."
    assert lines[-2].startswith("efficiencies at tp=1, pp=dp=1, 24 tokens per sequence, by "
                                "micro-batch size: forward 1: ")
    calib = Calibration.from_json(out)
    (profile,) = calib.passes
    # the search's sizes up to the step's 4 samples (the configured 2 among them)
    assert (profile.seq, profile.micro_batches, profile.backend) == (24, [1, 2, 4], "megatron")
    assert all(0 < e <= 1 for k in ("forward", "train") for e in getattr(profile, k))
    assert 0 < profile.generate <= 1
    cfg = load_config(RLConfig, None, run)
    shapes = model_sources(cfg)[1]
    assert calib.profile(shapes["model"], "fp32") == profile
    assert predict(cfg, shapes, calib).profiled
    # --configured-sizes measures the configured micro-batch alone; at tp=2 in two ranks
    assert main(["calibrate", "--quick", "--out", str(out), "--configured-sizes", "--config",
                 *run, "actor.layout.tp=2"]) == 0
    (profile,) = Calibration.from_json(out).passes
    assert profile.micro_batches == [2] and profile.tp == 2
    assert "efficiencies at tp=2, pp=dp=1" in capsys.readouterr().out
    # With LoRA the engine trains the adapters (the base frozen): a profile kept under them,
    # which the LoRA config reads and full fine-tuning does not.
    lora = [*run, "actor.lora.rank=2"]
    assert main(["calibrate", "--quick", "--out", str(out), "--configured-sizes", "--config",
                 *lora]) == 0
    assert "profiling tiny-llama's passes (fp32, tp=1, LoRA rank 2)..." in capsys.readouterr().out
    calib = Calibration.from_json(out)
    (profile,) = calib.passes
    assert profile.lora["rank"] == 2 and profile.micro_batches == [2]
    assert 0 < profile.train[0] <= 1 and 0 < profile.optimizer <= 1
    lora_cfg = load_config(RLConfig, None, lora)
    assert calib.profile(shapes["model"], "fp32", lora=lora_cfg.actor.lora) == profile
    assert calib.profile(shapes["model"], "fp32") is None
    assert predict(lora_cfg, shapes, calib).profiled and not predict(cfg, shapes, calib).profiled
    with pytest.raises(SystemExit) as e:  # argparse's exit 2: it needs a config to profile
        main(["calibrate", "--quick", "--out", str(out), "--configured-sizes"])
    assert e.value.code == 2


def test_cli_bad_config_exits_2_before_measuring(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "--out", str(out), "--config",
                 "actor.engine.micro_batch_size=0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "actor.engine.micro_batch_size" in captured.err
    assert not out.exists()


def test_the_probe_trains_with_the_actors_loss_function():
    # The training probe's micro-batches run the RL worker's loss (actor_loss_fn, the default
    # objective, on-policy), not a loss of its own: what it measures per micro-batch includes
    # the loss's work and its backward.
    import torch

    from hybridflow.algorithms import ActorObjective, actor_loss
    from hybridflow.config.rl import ActorConfig
    from hybridflow.planner.overhead import PROBE_RESPONSE, PROBE_SEQ, probe_batch, probe_loss_fn
    batch = probe_batch(2)
    assert set(batch) == {"input_ids", "attention_mask", "response_mask", "advantages"}
    assert batch["response_mask"][:, PROBE_SEQ - PROBE_RESPONSE:].all()
    logprobs = -torch.rand(2, PROBE_SEQ)
    loss, metrics = probe_loss_fn(batch)(logprobs, batch)
    want, want_metrics = actor_loss(logprobs, batch, 2.0 * PROBE_RESPONSE,
                                    ActorObjective.of(ActorConfig()))
    assert torch.equal(loss, want) and list(metrics) == list(want_metrics)
