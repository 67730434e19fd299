"""experiments/: composed configs (``defaults:``), the SmolLM2 recipes resolving as their flat files
did, the HybridFlow paper's configs (shape presets, synthetic prompts, cluster and memory checks,
the GPU-count sweep, the placements of its Figures 12-13), and every config passing
``hybridflow check``."""

import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config, to_yaml
from hybridflow.config.placement import resolve_placement
from hybridflow.preflight import check_run
from hybridflow.planner.memory import (checkpoint_bytes, estimate_memory, layer_activation_bytes,
                                      param_count, streamed_unit_bytes)
from hybridflow.data.loader import tokenize_prompts
from hybridflow.data.prompts import SYNTHETIC_FIRST_ID, PromptDataConfig, load_prompts
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.presets import SHAPES

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
ALL_YAML = sorted(EXPERIMENTS.glob("**/*.yaml"))
# A file that names no run (no `name:`) is a building block that runs compose with `defaults:`.
BLOCKS = [p for p in ALL_YAML if "name" not in (yaml.safe_load(p.read_text()) or {})]
RUNNABLE = [p for p in ALL_YAML if p not in BLOCKS]
PAPER = sorted((EXPERIMENTS / "paper").glob("*/llama2_*.yaml"))
PLACEMENT = sorted((EXPERIMENTS / "paper" / "placement").glob("*.yaml"))
PAPER = PAPER
HARDWARE = ("Hardware as the paper states it (section 8.1): nodes of 8 NVIDIA A100-80GB GPUs, "
            "NVLink at 600 GB/s within a node, 200 Gb/s between nodes")

sys.path.insert(0, str(ROOT / "tools"))
import paper_sweep  # noqa: E402


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def resolved(path, *overrides) -> dict:
    return yaml.safe_load(to_yaml(load_config(RLConfig, path, list(overrides))))


