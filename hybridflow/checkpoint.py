"""Checkpoints of an RL run, and the decision to resume one.

A checkpoint holds everything that decides the rest of the run: each trained model's weights and
optimizer state (Megatron-Core distributed checkpoints, reloadable at another layout), every
worker's RNG states and rollout call count, the prompt sampler's position, the KL and Lagrange
controllers, the step and the W&B run id. On disk::

    <run_dir>/checkpoints/step_000012/
        trainer.json            the driver's state, and the size of every file (a manifest)
        actor/  critic/ ...     Megatron-Core dist checkpoints (weights + optimizer state) of
                                the trained models: the actor, the critic, the cost critic
        actor-rank0000.pt ...   each rank's RNG states (tensors and ints: loaded weights_only)

It is written into a hidden temporary directory beside it and renamed when complete: a
``step_*`` directory is always whole, and a half-written one is never loaded (nor kept: the next
start deletes it). A write the file system refuses (a full disk, a quota, EIO, a read-only mount),
in a worker or in the driver, stops the run with one line naming the file and the OS's reason.
Nothing is unpickled: JSON, torch tensors loaded with ``weights_only=True``, and dist checkpoints
whose metadata goes through a restricted unpickler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from hybridflow.algorithms.specs import TRAINED_CRITICS, algorithm_spec
from hybridflow.errors import ConfigError, RunError, check_int

FORMAT = 1
CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints, inside the run directory."""
STATE_FILE = "trainer.json"
"""The driver's state in a checkpoint; written last, so its presence marks a complete write."""
RESUMABLE_KEYS = ("steps", "resume", "checkpoint", "ray", "on_nonfinite", "cluster.calibration",
                  "reward_timeout_s")
"""Config keys (or sections) a resumed run may change: they decide how long and where it runs,
how long it waits, or what it predicts, not what it computes. Any other difference means another
run."""
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When a run saves what it needs to resume exactly."""

    every: int = 10
    """Steps between checkpoints; the last step and a SIGTERM also write one. 0: never (a
    killed run then starts again from step 0)."""
    keep: int = 2
    """How many of the newest complete checkpoints to keep; older ones are deleted once a newer
    one is complete."""

    def __post_init__(self) -> None:
        check_int("every", self.every, low=0)
        check_int("keep", self.keep)


@dataclass
class ResumePlan:
    """Where a run starts: from step 0, or from a complete checkpoint."""

    run_dir: Path
    checkpoint: Path | None
    """The checkpoint to load (None: start from step 0)."""
    state: dict[str, Any]
    """Its trainer.json ({} without one)."""
    continues: bool
    """The run directory holds this run's earlier rows (kept up to ``step``) and config."""

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"resuming from {self.checkpoint} (step {self.step})"
        if self.continues:
            return f"{self.run_dir} has no complete checkpoint: starting it again from step 0"
        return f"a new run in {self.run_dir}"


