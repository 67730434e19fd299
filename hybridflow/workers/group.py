"""The single controller's view of a distributed worker: one Ray actor per rank.

A WorkerGroup starts ``world_size`` Ray actors of one worker class; the actors form a
torch.distributed group (gloo on CPU, NCCL on GPU) among themselves. The controller calls a method
on every rank at once, or dispatches a Batch by data-parallel rank: each DP group's ranks get the
same shard, and only the ranks that hold the output (e.g. TP rank 0 of the last pipeline stage)
send results back.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.errors import ConfigError, RunError, check_float, check_int
from hybridflow.parallel.host import cpu_rank_settings
from hybridflow.parallel.spawn import free_port
from hybridflow.profiling import profile_step
from hybridflow.workers.reaper import RUN_MARK


@dataclass(kw_only=True)
class RayConfig:
    """How the controller reaches Ray."""

    address: str = "local"
    """"local" always starts a Ray of its own on this machine, ignoring RAY_ADDRESS and any
    cluster Ray recorded in /tmp/ray; its servers, agents and workers listen on 127.0.0.1 only,
    behind Ray's token authentication (``init_ray``), and our gloo rendezvous and connections
    stay on loopback. "auto" or host:port joins a cluster (what launch/slurm does); where no
    Ray answers there within 5 s, the run (and ``hybridflow check``) stops naming it
    (``check_ray_address``)."""
    num_cpus: int | None = None
    """CPUs Ray may schedule locally (None: all)."""
    gpus_per_worker: float = 0.0
    """GPUs each rank claims (1 on GPU machines; 0 on CPU)."""
    cpus_per_worker: float = 0.0
    """CPUs each rank claims; 0 lets more ranks than cores share them (CPU demos)."""
    start_timeout_s: float = 1800.0
    """Seconds a worker group may take to start (its constructors: loading models, building
    engines) before the run stops; 0 waits forever."""
    call_timeout_s: float = 3600.0
    """Seconds one call on a worker group (a generation, an update) may take before the run
    stops; 0 waits forever."""
    stop_timeout_s: float = 240.0
    """Seconds a SIGTERM leaves the current step and its checkpoint; past them the run stops
    where it is, its last checkpoint kept (exit code 143). 0: as long as the step takes. Slurm's
    notice (launch/slurm/train.sbatch) is 300 s."""
    collective_timeout_s: float = 600.0
    """Seconds a torch.distributed collective inside a worker waits for the other ranks before
    it fails (a rank died or went astray); the run then stops naming the rank."""
    gpu_memory_gib: float | None = None
    """Cap each worker process's CUDA allocator at this many GiB
    (``torch.cuda.set_per_process_memory_fraction``): the run behaves as on a GPU of that size,
    running out of memory where that GPU would. Per process: colocated worker groups (a critic,
    reward models) get the cap each. null: the whole GPU."""

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ConfigError("address", "must be local, auto or host:port")
        check_int("num_cpus", self.num_cpus, none_ok=True)
        check_float("gpus_per_worker", self.gpus_per_worker, low=0)
        check_float("cpus_per_worker", self.cpus_per_worker, low=0)
        check_float("start_timeout_s", self.start_timeout_s, low=0)
        check_float("call_timeout_s", self.call_timeout_s, low=0)
        check_float("stop_timeout_s", self.stop_timeout_s, low=0)
        check_float("collective_timeout_s", self.collective_timeout_s, low=0, low_open=True)
        check_float("gpu_memory_gib", self.gpu_memory_gib, low=0, low_open=True, none_ok=True)


def quiet_engines_env() -> dict[str, str]:
    """vLLM's and torch's C++ warnings on CPU (no Triton, no tcmalloc, NUMA binding, the
    chat-template warmup that skip_tokenizer_init fails) and the libraries' deprecation notices
    say nothing a user of this loop can act on: the environment of a process that runs an engine
    keeps them out, unless the user set the logging variables to see them."""
    return {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}


def init_ray(cfg: RayConfig) -> None:
    """Start (``address: local``) or join Ray, once per process. The SIGTERM handler of the
    caller stays: ray.init would replace it with one of its own."""
    import ray  # deferred: Ray
    if ray.is_initialized():
        return
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                        **quiet_engines_env(), "RAY_DEDUP_LOGS": "1"}}
    with _keep_sigterm_handler():
        if cfg.address == "local":
            # Ray turns its token authentication on for a new local cluster (which we keep) and
            # warns that it did, every run; only that notice goes. (Setting RAY_AUTH_MODE here
            # instead would be too late: Ray read it at import.)
            logging.getLogger("ray._private.authentication.authentication_token_setup"
                              ).setLevel(logging.ERROR)
            # address="local", not None: with None Ray joins the cluster named by RAY_ADDRESS or
            # by /tmp/ray/ray_current_cluster, and retries that address for minutes when a
            # failed job left it behind dead.
            # A driver killed by SIGKILL takes this Ray with it: its servers are started with
            # PR_SET_PDEATHSIG, and the reaper, started first, kills the rest (test_faults).
            _start_reaper()
            with _loopback_node():
                ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False,
                         runtime_env=env, logging_level="WARNING", log_to_driver=True)
        else:
            check_ray_address(cfg.address)
            try:
                ray.init(address=cfg.address, runtime_env=env, logging_level="WARNING")
            except ConnectionError as e:  # a gRPC server, but not a Ray that lets us in
                reason = str(e.__cause__ or e).strip().splitlines()[-1]
                raise ConfigError("ray.address", f"{cfg.address}: Ray could not join the "
                                  f"cluster there ({reason}); check the address, and that "
                                  "the driver has the cluster's token (RAY_AUTH_MODE, "
                                  "RAY_AUTH_TOKEN)") from None


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """A ConfigError naming ``address`` (``ray.address``, a cluster's) unless a gRPC server
    answers there within ``timeout_s``: ray.init retries an address where nothing listens, or
    where a server of another kind does, for minutes, deaf to SIGTERM. The address is the one
    ray.init would reach: ``auto`` the one Ray finds (RAY_ADDRESS, else the cluster recorded in
    /tmp/ray, else a GCS running on this machine), 127.0.0.1 or localhost this machine's address;
    ``ray://`` (Ray Client) its host:port as given."""
    from ray._private.services import (canonicalize_bootstrap_address,  # deferred: Ray
                                       canonicalize_bootstrap_address_or_die)
    try:
        if address.startswith("ray://"):
            target = address.removeprefix("ray://")
        elif address == "auto":
            target = canonicalize_bootstrap_address_or_die("auto")
        else:
            target = canonicalize_bootstrap_address(address)
    except ConnectionError as e:  # auto: Ray found no cluster to join
        raise ConfigError("ray.address", f"auto: {e} Start the cluster first, or use "
                                         "ray.address=local") from None
    except ValueError:
        target = ""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("ray.address", f"{address!r} is none of local, auto, host:port or "
                                         "ray://host:port")
    why_not = _grpc_answer(host.strip("[]"), int(port), timeout_s)
    if why_not is not None:
        if address == "auto":
            found = (f"the address Ray took from RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
                     if os.environ.get("RAY_ADDRESS") else "the cluster Ray found here")
            where = f"auto: {target}, {found}"
        else:
            where = target if target == address.removeprefix("ray://") else \
                f"{target} ({address}, as Ray reaches it)"
        raise ConfigError("ray.address", f"{where}: {why_not}; start the cluster's head there "
                                         "(ray start --head --port=PORT), correct the address, "
                                         "or use ray.address=local")


_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS,
its client server) answers with a SETTINGS frame of its own."""


def _grpc_answer(host: str, port: int, timeout_s: float) -> str | None:
    """None if an HTTP/2 (gRPC) server answers at ``host``:``port`` within ``timeout_s``, else
    why not, in a few words."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(_HTTP2_HELLO)
            header = b""
            while len(header) < 9:  # a frame header: length (3 bytes), type (1), ...
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                chunk = conn.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    except TimeoutError:
        return f"nothing answers within {timeout_s:g}s"
    except OSError as e:
        return f"nothing answers ({(e.strerror or str(e)).lower()})"
    if len(header) < 9 or header[3] != 4:
        return "what listens there is no Ray (it does not speak gRPC)"
    return None


