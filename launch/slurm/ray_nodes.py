"""train.sbatch's helpers, run with the job's Python (Ray's own API and psutil, no hybridflow).

    python ray_nodes.py wait ADDRESS TIMEOUT NODE [NODE ...]
        Wait until every NODE (Slurm node names) has joined the Ray cluster at ADDRESS, asking
        Ray's node table; one line per change. Exit 1 after TIMEOUT seconds naming the missing.
    HF_RAY_TEMP_DIR=DIR python ray_nodes.py sweep
        Stop what is left on this node of the Ray whose files are under DIR: the processes whose
        command line names DIR (gcs_server, raylet, ...) and their descendants; SIGTERM, then
        SIGKILL after 5 s. Unlike `ray stop`, no other Ray on the node (another job's, another
        user's) is touched. DIR comes by the environment so that no command line holds it but
        Ray's own.
"""

from __future__ import annotations

import os
import sys
import time


def say(msg: str) -> None:
    print(f"[slurm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def short(name: str) -> str:
    return name.split(".")[0]


def wait(address: str, timeout: float, nodes: list[str]) -> int:
    import ray
    deadline = time.monotonic() + timeout
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - Ray raises several kinds; all end the job the same
        say(f"error: cannot join the Ray head at {address}: {type(e).__name__}: {e}")
        return 1
    wanted = {short(n) for n in nodes}
    shown = None
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        names = sorted({short(n.get("NodeManagerHostname", "?")) for n in alive})
        if len(alive) != shown:
            shown = len(alive)
            say(f"{len(alive)}/{len(nodes)} nodes joined: {', '.join(names)}")
        if len(alive) >= len(nodes):
            ray.shutdown()
            return 0
        if time.monotonic() > deadline:
            missing = sorted(wanted - set(names)) or ["?"]
            say(f"error: after {timeout:g} s only {len(alive)}/{len(nodes)} nodes have joined "
                f"the Ray cluster (missing: {', '.join(missing)}); see the `ray start` output "
                "of the missing nodes above, or raise RAY_JOIN_TIMEOUT")
            ray.shutdown()
            return 1
        time.sleep(1)


def _names(arg: str, temp_dir: str) -> bool:
    """Whether a command-line argument is ``temp_dir``, ``--opt=temp_dir`` or a path in it."""
    return arg == temp_dir or arg.endswith("=" + temp_dir) or temp_dir + "/" in arg


def sweep(temp_dir: str) -> int:
    import psutil
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid not in mine and any(_names(a, temp_dir) for a in proc.info["cmdline"]
                                            or ()):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    procs = [p for pid, p in found.items() if pid not in mine]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    if procs:
        say(f"{os.uname().nodename}: stopped {len(procs)} leftover Ray process(es) of {temp_dir}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["wait"] and len(argv) >= 4:
        return wait(argv[1], float(argv[2]), argv[3:])
    if argv == ["sweep"] and os.environ.get("HF_RAY_TEMP_DIR"):
        return sweep(os.environ["HF_RAY_TEMP_DIR"].rstrip("/"))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
