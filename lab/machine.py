"""A run on its machine: torchrun's processes and their devices, what they exchange in a step,
torch's CPU threads (the cores other programs leave free, chosen again after every step), the
peak memory, and the signals that ask a run to stop after a step all processes agree on.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 train.py --out runs/two
    kill -TERM PID      # the run stops after its current step, its checkpoint kept (docs/runs.md)

Exercised by: pytest tests/test_train.py, tests/test_distributed.py, tests/test_bench.py
"""
import ctypes
import os
import re
import resource
import signal
import sys
from collections import defaultdict
from itertools import chain
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm


# ----------------------------------------------------------------------------
# Several processes (docs/torchrun.md), data parallel over problems; alone, each returns its input


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share_of(items: list) -> list:
    """This process's part of a list that every process holds: every world-th item."""
    rank, world = rank_and_world()
    return items[rank::world]


def block(n: int) -> range:
    """This process's contiguous block of n items (the first n % world processes get one more)."""
    rank, world = rank_and_world()
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


def gather_lists(items: list) -> list:
    """Every process's list of picklable items, concatenated in rank order."""
    world = rank_and_world()[1]
    if world == 1:
        return items
    parts = [None] * world
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()


def sum_across(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the processes, in place; returns it."""
    if rank_and_world()[1] > 1:
        on = t if t.is_cuda or dist.get_backend() != "nccl" else t.cuda()  # nccl reduces on the GPU
        dist.all_reduce(on)
        if on is not t:
            t.copy_(on)
    return t


def sum_gradients(params: list[torch.Tensor]) -> None:
    """Add up the processes' gradients: each backward used the whole mini-batch's denominators,
    so the sum is the mini-batch's gradient, as one process would have computed it."""
    if rank_and_world()[1] == 1:
        return
    flat = sum_across(torch.cat([p.grad.reshape(-1) for p in params]))  # one message, not many
    for p, summed in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(summed.view_as(p))


# ----------------------------------------------------------------------------
# Joining the processes; threads, memory


def check_device(device: str) -> bool:
    """Whether --device is a GPU; a one-line error where it is unknown or not here."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise SystemExit(f"--device {device}: not a device of this project; "
                         "use auto, cpu, cuda or cuda:N")
    cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no GPU is visible")
        raise SystemExit(f"--device {device}: {why}; use --device cpu (or auto)")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise SystemExit(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s), "
                         "from cuda:0")
    return cuda


def alone() -> bool:
    """Whether this process runs by itself, not under torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) == 1


def join_processes(device: str) -> str:
    """This process's device; under torchrun also join the process group: nccl and one GPU per
    local rank on CUDA, gloo on CPU."""
    cuda = check_device(device)
    if alone():
        return ("cuda" if cuda else "cpu") if device == "auto" else device
    if cuda:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device if cuda else "cpu"


def log(line: str) -> None:
    """One line of the run's log (rank 0), above the progress bar on a terminal."""
    if rank_and_world()[0] == 0:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()  # a redirected log shows each line as it happens


def run_main(main: Callable[[], object]) -> None:
    """Run `main`; under torchrun then leave without the interpreter's shutdown, which gloo's
    threads could abort (SIGABRT) on CPU."""
    if alone():
        main()
        return
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else print(stop.code, file=sys.stderr) or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def gather_episodes(calls: list, outcomes, rewards: list[float], problem_of: list[int]):
    """Every process's episodes in rank order, numbered across the processes."""
    offset = sum(gather_lists([len(problem_of)])[: rank_and_world()[0]])
    for c in calls:
        c.episode += offset
    return (gather_lists(calls), gather_lists(outcomes), gather_lists(rewards),
            gather_lists(problem_of))


def gather_stats(stats: dict[str, list[float]]) -> dict[str, list[float]]:
    """The update statistics of every process, each key's lists joined."""
    joined = defaultdict(list)
    for k, v in chain.from_iterable(part.items() for part in gather_lists([dict(stats)])):
        joined[k] += v
    return joined


# The processes as train.py hands them to the algorithm's passes (as rollout.ONE_PROCESS)
PROCESSES = SimpleNamespace(share=share_of, sum=sum_across, sum_grads=sum_gradients,
                            gather=gather_lists, block=block, episodes=gather_episodes,
                            stats=gather_stats)


def running_threads() -> int:
    """Threads running or runnable on the machine right now, this one included."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 1 << 30  # unknown: the load average alone decides


def pick_threads(requested: int, own_load: float) -> int:
    """Torch's CPU threads: --threads, else the cores less those other processes keep busy (the
    load average less this process's own, or the threads running now when fewer: the average
    trails a program that just stopped). One matmul thread whose core is taken stalls them all."""
    if requested:
        return requested
    cores = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    others = max(0.0, min(os.getloadavg()[0] - own_load, running_threads() - 1))
    return max(1, min(cores, round(cores - others)))


def peak_memory_mb(device: str) -> float:
    """Peak memory so far: the allocator's on CUDA, else the process's RSS, as VmHWM (ru_maxrss
    would carry over the parent's peak to a child, as lab/bench.py starts them)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024  # KiB
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def eval_batch(free_bytes: int, kv_bytes: int, episode_tokens: int, least: int,
               episodes: int) -> int:
    """Episodes rolled out at once: as many as their keys and values fit in half the free memory
    (the rest: activations and logits), at least `least`, at most `episodes`."""
    return min(episodes, max(least, free_bytes // 2 // (kv_bytes * episode_tokens)))


def fitting_batch(model, episode_tokens: int, least: int, episodes: int) -> int:
    """eval_batch on the model's GPU: its bytes of keys and values a token, the memory free to
    torch (its own cache included), at most `episode_tokens` an episode."""
    c, device = model.config, model.device
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = 2 * c.num_hidden_layers * heads * head_dim * model.dtype.itemsize  # keys, values
    free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    return eval_batch(free, kv_bytes, episode_tokens, least, episodes)


def gpu_rngs(device: torch.device) -> list:
    """The devices whose random state torch.random.fork_rng sets aside besides the CPU's."""
    return [device] if device.type == "cuda" else []


LIBC = ctypes.CDLL(None)  # this process's C library: malloc_trim where it is glibc


def release_free_memory() -> None:
    """Give freed memory back to the system: glibc keeps the backward's activations in its heap,
    where the rollout's tensors of other sizes do not fit."""
    if hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


# ----------------------------------------------------------------------------
# Signals: Ctrl-C (SIGINT) and SIGTERM stop the run at the end of a step

requested: list[int] = []  # the stop signal received, once one is


def catch_stop_signals() -> None:
    """From now on SIGINT and SIGTERM ask the run to stop after its current step."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ask_to_stop)


def ask_to_stop(signum: int, frame: object = None) -> None:
    """The first signal is noted; a second stops the process at once, except under torchrun,
    which passes on a signal they may have had already, and kills them 30 s later."""
    if requested:
        if not alone():
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    requested.append(signum)
    if rank_and_world()[0] == 0:  # unbuffered: the signal may have come in the middle of a print
        again = "; again to stop at once" if alone() else ""
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step{again}\n".encode())


def stop_requested() -> int:
    """The signal that stops the run at this step's end (0: none), agreed by every process."""
    return max(gather_lists([requested[0] if requested else 0]))