def header(path: Path) -> str:
    """The comment a config file starts with, as one line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


# ------------------------------------------------------------------------------------------------
# composition


def test_defaults_merge_in_order_then_own_keys_then_overrides(tmp_path):
    write(tmp_path / "common" / "root.yaml", "steps: 1\nseed: 1\ndata: {size: 10, tasks: [a]}\n")
    write(tmp_path / "common" / "base.yaml", "defaults: [root.yaml]\nsteps: 2\n"
                                             "data: {size: 20, tasks: [basic_arithmetic]}\n")
    write(tmp_path / "other.yaml", "steps: 3\npad_token_id: 5\n")
    run = write(tmp_path / "runs" / "run.yaml",
                "defaults: [../common/base.yaml, ../other.yaml]\nname: composed\nseed: 7\n")
    cfg = load_config(RLConfig, run, ["pad_token_id=6"])
    assert (cfg.name, cfg.steps, cfg.seed, cfg.pad_token_id) == ("composed", 3, 7, 6)
    assert cfg.data.size == 20 and cfg.data.tasks == ["basic_arithmetic"]  # a list is replaced
    assert cfg.data.max_prompt_tokens == PromptDataConfig().max_prompt_tokens  # untouched key
    text = to_yaml(cfg)  # what runs/<name>/config.yaml holds: resolved, no defaults key
    assert "defaults" not in yaml.safe_load(text) and "steps: 3" in text


@pytest.mark.parametrize("text, message", [
    ("defaults: [missing.yaml]\n", "missing.yaml is not a file"),
    ("defaults: base.yaml\n", "defaults must be a list"),
    ("defaults: [3]\n", "defaults must be a list"),
    ("defaults: [loop.yaml]\n", "cycle"),
])
def test_bad_defaults_name_the_file_and_the_fix(tmp_path, capsys, text, message):
    write(tmp_path / "loop.yaml", "defaults: [c.yaml]\n")
    config = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, config)
    assert e.value.field == "CONFIG" and str(config) in e.value.message, e.value
    assert message in e.value.message, e.value
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: CONFIG: ") and len(err.strip().splitlines()) == 1


def test_a_key_of_a_default_is_checked_like_any_other(tmp_path):
    write(tmp_path / "base.yaml", "actor: {ppo_epoch: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, write(tmp_path / "run.yaml", "defaults: [base.yaml]\n"))
    assert e.value.field == "actor.ppo_epoch"


QUICKSTART = EXPERIMENTS / "quickstart_grpo.yaml"


def test_tilde_deletes_a_key(tmp_path):
    """``~key`` puts a key of the schema back to its default and removes an entry of a mapping;
    a key it names that is not there is one error naming it."""
    cfg = load_config(RLConfig, QUICKSTART, ["~data.task_kwargs", "~data.size", "~actor.layout",
                                             "data.tasks=[basic_arithmetic]"])
    default = RLConfig()
    assert cfg.data.task_kwargs == {} and cfg.data.size == default.data.size
    assert cfg.actor.layout == default.actor.layout and cfg.steps == 10
    cfg = load_config(RLConfig, QUICKSTART, ["~data.task_kwargs.chain_sum",
                                             "data.tasks=[basic_arithmetic]"])
    assert cfg.data.task_kwargs == {} and cfg.data.tasks == ["basic_arithmetic"]
    cfg = load_config(RLConfig, QUICKSTART, ["~data.task_kwargs.gsm_symbolic"])  # not set
    assert list(cfg.data.task_kwargs) == ["chain_sum"]
    # A key the file set to auto is no longer chosen by the planner (which needs rates).
    run = write(tmp_path / "auto.yaml", f"defaults: [{QUICKSTART}]\nrollout: {{tp: auto}}\n")
    with pytest.raises(ConfigError, match="^cluster.calibration"):
        load_config(RLConfig, run)
    assert load_config(RLConfig, run, ["~rollout.tp"]).auto == []
    for item, key, message in [("~data.no_such_key", "data.no_such_key", "not a key"),
                               ("~data.tasks.x", "data.tasks.x", "not a key"),
                               ("~steps=3", "overrides", "write ~steps")]:
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, QUICKSTART, [item])
        assert e.value.field == key and message in e.value.message, e.value


def test_an_override_drops_the_file_keys_it_leaves_unread(tmp_path, capsys):
    """``data.source=FILE`` on a reasoning-gym config drops the file's tasks, their options and
    size, with one note; ``data.tasks`` drops the options of the tasks it no longer lists; what
    the command line itself sets unread is still refused."""
    prompts = write(tmp_path / "p.jsonl", '{"prompt": "1+1?", "answer": "2"}\n')
    cfg = load_config(RLConfig, QUICKSTART, [f"data.source={prompts}"])
    default = PromptDataConfig()
    assert (cfg.data.source, cfg.data.tasks, cfg.data.task_kwargs, cfg.data.size) == \
        (str(prompts), default.tasks, {}, default.size)
    assert cfg.data.system_prompt == "Reply with only the final number."  # read by files too
    assert capsys.readouterr().out == (
        f"note: data.source={prompts}: dropped data.tasks, data.task_kwargs, data.size of "
        f"{QUICKSTART}, which it leaves unread\n")
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, QUICKSTART, [f"data.source={prompts}", "data.tasks=[chain_sum]"])
    assert e.value.field == "data.tasks" and "no effect" in e.value.message
    cfg = load_config(RLConfig, QUICKSTART, ["data.tasks=[basic_arithmetic]"])
    assert cfg.data.task_kwargs == {}
    assert "dropped data.task_kwargs.chain_sum" in capsys.readouterr().out
    cfg = load_config(RLConfig, QUICKSTART, ["data.tasks=[chain_sum, basic_arithmetic]"])
    assert list(cfg.data.task_kwargs) == ["chain_sum"] and capsys.readouterr().out == ""
    # The other way: a file config switched to reasoning-gym drops its columns.
    run = write(tmp_path / "file.yaml", f"reward: math\ndata: {{source: {prompts}, "
                                        "prompt_key: q}\n")
    cfg = load_config(RLConfig, run, ["data.source=reasoning_gym"])
    assert cfg.data.prompt_key is None and "dropped data.prompt_key" in capsys.readouterr().out


def test_one_command_switches_the_quickstart_to_a_file(tmp_path, capsys):
    """Issue 45, item 6: ``hybridflow check experiments/quickstart_grpo.yaml data.source=FILE``
    passes for a file of reasoning-gym entries; an unknown task is named under data.tasks."""
    from hybridflow.data.prompts import reasoning_gym_prompts
    import json
    items = reasoning_gym_prompts(["chain_sum"], size=40, seed=0)
    rows = [{"prompt": i.messages[-1]["content"], "answer": i.reference,
             "metadata": i.extra["metadata"]} for i in items]
    data = write(tmp_path / "chain_sum.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", str(QUICKSTART), f"data.source={data}",
                 f"tracking.out_dir={tmp_path}"]) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
    assert main(["check", str(QUICKSTART), "data.tasks=[no_such_task]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: data.tasks: unknown reasoning-gym datasets "
                          "['no_such_task']") and len(err.splitlines()) == 1, err


# The two SmolLM2 recipes as flat files, before experiments/ was composed: the composed ones must
# resolve to exactly these.
FLAT_SMOLLM2 = """
model: smollm2
actor:
  layout: {tp: 1, pp: 2, dp: 1}
  engine:
    micro_batch_size: 4
    optim: {name: adam, lr: 2.0e-5, clip_grad: 1.0}
  mini_batches: 1
rollout:
  backend: vllm
  tp: 1
  sampling: {temperature: 1.0, max_tokens: 24, n: 4}
data:
  source: reasoning_gym
  tasks: [chain_sum]
  task_kwargs:
    chain_sum: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, allow_negation: false}
  size: 400
  system_prompt: "Reply with only the final number."
  max_prompt_tokens: 64
reward: reasoning_gym
train_batch_size: 4
"""
FLAT = {
    "quickstart_grpo.yaml": FLAT_SMOLLM2 + "name: quickstart-grpo\nalgorithm: {name: grpo}\n"
                                           "steps: 10\nvalidation: {every: 5, size: 32}\n",
    "dapo_smollm2.yaml": FLAT_SMOLLM2.replace("  mini_batches: 1\n", """  mini_batches: 2
  clip_ratio_low: 0.2
  clip_ratio_high: 0.28
  loss_agg_mode: token-mean
  kl_loss_coef: 0.0
