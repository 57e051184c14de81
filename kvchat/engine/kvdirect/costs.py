"""What bringing one cold token back costs on this device: measured once, cached, used by auto.

``--checkpoint auto`` picks, per layer, the exact form that makes a step cheapest under a
ceiling. A cold token's K/V come back either by reading them (K/V form) or by reading its
residual and recomputing them (residual form), so the inputs are:

* read bandwidth from memory (a tensor copy) and from the data dir's disk (a file written
  there, read back warm from the page cache and cold after ``POSIX_FADV_DONTNEED``);
* recompute rows/s for the layer's shape (its k/v projection GEMM plus the norm), at one
  row per call (decoded tokens, replayed one by one) and at 256 rows per call (prefill).

Measured with random weights of the layer's shape (the shape, not the values, sets the
cost), once per device, dtype and shape, and cached as JSON under the user cache dir;
``kvchat inspect MODEL --costs`` shows them and the choice they lead to.

The cost model per cold token and step, with the cold rows on disk (the tier a ceiling
below the K/V sends them to):

    kv:        kv_bytes / disk_read
    residual:  residual_bytes / disk_read + 1 / recompute_rows_per_s

The residual form wins only where its bytes are so much smaller that the reading saved
pays for the recompute: on this project's CPUs it never did (``kvchat bench`` latency);
on a GPU behind slow storage it can.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvchat.engine.kvdirect.footprint import LayerFootprint, ModelFootprint

COSTS_VERSION = 1
PROBE_BYTES = 32 * 2**20


@dataclass
class DeviceCosts:
    device: str
    dtype: str
    memory_read_gbps: float
    disk_warm_read_gbps: float
    disk_cold_read_gbps: float
    # "hidden x kv_width" -> rows/s for {"1": one-row calls, "256": 256-row calls}
    recompute_rows_per_s: dict[str, dict[str, float]] = field(default_factory=dict)

    def step_cost(self, layer: LayerFootprint, form: str) -> float:
        """Seconds per cold token per step to bring ``layer``'s K/V back in ``form``."""
        disk = max(self.disk_warm_read_gbps, 1e-3) * 1e9
        if form == "kv":
            return layer.kv_bytes / disk
        rates = self.recompute_rows_per_s.get(shape_key(layer), {})
        # Cold tokens are mostly prefill rows in long conversations, decoded ones in chats:
        # weigh both call shapes alike.
        per_row = [1.0 / r for r in rates.values() if r > 0] or [0.0]
        return layer.residual_bytes / disk + sum(per_row) / len(per_row)

    def cheaper_form(self, layer: LayerFootprint) -> str:
        cheaper = self.step_cost(layer, "residual") < self.step_cost(layer, "kv")
        return "residual" if cheaper else "kv"


def shape_key(layer: LayerFootprint) -> str:
    return f"{layer.hidden_size}x{2 * layer.kv_heads * layer.head_dim}"


def _cache_file(device: str, dtype: str, data_dir: Path) -> Path:
    from kvchat.paths import cache_dir

    try:
        dev = os.stat(data_dir).st_dev
    except OSError:
        dev = 0
    return cache_dir() / "costs" / f"v{COSTS_VERSION}-{device}-{dtype}-dev{dev}.json"


def device_costs(
    fp: ModelFootprint, device: torch.device, dtype: str, data_dir: Path
) -> DeviceCosts:
    """The cached costs for this device, dtype and disk, measuring what is missing."""
    device_name = str(device)
    path = _cache_file(device_name, dtype, data_dir)
    costs = None
    try:
        costs = DeviceCosts(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        costs = None
    if costs is None:
        memory = _memory_read_gbps(device)
        warm, cold = _disk_read_gbps(data_dir)
        costs = DeviceCosts(device_name, dtype, memory, warm, cold)
    missing = {shape_key(x): x for x in fp.layers if shape_key(x) not in costs.recompute_rows_per_s}
    for key, layer in missing.items():
        costs.recompute_rows_per_s[key] = _recompute_rates(layer, device, dtype)
    if missing or not path.exists():
        _save(path, costs)
    return costs


def _save(path: Path, costs: DeviceCosts) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(costs), indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir costs a re-measure next time, nothing else


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def _memory_read_gbps(device: torch.device) -> float:
    import torch

    src = torch.empty(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        _sync(device)

    return PROBE_BYTES / _best(copy) / 1e9


def _disk_read_gbps(data_dir: Path) -> tuple[float, float]:
    """Warm (page cache) and cold read bandwidth of a file in ``data_dir``."""
    try:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".kvchat-probe-", dir=data_dir)
    except OSError:
        return 1.0, 0.1  # cannot write there: a cautious guess
    try:
        block = os.urandom(2**20)
        for _ in range(PROBE_BYTES // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        buffer = bytearray(PROBE_BYTES)
        view = memoryview(buffer)

        def read() -> None:
            done = 0
            while done < PROBE_BYTES:
                done += os.preadv(fd, [view[done:]], done)

        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        read()
        cold = PROBE_BYTES / (time.perf_counter() - t0) / 1e9
        warm = PROBE_BYTES / _best(read, 3) / 1e9
        return warm, cold
    finally:
        os.close(fd)
        os.unlink(name)


def _recompute_rates(layer: LayerFootprint, device: torch.device, dtype: str) -> dict[str, float]:
    """Rows/s of norm + k/v projection at the layer's shape, for 1-row and 256-row calls."""
    import torch
    import torch.nn.functional as F

    torch_dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
    width = 2 * layer.kv_heads * layer.head_dim
    weight = torch.randn(width, layer.hidden_size, dtype=torch_dtype, device=device)
    norm = torch.ones(layer.hidden_size, dtype=torch_dtype, device=device)
    rates = {}
    for rows in (1, 256):
        x = torch.randn(1, rows, layer.hidden_size, dtype=torch_dtype, device=device)

        calls = 8 if rows == 1 else 1

        def step(x: torch.Tensor = x, calls: int = calls) -> None:
            with torch.no_grad():
                for _ in range(calls):
                    F.linear(F.rms_norm(x, (layer.hidden_size,), norm), weight)
            _sync(device)

        per_call = _best(step) / calls
        rates[str(rows)] = rows / per_call
    return rates
