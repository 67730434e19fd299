"""Megatron-Core training engine: a GPTModel at a TrainLayout, per-token log-probs, training steps.

One TrainEngine lives in each rank of a training layout. Weights come in as full (unsharded)
tensors under Megatron names with global layer indices; each rank keeps only its shard. The model
it builds is training/model.py's, its micro-batches training/micro_batches.py's.

Loss convention: ``train_step(batch, loss_fn)`` minimises the SUM of the losses that ``loss_fn``
returns over every micro-batch of every data-parallel rank (Megatron's per-micro-batch and
per-DP averaging are switched off), so the caller decides the normalisation, e.g. a token-mean
over the global batch divides by the global token count. It returns that sum as ``loss``, and the
loss function's metrics reduced over the same micro-batches and ranks (``LossFn``).

Micro-batches: fixed-size, or with ``max_tokens_per_micro_batch`` a token budget
(``plan_micro_batches``). Log-probs and values are 0 where nothing defines them -- padding, and
for log-probs a sequence's first token -- whichever the split, so the two paths return the same
tensors.

Output layer over the response only: with a ``response_mask`` [B, S] in the batch (the RL
batches, ``rollout_batch``: a left-padded prompt, then the response), an LM head computes its
output layer and the cross entropy (and the entropy) only from each micro-batch's first column
whose label is a response token (``first_logit_column``: its first response column minus one)
to its end; prompt positions are nothing an RL loss reads, and their logits are most of a
short response's. Log-probs and entropy are then 0 before each row's first response token.
Everything before the output layer (every pipeline stage, the activations between them) still
runs over the whole sequence. A batch without ``response_mask``, a value head and
``compute_logits`` compute every position.

Streamed weights (``stream_weights``; the reference with ``ref.offload``): a frozen engine keeps
its weights in host memory and each forward brings them to the device one unit at a time (the
embedding, each transformer layer, the final norm with the output layer), the next unit's copy on
a side CUDA stream overlapping the current one's kernels, each dropped after it ran: a pass holds
at most two units' weights, and each micro-batch copies the rank's weights once
(``training/streaming.py``). Between passes its parameters are empty placeholders. This is the
one mechanism behind ``ref.offload`` (it replaced reloading the whole model for each pass).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.algorithms.losses import vocab_parallel_entropy
from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import DTYPES, ParamMeta, llama_param_metas, shard, unshard
from hybridflow.parallel.groups import init_megatron_parallel
from hybridflow.parallel.layout import TrainLayout
from hybridflow.training.config import EngineConfig
from hybridflow.training.host_optimizer import HostAdam
from hybridflow.training.lora import (Adapters, LoraConfig, initial_adapters, lora_metas,
                                      merge_adapters)
from hybridflow.training.micro_batches import (_take, first_logit_column, plan_micro_batches,
                                               response_starts, to_batch_order)
from hybridflow.training.model import (ADAPTER_SUFFIXES, VALUE_HEAD, ValueHead, _build_chunks,
                                       batch_attention_mask, batch_position_ids,
                                       check_model_fits_layout, global_name,
                                       recompute_from_frozen_embedding, shift_right,
                                       transformer_config)
from hybridflow.training.streaming import StreamedWeights


# A loss function sees this micro-batch's per-token outputs [b, s] -- log-probs for an LM head,
# values for a value head -- and the micro-batch itself, and returns (loss, metrics): loss is this
# micro-batch's share of the global objective. A metric is such a share too (a 0-dim value), or a
# (mean, count) pair: a mean over ``count`` elements of the micro-batch (its response tokens,
# say). ``reduce_metrics`` sums the shares and weighs the means by their counts over every
# micro-batch of every data-parallel rank, so that no metric depends on how the batch was split.
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def fuse_adam(optimizer) -> int:
    """Make torch's Adam inside a Megatron optimizer (its fallback without Transformer Engine or
    apex) step with its fused kernel; returns the torch optimizers changed. Its default on CUDA,
    the multi-tensor path, allocates a temporary list as large as the fp32 state (4 bytes a
    parameter: 25 GiB at 7B, the step's peak when micro-batches are small) and launches more
    kernels."""
    changed = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):  # AdamW is one
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True
            inner._step_supports_amp_scaling = True  # what Adam(fused=True) sets
            changed += 1
    return changed


def _torch_param_groups(optimizer) -> list[dict]:
    """The param groups of the torch optimizers inside a Megatron optimizer (chained or not)."""
    return [group for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in opt.optimizer.param_groups]


def _cross_entropy_and_entropy(vocab_shard: torch.Tensor, labels: torch.Tensor, tp_group
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross entropy of ``labels`` (as GPTModel computes it when given them) and the
    entropy, both [b, s], from this rank's vocabulary slice of the logits [b, s, V/tp]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # deferred: Megatron
    # Megatron's cross entropy overwrites fp32 logits in place, and the entropy reads them too;
    # it reduces over parallel_state's TP group, which is ``tp_group``.
    cross_entropy = vocab_parallel_cross_entropy(vocab_shard.to(torch.float32, copy=True), labels)
    return cross_entropy, vocab_parallel_entropy(vocab_shard, tp_group)


@contextlib.contextmanager
def output_layer_from(model, start: int, tp_group) -> Iterator[None]:
    """Inside this block GPTModel ``model`` (a DDP chunk or the module) computes its output
    layer (and the loss on it) only over sequence positions ``start`` on: its input, [s, b, h],
    is cut to [s - start, b, h]. Under sequence parallelism that input is this rank's sequence
    split: it is gathered first (backward: each rank's split of the gradient, not summed) and
    the layer runs without its own all-gather, so its input gradient is all-reduced once over
    TP -- inside the layer, as without sequence parallelism. A no-op at ``start`` 0 or on a
    chunk without the output layer (earlier pipeline stages)."""
    gpt = getattr(model, "module", model)
    layer = gpt.output_layer if getattr(gpt, "post_process", False) else None
    if not start or layer is None:
        yield
        return
    # deferred: Megatron
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    sequence_parallel = layer.sequence_parallel

    def cut(module, args, kwargs):
        hidden = args[0]
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=tp_group)
        return (hidden[start:], *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(cut, with_kwargs=True)
    # Read in the forward only (the backward's communication is fixed then); GPTModel itself
    # does the same for inference's last-token logits.
    layer.sequence_parallel = False
    try:
        yield
    finally:
        handle.remove()
        layer.sequence_parallel = sequence_parallel


def metric_pair(metric, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A loss function's metric (``LossFn``: a share of a sum, or a (mean, count) pair) as
    (value, count), detached 0-dim fp32 tensors on ``device``; count None for a share."""
    value, count = metric if isinstance(metric, tuple) else (metric, None)

    def scalar(x):
        return torch.as_tensor(x, device=device).detach().float().reshape(())
    return scalar(value), None if count is None else scalar(count)


def reduce_metrics(rows: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]],
                   group=None) -> dict[str, float]:
    """A step's metrics from its micro-batches' ``rows`` (``metric_pair``s, the same keys in
    each): a share of a sum summed, a mean weighted by its count (0 where nothing was counted),
    over the rows and, with ``group``, over its ranks -- what one micro-batch holding all of
    their samples would report. One all-reduce and one device -> host copy in all."""
    keys = list(rows[0])
    means = [rows[0][k][1] is not None for k in keys]
    values = torch.stack([torch.stack([r[k][0] for k in keys]) for r in rows])  # [m, k]
    counts = torch.stack([torch.stack([r[k][1] if mean else torch.ones_like(r[k][0])
                                       for k, mean in zip(keys, means)]) for r in rows])
    totals = torch.stack([(values * counts).sum(0), counts.sum(0)])  # [2, k]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    sums, total_counts = totals.tolist()
    return {k: (v / n if n else 0.0) if mean else v
            for k, mean, v, n in zip(keys, means, sums, total_counts)}


