"""The config contract: every ConfigError the code can raise names a real key, every malformed
input a new user tried ends in one line naming the key they typed, exit code 2, nothing written;
the Python API keeps the same promises."""

import ast
import dataclasses
import fnmatch
import os
import typing
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config, make_config
from hybridflow.errors import ConfigError
from hybridflow.lm_demo import LMDemoConfig

ROOT = Path(__file__).resolve().parents[2]

# Names of what is not a key of a schema: the command line's CONFIG file and overrides, the
# Python API's arguments, the tools' flags.
NOT_KEYS = {"CONFIG", "overrides", "config", "prompts", "max_steps", "learning_rate",
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
            "max_new_tokens", "use_3d_hybrid", "algorithm"}


def schema_keys(cls, prefix=""):
    keys = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        hint = typing.get_type_hints(cls)[f.name]
        sub = [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
        if typing.get_origin(hint) is dict and sub:
            # a mapping of names to sections: placement.pools.<name>.nodes
            keys |= schema_keys(sub[0], key + ".*.")
        elif sub:
            keys |= schema_keys(sub[0], key + ".")
    return keys


KEYS = schema_keys(RLConfig) | schema_keys(LMDemoConfig)
SUFFIXES = {".".join(k.split(".")[i:]) for k in KEYS for i in range(len(k.split(".")))}
SUFFIXES |= {f"{k}.*" for k in SUFFIXES}  # an entry of a mapping-valued key


def config_error_fields():
    """(file:line, pattern) of the first argument of every ConfigError(...) in the package and
    tools; an f-string's holes become '*'."""
    for path in sorted([*(ROOT / "hybridflow").rglob("*.py"), *(ROOT / "tools").glob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigError"):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            arg = node.args[0]
            if isinstance(arg, ast.Constant):
                yield where, arg.value
            elif isinstance(arg, ast.JoinedStr):
                yield where, "".join(v.value if isinstance(v, ast.Constant) else "*"
                                     for v in arg.values)
            else:
                yield where, None


def test_every_config_error_names_a_key_of_the_schema():
    bad = []
    for where, pattern in config_error_fields():
        if pattern is None:
            # A computed field must come from a key (e.g. ``e.field``, a loop over key names):
            # those places are few and each is read by a test below.
            continue
        if pattern in NOT_KEYS or pattern.startswith("--"):
            continue
        if not fnmatch.filter(SUFFIXES, pattern):
            bad.append(f"{where}: {pattern!r}")
    assert not bad, "ConfigError fields that are no key of RLConfig / LMDemoConfig:\n" + \
        "\n".join(bad)


def test_the_walk_sees_the_errors():
    found = list(config_error_fields())
    assert len(found) > 60
    assert any(p == "actor.mini_batches" or p == "*.mini_batches" for _, p in found)


# ------------------------------------------------------------------------------------------------
# malformed input, as a new user typed it


@pytest.fixture
def tiny_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def run_train(tmp_path, capsys, *args, command="train"):
    """``hybridflow COMMAND [CONFIG] model=tiny-llama rollout.backend=hf ARGS``."""
    out = tmp_path / "runs"
    files = [a for a in args[:1] if "=" not in a]
    code = main([command, *files, "model=tiny-llama", "rollout.backend=hf",
                 f"tracking.out_dir={out}", *args[len(files):]])
    err = capsys.readouterr().err
    return code, err, out


PROBES = [  # (overrides, the key the error must name, a piece of its message)
    (["actor.engine.optim.lr=inf"], "actor.engine.optim.lr", "finite"),
    (["actor.engine.optim.lrr=1"], "actor.engine.optim.lrr", "not a key"),
    (["actor.ppo_epochs=0"], "actor.ppo_epochs", "positive integer"),
    (["actor.mini_batches=0"], "actor.mini_batches", "positive integer"),
    (["seed=-1"], "seed", "non-negative"),
    (["rollout.bucket_mb=0"], "rollout.bucket_mb", "(0, inf)"),
    (["rollout.kv_cache_mb=0"], "rollout.kv_cache_mb", "(0, inf)"),
    (["pad_token_id=-3"], "pad_token_id", "non-negative"),
    (["pad_token_id=100000"], "pad_token_id", "vocab_size"),
    (["algorithm.name=ppo", "algorithm.gamma=2"], "algorithm.gamma", "[0, 1]"),
    (["algorithm.kl_in_reward=true", "algorithm.kl_coef=-1"], "algorithm.kl_coef", "[0, inf)"),
    (["actor.clip_ratio_low=5"], "actor.clip_ratio_low", "(0, 1)"),
    (["algorithm.kl_in_reward=true", "algorithm.kl_type=k9"], "algorithm.kl_type", "k9"),
    (["actor.loss_agg_mode=foo"], "actor.loss_agg_mode", "foo"),
    (["actor.entropy_coef=-0.01"], "actor.entropy_coef", "[0, inf)"),
    (["rollout.sampling.n=0"], "rollout.sampling.n", "positive integer"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p", "(0, 1]"),
    (["actor.layout.tp=8"], "actor.layout.tp", "num_heads=4"),
    (["actor.layout.pp=8"], "actor.layout.pp", "num_layers=4"),
    (["actor.layout.tp=0"], "actor.layout.tp", "positive integer"),
    (["rollout.tp=2"], "rollout.tp", "rollout.backend=megatron"),
    (["rollout.backend=megatron", "actor.layout.tp=2", "rollout.tp=4"], "rollout.tp",
     "must divide"),
    (["actor.layout.vpp=2"], "actor.layout.vpp", "pp > 1"),
    (["actor.layout.last_stage_layers=2"], "actor.layout.last_stage_layers", "pp > 1"),
    (["actor.layout.pp=2", "actor.layout.last_stage_layers=4"],
     "actor.layout.last_stage_layers", "between 1 and the model's 4 layers"),
    (["train_batch_size=0"], "train_batch_size", "positive integer"),
    (["train_batch_size=3", "actor.engine.micro_batch_size=5"], "actor.mini_batches",
     "multiple"),
    (["algorithm.name=grpo", "rollout.sampling.n=1"], "rollout.sampling.n", "n >= 2"),
    (["algorithm.name=safe_rlhf"], "cost", "cost function"),
    (["algorithm.name=safe_rlhf", "cost=math", "algorithm.norm_by_std=false"],
     "algorithm.norm_by_std", "remove it or algorithm.name=grpo"),  # GAE: no groups
    (["cost=math"], "cost", "only safe_rlhf"),
    (["algorithm.lam=0.9"], "algorithm.lam", "no effect"),
    (["algorithm.kl_coef=0.1"], "algorithm.kl_coef", "kl_in_reward=true"),
    (["critic.engine.optim.lr=0.1"], "critic.engine.optim", "no effect"),
    (["actor.engine.optim.offload=true", "actor.layout.tp=2"], "actor.engine.optim.offload",
     "tp, pp and dp to 1"),
    (["actor.engine.optim.offload=true", "actor.engine.optim.name=sgd"],
     "actor.engine.optim.offload", "Adam only"),
    (["actor.engine.optim.offload=true", "actor.lora.rank=4"], "actor.engine.optim.offload",
     "actor.lora.rank=0"),
    (["actor.engine.optim.offload=true", "hybrid_engine.offload_optimizer=true"],
     "hybrid_engine.offload_optimizer", "never leaves host memory"),
    (["critic.engine.recompute=true"], "critic.engine.recompute", "no effect"),
    (["actor.engine.recompute=maybe"], "actor.engine.recompute", "maybe"),
    (["actor.engine.max_tokens_per_micro_batch=64", "actor.engine.forward_micro_batch_size=4"],
     "actor.engine.forward_micro_batch_size", "set actor.engine.max_tokens_per_micro_batch=null"),
    (["name=../x"], "name", "plain name"),
    (["name=a/b"], "name", "plain name"),
    (["name="], "name", "Incompatible value 'None'"),
    (["steps=abc"], "steps", "abc"),
    (["hybrid_engine.mode=fast"], "hybrid_engine.mode", "3d, naive"),
    (["weight_sync.verify=sometimes"], "weight_sync.verify", "every, first, off"),
    (["hybrid_engine.mode=naive", "hybrid_engine.resident=true"], "hybrid_engine.resident",
     "hybrid_engine.mode=3d"),
    (["actor.lora.rank=4", "hybrid_engine.resident=true"], "hybrid_engine.resident",
     "lora_merge=in_place"),
    (["hybrid_engine.lora_merge=in_place"], "hybrid_engine.lora_merge", "actor.lora.rank > 0"),
    (["actor.lora.rank=4", "hybrid_engine.lora_merge=fused"], "hybrid_engine.lora_merge",
     "copy, in_place"),
    (["ray.gpu_memory_gib=24"], "ray.gpu_memory_gib", "ray.gpus_per_worker > 0"),
    (["rollout.keep_cache=true"], "rollout.keep_cache", "rollout.backend=megatron"),
    (["rollout.backend=megatron", "rollout.keep_cache=true"], "rollout.keep_cache",
     "ray.gpus_per_worker > 0"),
    (["rollout.backend=megatron", "ray.gpus_per_worker=1", "actor.layout.tp=2", "rollout.tp=2",
      "rollout.keep_cache=true"], "rollout.keep_cache", "rollout.tp=1"),
    (["ray.gpus_per_worker=1", "ray.gpu_memory_gib=0"], "ray.gpu_memory_gib", "(0, inf)"),
    (["actor.engine.optim.distributed=true", "hybrid_engine.resident=true"],
     "hybrid_engine.resident", "optim.distributed=false"),
    (["reward=nosuchreward"], "reward", "nosuchreward"),
    (["data.source=missing.jsonl"], "data.source", "not found"),
    (["data.source=prompts.csv"], "data.source", ".jsonl"),
    (["ray.gpus_per_worker=-1"], "ray.gpus_per_worker", "[0, inf)"),
    (["model=/nonexistent"], "model", "no config.json"),
    (["reward_model=/nonexistent"], "reward_model", "no config.json"),
    (["actor.engine.dtype=fp8"], "actor.engine.dtype", "fp8"),
    (["data.tasks=[]"], "data.tasks", "at least one"),
    (["tracking.out_dir="], "tracking.out_dir", "Incompatible value 'None'"),
    (["algorithm.name=ppo", "critic.layout.tp=2", "critic.engine.sequence_parallel=true"],
     "critic.engine.sequence_parallel", "value heads"),
]


@pytest.mark.parametrize("args, key, message", PROBES, ids=[" ".join(p[0]) for p in PROBES])
def test_bad_train_config_exits_2_naming_the_key(tmp_path, capsys, tiny_cache, args, key,
                                                 message):
    for command in ("check", "train"):
        code, err, out = run_train(tmp_path, capsys, *args, command=command)
        assert code == 2, err
        assert err.startswith(f"hybridflow: error: {key}: ") and message in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_bad_files_exit_2_naming_the_key(tmp_path, capsys, tiny_cache):
    bad_utf8 = write(tmp_path / "bad.jsonl", b'{"prompt": "a\xff"}\n')
    bad_row = write(tmp_path / "rows.jsonl", '{"prompt": 3}\n')
    bad_py = write(tmp_path / "r.py", "def f(x:\n")
    a_file = write(tmp_path / "a_file", "x")
    cases = [  # (config file text, overrides, the key, a piece of the message)
        ("actor: {layout: {tp: 1}\n", [], "CONFIG", "line 2"),
        ("steps: 1\nsteps: 2\n", [], "CONFIG", "duplicate key 'steps'"),
        ("- a\n- b\n", [], "CONFIG", "mapping"),
        (b"name: \xff\n", [], "CONFIG", "UTF-8"),
        ("", [f"data.source={bad_utf8}"], "data.source", "UTF-8"),
        ("", [f"data.source={bad_row}"], "data.source", "row 1"),
        ("", [f"reward={bad_py}:f"], "reward", "SyntaxError"),
        ("", [f"tracking.out_dir={a_file}/runs"], "tracking.out_dir", "not a folder"),
        ("", ["steps"], "overrides", "key=value"),
    ]
    model = tmp_path / "empty_model"
    model.mkdir()
    (model / "config.json").write_text("")
    cases.append(("", [f"model={model}"], "model", "config.json"))
    for text, overrides, key, message in cases:
        config = write(tmp_path / "c.yaml", text)
        code, err, out = run_train(tmp_path, capsys, config, *overrides)
        assert code == 2, (text, overrides, err)
        assert err.startswith(f"hybridflow: error: {key}: ") and message in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_a_refused_start_leaves_an_earlier_run_alone(tmp_path, capsys, tiny_cache):
    run = tmp_path / "runs" / "rl"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("earlier\n")
    for bad in ("actor.layout.tp=8", "data.source=missing.jsonl"):
        code, err, _ = run_train(tmp_path, capsys, bad)
        assert code == 2, err
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert (run / "config.yaml").read_text() == "earlier\n"


# ------------------------------------------------------------------------------------------------
# the Python API


def test_python_api_refuses_what_the_config_refuses(tiny_cache):
    from hybridflow.trainer import RLTrainer
    base = dict(model="tiny-llama", rollout={"backend": "hf"})
    for kwargs, key in [(dict(max_steps=0), "max_steps"), (dict(num_generations=0),
                                                            "num_generations"),
                        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
                        (dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
                        (dict(learning_rate=float("nan")), "learning_rate"),
                        ({"actor.ppo_epochs": -1}, "actor.ppo_epochs")]:
        with pytest.raises(ConfigError) as e:
            RLTrainer(base, **kwargs)
        assert e.value.field == key, (kwargs, e.value)
    with pytest.raises(ConfigError) as e:
        RLTrainer("experiments/quickstart_grpo.yaml")
    assert e.value.field == "config" and "str" in str(e.value)


def test_python_api_applies_overrides_to_a_given_config(tiny_cache):
    from hybridflow.trainer import RLTrainer
    cfg = load_config(RLConfig, None, ["model=tiny-llama", "rollout.backend=hf"])
    trainer = RLTrainer(cfg, steps=3, **{"actor.engine.optim.lr": 1e-4}, max_new_tokens=5,
                        reward_fn=len)
    assert (trainer.config.steps, trainer.config.actor.engine.optim.lr) == (3, 1e-4)
    assert trainer.config.rollout.sampling.max_tokens == 5
    assert trainer.config.reward == "builtins:len"
    assert cfg.steps == 10  # the caller's config is not changed
    from_dict = RLTrainer({"model": "tiny-llama", "rollout": {"backend": "hf"}, "steps": 2})
    assert from_dict.config.steps == 2 and isinstance(from_dict.config, RLConfig)


def test_component_errors_name_the_full_key():
    with pytest.raises(ConfigError) as e:
        make_config(RLConfig, None, {"critic.engine.optim.adam_beta2": 1.0,
                                     "algorithm.name": "ppo"})
    assert e.value.field == "critic.engine.optim.adam_beta2"
    with pytest.raises(ConfigError) as e:
        load_config(LMDemoConfig, None, ["model.num_kv_heads=3"])
    assert e.value.field == "model.num_kv_heads"


@pytest.mark.parametrize("args, resident", [
    (["rollout.backend=megatron"], True),  # the default where it can act
    (["rollout.backend=hf"], False),  # the engine keeps its own copy anyway
    (["rollout.backend=megatron", "hybrid_engine.mode=naive"], False),
    (["rollout.backend=megatron", "actor.lora.rank=4"], False),
    (["rollout.backend=megatron", "actor.lora.rank=4", "hybrid_engine.lora_merge=in_place"],
     True),
    (["rollout.backend=megatron", "actor.engine.optim.distributed=true"], False),
    (["rollout.backend=megatron", "hybrid_engine.resident=false"], False),
    (["rollout.backend=hf", "hybrid_engine.resident=true"], True),
])
def test_resident_switch_is_on_by_default_where_it_can_act(args, resident):
    cfg = load_config(RLConfig, None, ["model=tiny-llama", *args])
    assert cfg.hybrid_engine.resident_for(cfg.actor, cfg.rollout) is resident