""") + """name: dapo-smollm2
algorithm:
  name: grpo
  dynamic_sampling: true
  max_sampling_rounds: 3
  overlong_buffer: 8
  overlong_penalty: 1.0
steps: 4
""",
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_smollm2_recipes_resolve_as_their_flat_files_did(tmp_path, name):
    flat = write(tmp_path / name, FLAT[name])
    composed = EXPERIMENTS / name
    assert "defaults:" in composed.read_text()  # a small override of experiments/smollm2/
    assert resolved(composed) == resolved(flat)


# ------------------------------------------------------------------------------------------------
# every config passes hybridflow check


def test_every_base_is_a_building_block_of_some_config():
    named = set()
    for path in ALL_YAML:
        data = yaml.safe_load(path.read_text()) or {}
        named |= {(path.parent / d).resolve() for d in data.get("defaults", [])}
    bases = {p.resolve() for p in BLOCKS}
    assert bases and bases <= named, bases - named
    assert all(p.resolve() not in named for p in RUNNABLE)  # a run is nobody's building block


@pytest.mark.parametrize("path", RUNNABLE, ids=[str(p.relative_to(EXPERIMENTS)) for p in RUNNABLE])
def test_hybridflow_check_passes(path, capsys, tmp_path):
    # smollm2 is prepared once into the default cache (as the config contract's check does).
    assert main(["check", str(path), f"tracking.out_dir={tmp_path}"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "config OK" in out
    if path in PAPER + PLACEMENT:
        assert "memory per GPU of actor" in out and "GiB of cluster.gpu_memory_gb=80" in out


def test_the_paper_configs_cover_every_workload():
    names = {(p.parent.name, p.stem) for p in PAPER}
    assert names == {(a, f"llama2_{s}") for a in ("ppo", "remax", "safe_rlhf")
                     for s in ("7b", "13b", "34b", "70b")}


@pytest.mark.parametrize("path", PAPER, ids=[str(p.relative_to(EXPERIMENTS)) for p in PAPER])
def test_paper_config_is_the_papers_workload(path):
    cfg = load_config(RLConfig, path)
    algorithm = path.parent.name
    size = path.stem.split("_")[1]
    assert cfg.algorithm.name == algorithm
    assert cfg.model == cfg.reward_model == f"llama2-{size}"
    assert cfg.cost_model == (f"llama2-{size}" if algorithm == "safe_rlhf" else None)
    assert cfg.train_batch_size == 1024  # prompts per step
    assert cfg.data.source == "synthetic" and cfg.data.max_prompt_tokens == 1024
    assert cfg.rollout.sampling.max_tokens == 1024 and cfg.rollout.sampling.ignore_eos
    trained = [cfg.actor] + ([cfg.critic] if cfg.algorithm.spec.critic else [])
    assert all((p.ppo_epochs, p.mini_batches) == (1, 8) for p in trained)
    assert cfg.steps == 15  # the paper's 10 warm-up iterations, then 5 timed
    gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    assert 8 <= gpus <= 128 and cfg.cluster.gpu_memory_gb == 80
    assert cfg.actor.layout.world_size == cfg.critic.layout.world_size == gpus  # colocated
    assert len(resolve_placement(cfg).pools) == 1 and cfg.ray.gpus_per_worker == 1
    assert f"{gpus} A100-80GB GPUs" in header(path).replace("NVIDIA ", "")  # names its cluster


def offloads(data, key=""):
    """The keys of a resolved config (nested dicts) named *offload* that are set."""
    if isinstance(data, dict):
        return [k for name, value in data.items() for k in offloads(value, f"{key}{name}.")]
    return [key.rstrip(".")] if "offload" in key and data else []


def test_no_paper_config_offloads():
    # Section 8.2: "We do not enable offloading optimizer states in the experiments".
    assert offloads({"ref": {"offload": True}, "x": {"offload_y": False}}) == ["ref.offload"]
    found = {str(p.relative_to(EXPERIMENTS)): offloads(resolved(p)) for p in PAPER + PLACEMENT}
    assert not any(found.values()), found


@pytest.mark.parametrize("path", PAPER + PLACEMENT + [EXPERIMENTS / "paper" / "base.yaml"],
                         ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_paper_config_names_its_hardware(path):
    text = header(path)
    assert HARDWARE in text, text
    if path in PAPER + PLACEMENT:
        cfg = load_config(RLConfig, path)
        nodes = cfg.cluster.nodes
        assert f"on {nodes * 8} NVIDIA A100-80GB GPUs ({nodes} node" in text, text


# ------------------------------------------------------------------------------------------------
# the GPU-count sweep (tools/paper_sweep.py)


@pytest.mark.parametrize("path", PAPER, ids=[str(p.relative_to(EXPERIMENTS)) for p in PAPER])
def test_paper_config_runs_the_fewest_gpus_that_fit(path):
    """As the paper's section 8.2 starts each size: "from the smallest number of GPUs to run RLHF
    without OOM"; experiments/README.md lists the counts that fit, each with its dp."""
    cfg = load_config(RLConfig, path)
    rows = paper_sweep.sweep(path)
    assert paper_sweep.smallest_fit(rows) == cfg.cluster.gpus, paper_sweep.table(path, rows)
    (own,) = [r for r in rows if r.gpus == cfg.cluster.gpus]
    assert own.overrides == ()  # the file as it is
    assert paper_sweep.command(path, own) == f"hybridflow train {path.relative_to(ROOT)}"
    name = f"| `{path.relative_to(EXPERIMENTS / 'paper')}` | "
    (line,) = [l for l in (EXPERIMENTS / "README.md").read_text().splitlines()
               if l.startswith(name)]
    per_dp = cfg.actor.layout.tp * cfg.actor.layout.pp
    assert line.split(" | ")[1] == ", ".join(f"{r.gpus} ({r.gpus // per_dp})"
                                             for r in rows if r.fits)