@contextlib.contextmanager
def _keep_sigterm_handler():
    """The block runs, and SIGTERM's handler is the one it had before (ray.init installs its
    own, a sys.exit, in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node():
    """A Ray started in the block binds its servers, agents and workers to 127.0.0.1.

    Ray 2.60 binds them to the node's IP address, which it finds from the route out of this
    machine, and turns a ``_node_ip_address`` (or ``ray start --node-ip-address``) of 127.0.0.1
    into that address too (``services.resolve_ip_for_localhost``), so neither confines it. Its
    single-node switch does: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its default on macOS and
    Windows) the node's IP address is 127.0.0.1 (``services.get_node_ip_address``). Ray read the
    variable at import in this process (``ray_constants.ENABLE_RAY_CLUSTER``) and reads it at
    start in the processes it starts, so both are set, for the block only: joining a cluster
    later from this process must find the machine's real address."""
    from ray._private import ray_constants  # deferred: Ray
    saved = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
        if saved[0] is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved[0]


def _start_reaper() -> None:
    """A reaper process (hybridflow/workers/reaper.py) that kills every process of this local
    run once the driver is gone, forks of its workers included: they find one another by the
    mark ``RUN_MARK`` that this process puts into its environment, which everything it starts
    from now on inherits. One per driver process."""
    mark = os.environ.get(RUN_MARK, "")
    if mark.startswith(f"{os.getpid()}-"):  # this process's own (not its parent's): started
        return
    mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ[RUN_MARK] = mark
    subprocess.Popen([sys.executable, "-m", "hybridflow.workers.reaper", str(os.getpid()), mark],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


@dataclass(frozen=True)
class Rendezvous:
    """How a group's ranks form their torch.distributed world (and what each rank's process is
    allowed): the WorkerGroup makes it, every worker's constructor passes it on to
    ``Worker.__init__`` unchanged."""

    init_method: str
    """torch.distributed's init_method: file:// (a local run) or tcp://host:port."""
    timeout_s: float
    """The world's collective timeout (RayConfig.collective_timeout_s)."""
    gpu_memory_gib: float | None = None
    """The cap of each rank's CUDA allocator (RayConfig.gpu_memory_gib)."""


class Worker:
    """Base of every worker: joins the group's torch.distributed world in its constructor."""

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous):
        """``rendezvous``: from the WorkerGroup; subclasses pass it on unchanged."""
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        if rendezvous.init_method.startswith("file://"):  # a local run: gloo uses loopback only
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.rank, self.world_size = rank, world_size
        self.collective_timeout_s = rendezvous.timeout_s
        """ray.collective_timeout_s: the default group's, and that of any group a worker makes."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each actor its own GPU, visible as device 0
        else:
            cpu_rank_settings()
        if rendezvous.gpu_memory_gib is not None:
            cap_gpu_memory(rendezvous.gpu_memory_gib)
        dist.init_process_group(backend, init_method=rendezvous.init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=rendezvous.timeout_s))

    def dispatch_info(self, view: str) -> tuple[int, bool]:
        """(data group index, whether this rank returns the group's output) for ``view``."""
        raise NotImplementedError

    def memory_name(self, method: str) -> str:
        """The name of ``method``'s memory metrics (``memory/<name>_...``): the method's, unless
        two groups of one run call the same method."""
        return method

    def ping(self) -> int:
        """This rank's process id (the controller names it when the process dies)."""
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method``'s result; on a GPU, a Batch's meta gains this process's device memory over
        the call (``memory_meta``: the allocator's peak during it, what stays allocated, and how
        often it had to ask the device for memory). A call ``arm_profile`` named runs under
        torch.profiler."""
        run = getattr(self, method)
        armed = getattr(self, "_profile", {})
        if method in armed:
            run = self._profiled(run, armed.pop(method))
        if not torch.cuda.is_available():
            return run(*args, **kwargs)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        out = run(*args, **kwargs)
        if isinstance(out, Batch):
            out.meta.update(memory_meta(self.memory_name(method),
                                        torch.cuda.max_memory_allocated(),
                                        torch.cuda.memory_allocated(), before,
                                        torch.cuda.memory_stats()))
        return out

    def arm_profile(self, calls: dict[str, str], top: int) -> None:
        """The next call of each method in ``calls`` runs under torch.profiler (on rank 0), and
        the summary of its ``top`` costliest kernels (``profile_step``) is written as JSON to
        the path ``calls`` gives it (what ``bench_rl_step --profile`` reads)."""
        self._profile = ({m: (path, top) for m, path in calls.items()} if self.rank == 0
                         else {})

    @staticmethod
    def _profiled(run, where: tuple[str, int]):
        def profiled(*args: Any, **kwargs: Any) -> Any:
            out = []
            prof = profile_step(lambda: out.append(run(*args, **kwargs)), None, where[1])
            with open(where[0], "w") as f:
                json.dump(prof, f)
            return out[0]
        return profiled


def cap_gpu_memory(gib: float) -> None:
    """Limit this process's CUDA allocator to ``gib`` GiB of the current device (an allocation
    beyond it raises torch's out-of-memory error, as on a GPU of that size)."""
    if not torch.cuda.is_available():
        raise ConfigError("ray.gpu_memory_gib", "this worker has no GPU; set it to null, or give "
                          "the workers GPUs (ray.gpus_per_worker)")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise ConfigError("ray.gpu_memory_gib", f"{gib:g} GiB is more than this GPU's "
                          f"{total / 2**30:.1f} GiB; lower it or set it to null")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)


