"""``Task.compile``: the model's forward through ``torch.compile``, set up where it stays valid.

The rank compiles once its parameters live in flodl's flat buckets (flat.py)
and, for the CPU backend, in its shared-memory lane: the compiled code, and
the CUDA graphs ``mode="reduce-overhead"`` captures, read the parameters'
memory as it is at that point. Every average writes its result into that same
memory in place, so an average costs no re-compilation and no re-recording.
Only a storage move re-records a graph: a background NCCL average dropped at
a failure (collective.py re-homes the live buckets), rare by design.

``nn.Module.compile`` compiles the module's call in place: the rank, the
saver and the user's ``eval_fn`` keep the same module, and its state dict its
keys (``torch.compile(model)`` would wrap it and prefix every key).

With CUDA graphs each step begins with ``cudagraph_mark_step_begin`` (the
runner does it): the outputs of the previous replay may then be overwritten,
which is safe because the loss flodl keeps is computed outside the compiled
forward (``loss_fn``, or the user's ``train_step``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..task import GRAPHED_MODES, compile_kwargs

log = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module, spec: bool | str | dict[str, Any], device: torch.device) -> bool:
    """Compile ``model``'s forward in place per ``spec`` (``Task.compile``); True when it replays CUDA graphs."""
    kwargs = compile_kwargs(spec)
    if kwargs is None:
        return False
    model.compile(**kwargs)
    options = kwargs.get("options") or {}
    graphed = device.type == "cuda" and (kwargs.get("mode") in GRAPHED_MODES or bool(options.get("triton.cudagraphs")))
    log.info("model compiled (%s)%s", ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "default", ", CUDA graphs" if graphed else "")
    return graphed
