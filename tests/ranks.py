"""Runs a script as the ranks of one torch.distributed job on this machine (gloo on CPU), as a launcher would."""

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

# Variables of an outer launcher (or of accelerate's config) that must not leak into the ranks started here.
INHERITED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC", "ACCELERATE_", "FSDP_")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    argv: list[str], log_dir: Path, timeout_s: float, num_processes: int = 2, env: dict[str, str] | None = None
) -> None:
    """`python *argv` as `num_processes` ranks (one thread each), with `env` added to the cleaned environment and
    the repository on PYTHONPATH. When a rank fails the others are ended at once (they would wait in a collective),
    and the caller's test fails with the ranks' output."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith(INHERITED)}
    environment = clean | (env or {}) | {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    environment |= {"MASTER_PORT": str(free_port()), "WORLD_SIZE": str(num_processes)}
    environment |= {"LOCAL_WORLD_SIZE": str(num_processes)}
    repository = str(Path(__file__).resolve().parents[1])
    environment |= {"PYTHONPATH": os.pathsep.join([repository, clean.get("PYTHONPATH", "")])}
    logs = [log_dir / f"rank{rank}.log" for rank in range(num_processes)]
    with ExitStack() as files:
        ranks = [
            subprocess.Popen(
                [sys.executable, *argv],
                env=environment | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=files.enter_context(log.open("w")),
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a hung rank and its children can be ended
            )
            for rank, log in enumerate(logs)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not all_done_or_one_failed(ranks):
                time.sleep(0.2)
        finally:
            for process in ranks:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    outputs = [
        f"rank {rank}, exit code {process.returncode}:\n{log.read_text()[-4000:]}"
        for rank, (process, log) in enumerate(zip(ranks, logs, strict=True))
    ]
    assert all(process.returncode == 0 for process in ranks), "\n".join(outputs)


def all_done_or_one_failed(processes: list[subprocess.Popen]) -> bool:
    codes = [process.poll() for process in processes]
    return all(code is not None for code in codes) or any(code not in (None, 0) for code in codes)
