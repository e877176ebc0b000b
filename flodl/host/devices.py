"""Which devices a worker runs ranks on.

GPUs are counted through NVML (``pynvml``, from the nvidia-ml-py package)
without initialising CUDA in the worker, honouring ``CUDA_VISIBLE_DEVICES``;
a host without GPUs (or without NVML) runs CPU ranks. ``--devices`` overrides
discovery with an explicit list such as ``cuda:0,cuda:1``.
"""

from __future__ import annotations

import re

from ..config.env import cuda_visible_devices
from ..errors import ConfigError

_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def count_gpus() -> int:
    """Visible NVIDIA GPUs (0 where NVML is missing or finds none)."""
    visible = cuda_visible_devices()
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            total = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no GPU: all mean "none here"
        return 0
    if visible is not None:
        return min(total, len([v for v in visible.split(",") if v.strip()]))
    return total


def parse_devices(text: str) -> list[str]:
    """``cuda:0,cpu,cpu`` → ``['cuda:0', 'cpu', 'cpu']``.

    Raises:
        ConfigError: an entry is not ``cpu`` or ``cuda:N``, or a GPU repeats
            (NCCL refuses two ranks on one GPU).
    """
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise ConfigError("devices", "is empty")
    for d in devices:
        if not _DEVICE.match(d):
            raise ConfigError("devices", f"{d!r} is not 'cpu' or 'cuda:N'")
    gpus = [d for d in devices if d != "cpu"]
    if len(gpus) != len(set(gpus)):
        raise ConfigError("devices", "a GPU appears twice; one rank per GPU")
    return devices


def choose_devices(nproc: int | None, devices: str | None, gpus: int | None = None) -> list[str]:
    """The device of each rank this worker will spawn.

    Raises:
        ConfigError: ``nproc`` asks for more GPUs than the host has, or both
            ``nproc`` and ``devices`` are given and disagree.
    """
    if devices:
        chosen = parse_devices(devices)
        if nproc is not None and nproc != len(chosen):
            raise ConfigError("nproc", f"{nproc} disagrees with --devices ({len(chosen)} devices)")
        return chosen
    if nproc is not None and nproc < 1:
        raise ConfigError("nproc", f"must be >= 1, got {nproc}")
    gpus = count_gpus() if gpus is None else gpus
    if gpus == 0:
        return ["cpu"] * (nproc or 1)
    if nproc is not None and nproc > gpus:
        raise ConfigError("nproc", f"asks for {nproc} ranks but this host has {gpus} GPU(s); NCCL runs one rank per GPU")
    return [f"cuda:{i}" for i in range(nproc or gpus)]
