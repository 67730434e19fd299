"""What a run refuses to do on bad input it did not write itself: call standard-library code named
by a config, take a reward that is not a finite number, write metrics that are not strict JSON or
not whole, and unpickle anything but metadata from a checkpoint."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch

from hybridflow.errors import ConfigError, RunError
from hybridflow.rewards import as_reward_fn, describe_reward_fn, score_samples
from hybridflow.tracking import Tracker, TrackingConfig, read_metrics

# ---------------------------------------------------------------------------------------------
# code named by a config


@pytest.mark.parametrize("spec", ["os:system", "builtins:eval", "subprocess:getoutput",
                                  "posix:system", "yaml:unsafe_load", "sympy:sympify"])
def test_a_module_the_config_does_not_trust_is_refused(spec):
    """Issue 45, item 13: yaml:unsafe_load and sympy:sympify passed `check`, and ran a shell
    command written in the response: an installed module's function is taken only where the
    config trusts the module (reward_trust)."""
    for key in ("reward", "cost"):
        with pytest.raises(ConfigError, match="is not a module reward_trust lists") as e:
            as_reward_fn(spec, key=key)
        assert e.value.field == key and spec.split(":")[0] in e.value.message


WRAPPERS = {  # a reward file's `fn`: none of them is a def of that file
    "numpy.vectorize": ("import numpy, os\nfn = numpy.vectorize(os.system)\n",
                        "a numpy.vectorize object"),
    "callable object": ("import os\nclass Shell:\n    __call__ = os.system\nfn = Shell()\n",
                        "Shell object"),
    "partial subclass": ("import functools, os\nclass Call(functools.partial):\n    pass\n"
                         "fn = Call(os.system)\n", "Call object"),
    "builtin": ("import os\nfn = os.system\n", "the builtin posix.system"),
    "builtin's method": ("import os\nfn = os.system.__call__\n", "method-wrapper object"),
    "imported def": ("from yaml import unsafe_load as fn\n", "unsafe_load of "),
    "def rebuilt from another's code": (
        "import types, yaml\nfn = types.FunctionType(yaml.unsafe_load.__code__, globals())\n",
        "unsafe_load of "),
}


@pytest.mark.parametrize("code, what", WRAPPERS.values(), ids=WRAPPERS)
def test_a_reward_file_gives_only_its_own_defs(tmp_path, code, what):
    """Wrappers hid os.system from the standard-library check: only a def of the file itself
    (types.FunctionType, its module and code file the reward file's) is taken."""
    path = tmp_path / "sneaky.py"
    path.write_text(code + "def score(response):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="reward file") as e:
        as_reward_fn(f"{path}:fn")
    assert e.value.field == "reward" and what in e.value.message, e.value
    assert as_reward_fn(f"{path}:score")({}, "x") == 1.0


def test_our_rewards_and_a_trusted_package_resolve(tmp_path, monkeypatch):
    """hybridflow.rewards needs no trust; an installed package's def resolves where
    reward_trust lists its module or a package above it, judged by where it is defined."""
    pkg = tmp_path / "trusted_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text("def score(response):\n    return 2.0\n")
    (pkg / "reexport.py").write_text("from yaml import unsafe_load as score\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert as_reward_fn("hybridflow.rewards:math_reward_fn")({"reference": "5"}, "#### 5") == 1.0
    from hybridflow.rewards import extract_final_answer, resolve_function
    assert resolve_function("hybridflow.rewards.math:extract_final_answer") is \
        extract_final_answer  # a module below hybridflow.rewards
    for trust in (["trusted_pkg.rewards"], ["trusted_pkg"]):
        assert as_reward_fn("trusted_pkg.rewards:score", trust=trust)({}, "x") == 2.0
    for spec, trust, message in [
            ("trusted_pkg.rewards:score", [], "not a module reward_trust lists"),
            ("trusted_pkg.rewards:score", ["trusted_pkg.rew"], "not a module"),
            ("trusted_pkg.reexport:score", ["trusted_pkg"], "unsafe_load of ")]:
        with pytest.raises(ConfigError, match=message):
            as_reward_fn(spec, trust=trust)


def test_describe_names_the_function_and_its_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(response):\n    return 1.0\n")
    fn = as_reward_fn(f"{path}:score")
    assert describe_reward_fn(fn) == f"reward: my_rewards.py:score ({path.resolve()})"
    assert describe_reward_fn(fn, key="cost").startswith("cost: my_rewards.py:score (")
    import hybridflow.rewards as rewards
    assert describe_reward_fn(as_reward_fn("math")) == \
        f"reward: hybridflow.rewards:math_reward_fn ({os.path.abspath(rewards.__file__)})"


# ---------------------------------------------------------------------------------------------
# reward values


def test_scores_accept_real_numbers():
    values = [1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(-1.5), torch.tensor([3.0]),
              torch.tensor(7, dtype=torch.int32)]
    got = score_samples(lambda item, text: values[item], list(range(len(values))),
                        ["r"] * len(values))
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, 0.5, 0.25, 2.0, -1.5, 3.0, 7.0]
    wrapped = as_reward_fn(lambda response: len(response))
    assert score_samples(wrapped, [{}, {}], ["ab", ""]).tolist() == [2.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -math.inf, True, np.bool_(False),
                                 "1.0", None, [1.0], torch.tensor([1.0, 2.0]),
                                 torch.tensor(float("nan")), torch.tensor(True), 10 ** 400,
                                 np.array([1.0, 2.0]), 1 + 2j],
                         ids=repr)
def test_scores_refuse_what_is_not_a_finite_real_number(tmp_path, bad):
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(prompt_item, response):\n    return prompt_item['value']\n")
    fn = as_reward_fn(f"{path}:score")
    items = [{"value": 1.0}, {"value": bad}]
    with pytest.raises(RunError) as e:
        score_samples(fn, items, ["fine", "the bad one"])
    text = str(e.value)
    assert "sample 1" in text and "my_rewards.py:score" in text and str(path.resolve()) in text
    assert repr(bad)[:50] in text and "'the bad one'" in text
    # Called alone, the wrapper refuses it too (float() used to take True and "1.0").
    with pytest.raises(RunError, match="must return a number"):
        fn(items[1], "x")


def test_a_raising_reward_function_names_sample_function_and_error(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(response):\n    return 1 / (len(response) - 3)\n")
    texts = ["a", "bb", "cccc", "xyz", "z" * 100]
    with pytest.raises(RunError) as e:
        score_samples(as_reward_fn(f"{path}:score"), [{}] * 5, texts)
    text = str(e.value)
    assert text.startswith(f"reward function my_rewards.py:score ({path.resolve()}) raised "
                           "ZeroDivisionError: division by zero on sample 3 (response 'xyz')")
    with pytest.raises(RunError, match=r"cost function .* on sample 0 \(response 'z{60}' "
                                       r"truncated to 60 chars\)"):
        score_samples(lambda item, text: item["missing"], [{}], ["z" * 100], key="cost")


# A reward function that never returns, in the ways one can: each is stopped at its batch's limit.
HANGS = '''
import re
import time


def sleeps(response):
    if response == "hang":
        time.sleep(10 ** 6)
    return 1.0


def spins(response):
    while response == "hang":
        pass
    return 1.0


def backtracks(response):  # catastrophic backtracking: one long call into the regex engine
    return float(bool(re.match(r"(a+)+$", "a" * 60 + "b"))) if response == "hang" else 1.0


def swallows(response):  # catches what it can, and tries again
    while response == "hang":
        try:
            time.sleep(10 ** 6)
        except Exception:
            pass
    return 1.0
'''


@pytest.mark.parametrize("name", ["sleeps", "spins", "backtracks", "swallows"])
def test_a_reward_batch_past_its_time_stops_naming_function_and_sample(tmp_path, name):
    import signal
    path = tmp_path / "my_rewards.py"
    path.write_text(HANGS)
    fn = as_reward_fn(f"{path}:{name}")
    texts = ["fine", "also fine", "hang", "never reached"]
    with pytest.raises(RunError) as e:
        score_samples(fn, [{}] * 4, texts, timeout_s=0.5)
    assert str(e.value).startswith(
        f"reward function my_rewards.py:{name} ({path.resolve()}) did not return within 0.5s "
        "(reward_timeout_s, for a batch of 4 samples) on sample 2 (response 'hang')"), e.value
    # The alarm is put away (nothing strikes later) and SIGALRM's handler is the one before.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert score_samples(fn, [{}] * 2, ["a", "b"], timeout_s=0.5).tolist() == [1.0, 1.0]


def test_a_reward_batch_off_the_main_thread_has_its_limit_too(tmp_path):
    import threading
    path = tmp_path / "my_rewards.py"
    path.write_text(HANGS)
    fn = as_reward_fn(f"{path}:sleeps")
    caught = []

    def score():
        try:
            score_samples(fn, [{}] * 2, ["fine", "hang"], timeout_s=0.5)
        except RunError as e:
            caught.append(str(e))
    thread = threading.Thread(target=score)
    thread.start()
    thread.join(60)
    assert caught and "did not return within 0.5s" in caught[0] and "sample 1" in caught[0]


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


def _strict_loads(line: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=refuse)


def _tracker(run_dir, **kwargs) -> Tracker:
    return Tracker(run_dir, "a: 1\n", TrackingConfig(out_dir=str(run_dir.parent)), "t", **kwargs)


def test_rows_are_strict_json_with_nonfinite_keys_named(tmp_path):
    tracker = _tracker(tmp_path / "run")
    tracker.log(0, {"loss": 0.5, "kl": float("nan"), "grad": torch.tensor(float("inf")),
                    "n": np.int64(3), "hist": [1.0, float("-inf")]})
    tracker.log(1, {"loss": torch.tensor(0.25)})
    tracker.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [_strict_loads(line) for line in lines]
    assert rows[0] == {"step": 0, "loss": 0.5, "kl": None, "grad": None, "n": 3,
                       "hist": [1.0, None], "nonfinite": ["kl", "grad", "hist"]}
    assert rows[1] == {"step": 1, "loss": 0.25}
    assert (tmp_path / "run" / "config.yaml").read_text() == "a: 1\n"


def test_read_metrics_skips_a_partial_last_line_and_refuses_a_bad_middle_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1, "lo\n')  # cut short, newline or not
    assert read_metrics(path) == [{"step": 0}]
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON") as e:
        read_metrics(path)
    assert e.value.field == str(path)


def test_a_new_run_never_truncates_another_runs_metrics(tmp_path):
    run = tmp_path / "run"
    tracker = _tracker(run)
    tracker.log(0, {"loss": 1.0})
    tracker.close()
    with pytest.raises(ConfigError, match="already holds the metrics") as e:
        _tracker(run)
    assert e.value.field == "tracking.out_dir"
    assert read_metrics(run / "metrics.jsonl") == [{"step": 0, "loss": 1.0}]


def test_resume_keeps_rows_up_to_the_step_and_appends(tmp_path):
    run = tmp_path / "run"
    tracker = _tracker(run)
    for step in range(5):
        tracker.log(step, {"loss": float(step)})
    tracker.close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a crash mid-write
    tracker = _tracker(run, resume_step=2)
    tracker.log(3, {"loss": 30.0})
    tracker.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == \
        [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text().endswith("\n")


def test_a_full_disk_is_one_run_error(tmp_path, monkeypatch):
    tracker = _tracker(tmp_path / "run")
    tracker.log(0, {"loss": 1.0})

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tracker._file, "write", full)
    with pytest.raises(RunError, match=r"cannot write .*metrics\.jsonl: No space left on device; "
                                       r"free disk space"):
        tracker.log(1, {"loss": 1.0})
    monkeypatch.undo()
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunError, match="No space left on device"):
        tracker.log(2, {"loss": 1.0})
    monkeypatch.undo()
    tracker.close()


def test_an_unwritable_folder_is_one_run_error(tmp_path, monkeypatch):
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(RunError, match=r"config\.yaml: Permission denied; choose a writable "
                                       r"tracking\.out_dir"):
        _tracker(tmp_path / "run")
    monkeypatch.undo()
    if os.geteuid() != 0:  # root writes through a read-only mode
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(RunError, match="Permission denied"):
            _tracker(tmp_path / "ro" / "run")


def test_a_resumed_tracker_continues_the_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = TrackingConfig(out_dir=str(tmp_path), wandb=True)
    yaml_text = "actor:\n  lr: 1.0e-06\nname: t\n"
    tracker = Tracker(tmp_path / "run", yaml_text, config, "t")
    run_id = tracker.wandb_id
    assert run_id and tracker._wandb.config["actor"] == {"lr": 1e-6}
    tracker.log(0, {"loss": 1.0})
    tracker.close()
    tracker = Tracker(tmp_path / "run", yaml_text, config, "t", resume_step=0, wandb_id=run_id)
    assert tracker.wandb_id == run_id
    tracker.log(1, {"loss": 0.5})
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


# ---------------------------------------------------------------------------------------------
# checkpoints: the distributed half (a real checkpoint, saved and loaded) is
# tests/distributed/test_safe_load.py


class _Payload:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def _metadata(extra=None):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    size = torch.Size([4, 8])
    md = Metadata(
        state_dict_metadata={
            "embedding.word_embeddings.weight": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), size,
                [ChunkStorageMetadata(torch.Size([0, 0]), size)]),
            "layer._extra_state/shard_0_1": BytesStorageMetadata()},
        storage_data={MetadataIndex("embedding.word_embeddings.weight", torch.Size([0, 0])):
                      _StorageInfo("__0_0.distcp", 0, 64)})
    if extra is not None:
        md.all_local_plans = [extra]
    return md


