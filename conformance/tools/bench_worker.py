"""One timing job for ``decoder-conformance bench``, run in a fresh process.

Builds one backend's model for one size, runs forward + backward once to warm up, resets the
kernel's resident-memory high-water mark, then times ``repeats`` steps. Prints one JSON line:
the step times, and the peak resident memory the steps added over the built model. With
``--breakdown`` it then runs ``repeats`` more steps, instrumented, and adds how long each spent
in the matrix products of the linear layers and the head (for torch, ``aten::mm`` under
torch.profiler), so the time left is everything else: attention, norms, activations, the loss.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from spec.config import DecoderConfig
from spec.recipe import initial_parameters

__all__ = ["main"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _reference_step(config: DecoderConfig, tokens: Any, targets: Any) -> Any:
    from impl.model import DecoderModel

    model = DecoderModel.from_parameters(config, initial_parameters(config, 0))

    def step() -> None:
        model.zero_grad()
        model.loss(tokens, targets).backward(retain_graph=False)

    return step


def _torch_step(config: DecoderConfig, tokens: Any, targets: Any, threads: int) -> Any:
    import torch

    from conformance.adapters.torch_backend import TorchDecoder

    torch.set_num_threads(threads)
    module = TorchDecoder(config).double()
    with torch.no_grad():
        for parameter, (_, value) in zip(
            module.parameters(), initial_parameters(config, 0), strict=True
        ):
            parameter.copy_(torch.as_tensor(value))
    ids = torch.as_tensor(tokens)
    labels = torch.as_tensor(targets.reshape(-1))

    def step() -> None:
        module.zero_grad(set_to_none=True)
        _, logits = module(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocabulary_size), labels)
        torch.autograd.backward([loss])

    return step


def _reference_breakdown(step: Callable[[], None], repeats: int) -> tuple[float, float | None]:
    """Mean seconds per step, and of those in the weight-matrix products, as the reference's
    fast path times them (:func:`impl.kernels.timed_weight_products`); None where the
    products were too small to leave the plain rules, which are not timed."""
    from impl.kernels import timed_weight_products

    with timed_weight_products() as clock:
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        elapsed = time.perf_counter() - started
    return elapsed / repeats, clock.seconds / repeats if clock.calls else None


def _torch_breakdown(step: Callable[[], None], repeats: int) -> tuple[float, float | None]:
    """Mean seconds per step, and of those in ``aten::mm`` (every linear-layer and head product;
    attention's batched products are ``aten::bmm``, which the reference counts as the rest too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        elapsed = time.perf_counter() - started
    microseconds = sum(
        event.self_cpu_time_total for event in profiled.key_averages() if event.key == "aten::mm"
    )
    return elapsed / repeats, microseconds / 1e6 / repeats


def _matmul_rate(threads: int, size: int = 1024, repeats: int = 5) -> float:
    """This machine's float64 matrix-multiply rate (GFLOP/s) through numpy, median of runs."""
    rng = np.random.default_rng(0)
    a, b = rng.random((size, size)), rng.random((size, size))
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / float(np.median(times)) / 1e9


def main() -> None:
    """Parse the job, run it, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m conformance.tools.bench_worker")
    parser.add_argument("--backend", choices=("reference", "torch", "matmul"), required=True)
    parser.add_argument("--config", type=json.loads, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true")
    options = parser.parse_args()
    if options.backend == "matmul":
        print(json.dumps({"gflops": _matmul_rate(options.threads)}))
        return
    config = DecoderConfig(**options.config)
    rng = np.random.default_rng(1)
    shape = (options.batch, options.tokens)
    tokens = rng.integers(0, config.vocabulary_size, size=shape)
    targets = rng.integers(0, config.vocabulary_size, size=shape)
    if options.backend == "reference":
        step = _reference_step(config, tokens, targets)
    else:
        step = _torch_step(config, tokens, targets, options.threads)
    # The first step's growth over the built model is the working set of forward + backward;
    # the timed steps come after it (pages touched, lazy tables built).
    baseline = _status_kib("VmRSS")
    measured_peak = _reset_peak()
    step()
    peak = _status_kib("VmHWM") - baseline if measured_peak else None
    times = []
    for _ in range(options.repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    answer: dict[str, Any] = {"seconds": times, "peak_mib": None if peak is None else peak / 1024}
    if options.breakdown:
        measure = _reference_breakdown if options.backend == "reference" else _torch_breakdown
        answer["instrumented_seconds"], answer["product_seconds"] = measure(step, options.repeats)
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
