"""Adam in host memory, its gradients streamed there during the backward (``engine.optim.offload``).

Megatron's optimizers keep an fp32 gradient buffer on the GPU (4 bytes a parameter, whatever the
optimizer does with it) and their state beside it (12 bytes a parameter in bf16). At 7B that is
100 GiB: no one GPU trains every parameter of such a model. ``HostAdam`` leaves the GPU only the
weights the model computes with:

* GPU: the model's parameters (its dtype) and, for a moment, each gradient: a hook that runs as
  soon as the backward has accumulated a parameter's gradient casts it to fp32, copies it to host
  memory on a side stream and drops the GPU's copy.
* host: fp32 main weights, fp32 gradients and Adam's two moments, one flat buffer of each per
  weight-decay group (Megatron's: no decay for 1-D parameters and biases). The main weights and
  gradients are page-locked in place (``cudaHostRegister``: the caching allocator's pinned memory
  rounds each block up to a power of two), so the copies run asynchronously, both ways.

A step over m micro-batches: a parameter's first gradient of the step is copied straight into its
slice of the host gradient; each later one into a pinned staging tensor that a host thread adds
in. After a parameter's m-th gradient the thread takes its slice's squared norm, so the global
norm is ready when the backward ends, and the backward waits only for the copies and adds still
in flight. ``step`` then skips a step whose norm is not finite, folds the clip coefficient into
torch's fused AdamW (``grad_scale``: the gradients are not rewritten), updates the main weights on
the host's cores and copies them into the GPU's parameters (fp32, cast there).

The arithmetic is Megatron's with a fp32 main gradient (the ``Float16Optimizer`` /
``FP32Optimizer`` path without Transformer Engine): the same Adam, clip and decay groups; the
gradient of each micro-batch comes in the parameters' dtype, as Megatron's without
``gradient_accumulation_fusion`` (which ``transformer_config`` switches off here). One training
rank holds the whole model (``TrainEngine`` refuses other layouts): data-parallel reduction,
pipeline stages' shared embedding and the norm over model-parallel ranks are not done here.
On a CPU-only machine the same code runs with host "device" tensors (no streams; the thread and
the staging still do their work), which is what the tests check against Megatron's optimizer.
"""

from __future__ import annotations

import math
import queue
import threading

import torch

from hybridflow.training.config import OptimConfig
from hybridflow.training.host_memory import locked_buffer

IN_FLIGHT = 4
"""Gradients copied or being added that the backward runs ahead of: beyond, its hook waits for
the host thread (bounds the staging memory to this many of the largest parameter)."""


def decays(name: str, param: torch.Tensor) -> bool:
    """Megatron's default weight-decay rule: no decay for 1-D parameters and biases."""
    return param.dim() > 1 and not name.endswith(".bias")