def _fake_checkpoint(path, metadata) -> str:
    """A directory megatron takes for a torch_dist checkpoint, with ``metadata`` pickled."""
    path.mkdir()
    (path / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return str(path)


def test_checkpoint_metadata_of_torch_classes_is_read(tmp_path):
    from hybridflow.training.megatron_ckpt import checkpoint_dtype
    from hybridflow.training.safe_load import read_metadata_file
    ckpt = _fake_checkpoint(tmp_path / "ckpt", _metadata())
    md = read_metadata_file(tmp_path / "ckpt" / ".metadata")
    assert md.state_dict_metadata == _metadata().state_dict_metadata
    assert checkpoint_dtype(ckpt) == "bf16"


@pytest.mark.parametrize("call", [os.system, exec], ids=["os.system", "builtins.exec"])
def test_a_crafted_checkpoint_metadata_is_refused_before_it_runs(tmp_path, call):
    from megatron.core import dist_checkpointing

    from hybridflow.training.megatron_ckpt import checkpoint_dtype
    from hybridflow.training.safe_load import safe_load_tensors_metadata
    marker = tmp_path / "pwned"
    command = f"touch {marker}" if call is os.system else f"open({str(marker)!r}, 'w').close()"
    ckpt = _fake_checkpoint(tmp_path / "ckpt", _metadata(_Payload(call, command)))
    name = f"{call.__module__}.{call.__name__}"
    with pytest.raises(ConfigError, match=f"holds a pickled object of class {name}, which a "
                                          "checkpoint has no reason to hold") as e:
        safe_load_tensors_metadata(ckpt, field="resume")
    assert e.value.field == "resume" and os.path.join(ckpt, ".metadata") in e.value.message
    with pytest.raises(ConfigError) as e:
        checkpoint_dtype(ckpt)
    assert e.value.field == "--ckpt"
    assert not marker.exists()
    dist_checkpointing.load_tensors_metadata(ckpt)  # what megatron alone does with it
    assert marker.exists()


def test_a_damaged_metadata_file_is_a_config_error(tmp_path):
    from hybridflow.training.safe_load import read_metadata_file
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_metadata())[:50])
    with pytest.raises(ConfigError, match="not a readable checkpoint metadata file"):
        read_metadata_file(path)
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ConfigError, match="holds a dict, not"):
        read_metadata_file(path)


