"""hybridflow.checkpoint without processes: a checkpoint appears whole or not at all, a failed
write (a full disk) leaves the last complete one loadable, and ``keep`` prunes the oldest."""

import errno
import json

import pytest

from hybridflow.checkpoint import (checkpoints, plan_resume, read_checkpoint,
                                   remove_partial_checkpoints, save_checkpoint)
from hybridflow.errors import ConfigError, RunError

IDENTITY = {"algorithm": "grpo", "roles": ["actor"], "model": {"num_layers": 2}}


def parts(tmp):
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights.bin").write_bytes(b"x" * 100)


def test_checkpoints_are_whole_and_pruned(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, {**IDENTITY, "note": step}, parts, keep=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [4, 6]
    state = read_checkpoint(checkpoints(tmp_path)[-1][1])
    assert state["step"] == 6 and state["files"] == {"actor/weights.bin": 100}


def test_a_full_disk_leaves_the_last_checkpoint_loadable(tmp_path):
    save_checkpoint(tmp_path, 2, IDENTITY, parts, keep=2)

    def full(tmp):
        parts(tmp)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "actor"))
    with pytest.raises(RunError, match="No space left on device.*step_000002.* is intact"):
        save_checkpoint(tmp_path, 4, IDENTITY, full, keep=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [2]
    assert not list((tmp_path / "checkpoints").glob(".step_*"))  # the partial write is gone
    read_checkpoint(checkpoints(tmp_path)[-1][1])


def test_a_full_disk_under_the_driver_is_one_line(small_fs):
    """The driver's own writes on a real full file system (a 1 MiB tmpfs): one line, the last
    complete checkpoint loadable, nothing partial left."""
    run = small_fs("1m")
    save_checkpoint(run, 2, IDENTITY, parts, keep=2)

    def big(tmp):
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_bytes(bytes(2 << 20))
    with pytest.raises(RunError) as e:
        save_checkpoint(run, 4, IDENTITY, big, keep=2)
    message = str(e.value)
    assert message.startswith(f"writing checkpoint {run}/checkpoints/step_000004 failed: No space "
                              "left on device") and "\n" not in message, message
    assert f"the last complete checkpoint ({run}/checkpoints/step_000002) is intact" in message
    assert [s for s, _ in checkpoints(run)] == [2]
    assert not list((run / "checkpoints").glob(".step_*"))
    read_checkpoint(checkpoints(run)[-1][1])


def test_a_workers_write_error_names_its_file_in_the_checkpoint(tmp_path):
    """A worker's CheckpointWriteError (pickled across Ray) names its file relative to the
    checkpoint being written; an error that is not the file system's stays as it is."""
    import pickle

    from hybridflow.checkpoint import CheckpointWriteError
    save_checkpoint(tmp_path, 2, IDENTITY, parts, keep=2)

    def worker_full(tmp):
        error = CheckpointWriteError(str(tmp / "actor-rank0001.pt"), "Disk quota exceeded")
        raise pickle.loads(pickle.dumps(error))
    with pytest.raises(RunError, match=r"step_000004 failed: actor-rank0001.pt: Disk quota "
                                       r"exceeded; the last complete checkpoint .*step_000002"):
        save_checkpoint(tmp_path, 4, IDENTITY, worker_full, keep=2)

    def bug(tmp):
        raise KeyError("optimizer")
    with pytest.raises(KeyError):
        save_checkpoint(tmp_path, 4, IDENTITY, bug, keep=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [2]


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_rank_state_on_a_full_disk_is_one_line(small_fs, how):
    """save_rank_state (each worker's RNG file) on a full or read-only file system raises a
    CheckpointWriteError naming the file and the OS's reason."""
    from hybridflow.checkpoint import CheckpointWriteError
    from hybridflow.workers.updates import save_rank_state
    folder = small_fs("64k", full=True) if how == "full" else small_fs("64k", read_only=True)
    path = folder / "actor-rank0000.pt"
    with pytest.raises(CheckpointWriteError) as e:
        save_rank_state(path)
    reason = "No space left on device" if how == "full" else "Read-only file system"
    assert str(e.value) == f"{path}: {reason}"


def test_a_killed_write_is_never_loaded(tmp_path):
    save_checkpoint(tmp_path, 2, IDENTITY, parts, keep=2)
    # What a SIGKILL during the write of step 4 leaves: a hidden folder without trainer.json.
    partial = tmp_path / "checkpoints" / ".step_000004.tmp-abc"
    partial.mkdir()
    (partial / "actor").mkdir()
    (tmp_path / "config.yaml").write_text("name: rl\n")
    plan = plan_resume("auto", tmp_path, {"name": "rl"}, IDENTITY)
    assert plan.step == 2 and plan.checkpoint.name == "step_000002"
    remove_partial_checkpoints(tmp_path)
    assert not partial.exists()


def test_resume_auto_allows_only_the_resumable_keys_to_change(tmp_path):
    save_checkpoint(tmp_path, 2, IDENTITY, parts, keep=2)
    (tmp_path / "config.yaml").write_text("name: rl\nsteps: 4\nactor: {lr: 1}\n")
    assert plan_resume("auto", tmp_path, {"name": "rl", "steps": 8, "actor": {"lr": 1}},
                       IDENTITY).step == 2
    with pytest.raises(ConfigError, match=r"actor.lr \(1 there, 2 here\)"):
        plan_resume("auto", tmp_path, {"name": "rl", "steps": 4, "actor": {"lr": 2}}, IDENTITY)


def test_a_checkpoint_state_is_plain_json(tmp_path):
    save_checkpoint(tmp_path, 2, {**IDENTITY, "kl": 0.1}, parts, keep=1)
    text = (checkpoints(tmp_path)[0][1] / "trainer.json").read_text()
    assert json.loads(text)["kl"] == 0.1


def test_a_run_of_an_older_version_resumes_when_new_options_keep_their_defaults(tmp_path):
    save_checkpoint(tmp_path, 2, IDENTITY, parts, keep=2)
    (tmp_path / "config.yaml").write_text("name: rl\nactor: {lr: 1}\n")  # before `new` existed
    defaults = {"name": "rl", "actor": {"lr": 1, "new": "off"}}
    now = {"name": "rl", "actor": {"lr": 1, "new": "off"}}
    assert plan_resume("auto", tmp_path, now, IDENTITY, defaults).step == 2
    with pytest.raises(ConfigError, match=r"actor.new \(absent there, 'on' here\)"):
        plan_resume("auto", tmp_path, {**now, "actor": {"lr": 1, "new": "on"}}, IDENTITY,
                    defaults)


class _Payload:
    """A pickle that would run a command when loaded without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("content", ["crafted", "truncated", "another dict"])
def test_a_bad_rank_state_is_one_line_and_runs_nothing(tmp_path, content):
    """A per-rank RNG file of a checkpoint (what load_rank_state reads in each worker): a
    crafted pickle, a cut file or a foreign one is refused in one line naming it."""
    import torch

    from hybridflow.workers.updates import load_rank_state, save_rank_state
    path, marker = tmp_path / "actor-rank0000.pt", tmp_path / "ran"
    if content == "crafted":
        torch.save({"torch": _Payload(marker)}, path)
    elif content == "truncated":
        save_rank_state(path)
        path.write_bytes(path.read_bytes()[:100])
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ConfigError) as e:
        load_rank_state(path)
    assert e.value.field == "resume" and str(path) in e.value.message, e.value
    assert "\n" not in e.value.message and not marker.exists()