class HostAdam:
    """AdamW over ``named_params`` (the trainable ones; every one on ``device``) with its state in
    host memory (module docstring). Use: ``zero_grad``, ``begin(m)``, the backward of m
    micro-batches, ``finish()`` (the engine's ``finalize_model_grads_func``), ``step()``."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], optim: OptimConfig,
                 device: torch.device):
        self.config, self.device = optim, device
        self.cuda = device.type == "cuda"
        named = [(n, p) for n, p in named_params if p.requires_grad]
        # Per parameter: its group (0 decays, 1 not) and offset in the group's flat buffers.
        self.params = [p for _, p in named]
        groups = [[p for n, p in named if decays(n, p)], [p for n, p in named if not decays(n, p)]]
        self._where: dict[int, tuple[int, int]] = {}
        sizes = []
        for g, members in enumerate(groups):
            offset = 0
            for p in members:
                self._where[id(p)] = (g, offset)
                offset += p.numel()
            sizes.append(offset)
        self.main, self.grad = ([locked_buffer(n, torch.float32, self, self.cuda).zero_()
                                 for n in sizes] for _ in range(2))
        flat = [torch.nn.Parameter(m, requires_grad=False) for m in self.main]
        for p, g in zip(flat, self.grad):
            p.grad = g
        used = [(p, wd) for p, wd in zip(flat, (optim.weight_decay, 0.0)) if p.numel()]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p], "weight_decay": wd} for p, wd in used], lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps, fused=True)
        self._flat = [p for p, _ in used]
        self.reload_model_params()
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._micro_batches = 1
        self._count: dict[int, int] = {}
        self._squares: dict[int, float] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._arrive)

    def _slice(self, buffers: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        g, offset = self._where[id(p)]
        return buffers[g][offset:offset + p.numel()]

    # ------------------------------------------------------------------------- the backward
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._count, self._squares = {}, {}

    def begin(self, micro_batches: int) -> None:
        """The next backward passes are a step's ``micro_batches``: the host thread starts (it
        lives for one step's backward, ``finish`` ends it)."""
        self._stop_thread()  # one a failed backward left
        self._micro_batches, self._error = micro_batches, None
        self._thread = threading.Thread(target=self._host_work, daemon=True, name="host-adam")
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _arrive(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``p``'s gradient of one micro-batch leaves for the host."""
        grad, p.grad = p.grad, None
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        slot = self._slice(self.grad, p)
        grad32 = grad.detach().reshape(-1).to(torch.float32)
        # The first gradient of the step lands in place; the others in staging, added there.
        staging = None if n == 1 else torch.empty(
            slot.shape, dtype=torch.float32, pin_memory=self.cuda)
        target = slot if staging is None else staging
        event = None
        if self.cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                target.copy_(grad32, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            grad32.record_stream(self._copy_stream)
        else:
            target.copy_(grad32)
        final = n == self._micro_batches
        if staging is not None or final:
            self._put((event, slot, staging, id(p) if final else None))

    def _put(self, item) -> None:
        if self._error is not None:
            raise RuntimeError("the host optimizer's thread failed") from self._error
        self._queue.put(item)

    def _host_work(self) -> None:
        """The host thread: waits for each copy, adds staged gradients in, takes final norms."""
        while (item := self._queue.get()) is not None:
            event, slot, staging, final = item
            try:
                if self._error is None:
                    if event is not None:
                        event.synchronize()
                    if staging is not None:
                        slot.add_(staging)
                    if final is not None:
                        self._squares[final] = float(torch.linalg.vector_norm(slot)) ** 2
            except BaseException as e:  # re-raised by the training thread (finish, _put)
                self._error = e
            finally:
                self._queue.task_done()

    def finish(self) -> None:
        """After the step's last backward: every gradient is in host memory and counted (one a
        parameter no micro-batch reached is zero)."""
        self._stop_thread()
        if self.cuda:  # first gradients of parameters some micro-batch did not reach
            self._copy_stream.synchronize()
        if self._error is not None:
            raise RuntimeError("the host optimizer's thread failed") from self._error
        for p in self.params:
            if id(p) in self._squares:
                continue
            slot = self._slice(self.grad, p)
            if id(p) not in self._count:
                slot.zero_()
            self._squares[id(p)] = float(torch.linalg.vector_norm(slot)) ** 2

    # ------------------------------------------------------------------------- the update
    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Clip by the global norm and take Adam's step, unless the norm is not finite; copy the
        main weights into the model. Returns (grad norm, whether the step was applied)."""
        norm = math.sqrt(sum(self._squares[id(p)] for p in self.params))
        if not math.isfinite(norm):
            return norm, False
        clip = self.config.clip_grad
        coefficient = clip / (norm + 1.0e-6) if clip > 0.0 else 1.0  # Megatron's clip
        # fused AdamW divides each gradient by grad_scale: the clipped gradient, unwritten.
        self.optimizer.grad_scale = (torch.tensor(1.0 / coefficient) if coefficient < 1.0
                                     else None)
        self.optimizer.step()
        self._to_model()
        return norm, True

    def _to_model(self) -> None:
        for p in self.params:
            main = self._slice(self.main, p).view(p.shape)
            if self.cuda:  # fp32 up (asynchronously, from page-locked memory), cast on the GPU
                p.data.copy_(main.to(self.device, non_blocking=True))
            else:
                p.data.copy_(main)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """The main weights from the model's (after its weights were loaded)."""
        for p in self.params:
            self._slice(self.main, p).copy_(p.detach().reshape(-1))

    # ------------------------------------------------------------------------- checkpoints
    def _state(self, p: torch.nn.Parameter) -> dict:
        """Adam's state of a flat buffer, made as its first step makes it (zeros) where no step
        has run yet: a checkpoint loads into it. Made lazily, as torch does: 8 bytes a
        parameter of host memory that a run's start (its weights loading) does not hold too."""
        if not self.optimizer.state[p]:
            self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                       "exp_avg": torch.zeros_like(p),
                                       "exp_avg_sq": torch.zeros_like(p)}
        return self.optimizer.state[p]

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of everything a checkpoint holds: per group, the main weights, Adam's
        moments and its step count."""
        out = {}
        for g, p in enumerate(self._flat):
            state = self._state(p)
            for key, tensor in (("main", p.data), ("exp_avg", state["exp_avg"]),
                                ("exp_avg_sq", state["exp_avg_sq"]),
                                ("step", state["step"].view(1))):
                out[f"optimizer.host_adam.group{g}.{key}"] = tensor
        return out

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata=None) -> dict:
        """The state as Megatron dist-checkpointing tensors (one rank holds them whole), for
        ``megatron_ckpt.save_train_state`` / ``load_train_state``."""
        from megatron.core.dist_checkpointing import ShardedTensor  # deferred: Megatron

        return {name: ShardedTensor.from_rank_offsets(name, tensor, replica_id=0)
                for name, tensor in self._state_tensors().items()}

    @torch.no_grad()
    def load_state_dict(self, loaded: dict) -> None:
        """What ``sharded_state_dict`` saved, loaded (``dist_checkpointing.load``'s tensors);
        the model's weights are loaded beside it, so they equal the main weights cast."""
        for name, tensor in self._state_tensors().items():
            tensor.copy_(loaded[name])