MEMORY = "memory/"


def memory_meta(method: str, peak: int, resident: int, before: dict | None = None,
                after: dict | None = None) -> dict[str, float]:
    """``memory/<method>_peak_gib``: the most a process's tensors held during a call of
    ``method`` (torch's allocator: no CUDA context, no cached free blocks);
    ``memory/<method>_resident_gib``: what they hold after it. With torch's
    ``memory_stats()`` from ``before`` and ``after`` the call: ``_device_allocs``, the blocks
    the allocator had to take from the device during it (each a cudaMalloc: none once its cache
    is warm), and ``_alloc_retries``, the times it found no room, freed its whole cache and
    tried again (a device near full: each a synchronisation and a round of cudaFree)."""
    out = {f"{MEMORY}{method}_peak_gib": peak / 2**30,
           f"{MEMORY}{method}_resident_gib": resident / 2**30}
    if before is not None and after is not None:
        for key, stat in (("device_allocs", "num_device_alloc"),
                          ("alloc_retries", "num_alloc_retries")):
            out[f"{MEMORY}{method}_{key}"] = float(after.get(stat, 0) - before.get(stat, 0))
    return out


def max_memory_meta(metas: list[dict[str, Any]]) -> dict[str, float]:
    """The ``memory/`` entries of several ranks' (or rounds') metas, each the largest."""
    out: dict[str, float] = {}
    for meta in metas:
        for k, v in meta.items():
            if k.startswith(MEMORY):
                out[k] = max(out.get(k, v), v)
    return out


