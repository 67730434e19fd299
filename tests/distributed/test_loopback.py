"""A local run listens on loopback only: the processes that tests and demos spawn (and the Ray
workers of `ray.address: local`) rendezvous through a file store and connect gloo over loopback,
so none of their sockets accepts connections from another machine."""

import psutil
import torch

from hybridflow.parallel.spawn import spawn


def _listening(rank, world):
    torch.distributed.all_reduce(torch.ones(1))  # the gloo pairs are connected by now
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_spawned_ranks_listen_on_loopback_only():
    for addresses in spawn(_listening, 2):
        assert addresses, "gloo listens somewhere; the check must see it"
        assert all(ip in ("127.0.0.1", "::1") for ip in addresses), addresses
