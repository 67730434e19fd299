"""``spawn`` reports a worker that dies without a word (killed by a signal, as the kernel's
out-of-memory killer does) at once, naming it, instead of waiting out its timeout while the other
ranks hang in a collective with the dead one; and a worker's exception with its traceback."""

import os
import signal
import time

import pytest
import torch

from hybridflow.parallel.spawn import spawn


def _rank1_killed(rank, world, rank0_wait_s):
    # Both ranks past the group's set-up first: gloo may still be connecting rank 0 when rank 1
    # leaves init_process_group, and a death then fails rank 0's init with a collective error.
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(2)  # rank 0 is out of the barrier (unread bytes would make the close a reset)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank0_wait_s:  # busy elsewhere: nothing tells rank 0 of the dead peer
        time.sleep(rank0_wait_s)
    else:
        torch.distributed.barrier()  # gloo sees the closed connection
    return rank


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    torch.distributed.barrier()
    return rank


def test_a_killed_worker_is_named_with_its_signal_not_waited_for():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        spawn(_rank1_killed, 2, 600, timeout=900)
    assert "rank 1: the process ended (exit code -9) without a result" in str(e.value)
    # not a timing bound: waiting for rank 0 (600 s) would mean the death went unseen
    assert time.monotonic() - start < 600


def test_a_killed_worker_is_named_beside_the_collective_error_it_caused():
    with pytest.raises(RuntimeError) as e:
        spawn(_rank1_killed, 2, 0, timeout=300)
    assert "rank 1: killed by signal 9" in str(e.value) and "rank 0:" in str(e.value)


def test_a_raising_worker_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError) as e:
        spawn(_rank1_raises, 2, timeout=300)
    assert "rank 1:" in str(e.value) and "ValueError: bad input on rank 1" in str(e.value)