def run_identity(cfg: Any, model: Any) -> dict[str, Any]:
    """What a checkpoint must match to load into a run: its algorithm, trained models and model
    shape (``cfg`` an RLConfig, ``model`` the ModelConfig), as plain data."""
    spec = algorithm_spec(cfg.algorithm.name)
    roles = ["actor"] + [role for role in TRAINED_CRITICS if getattr(spec, role)]
    return {"algorithm": cfg.algorithm.name, "roles": roles,
            "model": json.loads(json.dumps(dataclasses.asdict(model)))}


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run, oldest first, as (step, directory)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def read_checkpoint(path: str | os.PathLike, field: str = "resume") -> dict[str, Any]:
    """A checkpoint's trainer.json, after checking that every file it lists is there whole."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(field, f"{path} is not a hybridflow checkpoint (no {STATE_FILE}); give "
                                 f"a <run>/{CHECKPOINTS}/step_N directory or a run directory")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(field, f"{state_file} is unreadable ({e}); resume from another "
                                 "checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or \
            not isinstance(state.get("files"), dict):
        raise ConfigError(field, f"{state_file} is not a format-{FORMAT} hybridflow checkpoint "
                                 "state; resume from another checkpoint")
    for rel, size in state["files"].items():
        f = path / rel
        if not f.is_file():
            raise ConfigError(field, f"{path}: {rel} is missing; the checkpoint is incomplete: "
                                     "resume from another one (resume=PATH)")
        if f.stat().st_size != size:
            raise ConfigError(field, f"{path}: {rel} has {f.stat().st_size} bytes, the "
                                     f"checkpoint wrote {size} (truncated?); resume from another "
                                     "one (resume=PATH)")
    return state


def plan_resume(resume: str, run_dir: str | os.PathLike, config: dict[str, Any],
                identity: dict[str, Any], defaults: dict[str, Any] | None = None) -> ResumePlan:
    """Decide where a run starts, from ``resume`` (auto, never or a checkpoint path) and what the
    run directory holds. ``config``: the run's config as plain data; ``identity``: what a
    checkpoint must match to be loadable into this run (algorithm, roles, model shape);
    ``defaults``: the schema's defaults, for keys that a run written by an older hybridflow lacks
    (equal to their default, they are no difference). Raises a ConfigError, writing nothing, when
    the run directory holds another run or the checkpoint does not fit."""
    run_dir = Path(run_dir)
    held = _holds_run(run_dir)
    if resume == "never":
        if held:
            raise ConfigError("resume", f"{run_dir} already holds a run; resume=auto continues "
                                        "it, or choose another name (or tracking.out_dir)")
        return ResumePlan(run_dir, None, {}, continues=False)
    if held:
        _check_same_run(run_dir, config, defaults or {})
    if resume == "auto":
        found = checkpoints(run_dir)
        if not found:
            return ResumePlan(run_dir, None, {}, continues=held)
        path = found[-1][1]
    else:
        path = _checkpoint_at(Path(resume))
        newest = checkpoints(run_dir)
        if held and (not newest or newest[-1][1].resolve() != path.resolve()):
            raise ConfigError("resume", f"{run_dir} already holds a run; starting it from {path} "
                                        "would overwrite its later rows and checkpoints: choose "
                                        "another name (a new run directory) for it")
    state = read_checkpoint(path)
    _check_identity(path, state, identity)
    return ResumePlan(run_dir, path, state, continues=held)


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """``path`` when it is a checkpoint (a step directory), else the newest complete checkpoint
    of the run directory (or its checkpoints folder) ``path`` names; None if there is none."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = checkpoints(path.parent if path.name == CHECKPOINTS else path)
    return found[-1][1] if found else None


def _checkpoint_at(path: Path) -> Path:
    if not path.exists():
        raise ConfigError("resume", f"{path} does not exist; use auto, never or a checkpoint "
                                    f"directory (<run>/{CHECKPOINTS}/step_N)")
    found = find_checkpoint(path)
    if found is None:
        raise ConfigError("resume", f"{path} holds no complete hybridflow checkpoint; give a "
                                    f"<run>/{CHECKPOINTS}/step_N directory")
    return found


def _holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl",
                                                      CHECKPOINTS))


def _check_same_run(run_dir: Path, config: dict[str, Any], defaults: dict[str, Any]) -> None:
    """The run in ``run_dir`` is this one: its config.yaml equals ours but for RESUMABLE_KEYS
    and for keys it lacks that we hold at their defaults (options added since it was written)."""
    stored_file = run_dir / "config.yaml"
    try:
        stored = yaml.safe_load(stored_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        stored = None
    if not isinstance(stored, dict):
        raise ConfigError("name", f"{run_dir} holds files of a run without a readable "
                                  "config.yaml; choose another name (or tracking.out_dir), or "
                                  "move that folder away")
    diffs = [k for k in _differences(stored, config)
             if k.split(".")[0] not in RESUMABLE_KEYS and k not in RESUMABLE_KEYS
             and not (_at(stored, k) is _ABSENT and _at(config, k) == _at(defaults, k))]
    if diffs:
        shown = ", ".join(f"{k} ({_shown(_at(stored, k))} there, {_shown(_at(config, k))} here)"
                          for k in diffs[:3])
        raise ConfigError("name", f"{run_dir} holds another run: its config differs at {shown}"
                                  f"{' ...' if len(diffs) > 3 else ''}; choose another name (or "
                                  "tracking.out_dir), or resume=PATH in a new run to start from "
                                  "its checkpoint")


_ABSENT = object()  # a key one config has and the other lacks


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys (leaves, or the first absent level) where ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value)


def _at(data: Any, key: str) -> Any:
    for part in key.split("."):
        data = data.get(part, _ABSENT) if isinstance(data, dict) else _ABSENT
    return data


