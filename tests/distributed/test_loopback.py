"""A local run listens on loopback only: the processes that tests and demos spawn (and the Ray
workers of `ray.address: local`) rendezvous through a file store and connect gloo over loopback,
and the Ray that `ray.address: local` starts (its GCS, raylet, autoscaler monitor, runtime-env
agent, the driver's and the workers' servers) is bound to 127.0.0.1, with Ray's token
authentication on: none of their sockets accepts connections from another machine."""

import ipaddress

import psutil
import torch

from hybridflow.parallel.spawn import spawn
from hybridflow.workers.group import RayConfig, WorkerGroup, init_ray
from tests.distributed.fault_workers import FaultWorker


def _on_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _listening(rank, world):
    torch.distributed.all_reduce(torch.ones(1))  # the gloo pairs are connected by now
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_spawned_ranks_listen_on_loopback_only():
    for addresses in spawn(_listening, 2):
        assert addresses, "gloo listens somewhere; the check must see it"
        assert all(_on_loopback(ip) for ip in addresses), addresses


def listening_sockets(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``root`` and of the
    processes below it."""
    out = []
    for process in [root, *root.children(recursive=True)]:
        try:
            out += [(process.name(), c.laddr.ip, c.laddr.port)
                    for c in process.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_local_ray_listens_on_loopback_only(monkeypatch):
    import ray
    from ray._raylet import AuthenticationMode, get_authentication_mode
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # Ray's default for a new local cluster
    if ray.is_initialized():
        ray.shutdown()
    init_ray(RayConfig(num_cpus=1))
    group = None
    try:
        group = WorkerGroup(FaultWorker, 2, ray_config=RayConfig(num_cpus=1), name="actor")
        assert group.run("world_sum") == [3.0, 3.0]  # the ranks' gloo world is connected
        sockets = listening_sockets(psutil.Process())
        names = {name for name, _, _ in sockets}
        # The check sees Ray's servers, its agent and the workers (ray::FaultWorker).
        assert {"gcs_server", "raylet", "ray::RuntimeEnvAgent"} <= names, sockets
        assert any(name.startswith("ray::FaultWorker") for name in names), sockets
        assert [s for s in sockets if not _on_loopback(s[1])] == [], sockets
        assert get_authentication_mode() == AuthenticationMode.TOKEN
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