def test_common_pt_is_loaded_weights_only(tmp_path):
    from hybridflow.training.safe_load import SafeCommonLoadStrategy
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(os.system, f"touch {marker}")}, tmp_path / "common.pt")
    with pytest.raises(ConfigError, match="common.pt is not plain data") as e:
        SafeCommonLoadStrategy(field="resume").load_common(str(tmp_path))
    assert e.value.field == "resume" and not marker.exists()
    torch.save({"step": 3, "w": torch.ones(2)}, tmp_path / "common.pt")
    assert SafeCommonLoadStrategy().load_common(str(tmp_path))["step"] == 3


# safe_load.py mirrors these; when upstream changes one, review the mirror and update the hash.
_MIRRORED = {
    "megatron TorchDistLoadShardedStrategy.load": "960cfa14f177d722",
    "megatron TorchDistLoadShardedStrategy.load_sharded_metadata": "05eb6000880fba66",
    "torch DefaultLoadPlanner.load_bytes": "666701f9808c4bc2",
    "torch FileSystemReader.read_metadata": "8586ce344a523602",
    "megatron TorchCommonLoadStrategy.load_common": "a2c96073da9e64a1",
}


def test_the_upstream_code_safe_load_mirrors_is_unchanged():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    functions = {"TorchDistLoadShardedStrategy.load": TorchDistLoadShardedStrategy.load,
                 "TorchDistLoadShardedStrategy.load_sharded_metadata":
                     TorchDistLoadShardedStrategy.load_sharded_metadata,
                 "DefaultLoadPlanner.load_bytes": DefaultLoadPlanner.load_bytes,
                 "FileSystemReader.read_metadata": FileSystemReader.read_metadata,
                 "TorchCommonLoadStrategy.load_common": TorchCommonLoadStrategy.load_common}
    for label, want in _MIRRORED.items():
        fn = functions[label.split(" ", 1)[1]]
        got = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
        assert got == want, f"{label} changed upstream; review hybridflow/training/safe_load.py"
