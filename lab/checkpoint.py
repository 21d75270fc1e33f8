"""A run's training state, one object (`TrainState`: everything training changes besides the
frozen base model), and its checkpoints, so that a resumed run goes on exactly where it stopped.
`save` writes out/ckpt, or with best.json out/best (`keep_best`); `load` reads out/ckpt back;
`load_start` takes another run's adapters, critics and random states (--start_from).

A checkpoint is a directory written as .tmp, flushed and swapped in whole: a kill or a power loss
leaves the old or the new one (`whole_checkpoint` finds which reads back). Each records the run's
id: --resume refuses another run's. Under torchrun every process calls `save`; rank 0 writes.

    python train.py --out runs/a           # runs/a/ckpt every --save_every steps, runs/a/best
    python train.py --out runs/a --resume  # TrainState.load: on from runs/a/ckpt

Exercised by: pytest tests/test_train.py, tests/test_refusals.py, tests/test_distributed.py
"""
import glob
import io
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save

from lab.machine import barrier, gather_lists, rank_and_world
from lab.files import RUN_ID, fsync, read_jsonl, write_files
from lora import adapter_files, adapter_names, load_adapter_state, load_adapters

BEST_METRIC = "val/accuracy"  # never test: a peak chosen on test would flatter its test score
STATE_KEYS = ("step", "optimizers", "schedulers", "torch_rngs", "cuda_rngs", "py_rng", "emas")


