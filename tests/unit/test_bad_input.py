"""Issue 13, bad input: malformed configs, data files, model directories, reward settings and
checkpoints to resume (or run folders of another run), each run through ``hybridflow train``
in-process, end in one line ``hybridflow: error: KEY: ...`` naming the key or file and the fix,
exit code 2, no traceback, and nothing written to the run folder (an earlier run's files there are
left as they were).

``test_config_contract.py`` probes the config keys one by one; this table covers what a user hands
the trainer: files that are missing, empty, of the wrong kind, or of another shape. A row that got
past the checks would start the workers: here that fails the row instead (``no_workers``)."""

import dataclasses
import importlib.util
import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest

from hybridflow.cli import main
from hybridflow.errors import ConfigError

PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
           for a, b in ((1, 1), (2, 3), (4, 4), (7, 1))]

BASE = """\
model: tiny-llama
reward: math
train_batch_size: 2
steps: 1
rollout:
  backend: hf
  sampling: {n: 2, max_tokens: 4}
data:
  source: DATA
"""
"""A valid run: the control row checks that it passes, so that no row passes vacuously."""


class Files:
    """Makes a row's inputs in ``tmp``: a config, a prompt file, an edited copy of tiny-llama."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.prompts = self.file("prompts.jsonl", _jsonl(PROMPTS))
        self.base = self.config(BASE)

    def file(self, name: str, content: str | bytes) -> str:
        """The path of a file named ``name`` holding ``content``."""
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def folder(self, name: str) -> str:
        """The path of an empty folder named ``name``."""
        (self.tmp / name).mkdir()
        return str(self.tmp / name)

    def config(self, text: str | bytes, name: str = "run.yaml") -> str:
        """The path of a config file holding ``text`` (DATA: the valid prompt file)."""
        if isinstance(text, str):
            text = text.replace("DATA", self.prompts)
        return self.file(name, text)

    def data(self, name: str, content: str | bytes) -> str:
        """``data.source=`` a file named ``name`` holding ``content``."""
        return f"data.source={self.file(name, content)}"

    def reward(self, code: str) -> str:
        """``reward=`` the function ``fn`` of a file holding ``code``."""
        return f"reward={self.file('r.py', code)}:fn"

    def model(self, edit: Callable[[Path], None]) -> str:
        """``model=`` a copy of tiny-llama changed by ``edit(dir)``."""
        from hybridflow.models.source import resolve_model
        path = self.tmp / "model"
        shutil.copytree(resolve_model("tiny-llama"), path)
        edit(path)
        return f"model={path}"

    def run(self, *overrides: str) -> str:
        """``name=`` a run folder in ``<tmp>/runs`` holding the config.yaml that this row's run,
        with ``overrides``, writes: a run there already."""
        from hybridflow.config import RLConfig, load_config, to_yaml
        cfg = load_config(RLConfig, self.base, [f"tracking.out_dir={self.tmp / 'runs'}",
                                                *overrides])
        run_dir = self.tmp / "runs" / cfg.name
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        return f"name={cfg.name}"

    def killed_run(self) -> str:
        """``resume=`` a run folder whose only checkpoint was never completed."""
        (self.tmp / "old" / "checkpoints" / ".step_000004.tmp-x" / "actor").mkdir(parents=True)
        return f"resume={self.tmp / 'old'}"

    def checkpoint(self, edit: Callable[[Path], None] | None = None, **state) -> str:
        """``resume=`` a checkpoint of another run that fits this one (tiny-llama, grpo), its
        trainer.json entries replaced by ``state``, then changed by ``edit(step_dir)``. Nothing
        in it is loaded: the checks read trainer.json and the manifest only."""
        from hybridflow.checkpoint import FORMAT, STATE_FILE, run_identity
        from hybridflow.config import RLConfig, load_config
        from hybridflow.models.source import resolve_model
        from hybridflow.training.loading import check_hf_checkpoint
        model = check_hf_checkpoint(resolve_model("tiny-llama"))
        step = self.tmp / "old_run" / "checkpoints" / "step_000003"
        (step / "actor").mkdir(parents=True)
        (step / "actor" / "__0_0.distcp").write_bytes(b"x" * 10)
        (step / "actor" / "metadata.json").write_text("{}")
        files = {"actor/__0_0.distcp": 10, "actor/metadata.json": 2}
        (step / STATE_FILE).write_text(json.dumps({
            "format": FORMAT, "step": 3, **run_identity(load_config(RLConfig, self.base), model),
            "files": files, "sampler": {"epoch": 0, "position": 6}, **state}))
        if edit is not None:
            edit(step)
        return f"resume={step}"


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# ------------------------------------------------------------------------------------------------
# edits of a model directory


def _hf_config(**changes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return edit


def _write_text(name: str, text: str | bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        (path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


def _remove(*names: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        for name in names:
            (path / name).unlink()
    return edit


def _truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])


def _safetensors_header(header: bytes, length: int | None = None) -> Callable[[Path], None]:
    """Replace the safetensors header by ``header`` (its length field ``length``), data kept."""
    def edit(path: Path) -> None:
        weights = path / "model.safetensors"
        data = weights.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        size = len(header) if length is None else length
        weights.write_bytes(struct.pack("<Q", size) + header + data[8 + n:])
    return edit


def _drop_tensor(name: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        from safetensors.torch import load_file, save_file
        weights = path / "model.safetensors"
        tensors = load_file(str(weights))
        del tensors[name]
        save_file(tensors, str(weights))
    return edit


def _cast_tensor(name: str, dtype: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file
        weights = path / "model.safetensors"
        tensors = load_file(str(weights))
        tensors[name] = tensors[name].to(getattr(torch, dtype))
        save_file(tensors, str(weights))
    return edit


def _index_to(file: str) -> Callable[[Path], None]:
    """An index that puts every tensor in ``file``."""
    def edit(path: Path) -> None:
        from safetensors import safe_open
        with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
            names = list(weights.keys())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {name: file for name in names}}))
    return edit


def _no_chat_template(path: Path) -> None:
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tok))


def _tiny_model_dict(**changes) -> dict:
    from hybridflow.models.source import resolve_model
    from hybridflow.training.loading import check_hf_checkpoint
    return {**dataclasses.asdict(check_hf_checkpoint(resolve_model("tiny-llama"))), **changes}


def _manifest(files: dict[str, int]) -> Callable[[Path], None]:
    """Set ``files`` (path: size) in a checkpoint's manifest."""
    def edit(step: Path) -> None:
        state = json.loads((step / "trainer.json").read_text())
        state["files"].update(files)
        (step / "trainer.json").write_text(json.dumps(state))
    return edit