def test_the_sweep_scales_every_pool_and_prints_the_command(tmp_path):
    path = EXPERIMENTS / "paper" / "placement" / "ppo_13b_actor_70b_critic.yaml"
    (small, half, full) = paper_sweep.sweep(path, [16, 64, 128])
    assert full.fits and full.overrides == ()
    assert not small.fits and small.error.field == "placement.layouts.reward_model.tp"
    assert "8 * 4 does not tile its pool's 8 ranks at 16 GPUs" in small.error.message
    assert half.fits and half.overrides == (
        "cluster.nodes=8", "placement.pools.actor_side.nodes=4", "actor.layout.dp=4",
        "placement.layouts.reward_model.dp=1", "placement.pools.critic_side.nodes=4",
        "critic.layout.dp=1")
    # The command as printed passes hybridflow check's checks at 64 GPUs.
    words = paper_sweep.command(path, half).split()
    assert words[:3] == ["hybridflow", "train", str(path.relative_to(ROOT))]
    cfg = load_config(RLConfig, ROOT / words[2], [*words[3:], f"tracking.out_dir={tmp_path}"])
    assert check_run(cfg).memory.peak[2] == pytest.approx(half.peak[1] * 2**30)
    placement = resolve_placement(cfg)
    assert [(p.name, p.ranks) for p in placement.pools] == [("actor_side", 32),
                                                           ("critic_side", 32)]
    assert all(m.layout.world_size == 32 for m in placement.models.values())


