"""Adam in host memory, its gradients streamed there during the backward (``engine.optim.offload``).

Megatron's optimizers keep an fp32 gradient buffer on the GPU (4 bytes a parameter, whatever the
optimizer does with it) and their state beside it (12 bytes a parameter in bf16). At 7B that is
100 GiB: no one GPU trains every parameter of such a model. ``HostAdam`` leaves the GPU only the
weights the model computes with:

* GPU: the model's parameters (its dtype) and, for a moment, each gradient: a hook that runs as
  soon as the backward has accumulated a parameter's gradient copies it to host memory on a side
  stream and drops the GPU's copy.
* host: fp32 main weights, the gradients and Adam's two fp32 moments, one flat buffer of each per
  weight-decay group (Megatron's: no decay for 1-D parameters and biases). The main weights and
  gradients are page-locked in place (``host_memory.locked_buffer``), so the copies run
  asynchronously, both ways. The gradients are kept in the parameters' dtype while each step has
  one micro-batch: then each parameter's gradient arrives once, exactly what Megatron's fp32 buffer
  would hold (2 bytes a parameter for bf16, not 4: 12.5 GiB at 7B, which its host needs); from the
  first step of several micro-batches on, in fp32, which sums them as Megatron's buffer does.

A step over m micro-batches: a parameter's first gradient of the step is copied straight into its
slice of the host gradient; each later one into a pinned staging tensor that a host thread adds
in, and after the m-th the thread takes the slice's squared norm. With m = 1 the norm is taken on
the GPU, from the gradient itself, and no host thread runs. The backward ends waiting only for the
copies and adds still in flight. ``step`` then skips a step whose norm is not finite, and takes
torch's fused AdamW on the host's cores (all this process may run on) chunk by chunk (``CHUNK``
parameters: bf16 gradients are widened into one fp32 chunk at a time), the clip coefficient
folded in (``grad_scale``: the gradients are not rewritten), and copies the main weights into
the GPU's parameters (fp32, cast there).

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
import os
import queue
import threading

import torch

from hybridflow.training.config import OptimConfig
from hybridflow.training.host_memory import locked_buffer, unlock

IN_FLIGHT = 4
"""Gradients copied or being added that the backward runs ahead of: beyond, its hook waits for
the host thread (bounds the staging memory to this many of the largest parameter)."""

CHUNK = 1 << 26
"""Parameters per Adam step on the host (256 MiB of fp32): the fp32 copy of a chunk of bf16
gradients is all the widening costs in memory."""


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
        if self.cuda:
            # Ray gives each worker one thread (workers/group.py's OMP_NUM_THREADS): the step's
            # host work (Adam, adds, norms: memory-bound) would run on one core. The one
            # training rank takes the cores this process may run on; its GPU work is
            # unaffected. (On CPU the rank's compute shares the cores: left as it is.)
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named]
        self.dtype = self.params[0].dtype if self.params else torch.float32
        # Per parameter: its group (0 decays, 1 not) and offset in the group's flat buffers.
        groups = [[p for n, p in named if decays(n, p)], [p for n, p in named if not decays(n, p)]]
        self._where: dict[int, tuple[int, int]] = {}
        self.sizes = []
        for g, members in enumerate(groups):
            offset = 0
            for p in members:
                self._where[id(p)] = (g, offset)
                offset += p.numel()
            self.sizes.append(offset)
        self.decay = (optim.weight_decay, 0.0)
        self.main = [locked_buffer(n, torch.float32, self, self.cuda) for n in self.sizes]
        self.grad: list[torch.Tensor] = []  # made by begin (module docstring: their dtype)
        self.moments: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # made at first use
        self.steps = torch.zeros((), dtype=torch.float32)
        self.reload_model_params()
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._micro_batches = 1
        self._count: dict[int, int] = {}
        self._squares: dict[int, float] = {}  # host-side, several micro-batches
        self._device_squares: list[torch.Tensor] = []  # one micro-batch
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._arrive)

    def _slice(self, buffers: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        g, offset = self._where[id(p)]
        return buffers[g][offset:offset + p.numel()]

    # ------------------------------------------------------------------------- the backward
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._count, self._squares, self._device_squares = {}, {}, []

    def begin(self, micro_batches: int) -> None:
        """The next backward passes are a step's ``micro_batches``: the gradient buffers are
        made (or widened to fp32 at the first step of several) and, for several, the host thread
        starts (it lives for one step's backward, ``finish`` ends it)."""
        self._stop_thread()  # one a failed backward left
        self._micro_batches, self._error = micro_batches, None
        dtype = self.dtype if micro_batches == 1 and (
            not self.grad or self.grad[0].dtype == self.dtype) else torch.float32
        if not self.grad or self.grad[0].dtype != dtype:
            for buf in self.grad:  # unlocked and freed before the wider ones are made
                unlock(buf)
            self.grad = []
            self.grad = [locked_buffer(n, dtype, self, self.cuda) for n in self.sizes]
        if micro_batches > 1:
            self._thread = threading.Thread(target=self._host_work, daemon=True,
                                            name="host-adam")
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
        if self._micro_batches == 1:
            self._device_squares.append(
                torch.linalg.vector_norm(grad, dtype=torch.float32).square())
        source = grad.detach().reshape(-1).to(slot.dtype)
        # The first gradient of the step lands in place; the others in staging, added there.
        staging = None if n == 1 else torch.empty(
            slot.shape, dtype=slot.dtype, pin_memory=self.cuda)
        target = slot if staging is None else staging
        event = None
        if self.cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                target.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            source.record_stream(self._copy_stream)
        else:
            target.copy_(source)
        if staging is not None:
            final = n == self._micro_batches
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
                    slot.add_(staging)
                    if final is not None:
                        self._squares[final] = _squared_norm(slot)
            except BaseException as e:  # re-raised by the training thread (finish, _put)
                self._error = e
            finally:
                self._queue.task_done()

    def finish(self) -> None:
        """After the step's last backward: every gradient is in host memory and counted (one a
        parameter no micro-batch reached is zero)."""
        self._stop_thread()
        if self.cuda:
            self._copy_stream.synchronize()
        if self._error is not None:
            raise RuntimeError("the host optimizer's thread failed") from self._error
        for p in self.params:
            arrived = self._count.get(id(p), 0)
            if arrived == 0:
                self._slice(self.grad, p).zero_()
            elif self._micro_batches > 1 and id(p) not in self._squares:  # some micro-batches
                self._squares[id(p)] = _squared_norm(self._slice(self.grad, p))

    # ------------------------------------------------------------------------- the update
    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Clip by the global norm and take Adam's step, unless the norm is not finite; copy the
        main weights into the model. Returns (grad norm, whether the step was applied)."""
        squares = sum(self._squares.values())
        if self._device_squares:
            squares += float(torch.stack(self._device_squares).sum())
        norm = math.sqrt(squares)
        if not math.isfinite(norm):
            return norm, False
        clip = self.config.clip_grad
        coefficient = clip / (norm + 1.0e-6) if clip > 0.0 else 1.0  # Megatron's clip
        # fused AdamW divides each gradient by grad_scale: the clipped gradient, unwritten.
        scale = torch.tensor(1.0 / coefficient) if coefficient < 1.0 else None
        self.steps += 1
        wide = torch.empty(min(CHUNK, max(self.sizes)), dtype=torch.float32)
        for g, n in enumerate(self.sizes):
            exp_avg, exp_avg_sq = self._moments()[g]
            for a in range(0, n, CHUNK):
                b = min(n, a + CHUNK)
                grad = self.grad[g][a:b]
                if grad.dtype != torch.float32:
                    grad = wide[:b - a].copy_(grad)
                torch._fused_adamw_(
                    [self.main[g][a:b]], [grad], [exp_avg[a:b]], [exp_avg_sq[a:b]], [],
                    [self.steps], amsgrad=False, lr=self.config.lr,
                    beta1=self.config.adam_beta1, beta2=self.config.adam_beta2,
                    weight_decay=self.decay[g], eps=self.config.adam_eps, maximize=False,
                    grad_scale=scale, found_inf=None)
        self._to_model()
        return norm, True

    def _moments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Adam's two moments per group, zeros until a step; made at their first use (a step or
        a checkpoint): 8 bytes a parameter of host memory a run's start (its weights loading)
        does not hold too."""
        if self.moments is None:
            self.moments = [(torch.zeros(n), torch.zeros(n)) for n in self.sizes]
        return self.moments

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
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of everything a checkpoint holds: per group, the main weights and
        Adam's moments; the step count."""
        out = {"optimizer.host_adam.step": self.steps.view(1)}
        for g, (exp_avg, exp_avg_sq) in enumerate(self._moments()):
            if self.sizes[g]:
                out.update({f"optimizer.host_adam.group{g}.main": self.main[g],
                            f"optimizer.host_adam.group{g}.exp_avg": exp_avg,
                            f"optimizer.host_adam.group{g}.exp_avg_sq": exp_avg_sq})
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


def _squared_norm(x: torch.Tensor) -> float:
    """Of an fp32 host slice; ``dot`` runs on every core (``vector_norm``: 2.2 s over 6.7B
    parameters on the H100 machine's 16 cores, where Adam's step takes 1.4)."""
    return float(torch.dot(x, x))