def _parquet(rows) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------
# the table: (id, the arguments after `hybridflow train`, the key the error names, pieces of its
# message[, a pytest mark]). ``f`` is a Files; every row also gets tracking.out_dir=<tmp>/runs.

ROWS = [
    # ---- config files and overrides
    ("unknown top-level key", lambda f: [f.config(BASE + "stepz: 3\n")],
     "stepz", ["not a key", "hybridflow defaults train"]),
    ("unknown nested key", lambda f: [f.config(BASE + "actor: {engine: {optim: {lrr: 1}}}\n")],
     "actor.engine.optim.lrr", ["not a key"]),
    ("unknown override key", lambda f: [f.base, "stepss=3"], "stepss", ["not a key"]),
    ("unknown nested override key", lambda f: [f.base, "rollout.sampling.temp=0.5"],
     "rollout.sampling.temp", ["not a key"]),
    ("string for an int", lambda f: [f.config(BASE + "seed: ten\n")], "seed", ["ten"]),
    ("list for a dict", lambda f: [f.config(BASE + "actor: [1, 2]\n")], "actor",
     ["section of ActorConfig", "[1, 2]"]),
    ("number for a nested dict", lambda f: [f.config(BASE + "actor: {engine: {optim: 3}}\n")],
     "actor.engine.optim", ["section of OptimConfig", "int 3"]),
    ("dict for an int", lambda f: [f.base, "train_batch_size={a: 1}"], "train_batch_size",
     ["could not be converted"]),
    ("negative lr", lambda f: [f.base, "actor.engine.optim.lr=-1e-6"], "actor.engine.optim.lr",
     ["-1e-06"]),
    ("clip ratio 0", lambda f: [f.base, "actor.clip_ratio_low=0"], "actor.clip_ratio_low",
     ["(0, 1)"]),
    ("temperature < 0", lambda f: [f.base, "rollout.sampling.temperature=-0.5"],
     "rollout.sampling.temperature", ["[0, inf)"]),
    ("tp does not divide the heads", lambda f: [f.base, "actor.layout.tp=3", "train_batch_size=3"],
     "actor.layout.tp", ["num_heads=4"]),
    ("critic tp does not divide the heads",
     lambda f: [f.base, "algorithm.name=ppo", "critic.layout.tp=3"], "critic.layout.tp",
     ["num_heads=4"]),
    ("batch does not split over the replicas", lambda f: [f.base, "train_batch_size=3",
                                                         "actor.layout.dp=2"],
     "train_batch_size", ["multiple of 2"]),
    ("samples do not split into micro-batches",
     lambda f: [f.base, "actor.engine.micro_batch_size=3"], "actor.mini_batches", ["multiple"]),
    ("YAML syntax error", lambda f: [f.config(BASE + "steps: [1\n")], "CONFIG",
     ["run.yaml", "line", "fix the YAML"]),
    ("duplicate YAML key", lambda f: [f.config(BASE + "steps: 2\n")], "CONFIG",
     ["duplicate key 'steps'"]),
    # An empty file is the defaults (PyYAML reads it as null); what is wrong is then named.
    ("empty config file", lambda f: [f.config(""), "model=tiny-llama", "rollout.backend=hf",
                                     f"data.source={f.tmp}/none.jsonl"],
     "data.source", ["none.jsonl", "not found"]),
    ("YAML list, not a mapping", lambda f: [f.config("- model: tiny-llama\n")], "CONFIG",
     ["mapping"]),
    ("YAML scalar, not a mapping", lambda f: [f.config("tiny-llama\n")], "CONFIG", ["mapping"]),
    ("config file not found", lambda f: [str(f.tmp / "nope.yaml")], "CONFIG",
     ["nope.yaml", "not found"]),
    ("config file is a folder", lambda f: [str(f.tmp)], "CONFIG", ["not found"]),
    ("config file not UTF-8", lambda f: [f.config(b"name: caf\xe9\n")], "CONFIG", ["UTF-8"]),
    ("override without =", lambda f: [f.base, "steps"], "overrides", ["key=value"]),
    ("override with an empty key", lambda f: [f.base, "=3"], "overrides", ["empty"]),
    ("override value not YAML", lambda f: [f.base, "data.tasks=[a"], "data.tasks",
     ["cannot parse"]),
    ("unknown reasoning-gym task", lambda f: [f.base, "data.source=reasoning_gym",
                                              "data.tasks=[no_such_task]"],
     "data.tasks", ["no_such_task"]),

    # ---- prompt files
    ("data file missing", lambda f: [f.base, f"data.source={f.tmp}/missing.jsonl"],
     "data.source", ["missing.jsonl", "not found"]),
    ("parquet file missing", lambda f: [f.base, f"data.source={f.tmp}/missing.parquet"],
     "data.source", ["missing.parquet", "not found"]),
    ("data file is a folder", lambda f: [f.base, f"data.source={f.folder('d.jsonl')}"],
     "data.source", ["d.jsonl", "folder"]),
    ("data file empty", lambda f: [f.base, f.data("e.jsonl", "")], "data.source",
     ["e.jsonl", "no prompts"]),
    ("data file blank lines only", lambda f: [f.base, f.data("e.jsonl", "\n \n")], "data.source",
     ["e.jsonl", "no prompts"]),
    ("data file not JSON", lambda f: [f.base, f.data("g.jsonl", "prompt,answer\n1+1,2\n")],
     "data.source", ["g.jsonl", "row 1", "not valid JSON"]),
    ("data lines not objects", lambda f: [f.base, f.data("l.jsonl", '["What is 1+1?", "2"]\n')],
     "data.source", ["l.jsonl", "row 1", "object"]),
    ("data line a JSON string", lambda f: [f.base, f.data("s.jsonl", '"What is 1+1?"\n')],
     "data.source", ["s.jsonl", "row 1", "object"]),
    ("no prompt column", lambda f: [f.base, f.data("q.jsonl", _jsonl(
        [{"question": "1+1?", "answer": "2"}] * 4))],
     "data.source", ["q.jsonl", "row 1", "data.prompt_key"]),
    ("prompt_key names no column", lambda f: [f.base, "data.prompt_key=question"],
     "data.source", ["row 1", "'question'", "data.prompt_key"]),
    ("answer_key names no column", lambda f: [f.base, "data.answer_key=solution"],
     "data.source", ["row 1", "'solution'", "data.answer_key"]),
    ("empty prompt", lambda f: [f.base, f.data("p.jsonl", _jsonl([{"prompt": " "}] * 4))],
     "data.source", ["p.jsonl", "row 1", "empty"]),
    ("answer a list", lambda f: [f.base, f.data("a.jsonl", _jsonl(
        [{"prompt": "1+1?", "answer": [2]}] * 4))],
     "data.source", ["a.jsonl", "row 1", "'answer'", "string or a number"]),
    ("chat turn without content", lambda f: [f.base, f.data("c.jsonl", _jsonl(
        [{"messages": [{"role": "user"}], "answer": "1"}] * 4))],
     "data.source", ["c.jsonl", "row 1", "turn 0"]),
    ("data not UTF-8", lambda f: [f.base, f.data("u.jsonl", b'{"prompt": "caf\xe9"}\n')],
     "data.source", ["u.jsonl", "UTF-8"]),
    ("every prompt too long", lambda f: [f.base, "data.max_prompt_tokens=4"],
     "data.max_prompt_tokens", ["longer than 4 tokens"]),
    ("parquet file that is text", lambda f: [f.base, f.data("t.parquet", _jsonl(PROMPTS))],
     "data.source", ["t.parquet", "parquet"]),
    ("parquet without a prompt column", lambda f: [f.base, f.data("n.parquet", _parquet(
        [{"question": "1+1?", "answer": "2"}] * 4))],
     "data.source", ["n.parquet", "row 1", "data.prompt_key"]),
    ("fewer prompts than train_batch_size", lambda f: [f.base, "train_batch_size=6"],
     "train_batch_size", ["4 prompts"]),
    ("math reward without answers", lambda f: [f.base, f.data("a.jsonl", _jsonl(
        [{"prompt": "Say hi."}] * 4))], "data.answer_key", ["a.jsonl", "reward=math"]),
    ("reasoning-gym reward on a file", lambda f: [f.base, "reward=reasoning_gym"],
     "reward", ["metadata", "reward=math"]),

    # ---- model directories
    ("model folder missing", lambda f: [f.base, f"model={f.tmp}/no_model"], "model",
     ["no_model", "config.json"]),
    ("model preset misspelt", lambda f: [f.base, "model=tiny-lama"], "model",
     ["tiny-lama", "tiny-llama"]),
    ("model is a file", lambda f: [f.base, f"model={f.file('weights.bin', 'x')}"], "model",
     ["weights.bin", "directory"]),
    ("model without config.json", lambda f: [f.base, f.model(_remove("config.json"))], "model",
     ["config.json"]),
    ("config.json not JSON", lambda f: [f.base, f.model(_write_text("config.json", "{llama"))],
     "model", ["config.json", "not valid JSON", "line 1"]),
    ("config.json a JSON list", lambda f: [f.base, f.model(_write_text("config.json", "[1]"))],
     "model", ["config.json", "JSON object"]),
    ("config.json without model_type", lambda f: [f.base, f.model(_write_text(
        "config.json", '{"hidden_size": 128}'))], "model", ["config.json", "model_type"]),
    ("unsupported architecture", lambda f: [f.base, f.model(_hf_config(
        model_type="gpt2", architectures=["GPT2LMHeadModel"]))],
     "model", ["model/config.json", "GPT2LMHeadModel", "LlamaForCausalLM"]),
    ("KV heads do not divide the heads", lambda f: [f.base, f.model(_hf_config(
        num_key_value_heads=3))], "model", ["config.json", "num_kv_heads"]),
    ("scaled RoPE", lambda f: [f.base, f.model(_hf_config(rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))],
     "model", ["rope_scaling"]),
    ("more layers in config.json than weights",
     lambda f: [f.base, f.model(_hf_config(num_hidden_layers=6))],
     "model", ["model.layers.4.", "missing"]),
    ("fewer layers in config.json than weights",
     lambda f: [f.base, f.model(_hf_config(num_hidden_layers=2))],
     "model", ["model.layers.2.", "config.json"]),
    ("hidden size of config.json not the weights'",
     lambda f: [f.base, f.model(_hf_config(hidden_size=64, head_dim=16))],
     "model", ["model.safetensors", "shape"]),
    ("truncated safetensors", lambda f: [f.base, f.model(_truncate)], "model",
     ["model.safetensors", "truncated"]),
    ("safetensors header garbage", lambda f: [f.base, f.model(_safetensors_header(
        b"\x00\x01garbage!", 10))], "model", ["model.safetensors", "header"]),
    ("safetensors header length garbage", lambda f: [f.base, f.model(_safetensors_header(
        b"{}", 2**62))], "model", ["model.safetensors", "header"]),
    ("safetensors header a JSON list", lambda f: [f.base, f.model(_safetensors_header(b"[1]"))],
     "model", ["model.safetensors", "header"]),
    ("safetensors header entry without offsets", lambda f: [f.base, f.model(_safetensors_header(
        b'{"model.norm.weight": {"dtype": "F32", "shape": [128]}}'))],
     "model", ["model.safetensors", "model.norm.weight"]),
    # An int16 tensor was loaded as numbers: the run went on with a broken model.
    ("tensor stored as integers", lambda f: [f.base, f.model(_cast_tensor(
        "model.layers.0.mlp.down_proj.weight", "int16"))], "model",
     ["model.layers.0.mlp.down_proj.weight", "I16"]),
    ("tensor missing", lambda f: [f.base, f.model(_drop_tensor("model.norm.weight"))], "model",
     ["model.norm.weight", "missing"]),
    ("no safetensors file", lambda f: [f.base, f.model(_remove("model.safetensors"))], "model",
     ["safetensors"]),
    ("index names a missing file", lambda f: [f.base, f.model(_index_to("model-1.safetensors"))],
     "model", ["model-1.safetensors", "missing"]),
    ("index not JSON", lambda f: [f.base, f.model(_write_text(
        "model.safetensors.index.json", "{"))], "model",
     ["model.safetensors.index.json", "not valid JSON"]),
    ("index without weight_map", lambda f: [f.base, f.model(_write_text(
        "model.safetensors.index.json", "[]"))], "model",
     ["model.safetensors.index.json", "weight_map"]),
    ("tokenizer missing", lambda f: [f.base, f.model(_remove("tokenizer.json"))], "model",
     ["model", "has no tokenizer", "tokenizer.json"]),
    ("tokenizer file garbage", lambda f: [f.base, f.model(_write_text("tokenizer.json", "{"))],
     "model", ["model", "cannot load its tokenizer"]),
    ("tokenizer without chat template", lambda f: [f.base, f.model(_no_chat_template)], "model",
     ["model", "chat template"]),
    ("reward model folder missing", lambda f: [f.config(BASE.replace("reward: math\n", "")),
                                                f"reward_model={f.tmp}/no_rm"],
     "reward_model", ["no_rm", "config.json"]),

    # ---- reward settings
    ("reward name unknown", lambda f: [f.base, "reward=nonexistent"], "reward",
     ["nonexistent", "module:function"]),
    ("reward module missing", lambda f: [f.base, "reward=no_such_module:fn"], "reward",
     ["no_such_module"]),
    ("reward file missing", lambda f: [f.base, f"reward={f.tmp}/nope.py:fn"], "reward",
     ["nope.py", "not found"]),
    ("reward attribute missing", lambda f: [f.base, f.reward("x = 1")], "reward",
     ["r.py", "'fn'"]),
    ("reward not callable", lambda f: [f.base, f.reward("fn = 1")], "reward",
     ["builtins.int object", "not a function defined with def"]),
    ("trusted reward module missing", lambda f: [f.base, "reward=no_such_module:fn",
                                                 "reward_trust=[no_such_module]"], "reward",
     ["cannot import 'no_such_module'"]),
    # Issue 45, item 13: each of these passed and ran a shell command written in the response.
    ("reward yaml:unsafe_load", lambda f: [f.base, "reward=yaml:unsafe_load"], "reward",
     ["yaml is not a module reward_trust lists", "reward_trust: [yaml]"]),
    ("reward sympy:sympify", lambda f: [f.base, "reward=sympy:sympify"], "reward",
     ["sympy is not a module reward_trust lists"],
     pytest.mark.skipif(importlib.util.find_spec("sympy") is None, reason="needs sympy")),
    ("cost yaml:unsafe_load", lambda f: [f.base, "algorithm.name=safe_rlhf",
                                         "cost=yaml:unsafe_load"], "cost",
     ["yaml is not a module reward_trust lists"]),
    ("reward numpy.vectorize(os.system)", lambda f: [f.base, f.reward(
        "import numpy, os\nfn = numpy.vectorize(os.system)")], "reward",
     ["r.py:fn", "a numpy.vectorize object"]),
    ("reward object calling os.system", lambda f: [f.base, f.reward(
        "import os\nclass Shell:\n    __call__ = os.system\nfn = Shell()")], "reward",
     ["r.py:fn", "Shell object"]),
    ("reward partial subclass of os.system", lambda f: [f.base, f.reward(
        "import functools, os\nclass Call(functools.partial):\n    pass\nfn = Call(os.system)")],
     "reward", ["r.py:fn", "Call object"]),
    ("reward builtin", lambda f: [f.base, f.reward("import os\nfn = os.system")], "reward",
     ["r.py:fn", "the builtin posix.system"]),
    ("reward_trust of the standard library", lambda f: [f.base, "reward=os:system",
                                                        "reward_trust=[os]"], "reward_trust",
     ["os is the standard library's"]),
    ("reward of three arguments", lambda f: [f.base, f.reward("def fn(a, b, c): return 0")],
     "reward", ["fn", "(response)"]),
    ("reward file raises on import", lambda f: [f.base, f.reward(
        "raise RuntimeError('no GPU here\\nnor there')")], "reward", ["r.py", "RuntimeError"]),
    # tiny-llama has 512 positions.
    ("vLLM engine longer than the model's positions", lambda f: [
        f.base, "rollout.backend=vllm", "data.max_prompt_tokens=500",
        "rollout.sampling.max_tokens=100"], "data.max_prompt_tokens", ["= 600 positions", "512"]),
    ("prompt and response past the model's positions", lambda f: [
        f.base, "rollout.sampling.max_tokens=600"], "rollout.sampling.max_tokens",
     ["a response of up to 600", "512"]),
    ("name longer than a folder name can be", lambda f: [f.base, "name=" + "n" * 300], "name",
     ["300 bytes", "at most 255"]),
    ("more CPUs per rank than the machine has", lambda f: [f.base, "ray.cpus_per_worker=100"],
     "ray.cpus_per_worker", ["x 100 CPU", "a local Ray has"]),
    # ray.init retried such an address for minutes, deaf to SIGTERM.
    ("ray.address where nothing listens", lambda f: [f.base, f"ray.address={_dead_address()}"],
     "ray.address", ["(127.0.0.1:", "as Ray reaches it): nothing answers (connection refused)",
                     "ray start --head"]),
    # SystemExit is no Exception: both commands printed nothing and exited 0.
    ("reward file exits at import", lambda f: [f.base, f.reward("import sys\nsys.exit(0)")],
     "reward", ["r.py", "SystemExit"]),

    # ---- checkpoints and run folders (nothing is loaded: trainer.json and its manifest decide)
    ("resume path missing", lambda f: [f.base, f"resume={f.tmp}/no_ckpt"], "resume",
     ["no_ckpt", "does not exist", "step_N"]),
    ("resume a folder that is no checkpoint", lambda f: [f.base, f"resume={f.folder('ckpt')}"],
     "resume", ["ckpt", "no complete hybridflow checkpoint"]),
    ("resume a run folder without a complete checkpoint", lambda f: [f.base, f.killed_run()],
     "resume", ["old", "no complete hybridflow checkpoint"]),
    ("trainer.json not JSON", lambda f: [f.base, f.checkpoint(_write_text("trainer.json", "{st"))],
     "resume", ["step_000003/trainer.json", "unreadable", "another checkpoint"]),
    ("trainer.json of another format", lambda f: [f.base, f.checkpoint(format=2)], "resume",
     ["trainer.json", "format-1"]),
    ("checkpoint of another algorithm", lambda f: [f.base, f.checkpoint(algorithm="ppo")],
     "resume", ["step_000003", "algorithm.name 'ppo' there, 'grpo' here"]),
    ("checkpoint of another model shape", lambda f: [
        f.base, f.checkpoint(model=_tiny_model_dict(num_layers=2))],
     "resume", ["step_000003", "another model", "num_layers=2 (this run: 4)"]),
    ("checkpoint file truncated", lambda f: [
        f.base, f.checkpoint(_manifest({"actor/__0_0.distcp": 100}))],
     "resume", ["actor/__0_0.distcp has 10 bytes", "wrote 100", "truncated"]),
    ("checkpoint file of the manifest missing", lambda f: [
        f.base, f.checkpoint(_manifest({"actor/common.pt": 7}))],
     "resume", ["actor/common.pt is missing", "incomplete"]),
    ("run folder holds another run", lambda f: [
        f.base, "resume=auto", f.run("actor.engine.optim.lr=0.5")],
     "name", ["runs/rl holds another run", "actor.engine.optim.lr (0.5 there", "another name"]),
    ("run folder holds another run: resume=PATH", lambda f: [
        f.base, f.checkpoint(), f.run("actor.engine.optim.lr=0.5")],
     "name", ["runs/rl holds another run"]),
    ("resume=never over a run", lambda f: [f.base, "resume=never", f.run()], "resume",
     ["runs/rl already holds a run", "resume=auto continues it"]),
    ("resume=PATH over this run, from an older checkpoint", lambda f: [
        f.base, f.checkpoint(), f.run()],
     "resume", ["runs/rl already holds a run", "would overwrite its later rows"]),
]


