"""Measurement helpers: alternating A/B timing, peak tensor memory, peak matmul throughput, environment facts."""

import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfile

RESULTS_DIR = Path(__file__).parent / "results"


def write_results(results: dict, output: Path | None, name: str) -> None:
    """`results` as JSON at `output`, by default `benchmarks/results/<UTC date-time>-<name>.json`."""
    output = output or RESULTS_DIR / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {output}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ABTiming:
    """Seconds per call of two candidates timed in alternation; `ratio` is the median of the per-round speed ratios
    a/b (time_b / time_a), which cancels slow drifts of a shared machine better than a ratio of medians."""

    seconds_a: list[float]
    seconds_b: list[float]

    @property
    def median_a(self) -> float:
        return statistics.median(self.seconds_a)

    @property
    def median_b(self) -> float:
        return statistics.median(self.seconds_b)

    @property
    def ratio(self) -> float:
        return statistics.median(b / a for a, b in zip(self.seconds_a, self.seconds_b))


# Wall time is what a user waits for. Process CPU time (with one thread) ignores the time a busy shared machine keeps
# the process off the CPU, so it gives steadier ratios there; with several threads it also counts their spin-waits.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_alternating(
    run_a: Callable[[], object],
    run_b: Callable[[], object],
    repeats: int,
    device: torch.device,
    clock: str = "wall",
    warmup: int = 1,
) -> ABTiming:
    """Time `run_a` and `run_b` in alternating rounds (a then b, then b then a, ...) after `warmup` calls of each."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        run_a(), run_b()
    seconds: dict[str, list[float]] = {"a": [], "b": []}
    for round_idx in range(repeats):
        order = [("a", run_a), ("b", run_b)]
        for name, run in order if round_idx % 2 == 0 else reversed(order):
            synchronize(device)
            start = now()
            run()
            synchronize(device)
            seconds[name].append(now() - start)
    return ABTiming(seconds["a"], seconds["b"])


def time_round_robin(
    runs: dict[str, Callable[[], object]],
    repeats: int,
    clock: str = "wall",
    warmup: int = 1,
    device: torch.device = torch.device("cpu"),
) -> dict[str, list[float]]:
    """Seconds per call of several candidates, timed in rounds that call each once, the order rotating every round
    (so none is always first after the previous one warmed or cooled the caches), after `warmup` calls of each.
    On a GPU each timed call is bracketed by synchronizations, so it counts the kernels it queued."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        for run in runs.values():
            run()
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_idx in range(repeats):
        shift = round_idx % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = now()
            runs[name]()
            synchronize(device)
            seconds[name].append(now() - start)
    return seconds


def memory_bandwidth(clock: str = "wall", gib: int = 1, repeats: int = 4) -> float:
    """Bytes/s at which this process reads a `gib` GiB float32 tensor: the best of summing it and of multiplying one
    row by it seen as a row-major square matrix (the access of a one-row decoding step), best of `repeats`. What a
    decoding step can stream its weights at, on this machine and under its current load."""
    now = CLOCKS[clock]
    tensor = torch.ones(gib * 2**28)
    side = int(tensor.numel() ** 0.5)
    matrix, row = tensor[: side * side].view(side, side), torch.ones(1, side)
    seconds = []
    for read in (tensor.sum, lambda: row @ matrix):
        read()
        for _ in range(repeats):
            start = now()
            read()
            seconds.append(now() - start)
    return gib * 2**30 / min(seconds)


def peak_memory_bytes(run: Callable[[], object], persistent_bytes: int, device: torch.device) -> int:
    """Peak bytes of live tensors while `run()` executes, counting `persistent_bytes` that exist before it.

    CUDA: the caching allocator's high-water mark above what was allocated before the call (so other models and
    optimizers alive in the process are not counted), plus `persistent_bytes`. CPU has no allocator statistics, so
    the profiler's memory timeline (every tensor allocation and free, as seen by torch) is replayed and its running
    sum's maximum taken. Both count tensor storage only: not the Python heap, not allocator fragmentation or cached
    free blocks.
    """
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        synchronize(device)
        return persistent_bytes + torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sign = {Action.CREATE: 1, Action.DESTROY: -1}
    deltas = (sign.get(action, 0) * size for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline)
    return persistent_bytes + max(itertools.accumulate(deltas, initial=0))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def matmul_peak_flops(size: int, dtype: torch.dtype, device: torch.device, repeats: int, clock: str = "wall") -> float:
    """FLOP/s of one large square matmul (median of `repeats`, on the clock the models are timed with): the
    denominator of MFU on this machine."""
    now = CLOCKS[clock]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = now()
        a @ b
        synchronize(device)
        seconds.append(now() - start)
    return 2 * size**3 / statistics.median(seconds)


def environment(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = cpu_name()
        info["bf16_flags"] = bf16_flags()
    return info


def bf16_flags() -> list[str]:
    """The CPU's native bfloat16 instructions (`lscpu` flags): AMX tiles and/or AVX512-BF16 dot products."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
