"""``host_memory.locked_buffer``'s bookkeeping, with CUDA's register calls recorded (the locking
itself runs on a GPU: tests/unit/test_host_optimizer.py there): each buffer is locked once at its
own size, and unlocked exactly once, by ``unlock`` or when its owner is collected."""

import gc

import torch

from hybridflow.training import host_memory


class FakeCudart:
    def __init__(self):
        self.calls = []

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes))
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


class Owner:
    pass


def test_each_buffer_is_unlocked_once(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    owner = Owner()
    a = host_memory.locked_buffer(1000, torch.bfloat16, owner, lock=True)
    b = host_memory.locked_buffer(10, torch.float32, owner, lock=True)
    unlocked = host_memory.locked_buffer(10, torch.float32, owner, lock=False)
    assert unlocked.shape == (10,) and a.dtype == torch.bfloat16
    assert cudart.calls == [("register", a.data_ptr(), 2000), ("register", b.data_ptr(), 40)]
    host_memory.unlock(a)
    host_memory.unlock(a)  # once only
    host_memory.unlock(unlocked)  # never locked: nothing
    assert cudart.calls[2:] == [("unregister", a.data_ptr())]
    del owner
    gc.collect()
    assert cudart.calls[3:] == [("unregister", b.data_ptr())]  # a is not unlocked twice
    assert host_memory._locked == {}
