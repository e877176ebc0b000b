"""The states ranks wrote at their probes' ``observe`` points (``FLODL_PROBE_DIR``: flodl/testing/probes.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from flodl.checkpoint import safetensors_io

_NAME = re.compile(r"(?P<point>.+)\.rank(?P<rank>\d+)\.(?P<k>\d+)\.safetensors")


def observed(folder: Path, point: str) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Rank -> the states it observed at ``point``, in order."""
    out: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    for path in folder.glob(f"{point}.rank*.safetensors"):
        match = _NAME.fullmatch(path.name)
        if match is None or match["point"] != point:
            continue
        out.setdefault(int(match["rank"]), []).append((int(match["k"]), safetensors_io.load(path)[0]))
    return {rank: [state for _, state in sorted(states, key=lambda s: s[0])] for rank, states in out.items()}


def train_state(state: dict[str, torch.Tensor]) -> dict:
    """The JSON kept beside an observed optimizer state (schedulers, the script's registered objects...)."""
    return json.loads(bytes(state["train_state"].numpy()).decode())


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit-identical: the same names, and each tensor of the same dtype, shape and bits."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), f"{name} differs"