@pytest.fixture(autouse=True)
def tiny_cache(tmp_path_factory, monkeypatch):
    """tiny-llama made once per session (test_config_contract shares it)."""
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def no_workers(monkeypatch):
    """Bad input must fail before any process starts: starting workers fails the row."""
    from hybridflow.trainer import RLTrainer

    def refuse(self):
        raise AssertionError("the input got past the checks: the workers were started")
    monkeypatch.setattr(RLTrainer, "start", refuse)


def test_the_valid_config_passes(tmp_path, capsys):
    """The control: the config every row breaks passes ``hybridflow check``, and ``train`` gets
    as far as starting the workers."""
    f = Files(tmp_path)
    assert main(["check", f.base, f"tracking.out_dir={tmp_path}/runs"]) == 0, \
        capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="workers were started"):
        main(["train", f.base, f"tracking.out_dir={tmp_path}/runs"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("make, key, pieces", [
    pytest.param(*row[1:4], id=row[0], marks=row[4:]) for row in ROWS])
def test_bad_input_is_one_line_naming_the_key(tmp_path, capsys, make, key, pieces):
    args = make(Files(tmp_path))
    runs = tmp_path / "runs"
    before = _contents(runs)  # a row's earlier run, or nothing
    code = main(["train", *args, f"tracking.out_dir={runs}"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"hybridflow: error: {key}: "), err
    for piece in pieces:
        assert piece in err, err
    assert _contents(runs) == before  # nothing written, an earlier run's files untouched
    # `hybridflow check` finds the same, so that a run it passes does not fail at the start.
    assert main(["check", *args, f"tracking.out_dir={runs}"]) == 2
    assert capsys.readouterr().err == err
    assert _contents(runs) == before


def test_a_trusted_package_reward_passes_check(tmp_path, capsys, monkeypatch):
    """The accepted forms of issue 45, item 13 through `hybridflow check`: a def of an installed
    module that reward_trust lists, a def of a reward file, our own rewards."""
    f = Files(tmp_path)
    (tmp_path / "trusted_rewards_pkg").mkdir()
    (tmp_path / "trusted_rewards_pkg" / "__init__.py").write_text(
        "def score(response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for args in (["reward=trusted_rewards_pkg:score", "reward_trust=[trusted_rewards_pkg]"],
                 [f.reward("def fn(response):\n    return 1.0")],
                 ["reward=hybridflow.rewards:math_reward_fn"]):
        assert main(["check", f.base, *args, f"tracking.out_dir={tmp_path}/runs"]) == 0, \
            capsys.readouterr().err
        assert "config OK" in capsys.readouterr().out


def test_an_out_dir_that_takes_no_folder_is_refused_before_start(tmp_path, capsys):
    """As root os.access allows everything, /proc included; check and train both refuse it."""
    f = Files(tmp_path)
    for command in ("check", "train"):
        assert main([command, f.base, "tracking.out_dir=/proc/hybridflow-runs"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridflow: error: tracking.out_dir: ") and "/proc" in err, err
    assert not Path("/proc/hybridflow-runs").exists()


def test_ray_address_auto_that_finds_a_dead_head_is_refused(tmp_path, capsys, monkeypatch):
    """``auto`` is the address Ray would join: RAY_ADDRESS here, where nothing listens. The
    commands refuse it (calibrate before it measures anything), and so does ``init_ray`` (the
    workers' start) itself, before Ray tries it."""
    from hybridflow.workers.group import RayConfig, init_ray
    dead = _dead_address()
    monkeypatch.setenv("RAY_ADDRESS", dead)
    f = Files(tmp_path)
    out = tmp_path / "calibration.json"
    for command in (["check", f.base], ["train", f.base],
                    ["calibrate", "--out", str(out), "--config", f.base]):
        assert main([*command, "ray.address=auto", f"tracking.out_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridflow: error: ray.address: auto: "), err
        assert f"RAY_ADDRESS={dead}: nothing answers (connection refused)" in err, err
        assert len(err.splitlines()) == 1, err
    assert not out.exists()
    with pytest.raises(ConfigError, match=f"ray.address: auto: .*{dead}: nothing answers"):
        init_ray(RayConfig(address="auto"))
    import ray
    assert not ray.is_initialized()


@pytest.mark.parametrize("answer, reason", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "what listens there is no Ray"),
    (None, "nothing answers within 0.5s")])
def test_ray_address_where_something_else_listens_is_refused(answer, reason):
    """ray.init would retry a server that is no Ray's for minutes as well: one that answers
    otherwise than gRPC, or not at all."""
    import socket
    import threading
    from hybridflow.workers.group import check_ray_address
    server = socket.create_server(("0.0.0.0", 0))  # every interface: Ray reaches this machine's

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            if answer is not None:
                conn.sendall(answer)
            else:
                conn.recv(1024)  # silent until the probe gives up

    threading.Thread(target=serve, daemon=True).start()
    with server, pytest.raises(ConfigError, match=f"ray.address: .*: {reason}"):
        check_ray_address(f"localhost:{server.getsockname()[1]}", timeout_s=0.5)


def test_a_server_that_ray_cannot_join_is_one_line(monkeypatch):
    """What the probe passes and Ray still cannot join (a gRPC server of another kind, a token
    it does not accept) is one line naming the address, Ray's last error in it."""
    import ray
    from hybridflow.workers import group
    monkeypatch.setattr(group, "check_ray_address", lambda address: None)

    def refuse(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster") from RuntimeError(
            "Failed to connect to GCS. Last connection error: Traceback ...\n"
            "ray.exceptions.RpcError: RPC error: Received http2 header with status: 404")
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ConfigError) as e:
        group.init_ray(group.RayConfig(address="10.0.0.5:6379"))
    assert e.value.field == "ray.address" and "\n" not in e.value.message
    assert e.value.message.startswith("10.0.0.5:6379: Ray could not join the cluster there "
                                      "(ray.exceptions.RpcError: RPC error: Received http2 "
                                      "header with status: 404)"), e.value.message


def _dead_address() -> str:
    """host:port on this machine where nothing listens."""
    from hybridflow.parallel.spawn import free_port
    return f"127.0.0.1:{free_port('127.0.0.1')}"


def _contents(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}