def test_the_sweep_says_why_a_count_does_not_fit(capsys):
    path = EXPERIMENTS / "paper" / "ppo" / "llama2_13b.yaml"
    assert paper_sweep.main([str(path), "--gpus", "16", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("experiments/paper/ppo/llama2_13b.yaml: the file runs 32 GPUs; the "
                      "smallest count that fits: 64")
    sixteen, sixty_four = out[2].split(), out[3].split()
    assert sixteen[:3] == ["16", "86.1", "generation"]
    assert " ".join(sixteen[3:]).startswith("does not fit: actor.layout.pp: the generation "
                                            "phase needs an estimated 86.1 GiB per GPU")
    assert sixty_four[:3] == ["64", "47.5", "generation"]
    assert " ".join(sixty_four[3:]) == ("hybridflow train experiments/paper/ppo/llama2_13b.yaml "
                                        "cluster.nodes=8 actor.layout.dp=8 critic.layout.dp=8")
    # Keys given with --set join the command, after the scaled ones; a key both set (dp) is
    # given once, at its scaled value; one equal to the file's (rollout.tp) not at all.
    given = ("actor.layout.pp=2", "actor.layout.dp=2", "critic.layout.pp=2",
             "critic.layout.dp=2", "rollout.tp=8")
    (row,) = paper_sweep.sweep(path, [128], given)
    assert row.fits and row.overrides == ("cluster.nodes=16", "actor.layout.dp=8",
                                          "critic.layout.dp=8", "actor.layout.pp=2",
                                          "critic.layout.pp=2")


def test_the_paper_placements_are_its_figures_12_and_13():
    # Figure 12, split: the actor side and the critic side on half the GPUs each
    for size in ("13b", "34b"):
        cfg = load_config(RLConfig, EXPERIMENTS / f"paper/placement/ppo_llama2_{size}_split.yaml")
        assert [(p.ranks, p.models) for p in resolve_placement(cfg).pools] == [
            (64, ("actor", "reference")), (64, ("critic", "reward_model"))]
        assert cfg.model == cfg.reward_model == f"llama2-{size}" and cfg.cluster.gpus == 128
    # Figure 12(a) at 128 GPUs: 64 for the actor, 32 for the critic, 16 each for the others
    cfg = load_config(RLConfig, EXPERIMENTS / "paper/placement/ppo_llama2_13b_standalone.yaml")
    assert sorted((p.ranks, p.models) for p in resolve_placement(cfg).pools) == [
        (16, ("reference",)), (16, ("reward_model",)), (32, ("critic",)), (64, ("actor",))]
    # Figure 13 at 128 GPUs: a 13B actor, reference and 70B reward model on 64, the 70B critic
    # on the other 64
    cfg = load_config(RLConfig, EXPERIMENTS / "paper/placement/ppo_13b_actor_70b_critic.yaml")
    assert (cfg.model, cfg.critic.model, cfg.reward_model) == ("llama2-13b", "llama2-70b",
                                                               "llama2-70b")
    assert sorted((p.ranks, p.models) for p in resolve_placement(cfg).pools) == [
        (64, ("actor", "reference", "reward_model")), (64, ("critic",))]


def test_the_readme_table_is_what_check_estimates():
    from hybridflow.planner.memory import GIB
    rows = {}
    for line in (EXPERIMENTS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| Llama-2"):
            rows[(cells[0], cells[1])] = cells
    names = {"ppo": "PPO", "remax": "ReMax", "safe_rlhf": "Safe-RLHF"}
    assert len(rows) == len(PAPER)
    for path in PAPER:
        cfg = load_config(RLConfig, path)
        shapes = {k: SHAPES[getattr(cfg, k)] for k in ("model", "reward_model", "cost_model")
                  if getattr(cfg, k) is not None}
        (pool,) = estimate_memory(cfg, shapes).pools
        row = rows[(f"Llama-2 {path.stem.split('_')[1].upper()}", names[path.parent.name])]
        assert row[2] == str(cfg.cluster.nodes * cfg.cluster.gpus_per_node)
        assert row[3] == f"{cfg.actor.layout.tp}, {cfg.actor.layout.pp}, {cfg.actor.layout.dp}"
        assert row[5].replace("*", "") == " / ".join(f"{pool.total(p) / GIB:.1f}"
                                                     for p in pool.phases), path


def test_the_readmes_recompute_figures_are_what_check_estimates():
    # "PPO 70B's actor and critic updates take 40.5 and 42.8 GiB instead of 46.5 and 55.2"
    from hybridflow.planner.memory import GIB
    text = " ".join((EXPERIMENTS / "README.md").read_text().split())
    path = EXPERIMENTS / "paper" / "ppo" / "llama2_70b.yaml"
    figures = []
    for overrides in (["actor.engine.recompute=true", "critic.engine.recompute=true"], []):
        cfg = load_config(RLConfig, path, overrides)
        (pool,) = estimate_memory(cfg, {k: SHAPES[getattr(cfg, k)]
                                        for k in ("model", "reward_model")}).pools
        figures += [f"{pool.total(p) / GIB:.1f}" for p in ("actor update", "critic update")]
    assert "PPO 70B's actor and critic updates take {} and {} GiB instead of {} and {}".format(
        *figures) in text, figures


# ------------------------------------------------------------------------------------------------
# shape presets


def test_llama2_presets():
    counts = {name: param_count(shape) / 1e9 for name, shape in SHAPES.items()}
    assert [round(counts[f"llama2-{s}"], 2) for s in ("7b", "13b", "34b", "70b")] == \
        [6.74, 13.02, 33.74, 68.98]
    assert SHAPES["llama2-70b"].num_kv_heads == SHAPES["llama2-34b"].num_kv_heads == 8
    assert all(s.vocab_size == 32000 and not s.tie_embeddings and s.head_dim == 128
               for s in SHAPES.values())


def test_check_takes_a_preset_and_notes_what_it_skips(capsys, tmp_path):
    assert main(["check", "model=llama2-7b", "rollout.backend=hf",
                 f"tracking.out_dir={tmp_path}"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "llama2-7b (shape preset, no weights)" in out and "32 layers" in out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "max_prompt_tokens" in notes[0] and "not checked" in notes[0]


@pytest.mark.parametrize("args, key, hint", [
    (["experiments/paper/remax/llama2_7b.yaml"], "model", "model=/path/to/Llama-2-7b-hf"),
    (["model=tiny-llama", "reward_model=llama2-13b", "rollout.backend=hf"], "reward_model",
     "reward_model=/path/to/Llama-2-13b-hf"),
])
def test_train_refuses_a_shape_preset(args, key, hint, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    files = [str(ROOT / a) for a in args if a.endswith(".yaml")]
    rest = [a for a in args if not a.endswith(".yaml")]
    assert main(["train", *files, *rest, f"tracking.out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridflow: error: {key}: ") and hint in err, err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------------
# synthetic prompts


def test_synthetic_prompts():
    cfg = PromptDataConfig(source="synthetic", size=5, max_prompt_tokens=7, seed=3)
    items = load_prompts(cfg, vocab_size=50)
    assert len(items) == 5 and all(len(i.prompt_ids) == 7 and not i.messages for i in items)
    assert all(SYNTHETIC_FIRST_ID <= t < 50 for i in items for t in i.prompt_ids)
    assert [i.prompt_ids for i in load_prompts(cfg, vocab_size=50)] == \
        [i.prompt_ids for i in items]  # drawn from data.seed
    other = load_prompts(PromptDataConfig(source="synthetic", size=5, max_prompt_tokens=7,
                                          seed=4), vocab_size=50)
    assert [i.prompt_ids for i in other] != [i.prompt_ids for i in items]
    kept, dropped = tokenize_prompts(items, None, max_prompt_tokens=7)  # passed through
    assert dropped == 0 and [k.prompt_ids for k in kept] == [i.prompt_ids for i in items]
    assert tokenize_prompts(items, None, max_prompt_tokens=6) == ([], 5)


@pytest.mark.parametrize("overrides, key, message", [
    (["data.source=synthetic"], "reward_model", "cannot score"),
    (["data.source=synthetic", "reward_model=llama2-7b", "algorithm.name=safe_rlhf",
      "cost=math"], "cost_model", "cannot score"),
    (["data.source=synthetic", "reward_model=llama2-7b", "data.system_prompt=hi"],
     "data.system_prompt", "no effect"),
    (["data.source=synthetic", "reward_model=llama2-7b", "data.prompt_key=q"],
     "data.prompt_key", "no effect"),
    (["data.source=synthetic", "reward_model=llama2-7b", "data.size=0"], "data.size",
     "positive integer"),
])
def test_synthetic_refusals(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, ["model=llama2-7b", *overrides])
    assert e.value.field == key and message in e.value.message, e.value


# ------------------------------------------------------------------------------------------------
# cluster and memory


def test_memory_estimate_by_hand():
    shape = ModelConfig(vocab_size=1000, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16)
    # embedding + output 2*1000*64, per layer qkv 128*64 + proj 64*64 + fc1 256*64 + fc2 64*128
    # + 2 norms 64, final norm 64
    assert param_count(shape) == 2 * 64000 + 2 * (8192 + 4096 + 16384 + 8192 + 128) + 64 == 202048
    cfg_args = [
        "algorithm.name=grpo", "actor.layout.tp=2", "actor.layout.dp=2", "rollout.backend=megatron",
        "actor.engine.dtype=bf16", "actor.engine.optim.distributed=true",
        "actor.engine.micro_batch_size=1", "train_batch_size=4", "rollout.sampling.n=2",
        "data.max_prompt_tokens=16", "rollout.sampling.max_tokens=16"]
    (pool,) = estimate_memory(load_config(RLConfig, None, cfg_args), {"model": shape}).pools
    assert pool.groups == ("actor",) and pool.ranks == 4
    p = 202048
    weights, grads, adam = p * 2 // 2, p * 4 // 2, p * 12 // 2 // 2  # bf16 / tp; fp32; / tp / dp
    # s = 32 tokens, h = 64, f = 128, a = 4 heads of 2 KV groups (q = 64), t = 2, 2 bytes: per
    # token the two norms' inputs and outputs and fp32 reciprocal RMS (replicated), SDPA's rotated
    # q, the repeated k, v and its output 4q / t, its fp32 logsumexp 4 a / t, fc1's output, the
    # fused SwiGLU's input and fc2's input 3f / t, and the bf16 mask B s
    layer = 32 * (2 * (2 * 2 * 64 + 4) + (2 * (4 * 64 + 3 * 128) + 4 * 4) / 2 + 2 * 32)
    assert layer == layer_activation_bytes(shape, 32, 1, 2, False, "bf16") == 39424
    # bf16 logits, the fp32 copy, softmax and gradient, over tp, at the 17 columns the engine
    # computes them at: the 16 response tokens' and the last prompt token's
    logits = 17 * 1000 / 2 * (2 + 8)
    update = {"actor": {"weights": weights, "grads": grads, "optimizer": adam,
                        "activations": 2 * layer + logits},
              "ref": {"weights": weights}, "rollout": {}}
    assert pool.phases["actor update"] == update
    # generation: the weights gathered to tg=1; beside them the training shard but its norms
    # (those are the generation tensors themselves), since the distributed optimizer keeps the
    # parameters where they are (no resident switch); the optimizer state stays, grads are
    # released; KV cache: 4 replicas (2 per tp=2 group, dp=2) share 8 samples, 2 each, of 32
    # tokens in the fast decoder's 64 slots (its block), 2 (k, v) * 2 layers * 2 KV heads * 16 *
    # 2 bytes a slot. The fast decoder prefills the
    # replica's one prompt (2 samples of it) of 16 tokens once: per token h = 64 in 8 tensors,
    # q = 64 in 3, kv = 32 in 2, f = 128 in 3, 2 bytes each, and the bool mask of its 2 query
    # heads a group, 2 * 16 * 16; more than sampling's [2, 1000] logits and noise (6 bytes each).
    norms = 2 * 2 * 64 + 64
    transient = 16 * 2 * (8 * 64 + 3 * 64 + 2 * 32 + 3 * 128) + 2 * 16 * 16
    assert transient == 37376 > 2 * 1000 * 6
    assert pool.phases["generation"] == {
        "actor": {"weights": (p - norms) * 2 // 2, "optimizer": adam, "generation weights": p * 2},
        "ref": {"weights": weights},
        "rollout": {"kv cache": 2 * 64 * (2 * 2 * 2 * 16 * 2), "decode transient": transient}}
    # Without it the resident switch (the megatron backend's default) keeps no shard beside.
    (plain,) = estimate_memory(load_config(RLConfig, None, [
        *cfg_args, "actor.engine.optim.distributed=false"]), {"model": shape}).pools
    assert plain.phases["generation"]["actor"]["weights"] == 0
    # rollout.keep_cache: the KV cache stays through training and the forward passes too (the
    # decode transient comes with generate calls only)
    (kept,) = estimate_memory(load_config(RLConfig, None, [
        *cfg_args, "ray.gpus_per_worker=1", "rollout.keep_cache=true"]), {"model": shape}).pools
    kv = {"kv cache": 2 * 64 * (2 * 2 * 2 * 16 * 2)}
    assert {phase: parts["rollout"] for phase, parts in kept.phases.items()} == {
        phase: kv | ({"decode transient": transient} if phase == "generation" else {})
        for phase in pool.phases}
    assert kept.phases["generation"] == pool.phases["generation"]
    assert kept.total("actor update") == pool.total("actor update") + kv["kv cache"]
    # a forward-only pass: the bf16 logits and the cross entropy's fp32 copy
    assert pool.phases["inference"]["actor"]["forward transient"] == 17 * 1000 / 2 * (2 + 4)
    assert pool.peak == ("actor update", sum(sum(r.values()) for r in update.values()))
    # With sequence parallelism the norms' tensors are split too; in fp32 every tensor but the
    # logsumexp and the reciprocal RMS is twice as large; with one query head per KV group the
    # values keep linear_qkv's whole output (3q) and the rotated keys are a tensor of their own
    assert layer_activation_bytes(shape, 32, 1, 2, True, "bf16") == 32 * (
        2 * (2 * 2 * 64 + 4) / 2 + (2 * (4 * 64 + 3 * 128) + 4 * 4) / 2 + 2 * 32)
    assert layer_activation_bytes(shape, 32, 1, 2, False, "fp32") == 32 * (
        2 * (2 * 4 * 64 + 4) + (4 * (4 * 64 + 3 * 128) + 4 * 4) / 2 + 4 * 32)
    mha = ModelConfig(**{**shape.__dict__, "num_kv_heads": 4})
    assert layer_activation_bytes(mha, 32, 1, 2, False, "bf16") == 32 * (
        2 * (2 * 2 * 64 + 4) + (2 * (6 * 64 + 3 * 128) + 4 * 4) / 2 + 2 * 32)

    # LoRA of rank 4 on qkv and fc2: adapters A = per layer 4*(64 + 128) + 4*(128 + 64); their
    # grads and Adam state alone; no reference copy; the adapted base shards stay in generation.
    (pool,) = estimate_memory(load_config(RLConfig, None, [
        *cfg_args, "actor.lora.rank=4", "actor.lora.target_modules=[linear_qkv,linear_fc2]"]),
        {"model": shape}).pools
    a, adapted = 2 * (4 * (64 + 128) + 4 * (128 + 64)), 2 * (8192 + 8192)
    lora = {"weights": weights + a * 2 // 2, "grads": a * 4 // 2, "optimizer": a * 12 // 2 // 2}
    assert pool.phases["actor update"]["actor"] == lora | {"activations": 2 * layer + logits}
    assert pool.phases["actor update"]["ref"] == {}
    assert pool.phases["generation"]["actor"] == {
        "weights": adapted * 2 // 2 + a * 2 // 2, "optimizer": lora["optimizer"],
        "generation weights": p * 2}

    # ref.offload: the reference holds nothing outside its own pass, which streams it unit by
    # unit (the embedding 1000*64/2, each layer (8192 + 4096 + 16384 + 8192)/2 + 128, the final
    # norm with the output layer 64 + 1000*64/2, at tp=2) and holds the two largest, here the
    # embedding and the output layer, beside its transient (the actor's: same model and layout)
    (base,), (off,) = (estimate_memory(load_config(RLConfig, None, [*cfg_args, *extra]),
                                       {"model": shape}).pools
                       for extra in ([], ["ref.offload=true"]))
    assert streamed_unit_bytes(shape, 2, 2) == [2 * 32000, 2 * 18560, 2 * 18560, 2 * 32064]
    tied = ModelConfig(**{**shape.__dict__, "tie_embeddings": True})  # the output reads the table
    assert streamed_unit_bytes(tied, 2, 2) == [2 * 32000, 2 * 18560, 2 * 18560, 2 * 32064]
    units = 2 * 32000 + 2 * 32064
    assert off.phases["inference"]["ref"] == {"forward transient": 17 * 1000 / 2 * (2 + 4),
                                              "streamed units": units}
    assert off.phases["generation"]["ref"] == off.phases["actor update"]["ref"] == {}
    assert off.total("inference") == base.total("inference") - weights + units


def test_memory_estimate_with_recompute_by_hand():
    """``engine.recompute``: a micro-batch in flight keeps each layer's input and the boolean
    mask, a backward one layer's activations beside them, and the last stage's logits are gone
    before it recomputes a layer (the module docstring of planner/memory.py)."""
    shape = ModelConfig(vocab_size=1000, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16)
    base = ["algorithm.name=grpo", "rollout.backend=megatron", "actor.engine.dtype=bf16",
            "actor.engine.micro_batch_size=1", "train_batch_size=4", "rollout.sampling.n=2",
            "data.max_prompt_tokens=16", "rollout.sampling.max_tokens=16"]

    def activations(*args):
        (pool,) = estimate_memory(load_config(RLConfig, None, [*base, *args]),
                                  {"model": shape}).pools
        return pool.phases["actor update"]["actor"]["activations"]

    tp2 = ["actor.layout.tp=2", "actor.layout.dp=2"]
    logits = 17 * 1000 / 2 * (2 + 8)  # as test_memory_estimate_by_hand's
    layer = layer_activation_bytes(shape, 32, 1, 2, False, "bf16")
    assert activations(*tp2) == 2 * layer + logits
    # 2 layers' inputs, 32 tokens of 64 features in bf16, and the [1, 1, 32, 32] mask; then the
    # logits, larger than a layer's activations
    assert checkpoint_bytes(shape, 32, 1, 2, 2, False, "bf16") == 2 * 32 * 64 * 2 + 32 * 32
    assert activations(*tp2, "actor.engine.recompute=true") == int(
        2 * 32 * 64 * 2 + 32 * 32 + logits) < 2 * layer + logits
    # sequence parallelism splits the inputs over tp, not the mask
    assert activations(*tp2, "actor.engine.sequence_parallel=true",
                       "actor.engine.recompute=true") == int(2 * 32 * 64 + 32 * 32 + logits)
    # PP=2, 4 micro-batches a rank: the first stage keeps two in flight (its one layer's input
    # and the mask each) and one layer's activations, the last stage one and the logits
    pp2 = ["actor.layout.pp=2", "actor.layout.dp=2", "actor.engine.recompute=true"]
    one = layer_activation_bytes(shape, 32, 1, 1, False, "bf16")
    first, last = 2 * (32 * 64 * 2 + 32 * 32) + one, 32 * 64 * 2 + 32 * 32 + 2 * logits
    assert activations(*pp2) == int(max(first, last))
    # one response token: 2 columns of logits, fewer bytes than a layer's activations of 64
    # tokens, which the last stage then holds beside its inputs instead
    short = ["data.max_prompt_tokens=63", "rollout.sampling.max_tokens=1"]
    wide = layer_activation_bytes(shape, 64, 1, 2, False, "bf16")
    assert wide > 2 * 1000 / 2 * (2 + 8)
    assert activations(*tp2, *short, "actor.engine.recompute=true") == int(
        2 * 64 * 64 * 2 + 64 * 64 + wide)


def paper(name, *overrides):
    return load_config(RLConfig, EXPERIMENTS / "paper" / name, list(overrides))


def test_a_70b_actor_at_tp1_does_not_fit(capsys, tmp_path):
    overrides = ["actor.layout.tp=1", "actor.layout.dp=8", "rollout.tp=1",
                 "actor.engine.sequence_parallel=false", f"tracking.out_dir={tmp_path}"]
    with pytest.raises(ConfigError) as e:
        check_run(paper("remax/llama2_70b.yaml", *overrides))
    assert e.value.field == "actor.layout.tp", e.value
    assert "cluster.gpu_memory_gb=80" in e.value.message and "GiB per GPU" in e.value.message
    assert main(["check", str(EXPERIMENTS / "paper/remax/llama2_70b.yaml"), *overrides]) == 2
    assert capsys.readouterr().err.startswith("hybridflow: error: actor.layout.tp: ")
    # Smaller GPUs: the layout that fits 80 GB does not fit 40.
    with pytest.raises(ConfigError) as e:
        check_run(paper("ppo/llama2_70b.yaml", "cluster.gpu_memory_gb=40",
                        f"tracking.out_dir={tmp_path}"))
    assert e.value.field.endswith(".tp") or e.value.field.endswith(".pp"), e.value


@pytest.mark.parametrize("overrides, key, message", [
    (["cluster.nodes=16"], "actor.layout.dp", "set actor.layout.dp=2"),
    (["critic.layout.dp=2"], "placement", "give the pools 64 GPUs in all"),
    # Models of one world size, each on GPUs of its own (a StopIteration before).
    (["placement.preset=standalone"], "placement", "reward_model (reward_model): 64 ranks"),
    (["ray.colocate=false"], "ray.colocate", "placement.preset"),
    (["ray.gpus_per_worker=0"], "ray.gpus_per_worker", "no rank claims a GPU"),
    (["cluster.nodes=16", "cluster.gpus_per_node=4"], "actor.layout.tp", "one node"),
    (["cluster.nodes=null", "cluster.gpus_per_node=4"], "cluster.gpus_per_node", "no effect"),
])
def test_cluster_world_sizes(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        paper("ppo/llama2_70b.yaml", *overrides)
    assert e.value.field == key and message in e.value.message, e.value
