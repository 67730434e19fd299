import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)



@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size, read_only=False, full=False)``: a folder on a tmpfs of ``size`` ("1m"),
    so that a write past it fails with the kernel's own ENOSPC (EROFS where read-only); ``full``
    fills it with a hidden file first. Unmounted after the test; the test is skipped where
    mounting is not allowed (not root)."""
    import contextlib
    import subprocess
    mounted = []

    def make(size: str, read_only: bool = False, full: bool = False):
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
        mounted.append(path)
        if full:
            with contextlib.suppress(OSError), open(path / ".filler", "wb", buffering=0) as f:
                while True:
                    f.write(bytes(4096))
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