def node_address() -> tuple[str, int]:
    """This node's address and a free port on it (runs where rank 0 will run)."""
    import ray  # deferred: Ray
    ip = ray.util.get_node_ip_address()
    return ip, free_port("")


class ResourcePool:
    """One Ray placement-group bundle per rank: ``{"GPU": gpus_per_worker, "CPU": ...}``.

    Worker groups built on the same pool put their rank r into bundle r and split its resources
    ``share`` ways: HybridFlow's colocated models (actor + rollout + reference in one group, the
    critic and reward models in others) use the same GPUs, and each rank's processes see the same
    device, one per rank."""

    def __init__(self, world_size: int, cfg: RayConfig, share: int = 1, timeout_s: float = 300.0):
        # deferred: Ray
        import ray
        from ray.util.placement_group import placement_group

        init_ray(cfg)
        self.world_size, self.share, self.cfg = world_size, share, cfg
        bundle = {"CPU": max(cfg.cpus_per_worker, 0.01)}
        if cfg.gpus_per_worker:
            bundle["GPU"] = cfg.gpus_per_worker
        self._check_resources(bundle)
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)],
                                               strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            raise ConfigError("ray.gpus_per_worker", f"{world_size} bundles of {bundle} were not "
                              f"placed within {timeout_s:g}s (other groups hold the resources); "
                              "share the devices (placement.preset=colocate) or lower the per-rank "
                              "resources") from None

    def _check_resources(self, bundle: dict[str, float], wait_s: float = 5.0) -> None:
        """Fail at once, naming the field, if the bundles cannot fit; Ray's free counts lag
        behind just-released groups, so a shortfall is re-read for ``wait_s`` first."""
        import ray  # deferred: Ray
        total = ray.cluster_resources()
        deadline = time.monotonic() + wait_s
        while True:
            free = ray.available_resources()
            short = [(k, need) for k, need in bundle.items()
                     if need * self.world_size > free.get(k, 0) + 1e-6]
            if not short:
                return
            key, need = short[0]
            if need * self.world_size <= total.get(key, 0) + 1e-6 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            field = "ray.gpus_per_worker" if key == "GPU" else "ray.cpus_per_worker"
            raise ConfigError(field, f"{self.world_size} ranks x {need:g} {key} = "
                              f"{need * self.world_size:g} {key}, but Ray has "
                              f"{free.get(key, 0):g} free of {total.get(key, 0):g}; lower it, "
                              "shrink the layout, or share the devices between models "
                              "(placement.preset=colocate)")

    def options(self, rank: int) -> dict[str, Any]:
        """Ray actor options that put a worker of this pool's rank ``rank`` into its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # deferred: Ray
        return dict(num_gpus=self.cfg.gpus_per_worker / self.share,
                    num_cpus=self.cfg.cpus_per_worker / self.share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=rank))

    def close(self) -> None:
        import ray  # deferred: Ray
        ray.util.remove_placement_group(self.placement_group)


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls``; construct with the worker's own arguments.
    ``pool``: the ResourcePool to place them in (shared with other groups to colocate them);
    None makes one of their own."""

    def __init__(self, worker_cls: type[Worker], world_size: int, *args: Any,
                 ray_config: RayConfig | None = None, name: str = "worker",
                 pool: ResourcePool | None = None, **kwargs: Any):
        import ray  # deferred: Ray
        cfg = ray_config or RayConfig()
        self.own_pool = pool is None
        pool = pool or ResourcePool(world_size, cfg)
        if pool.world_size != world_size:
            raise ValueError(f"a pool of {pool.world_size} bundles cannot hold {world_size} ranks")
        self.name, self.world_size, self.pool = name, world_size, pool
        self.memory_notes: dict[str, str] = {}
        """Worker method -> its phase and the memory estimate's note for a CUDA out-of-memory
        error in it (``planner.memory.out_of_memory_notes``); set by the driver."""
        placement = [pool.options(r) for r in range(world_size)]
        self._rendezvous_dir, self.pids, self.actors = None, [None] * world_size, []
        self.call_timeout_s = cfg.call_timeout_s
        if cfg.address == "local":
            # A file store: nothing listens (torch's TCP store would, on every interface).
            self._rendezvous_dir = tempfile.mkdtemp(prefix=f"hybridflow-{name}-")
            init_method = f"file://{self._rendezvous_dir}/store"
        else:
            # On a cluster rank 0 may land on any node: ask the node of bundle 0 for its address
            # and a free port.
            probe = ray.remote(num_cpus=0)(node_address).options(
                scheduling_strategy=placement[0]["scheduling_strategy"])
            addr, port = self._wait([probe.remote()], "finding rank 0's address",
                                    cfg.start_timeout_s, "ray.start_timeout_s")[0]
            init_method = f"tcp://{addr}:{port}"
        rendezvous = Rendezvous(init_method, cfg.collective_timeout_s, cfg.gpu_memory_gib)
        actor_cls = ray.remote(worker_cls)
        tag = uuid.uuid4().hex[:8]  # actor names are global in a Ray cluster
        self.actors = [actor_cls.options(name=f"{name}-{r}-{tag}", **placement[r]).remote(
            r, world_size, rendezvous, *args, **kwargs) for r in range(world_size)]
        try:  # surfaces constructor errors here
            self.pids = self._wait([a.ping.remote() for a in self.actors], "start",
                                   cfg.start_timeout_s, "ray.start_timeout_s")
        except BaseException:
            self.shutdown()  # the caller never gets this group to shut down
            raise
        self._dispatch: dict[str, list[tuple[int, bool]]] = {}

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank with the same arguments; results in rank order."""
        return self._wait([getattr(a, method).remote(*args, **kwargs) for a in self.actors],
                          method, self.call_timeout_s, "ray.call_timeout_s")

    def _wait(self, futures: list, method: str, timeout_s: float, field: str) -> list[Any]:
        """The results of one call per rank, in rank order. Unlike a plain ``ray.get`` it stops
        at the first rank that fails: the others may be waiting for that rank in a collective.

        A rank whose process died, or a call that takes longer than ``timeout_s`` (0: no limit,
        ``field`` its config key), kills the group and raises a RunError naming the rank. An
        exception raised in a worker propagates: a ConfigError as itself (bad input found in a
        worker), anything else as Ray's RayTaskError with the worker's traceback."""
        import ray  # deferred: Ray
        rank_of = {ref: r for r, ref in enumerate(futures)}
        results: list[Any] = [None] * len(futures)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        pending = list(futures)
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self._kill()
                ranks = sorted(rank_of[ref] for ref in pending)
                raise RunError(f"worker group '{self.name}': {method} did not finish within "
                               f"{timeout_s:g}s on rank(s) {ranks}; the run stopped (its last "
                               f"checkpoint, if any, is intact); raise {field} if it needs "
                               "longer")
            for ref in done:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    # A rank's error in a collective is often the echo of another rank's death:
                    # report the death if one shows within a few seconds.
                    self._raise_if_died(pending, rank_of, wait_s=5.0)
                    if isinstance(e.cause, torch.OutOfMemoryError):
                        self._kill()  # the other ranks may wait in a collective for this one
                        raise self._cuda_out_of_memory(rank, method) from None
                    _raise_task_error(e)
                except ray.exceptions.RayActorError as e:
                    self._kill()
                    if (task_error := _creation_error(e)) is not None:
                        _raise_task_error(task_error.as_instanceof_cause())
                    raise self._died(rank, e) from None
                except ray.exceptions.OutOfMemoryError as e:
                    self._kill()
                    raise self._out_of_memory(rank, e) from None
        return results

    def _out_of_memory(self, rank: int, e) -> RunError:
        """Ray's memory monitor killed a worker (this rank's, or one it waited for)."""
        usage = re.search(r"was ([\d.]+GB used / [\d.]+GB limit)", str(e))
        return RunError(f"worker group '{self.name}' rank {rank}: Ray killed a worker because "
                        f"this node ran out of memory"
                        + (f" ({usage.group(1)})" if usage else "") + "; the run stopped (its "
                        "last checkpoint, if any, is intact). Give the run less to hold (smaller "
                        "micro-batches, rollout.kv_cache_mb, shorter sequences, fewer colocated "
                        "models) or stop what else uses this node's memory")

    def _cuda_out_of_memory(self, rank: int, method: str) -> RunError:
        """This rank's CUDA allocator found no room during ``method``: one line naming them and,
        where the driver gave it, the method's phase, the estimate for it and the key to turn."""
        note = self.memory_notes.get(method)
        return RunError(f"worker group '{self.name}' rank {rank}: CUDA out of memory in "
                        f"{method}" + (f", {note}" if note else "") + "; the run stopped (its "
                        "last checkpoint, if any, is intact)")

    def _died(self, rank: int, e) -> RunError:
        return RunError(f"worker group '{self.name}' rank {rank} (pid "
                        f"{_pid(e, self.pids[rank])}) died: {_exit_reason(e)}; the run stopped "
                        "(its last checkpoint, if any, is intact)")

    def _raise_if_died(self, refs: list, rank_of: dict, wait_s: float) -> None:
        import ray  # deferred: Ray
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if _creation_error(e) is None:
                    self._kill()
                    raise self._died(rank_of[ref], e) from None
            except Exception:  # noqa: BLE001 - only a death is looked for here
                pass

    def _info(self, view: str) -> list[tuple[int, bool]]:
        if view not in self._dispatch:
            self._dispatch[view] = self.run("dispatch_info", view)
        return self._dispatch[view]

    def data_parallel_size(self, view: str) -> int:
        return 1 + max(group for group, _ in self._info(view))

    def run_by_dp(self, method: str, batch: Batch, view: str = "train", **kwargs: Any) -> Batch:
        """Split ``batch`` over the data groups of ``view``, give every rank its group's shard,
        and concatenate the outputs of the groups' output ranks in group order."""
        import ray  # deferred: Ray
        info = self._info(view)
        shards = batch.split(self.data_parallel_size(view))
        refs = [ray.put(s) for s in shards]
        futures = [a.call.remote(method, refs[group], **kwargs)
                   for a, (group, _) in zip(self.actors, info)]
        results = self._wait(futures, method, self.call_timeout_s, "ray.call_timeout_s")
        outputs = {group: r for r, (group, out) in zip(results, info) if out}
        batch = Batch.concat([outputs[g] for g in sorted(outputs)])
        # every rank's device memory, not only the output ranks': the fullest one counts
        batch.meta.update(max_memory_meta([r.meta for r in results if isinstance(r, Batch)]))
        return batch

    def _kill(self) -> None:
        """End every rank's process now (a rank that is already dead is no error)."""
        import ray  # deferred: Ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - a dead actor or a Ray already shut down
                pass

    def shutdown(self) -> None:
        """Kill the ranks and free what the group holds; safe to call twice or after a rank
        died."""
        import ray  # deferred: Ray
        if ray.is_initialized():
            self._kill()
            if self.own_pool and self.pool is not None:
                self.pool.close()
        self.actors, self.pool = [], None
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None