class TrainEngine:
    """The actor (or reference, critic, reward model) on one rank of a training layout.

    ``head="lm"`` keeps the language-model output layer (per-token log-probs); ``head="value"``
    replaces it with a scalar ValueHead (per-token values) for critics and reward models.
    ``lora`` (with rank > 0) freezes the model and trains LoRA
    adapters on its linears instead (``self.adapters``)."""

    streamed: StreamedWeights | None = None
    """Set by ``stream_weights``: the weights live in host memory and come unit by unit."""

    def __init__(self, model: ModelConfig, layout: TrainLayout, engine: EngineConfig,
                 *, build_optimizer: bool = True, head: str = "lm",
                 lora: LoraConfig | None = None):
        # deferred: Megatron
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        model = self._checked_model(model, layout, engine, head)
        self.model_config, self.layout, self.config, self.head = model, layout, engine, head
        self.pg = init_megatron_parallel(layout, seed=engine.seed)
        self.tf_config = transformer_config(model, layout, engine)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _, self.pp_rank, self.tp_rank = layout.coords(dist.get_rank())
        self.metas: dict[str, ParamMeta] = {m.name: m for m in llama_param_metas(model)}
        if head == "value":
            del self.metas["output_layer.weight"]
            self.metas[VALUE_HEAD] = ParamMeta(name=VALUE_HEAD, shape=(1, model.hidden_size),
                                               tp_dim=None, layer=None, position="post")

        chunks = _build_chunks(model, layout, self.tf_config, self.pg)
        if head == "value":
            self._attach_value_heads(chunks)
        self.adapters = None
        if lora is not None and lora.enabled and engine.optim.offload:
            raise ConfigError("engine.optim.offload", "trains every parameter, not LoRA "
                              "adapters; set it to false or the LoRA rank to 0")
        if lora is not None and lora.enabled:
            self.adapters = self._attach_adapters(chunks, lora)
        elif not build_optimizer:
            # Nothing trains it (a reference, a reward model, a conversion): frozen, DDP gives it
            # no fp32 grad buffer (4 bytes a parameter, 3.3 GiB of a 0.9B reference).
            for chunk in chunks:
                chunk.requires_grad_(False)
        host_optimizer = build_optimizer and engine.optim.offload
        self.chunks = self._wrap_in_ddp(chunks, grad_buffers=not host_optimizer)
        # Megatron scales grads by 1/num_tokens when given them; our loss functions already
        # carry their own normalisation, so the count is dropped here. The host optimizer's
        # gradients are all in host memory once its copies end.
        self.tf_config.finalize_model_grads_func = (
            (lambda model, num_tokens=None, **kw: self.optimizer.finish()) if host_optimizer
            else (lambda model, num_tokens=None, **kw: finalize_model_grads(model, None, **kw)))
        self.optimizer = None
        if host_optimizer:
            self.optimizer = HostAdam(list(self.named_local_params()), engine.optim, self.device)
        elif build_optimizer:
            self.optimizer = self._build_optimizer()

    @staticmethod
    def _checked_model(model: ModelConfig, layout: TrainLayout, engine: EngineConfig,
                       head: str) -> ModelConfig:
        """Refuse what the engine cannot build; the model it builds (a value head's untied)."""
        check_model_fits_layout(model, layout, engine)
        if head not in ("lm", "value"):
            raise ArgumentError("head", f"unknown head {head!r}; use lm or value")
        if (engine.max_tokens_per_micro_batch is not None and layout.vpp
                and not torch.cuda.is_available()):
            # Megatron sends the shapes in one batched isend/irecv; gloo matches a peer's
            # messages in posting order, and at pp=2 under interleaving both directions share
            # the peer, so an activation's shape can arrive as a gradient's.
            raise ConfigError("engine.max_tokens_per_micro_batch", "not supported with "
                              "layout.vpp on CPU (gloo); set layout.vpp to null")
        if engine.optim.offload and layout.world_size > 1:
            raise ConfigError("engine.optim.offload", f"the host optimizer trains one rank's "
                              f"whole model; use layout tp = pp = dp = 1 (got {layout}), or set "
                              "it to false")
        if head == "value" and engine.sequence_parallel:
            raise ConfigError("engine.sequence_parallel", "not supported with a value head yet; "
                              "set it to false for critics and reward models")
        if head == "value" and model.tie_embeddings:
            # A value head has nothing to tie to; the LM output layer is replaced, not shared.
            model = replace(model, tie_embeddings=False)
        return model

    def _attach_value_heads(self, chunks) -> None:
        """A ValueHead in place of the output layer, on the chunk that has one."""
        model, engine = self.model_config, self.config
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(model.hidden_size, DTYPES[engine.dtype],
                                               self.device)
                # A critic usually starts from an LM checkpoint: a fresh, small, seeded
                # head, the same on every rank, unless the weights loaded carry one.
                g = torch.Generator().manual_seed(engine.seed)
                with torch.no_grad():
                    chunk.output_layer.weight.copy_(
                        torch.randn(1, model.hidden_size, generator=g) / model.hidden_size)

    def _wrap_in_ddp(self, chunks, grad_buffers: bool = True) -> list:
        """The chunks in Megatron's DDP, which keeps their gradients in fp32 buffers; without
        ``grad_buffers`` (the host optimizer's engine) DDP wraps them frozen, so that it makes
        neither buffers nor hooks, and they train again after: each parameter keeps its own
        ``.grad``, which the host optimizer's hooks take."""
        # deferred: Megatron
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from hybridflow.training.embedding import use_main_grad_lookup

        # The lookup's gradient added into main_grad by row, not as a dense table (its module).
        lookup_into_main_grad = grad_buffers and any(
            [use_main_grad_lookup(c.embedding.word_embeddings) for c in chunks if c.pre_process])
        trainable = [p for c in chunks for p in c.parameters() if p.requires_grad]
        if not grad_buffers:
            for p in trainable:
                p.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=self.config.optim.distributed,
            overlap_grad_reduce=False,
        )
        wrapped = [DistributedDataParallel(self.tf_config, ddp_config, c, pg_collection=self.pg)
                   for c in chunks]
        if not grad_buffers:
            for p in trainable:
                p.requires_grad_(True)
        if self.tf_config.gradient_accumulation_fusion and self.model_config.tie_embeddings:
            # The output layer adds its gradient of the shared table into main_grad itself and
            # hands autograd a dummy. With Megatron's lookup the dummy must be zeros, so that
            # DDP's hook still adds the lookup's gradient (Megatron marks it so only at PP=1);
            # by row the lookup adds its own, and the dummy stays unfilled, as every weight's.
            for chunk in chunks:
                if chunk.pre_process:
                    chunk.embedding.word_embeddings.weight.zero_out_wgrad = (
                        not lookup_into_main_grad)
        return wrapped

    def _build_optimizer(self):
        """Megatron's optimizer (``engine.optim``) over the DDP chunks; Adam fused on CUDA."""
        # deferred: Megatron
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        engine, o = self.config, self.config.optim
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=o.name, lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay,
                clip_grad=o.clip_grad, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps, use_distributed_optimizer=o.distributed,
                bf16=engine.dtype == "bf16", params_dtype=DTYPES[engine.dtype],
            ),
            self.chunks, use_gloo_process_groups=False, pg_collection=self.pg)
        # Megatron exempts 1-D parameters and biases from decay through each group's wd_mult,
        # which only its learning-rate scheduler applies; without one every group decays.
        for group in _torch_param_groups(optimizer):
            group["weight_decay"] = o.weight_decay * group.get("wd_mult", 1.0)
        if self.device.type == "cuda":
            fuse_adam(optimizer)
        return optimizer

    def _attach_adapters(self, chunks, lora):
        """Freeze every parameter and give the targeted linears LoRA adapters (before DDP wraps
        the chunks, so that only the adapters get grad buffers and optimizer state)."""
        if self.head != "lm":
            raise ArgumentError("lora", "adapters are for the actor (head='lm')")
        if self.config.sequence_parallel:  # RLConfig refuses it as actor.lora
            raise ArgumentError("lora", "adapters need the full sequence on every TP rank; "
                                "build the engine with sequence_parallel=False")
        metas = lora_metas(self.model_config, lora)
        adapters, init = Adapters(lora, metas), initial_adapters(metas, self.config.seed)
        for chunk in chunks:
            chunk.requires_grad_(False)
            for local, module in chunk.named_modules():
                name = global_name(chunk, f"{local}.weight")
                if name.removesuffix("weight") + "lora_A" in adapters.metas:
                    adapters.attach(module, name, init, self.layout.tp, self.tp_rank)
        if self.config.recompute:
            recompute_from_frozen_embedding(chunks)
        return adapters

    # ----------------------------------------------------------------------------- weights
    def named_local_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(global Megatron name, local shard) of every model weight this rank holds (LoRA
        adapters are ``self.adapters.named_parameters()``)."""
        for chunk in self.chunks:
            module = chunk.module
            for name, param in module.named_parameters():
                if name.endswith(ADAPTER_SUFFIXES):
                    continue
                if self.head == "value" and name == "output_layer.weight":
                    name = VALUE_HEAD
                yield global_name(module, name), param

    def load_full_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of each full tensor in ``full`` (Megatron names, global layer
        indices) into the model. Every parameter this rank holds must be present."""
        for name, param in self.named_local_params():
            source = name
            if name == VALUE_HEAD and name not in full:
                continue  # keep the fresh head
            if name == "output_layer.weight" and self.model_config.tie_embeddings:
                source = "embedding.word_embeddings.weight"
            if source not in full:
                raise ConfigError(source, "missing from the weights being loaded")
            piece = shard(full[source], self.metas[source], self.layout.tp, self.tp_rank)
            if piece.shape != param.shape:
                raise ConfigError(source, f"shard shape {tuple(piece.shape)} does not match the "
                                  f"model's {tuple(param.shape)} at {self.layout}")
            with torch.no_grad():
                param.copy_(piece)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def stream_weights(self) -> None:
        """From now on keep the weights in host memory and bring them to the device unit by unit
        during each pass (module docstring: streamed weights). Only for engines without an
        optimizer (a reference): nothing may write the weights, and a streamed engine's
        parameters are empty placeholders between passes."""
        if self.optimizer is not None:
            raise ValueError("only an engine without an optimizer (a reference) can stream its "
                             "weights")
        self.streamed = StreamedWeights([chunk.module for chunk in self.chunks], self.device)

    # ----------------------------------------------------------------------------- compute
    def _micro_batches(self, batch: dict[str, torch.Tensor], forward_only: bool
                       ) -> list[dict[str, torch.Tensor]]:
        """The micro-batches ``plan_micro_batches`` gives, each a dict of the batch's fields cut
        to it, plus the model's inputs (``_ids``, ``_mask``, padded for sequence parallelism),
        its kept width ``_seq``, where it came from (``_rows``, ``_starts``, the batch's width
        ``_width``: what ``to_batch_order`` reads) and the column its output layer starts at,
        ``_logits_from`` (``first_logit_column`` of a batch with ``response_mask`` and an LM
        head, else 0)."""
        plans = plan_micro_batches(batch["attention_mask"], self.config, self.layout.tp,
                                   forward_only)
        starts = None
        if "response_mask" in batch and self.head == "lm":
            starts = response_starts(batch["response_mask"], batch["input_ids"].shape)
        # Everything a loss function reads (advantages, old log-probs, ...) goes to the device in
        # one copy per field; fixed-size micro-batches are views of it.
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        s = batch["input_ids"].shape[1]
        out = []
        for plan in plans:
            mb = {k: _take(v, plan) for k, v in batch.items()}
            ids, mask = mb["input_ids"], mb["attention_mask"]
            # Sequence parallelism splits the sequence over TP ranks: pad it to a multiple of tp.
            pad = plan.padded_width - plan.width
            if pad:
                ids = torch.nn.functional.pad(ids, (0, pad))
                mask = torch.nn.functional.pad(mask, (0, pad))
            mb.update(_ids=ids, _mask=mask, _seq=plan.width, _rows=plan.rows,
                      _starts=plan.starts, _width=s,
                      _logits_from=0 if starts is None else first_logit_column(starts, plan))
            out.append(mb)
        return out

    def _forward_step(self, loss_fn: LossFn | None, outputs: list, logits: bool = False,
                      entropy: bool = False):
        """Megatron's forward_step_func. With ``loss_fn`` it feeds per-token log-probs to it (a
        training step), and with ``entropy`` the policy's per-token entropy as ``mb["entropy"]``;
        without, it collects log-probs, or full logits when ``logits``."""
        def step(data_iterator, model):
            mb = next(data_iterator)
            ids, mask, seq = mb["_ids"], mb["_mask"], mb["_seq"]
            args = (ids, batch_position_ids(mask), batch_attention_mask(mask))
            if logits:
                return model(*args), lambda out: self._collect_logits(out[:, :seq], outputs)
            # Label at position i is token i+1; the last label is a dummy, dropped below. The
            # output layer computes columns from ``start`` on (``first_logit_column``).
            start = mb["_logits_from"]
            labels = torch.roll(ids, -1, dims=1)[:, start:]
            with output_layer_from(model, start, self.pg.tp):
                if self.head == "value" or entropy:
                    # [b, s, 1] from the ValueHead, or this rank's vocab slice of the logits
                    # [b, s - start, V/tp] (hidden states on the other pipeline stages).
                    out = model(*args)
                else:
                    out = model(*args, labels=labels)

            def loss(output):
                inputs = mb
                real = mask[:, :seq].bool()
                if self.head == "value":
                    per_token = torch.where(real, output[:, :seq, 0], 0.0)
                else:
                    if entropy:
                        output, token_entropy = _cross_entropy_and_entropy(output, labels,
                                                                           self.pg.tp)
                    # The per-token cross entropy [b, s] for the labels (GPTModel's output when
                    # given them), 0 before ``start``. 0 where no real token predicts a real one:
                    # what a padding position outputs depends on the micro-batch's width, which
                    # the split sets; with a response mask, 0 before each row's first response
                    # token: what a prompt position outputs depends on the micro-batch's start.
                    defined = real & shift_right(real)
                    if entropy:
                        token_entropy = shift_right(F.pad(token_entropy, (start, 0)))[:, :seq]
                    if "response_mask" in mb:
                        after = mb["response_mask"][:, :seq].cumsum(-1) > 0
                        defined = defined & after
                        if entropy:
                            token_entropy = torch.where(after, token_entropy, 0.0)
                    if entropy:
                        inputs = mb | {"entropy": token_entropy}
                    per_token = torch.where(
                        defined, shift_right(-F.pad(output, (start, 0)))[:, :seq], 0.0)
                if loss_fn is None:
                    outputs.append(per_token.detach())
                    return per_token.sum() * 0, torch.tensor(1, dtype=torch.int), {}
                value, metrics = loss_fn(per_token, inputs)
                # Kept on the device: a host sync per micro-batch would idle the GPU while the
                # host launches the next one; train_step reads them all at once.
                row = {k: metric_pair(v, value.device) for k, v in metrics.items()}
                outputs.append(row | {"loss": metric_pair(value, value.device)})
                return value, torch.tensor(1, dtype=torch.int), {}
            return out, loss
        return step

    def _collect_logits(self, vocab_shard: torch.Tensor, outputs: list):
        # deferred: Megatron
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        outputs.append(gather_from_tensor_model_parallel_region(vocab_shard).detach())
        return vocab_shard.sum() * 0, torch.tensor(1, dtype=torch.int), {}

    def _run(self, batch: dict[str, torch.Tensor], loss_fn: LossFn | None, forward_only: bool,
             logits: bool = False, entropy: bool = False):
        from megatron.core.pipeline_parallel import get_forward_backward_func  # deferred: Megatron

        mbs = self._micro_batches(batch, forward_only)
        if not forward_only and isinstance(self.optimizer, HostAdam):
            self.optimizer.begin(len(mbs))
        outputs: list = []
        fb = get_forward_backward_func()
        iters = [iter(mbs) for _ in self.chunks] if len(self.chunks) > 1 else iter(mbs)
        # seq_length and micro_batch_size give the p2p shapes unless variable_seq_lengths (the
        # token budget), where each activation's shape travels before it.
        try:
            fb(forward_step_func=self._forward_step(loss_fn, outputs, logits, entropy),
               data_iterator=iters,
               model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
               num_microbatches=len(mbs), seq_length=mbs[0]["_ids"].shape[1],
               micro_batch_size=mbs[0]["_ids"].shape[0], forward_only=forward_only)
        finally:
            if self.streamed is not None:  # a pass that raised part-way leaves no unit behind
                self.streamed.release()
        return outputs, mbs

    def _from_last_stage(self, obj):
        """Objects computed on the last pipeline stage, given to every stage."""
        if self.layout.pp == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.pg.pp, self.layout.pp - 1)
        dist.broadcast_object_list(box, src=src, group=self.pg.pp)
        return box[0]

    @torch.no_grad()
    def _per_token(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.eval()
        outputs, mbs = self._run(batch, None, forward_only=True)
        return self._from_last_stage(to_batch_order(list(zip(outputs, mbs))).cpu()
                                     if outputs else None)

    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs [B, S]: ``out[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``,
        0 at i = 0. ``batch`` holds ``input_ids`` and ``attention_mask`` [B, S] of this DP rank,
        and optionally ``response_mask`` [B, S]: then only positions from a row's first response
        token on are computed, the ones before come back 0 (module docstring)."""
        if self.head != "lm":
            raise ValueError("compute_logprobs needs an engine built with head='lm'")
        return self._per_token(batch)

    def compute_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token values [B, S] of a value-head engine (critic, reward model)."""
        if self.head != "value":
            raise ValueError("compute_values needs an engine built with head='value'")
        return self._per_token(batch)

    @torch.no_grad()
    def compute_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Full-vocabulary logits [B, S, V] (gathered over TP; for tests, greedy checks and small
        vocabularies -- training paths stay vocab-parallel); 0 at the padding positions no
        micro-batch computes (``plan_micro_batches``: with fixed-size micro-batches the columns
        that are padding in every row)."""
        for chunk in self.chunks:
            chunk.eval()
        outputs, mbs = self._run(batch, None, forward_only=True, logits=True)
        return self._from_last_stage(to_batch_order(list(zip(outputs, mbs))).cpu()
                                     if outputs else None)

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over ``batch`` (this DP rank's share), split into micro-batches.
        ``with_entropy``: ``loss_fn`` also finds the policy's per-token entropy [b, s] in
        ``mb["entropy"]``, aligned with the log-probs (at i, the entropy of the distribution that
        predicted token i; 0 at i = 0) and differentiable; it costs a softmax over this rank's
        vocabulary slice. With a ``response_mask`` in ``batch`` the log-probs and the entropy
        are 0 before each row's first response token (only the response's output layer is
        computed: module docstring). ``loss_fn`` may see the micro-batches in another order
        than the batch's and cut to fewer columns (``max_tokens_per_micro_batch``);
        ``to_batch_order`` puts per-token results it keeps, with their ``mb``, back in the
        batch's order. Returns, the same on every rank, ``loss`` (the global objective: the sum
        over every micro-batch of every data-parallel rank) and ``loss_fn``'s metrics reduced
        alike (``reduce_metrics``), grad_norm, ``nonfinite`` (1.0 when the gradients were not
        finite and the step was not applied)."""
        if with_entropy and self.head != "lm":
            raise ValueError("with_entropy needs an engine built with head='lm'")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs, _ = self._run(batch, loss_fn, forward_only=False, entropy=with_entropy)
        grad_norm, applied = self._step_if_finite()
        # The last stage's: its data-parallel peers are last stages too.
        metrics = reduce_metrics(outputs, self.pg.dp) if outputs else {}
        metrics = self._from_last_stage(metrics)
        metrics["grad_norm"] = grad_norm
        metrics["nonfinite"] = 0.0 if applied else 1.0
        return metrics

    @torch.no_grad()
    def _step_if_finite(self) -> tuple[float, bool]:
        """Megatron's optimizer step (clip by the global norm, then update), taken only when the
        gradients are finite: one NaN would otherwise spread to every weight. The norm is reduced
        over the model-parallel ranks after the data-parallel all-reduce, so every rank decides
        alike. Returns (grad norm, whether the step was applied)."""
        # deferred: Megatron
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        opt = self.optimizer
        if isinstance(opt, HostAdam):
            return opt.step()
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            opt.zero_grad()
            return grad_norm, False
        for part in getattr(opt, "chained_optimizers", [opt]):
            params = part.get_parameters()
            if part.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(
                    params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        opt.step_with_ready_grads()
        return grad_norm, True

    def full_weights(self, merged: bool = False) -> dict[str, torch.Tensor]:
        """Gather every model weight to its full shape on every rank (for tests and export; the
        generation path uses the 3D-HybridEngine instead). ``merged``: with the LoRA adapters
        merged in (the weights the policy computes with)."""
        full = self._gather({n: p.detach() for n, p in self.named_local_params()}, self.metas)
        if merged and self.adapters is not None:
            full = merge_adapters(full, self.full_adapters(), self.adapters.config.scaling)
        return full

    def full_adapters(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters, full (unsharded), on every rank."""
        local = {n: p.detach() for n, p in self.adapters.named_parameters()}
        return self._gather(local, self.adapters.metas)

    def _gather(self, local: dict[str, torch.Tensor], metas: dict[str, ParamMeta]
                ) -> dict[str, torch.Tensor]:
        out = {}
        for name, meta in metas.items():
            box = [None] * self.layout.pp
            mine = local.get(name)
            # Each TP group gathers its shards; then stages exchange what they own.
            if mine is not None and meta.tp_dim is not None and self.layout.tp > 1:
                pieces = [torch.empty_like(mine) for _ in range(self.layout.tp)]
                dist.all_gather(pieces, mine.contiguous(), group=self.pg.tp)
                mine = unshard(pieces, meta)
            dist.all_gather_object(box, None if mine is None else mine.cpu(), group=self.pg.pp)
            out[name] = next(t for t in box if t is not None)
        return out