@dataclass
class TrainState:
    """What a checkpoint holds; the base model's own weights are frozen and not saved."""
    model: torch.nn.Module  # the LoRA adapters RL trains, critics' and KL anchors' included
    heads: dict  # critic name -> its value head (maac)
    optimizers: dict  # adapter or critic name -> its AdamW
    schedulers: dict  # the same names -> its learning-rate schedule
    rng: random.Random  # problems and mini-batches (torch's generator is the global one)
    emas: dict  # adapter name -> the EMA of its gradient (--damping)
    run_id: str = ""  # the run's, as its config.json holds it: a resume refuses another run's

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def save(self, out: str, step: int, best: dict | None = None) -> None:
        """Write out/ckpt, or with `best` (best.json's content) out/best."""
        torch_rngs = gather_lists([torch.get_rng_state()])
        device = self.device()
        cuda_rngs = (gather_lists([torch.cuda.get_rng_state(device)]) if device.type == "cuda"
                     else None)
        if rank_and_world()[0] != 0:
            return
        final = os.path.join(out, "best" if best else "ckpt")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        state = io.BytesIO()
        torch.save({"step": step, RUN_ID: self.run_id,
                    "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
                    "schedulers": {k: s.state_dict() for k, s in self.schedulers.items()},
                    "torch_rngs": torch_rngs,  # one per process
                    "cuda_rngs": cuda_rngs,  # of each process's own GPU
                    "py_rng": self.rng.getstate(),
                    "emas": self.emas}, state)
        files = adapter_files(self.model)  # a PEFT LoRA directory per adapter, critics' included
        files |= {os.path.join(name, "value_head.safetensors"): save(head.state_dict())
                  for name, head in self.heads.items()}
        files |= {"best.json": json.dumps(best, indent=2).encode()} if best else {}
        # written here, not by torch.save or safetensors, whose errors do not say a disk is full
        write_files(tmp, files | {"state.part": state.getvalue()})
        os.replace(os.path.join(tmp, "state.part"), os.path.join(tmp, "state.pt"))  # tmp is whole
        fsync(tmp)
        shutil.rmtree(final + ".old", ignore_errors=True)  # left by a crash after a swap
        if os.path.exists(final):
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        fsync(out)  # the swap on disk before the old checkpoint goes
        shutil.rmtree(final + ".old", ignore_errors=True)

    def keep_best(self, out: str, row: dict) -> None:
        """out/best when the evaluation `row`'s BEST_METRIC beats the best so far (of equal scores
        the earliest stays): Paper A's cliffs come late, and the peak outlives out/ckpt."""
        if BEST_METRIC not in row:
            return
        best = read_best(os.path.join(out, "best"))
        better = best is None or row[BEST_METRIC] > best["score"]
        if gather_lists([better])[0]:  # rank 0's answer, which reads the run; every process saves
            evaluation = {k: v for k, v in row.items() if k.startswith(("eval/", "val/"))}
            self.save(out, row["step"], best={"step": row["step"], "metric": BEST_METRIC,
                                              "score": row[BEST_METRIC], "evaluation": evaluation})

    def load(self, out: str) -> int:
        """Load out/ckpt, the newest checkpoint that reads back whole put in its place first;
        returns its step."""
        path = os.path.join(out, "ckpt")
        rank0 = rank_and_world()[0] == 0  # only rank 0 puts a checkpoint back in place
        if rank0 and not whole_checkpoint(path) and not os.path.exists(f"{path}/state.pt"):
            raise SystemExit(f"--resume: no checkpoint in {out} reads back whole (a save was torn "
                             "or damaged); start the run over with --overwrite")
        barrier()
        try:
            load_adapters(self.model, path, adapter_names(self.model))  # the KL anchors too
            state = load_state(path)
            if not is_state(state):
                raise ValueError("not a checkpoint's state.pt")
            refuse_foreign(state, self.run_id, path, "resume that run in its own directory, "
                           "or start this one over with --overwrite")
            for k, h in self.heads.items():
                h.load_state_dict(load_file(os.path.join(path, k, "value_head.safetensors")))
            for k, optimizer in self.optimizers.items():
                scheduler = self.schedulers[k]
                lrs = [group["initial_lr"] for group in optimizer.param_groups]  # this --lr
                optimizer.load_state_dict(state["optimizers"][k])
                scheduler.load_state_dict(state["schedulers"][k])
                if lrs != scheduler.base_lrs:  # --resume --lr: the schedule scaled to the new peak
                    scheduler.base_lrs = lrs
                    for group, lr, factor in zip(optimizer.param_groups, lrs,
                                                 scheduler.lr_lambdas):
                        group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)
            set_rngs(state, self.rng, f"--resume: {out}", self.device())
            self.emas.update({name: {k: t.to(self.device()) for k, t in ema.items()}
                              for name, ema in state["emas"].items()})
        except Exception as e:  # a truncated, foreign or wrong-shaped file: say so in one line
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            if isinstance(e, pickle.UnpicklingError):  # weights_only refused what could run code
                first = "it holds objects besides tensors and plain data, which are not loaded"
            raise SystemExit(f"--resume: the checkpoint in {path} cannot be read "
                             f"({type(e).__name__}: {first}); start the run over with "
                             "--overwrite") from None
        return state["step"]

    def load_start(self, where: str, sharing: str, saved: dict) -> dict:
        """--start_from: the start's adapters (a shared one copied into each role's), critics and
        random states; `saved`: its config. Returns its step-0 row."""
        run, path = start_checkpoint(where)
        state = load_state(path)
        fresh = {n for n in self.heads if not os.path.isdir(os.path.join(path, n))}  # start lacks
        for name in (n for n in adapter_names(self.model) if n not in fresh):
            source = name if saved["sharing"] == sharing or name in self.heads else "shared"
            load_adapter_state(self.model, name,
                               load_file(os.path.join(path, source, "adapter_model.safetensors")))
        for name, head in ((n, h) for n, h in self.heads.items() if n not in fresh):
            head.load_state_dict(load_file(os.path.join(path, name, "value_head.safetensors")))
        set_rngs(state, self.rng, f"--start_from {where}", self.device())
        best = read_best(path)
        return ({"step": 0, **best["evaluation"]} if best
                else read_jsonl(os.path.join(run, "metrics.jsonl"))[0])


def load_state(ckpt: str) -> dict:
    """A checkpoint's state.pt on the CPU (an optimizer moves its state to its parameters' device).
    Tensors and plain data only: a pickled object in a run someone hands over runs no code."""
    return torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=True)


def is_state(state) -> bool:
    """Whether a loaded state.pt holds what `TrainState.save` writes."""
    return isinstance(state, dict) and set(STATE_KEYS) <= state.keys() \
        and type(state["step"]) is int