def _creation_error(e) -> BaseException | None:
    """The RayTaskError of a worker's constructor, if that is why its actor died (Ray's
    ActorDiedError carries it as its argument)."""
    import ray  # deferred: Ray
    return next((a for a in e.args if isinstance(a, ray.exceptions.RayTaskError)), None)


def _raise_task_error(e) -> None:
    """A worker's exception: a ConfigError or RunError as itself (bad input, or a reason to stop
    found in a worker: the CLI prints one line), anything else as Ray's error with the worker's
    traceback (a bug)."""
    if isinstance(e.cause, (ConfigError, RunError)):
        raise e.cause from None
    raise e


def _pid(e, known: int | None) -> int | str:
    match = re.search(r"^\s*pid: (\d+)$", str(e), re.M)
    return int(match.group(1)) if match else (known if known is not None else "unknown")


def _exit_reason(e) -> str:
    """One line from Ray's ActorDiedError: the worker's exit type and detail, without Ray's
    paragraph of possible causes."""
    text = " ".join(str(e).split())
    match = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*)", text)
    if not match:
        return text.rsplit(". ", 1)[-1] if text else type(e).__name__
    detail = re.split(r" (?:Some common causes|There are some potential root causes)", match[2])[0]
    # Ray learns of a death from its socket closing: a kill -9, the OOM killer, a crash and an
    # os._exit all read the same, hence the hint.
    return (f"{match[1]}: {detail} (killed, out of memory, or crashed: its log above or the "
            "kernel log says which)")
