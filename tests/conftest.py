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

from rollout import tiny_model  # noqa: E402


@pytest.fixture
def tiny():
    """(model, tokenizer) of the random 2-layer test model, in eval mode."""
    torch.manual_seed(0)
    model, tok = tiny_model()
    tok.padding_side = "left"
    return model.eval(), tok