def set_rngs(state: dict, rng: random.Random, source: str, device: torch.device) -> None:
    """This process's random states from a state.pt saved by as many processes."""
    rank, world = rank_and_world()
    torch_rngs = state["torch_rngs"]
    if len(torch_rngs) != world:
        raise SystemExit(f"{source} was saved by {len(torch_rngs)} process(es); run it with as "
                         f"many (torchrun --nproc_per_node {len(torch_rngs)}), not {world}")
    torch.set_rng_state(torch_rngs[rank])
    if state["cuda_rngs"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rngs"][rank], device)
    rng.setstate(state["py_rng"])


def read_best(ckpt: str) -> dict | None:
    """The best.json of checkpoint `ckpt`; None where there is none or it is not keep_best's."""
    try:
        with open(os.path.join(ckpt, "best.json")) as f:
            best = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    whole = (isinstance(best, dict) and type(best.get("step")) is int
             and best.get("metric") == BEST_METRIC and type(best.get("score")) in (int, float)
             and isinstance(best.get("evaluation"), dict)
             and isinstance(best["evaluation"].get("eval/accuracy"), (int, float)))
    return best if whole else None


def start_checkpoint(where: str) -> tuple[str, str]:
    """--start_from's run directory and checkpoint: RUN and RUN/ckpt, or for RUN/best the same."""
    if os.path.exists(os.path.join(where, "best.json")):
        return os.path.dirname(os.path.normpath(where)), where
    return where, os.path.join(where, "ckpt")


def has_checkpoint(out: str) -> bool:
    """Whether a run saved a checkpoint: out/ckpt, or the .tmp or .old a killed save leaves."""
    return any(os.path.exists(os.path.join(out, f"ckpt{end}", "state.pt"))
               for end in ("", ".tmp", ".old"))


def refuse_foreign(state: dict, run_id: str, path: str, then: str) -> None:
    """Stop a resume whose `state` is another run's (one saved before runs had an id is taken)."""
    owner = state.get(RUN_ID, run_id)
    if owner != run_id:
        raise SystemExit(f"--resume: the checkpoint in {path} is another run's (run id {owner}, "
                         f"not this run's {run_id}); {then}")


def unreadable(path: str) -> str:
    """Why checkpoint directory `path` does not read back whole, naming the file; "" if it does."""
    if not os.path.isdir(path):
        return f"{path} is not a checkpoint's directory"
    if os.path.lexists(os.path.join(path, "best.json")) and read_best(path) is None:
        return f"{path}/best.json cannot be read or is not what keep_best writes"
    file = os.path.join(path, "state.pt")
    try:  # the files a load reads: one torn by a crash or a power loss replaces nothing
        load_state(path)
        for file in glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True):
            load_file(file)
    except Exception as e:  # missing, truncated or foreign
        return f"{file} cannot be read ({type(e).__name__})"
    return ""


def whole_checkpoint(final: str) -> bool:
    """Put the newest checkpoint that reads back whole in place as `final`; False if none does."""
    # .tmp: a save that crashed in its swap
    path = next((p for p in (final + ".tmp", final, final + ".old") if not unreadable(p)), None)
    if path is None:
        return False
    if path != final:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(path, final)
    for other in (final + ".tmp", final + ".old"):  # torn or older: never read
        shutil.rmtree(other, ignore_errors=True)
    return True


def restore_best(out: str, run_id: str) -> None:
    """--resume: out/best put back whole. One that does not read back, or another run's, stops
    the resume before a log is cut, and is kept: it may be all that is left of the run's peak."""
    final = os.path.join(out, "best")
    if not any(os.path.lexists(final + end) for end in ("", ".tmp", ".old")):
        return
    aside = (f"it is kept as it is: repair it, or move {final} aside (the next evaluation keeps "
             "a new best) and resume again")
    if not whole_checkpoint(final):
        why = unreadable(final) if os.path.lexists(final) else f"{final}.tmp or .old is torn"
        raise SystemExit(f"--resume: the best checkpoint cannot be read ({why}); {aside}")
    refuse_foreign(load_state(final), run_id, final, aside)
