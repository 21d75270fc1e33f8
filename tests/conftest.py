"""Shared fixtures. The project is flat files at the repository root, not a package."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
# The test model is 64 wide: a second thread gains nothing, and on a busy 2-core
# machine waiting for it can turn milliseconds into seconds.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # and train.py's automatic choice stays at one too

from model import tiny_model  # noqa: E402


def make_read_only(path: str, monkeypatch) -> None:
    """Take write permission from `path` and everything in it. Root may write anyway, so under root
    os.access (what the checks ask) answers as it would for a user: from the owner's mode bits."""
    for root, _, files in os.walk(path):
        for p in [root] + [os.path.join(root, name) for name in files]:
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and (
            not mode & os.W_OK or bool(os.stat(p).st_mode & 0o200)))


def directory_state(path: str) -> dict[str, bytes]:
    """Every file under `path`, by its path relative to it, with its bytes."""
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return found


@pytest.fixture
def tiny():
    """(model, tokenizer) of the random 2-layer test model, in eval mode."""
    torch.manual_seed(0)
    model, tok = tiny_model()
    tok.padding_side = "left"
    return model.eval(), tok


def update_config(**changes):
    """train.py's Config as the unit tests of an update read it: one optimizer step per
    --minibatch_size calls, each call a group of its own, sampled at temperature 1."""
    import train
    return train.Config(**{"temperature": 1.0, "one_step": False, "group_size": 1, **changes})


def critic_config(**changes):
    """train.py's Config as the unit tests of the critics read it: --algo maac, a call cut by the
    length limit scored like any other."""
    import train
    return train.Config(**{"algo": "maac", "truncated": "keep", **changes})


def train_state(model, optimizers: dict, heads=None, seed: int = 0):
    """The training state an update reads (lab/checkpoint.py's TrainState): `optimizers` by
    adapter or critic name, no schedule, a fresh random state and empty gradient EMAs."""
    import random

    from lab.checkpoint import TrainState
    return TrainState(model, heads or {}, optimizers, {}, random.Random(seed),
                      {name: {} for name in optimizers})