def _check_identity(path: Path, state: dict[str, Any], identity: dict[str, Any]) -> None:
    for key, mine in identity.items():
        theirs = state.get(key)
        if theirs != mine:
            what = {"algorithm": "algorithm.name", "roles": "its trained models",
                    "model": "the model's shape"}.get(key, key)
            if key == "model" and isinstance(theirs, dict):
                diff = _differences(theirs, mine)
                shown = ", ".join(f"{k}={_shown(_at(theirs, k))} (this run: {_shown(_at(mine, k))})"
                                  for k in diff[:3])
                raise ConfigError("resume", f"{path} holds another model ({shown}); resume "
                                            "from a checkpoint of this model")
            raise ConfigError("resume", f"{path} is a checkpoint of another kind of run: {what} "
                                        f"{theirs!r} there, {mine!r} here; resume it with its "
                                        "own config")


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any],
                    write_parts: Callable[[Path], None], keep: int) -> Path:
    """Write checkpoint ``step``: ``write_parts(tmp)`` has the workers write their files into a
    temporary directory, then ``state`` (plain data) and the manifest go into trainer.json and
    the directory is renamed into place. Older checkpoints beyond ``keep`` are deleted after.
    A failed write (a full disk) raises a RunError and leaves the complete ones as they were."""
    root = Path(run_dir) / CHECKPOINTS
    dest = root / f"step_{step:06d}"
    previous = checkpoints(run_dir)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=root))
        write_parts(tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        _write_json(tmp / STATE_FILE, {**state, "format": FORMAT, "step": step, "files": files})
        _fsync_tree(tmp)
        if dest.exists():  # the same step saved again (a stop right after a periodic save)
            shutil.rmtree(dest)
        os.rename(tmp, dest)
        _fsync_dir(root)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointWriteError):  # a worker's: its file, inside tmp
            reason = f"{_relative(e.path, tmp)}: {e.reason}"
        else:
            reason = os_failure(e)
        if reason is None:
            raise
        last = previous[-1][1] if previous else None
        raise RunError(f"writing checkpoint {dest} failed: {reason}; the last complete "
                       f"checkpoint ({last or 'none yet'}) is intact: free space or choose a "
                       "writable tracking.out_dir, then run the same command to resume") from None
    for _, old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> None:
    """Delete what a killed checkpoint write left behind (hidden ``.step_*.tmp-*`` folders)."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for path in root.glob(".step_*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


class CheckpointWriteError(RunError):
    """A checkpoint file (or folder) ``path`` the file system would not write, and its
    ``reason`` (``No space left on device``): raised in a worker, it reaches the driver as
    itself, which says which checkpoint failed and that the last complete one is intact."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self):  # pickled across processes (a Ray worker raised it)
        return type(self), (self.path, self.reason)


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Checkpoint files written into ``path`` inside: a failure the file system caused becomes
    a CheckpointWriteError naming ``path`` (see ``os_failure``); any other error propagates as
    it is. A failure that carries no errno at all (torch.save's C++ writer, which Megatron
    uses for common.pt, reports a full disk as "unexpected pos 768 vs 662") is put down to the
    file system where a small write into ``path``'s folder fails now too."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except BaseException as e:
        reason = os_failure(e, named=str(path))
        if reason is None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            reason = _probe(Path(path))
        if reason is None:
            raise
        raise CheckpointWriteError(str(path), reason) from None


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def os_failure(e: BaseException, named: str | None = None) -> str | None:
    """The OS's reason for ``e`` as one line (``No space left on device (/path)``, the file left
    out where it is ``named`` already) where the file system caused it: ``e`` is an OSError or
    has one among its causes, or says ``[Errno N]`` in its message (how Megatron's writer
    processes report one, gathered per rank into torch's CheckpointException); else None."""
    chain, cause = [], e
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for cause in chain:
        if isinstance(cause, OSError) and cause.errno:
            shown = cause.filename and str(cause.filename) != named
            return os.strerror(cause.errno) + (f" ({cause.filename})" if shown else "")
    for cause in chain:
        found = _ERRNO_TEXT.search(str(cause))
        if found:
            return os.strerror(int(found.group(1)))
    return None


_PROBE_BYTES = 1 << 20


def _probe(path: Path) -> str | None:
    """The OS's reason a write of a MiB into ``path`` (or its nearest existing folder) fails
    now, or None where it succeeds."""
    folder = path if path.is_dir() else next((p for p in path.parents if p.is_dir()), None)
    if folder is None:
        return None
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(bytes(_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e)
    return None


def _relative(path: str, folder: Path | None) -> str:
    """``path`` relative to ``folder`` where it is inside it."""
    try:
        return str(Path(path).relative_to(folder)) if folder is not None else path
    except ValueError:
        return path


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=1, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    for p in [*path.rglob("*"), path]:
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(p)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
