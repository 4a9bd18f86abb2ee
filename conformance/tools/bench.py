"""``decoder-conformance bench``: forward + backward of the reference against PyTorch float64.

Every measurement runs in a fresh process (``conformance.tools.bench_worker``) with the same thread
count for the reference (its own threads and numpy's BLAS) and for torch; the two backends
alternate, and each figure is the median of all timed steps; ``by round`` is the range of the
per-round ratios (each round's reference against the torch run right after it), the spread
the machine's drift put into the ratio. The machine's own float64
matrix-multiply rate is measured in the same run, before every size and after the last, so
achieved GFLOP/s can be read against it: the best of those measurements is the rate (a single
one, taken while another process had the cores, once read 38 GFLOP/s on a machine that
reaches 94, and every share came out above 100%).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from typing import Any

from conformance.runner import thread_environment
from spec.config import FIXTURE, DecoderConfig
from spec.scale import SCALE_SHAPES

__all__ = [
    "SIZES",
    "BenchResult",
    "forward_backward_flops",
    "linear_product_flops",
    "render_bench",
    "round_ratios",
    "run_bench",
]

SIZES: dict[str, tuple[DecoderConfig, int, int]] = {
    "small": (FIXTURE.config, 1, 3),
    "medium": (DecoderConfig(4096, 256, 8, 688, 4, 128), 4, 128),
    "large": (DecoderConfig(32000, 512, 8, 1376, 8, 512), 2, 512),
    # The scale profile's SmolLM2-135M shape over one sequence of 1,024 tokens.
    "smollm2": (SCALE_SHAPES["smollm2-135m"].config, 1, 1024),
}
# Scaling studies on the medium model: sequence length at batch 1, depth at batch 4 x 128.
TOKEN_STEPS = (64, 128, 256, 512, 1024)
LAYER_STEPS = (1, 2, 4, 8, 16)


def linear_product_flops(config: DecoderConfig, batch: int, length: int) -> float:
    """FLOPs of one forward + backward pass in the products with a weight matrix: the seven
    projections of every block and the tied head (backward = 2 x forward)."""
    d, f, v = config.model_width, config.feed_forward_width, config.vocabulary_size
    rows = batch * length
    forward = config.layers * 2 * rows * (4 * d * d + 3 * d * f) + 2 * rows * d * v
    return 3.0 * forward


def forward_backward_flops(config: DecoderConfig, batch: int, length: int) -> float:
    """Matrix-product FLOPs of one forward + backward pass: the linear products and the
    attention scores and weighted sums (backward = 2 x forward)."""
    attention = config.layers * 2 * 2 * batch * length * length * config.model_width
    return linear_product_flops(config, batch, length) + 3.0 * attention


@dataclass
class Measurement:
    """One backend at one size: every timed step and the working set of a step."""

    seconds: list[float] = field(default_factory=list)
    peak_mib: float | None = None
    # With --breakdown: per round, an instrumented step's mean time and its share spent in
    # the linear-layer matrix products.
    instrumented_seconds: list[float] = field(default_factory=list)
    product_seconds: list[float] = field(default_factory=list)
    # Per round, the median of that round's timed steps: paired with the other backend's
    # round, run right after it, so the spread of their ratios shows the machine's drift.
    round_medians: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """The median step time."""
        return statistics.median(self.seconds) if self.seconds else float("nan")


@dataclass
class BenchResult:
    """Everything one bench run measured."""

    threads: int
    # The best of matmul_samples: the rate this machine reaches (a slower sample met another
    # process on the cores).
    matmul_gflops: float
    allocator: str
    matmul_samples: list[float] = field(default_factory=list)
    sizes: dict[str, dict[str, Measurement]] = field(default_factory=dict)
    tokens: dict[int, dict[str, Measurement]] = field(default_factory=dict)
    layers: dict[int, dict[str, Measurement]] = field(default_factory=dict)

    def as_json(self) -> str:
        """The result as JSON."""
        return json.dumps(asdict(self), indent=2) + "\n"


def _environment(threads: int, tuned_allocator: bool) -> dict[str, str]:
    environment = {**os.environ, **thread_environment(threads)}
    if tuned_allocator:
        # Keep freed memory for reuse instead of returning it to the kernel (glibc): fewer
        # page faults for numpy's many large temporaries. Applied to both backends alike.
        environment["MALLOC_MMAP_THRESHOLD_"] = str(2**30)
        environment["MALLOC_TRIM_THRESHOLD_"] = str(2**30)
    return environment


def _worker(arguments: list[str], environment: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "conformance.tools.bench_worker", *arguments]
    result = subprocess.run(
        command, capture_output=True, text=True, env=environment, check=False, timeout=3600
    )
    if result.returncode != 0:
        raise RuntimeError(f"bench worker failed: {' '.join(arguments)}\n{result.stderr[-2000:]}")
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def _measure(
    config: DecoderConfig,
    batch: int,
    length: int,
    backends: list[str],
    *,
    rounds: int,
    repeats: int,
    threads: int,
    environment: dict[str, str],
    breakdown: bool = False,
) -> dict[str, Measurement]:
    measured = {backend: Measurement() for backend in backends}
    for _ in range(rounds):
        for backend in backends:  # alternate, so drift in the machine's speed hits both
            job = [
                "--backend", backend, "--config", json.dumps(config.as_dict()),
                "--batch", str(batch), "--tokens", str(length),
                "--repeats", str(repeats), "--threads", str(threads),
            ]  # fmt: skip
            answer = _worker([*job, "--breakdown"] if breakdown else job, environment)
            measured[backend].seconds.extend(answer["seconds"])
            measured[backend].round_medians.append(statistics.median(answer["seconds"]))
            if breakdown:
                measured[backend].instrumented_seconds.append(answer["instrumented_seconds"])
                if answer["product_seconds"] is not None:  # None: products too small to time
                    measured[backend].product_seconds.append(answer["product_seconds"])
            peak = answer.get("peak_mib")
            if peak is not None:
                previous = measured[backend].peak_mib
                measured[backend].peak_mib = peak if previous is None else max(previous, peak)
    return measured


def run_bench(
    *,
    sizes: list[str],
    threads: int,
    rounds: int = 2,
    repeats: int = 3,
    scaling: bool = True,
    tuned_allocator: bool = False,
    breakdown: bool = False,
    progress: Any = None,
) -> BenchResult:
    """Measure the reference (and torch, when installed) at the given sizes and scalings;
    ``breakdown`` also splits each size's step into linear-layer products and the rest."""
    environment = _environment(threads, tuned_allocator)
    backends = ["reference", *(["torch"] if find_spec("torch") is not None else [])]
    result = BenchResult(threads, 0.0, "tuned" if tuned_allocator else "default")

    def sample_rate() -> None:
        answer = _worker(["--backend", "matmul", "--threads", str(threads)], environment)
        result.matmul_samples.append(answer["gflops"])
        result.matmul_gflops = max(result.matmul_samples)

    say = progress or (lambda text: None)
    sample_rate()
    for name in sizes:
        config, batch, length = SIZES[name]
        say(f"size {name} ...")
        result.sizes[name] = _measure(
            config,
            batch,
            length,
            backends,
            rounds=rounds,
            repeats=repeats,
            threads=threads,
            environment=environment,
            breakdown=breakdown,
        )
        sample_rate()
    if scaling:
        medium, batch, length = SIZES["medium"]
        for tokens in TOKEN_STEPS:
            say(f"tokens {tokens} ...")
            config = dataclasses.replace(medium, context=max(tokens, medium.context))
            result.tokens[tokens] = _measure(
                config,
                1,
                tokens,
                backends,
                rounds=1,
                repeats=repeats,
                threads=threads,
                environment=environment,
            )
        for layers in LAYER_STEPS:
            say(f"layers {layers} ...")
            config = dataclasses.replace(medium, layers=layers)
            result.layers[layers] = _measure(
                config,
                batch,
                length,
                backends,
                rounds=1,
                repeats=repeats,
                threads=threads,
                environment=environment,
            )
    return result


def _rate(flops: float, measured: Measurement | None, result: BenchResult) -> str:
    """Achieved GFLOP/s, and its share of the machine's matrix-multiply rate."""
    if measured is None:
        return "-"
    achieved = flops / measured.median / 1e9
    return f"{achieved:.1f} ({100 * achieved / result.matmul_gflops:.0f}%)"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def round_ratios(reference: Measurement, torch: Measurement | None) -> list[float]:
    """reference / torch for each round, each backend's median step in that round: pairs
    measured minutes apart, so their spread is the machine's drift during the run."""
    if torch is None:
        return []
    return [
        ref / other
        for ref, other in zip(reference.round_medians, torch.round_medians, strict=False)
        if other > 0
    ]


def _ratio_range(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def _breakdown_lines(result: BenchResult) -> list[str]:
    """Where each backend's step goes: linear-layer matrix products against everything else."""
    rows = [
        (name, backend, measured)
        for name, by_backend in result.sizes.items()
        for backend, measured in by_backend.items()
        if measured.product_seconds
    ]
    if not rows:
        return []
    lines = [
        "",
        "where a step goes (instrumented steps, after the timed ones): matrix products with a",
        "weight matrix (the projections and the tied head) against everything else",
        f"{'size':<7} {'backend':<9} {'step':>9} {'products':>9} {'GFLOP/s':>8} {'the rest':>9}",
    ]
    for name, backend, measured in rows:
        config, batch, length = SIZES[name]
        step = statistics.median(measured.instrumented_seconds)
        products = statistics.median(measured.product_seconds)
        rate = linear_product_flops(config, batch, length) / products / 1e9 if products else 0.0
        lines.append(
            f"{name:<7} {backend:<9} {step:>8.4f}s {products:>8.4f}s {rate:>8.1f} "
            f"{step - products:>8.4f}s"
        )
    return lines


def render_bench(result: BenchResult) -> str:
    """The size table and the two scaling tables."""
    samples = result.matmul_samples
    spread = (
        f" (the best of {len(samples)} measurements through the run; the lowest {min(samples):.1f})"
        if len(samples) > 1
        else ""
    )
    lines = [
        f"threads {result.threads} (the reference, numpy's BLAS and torch alike); "
        f"allocator {result.allocator}; "
        f"this machine's float64 matrix multiply: {result.matmul_gflops:.1f} GFLOP/s{spread}",
        f"{'size':<7} {'reference':>10} {'torch':>9} {'ref/torch':>9} {'by round':>11} "
        f"{'ref GFLOP/s':>14} {'torch GFLOP/s':>14} {'ref MiB':>8} {'torch MiB':>9} "
        f"{'mem ratio':>9}",
    ]
    for name, measured in result.sizes.items():
        config, batch, length = SIZES[name]
        flops = forward_backward_flops(config, batch, length)
        ref, torch = measured["reference"], measured.get("torch")
        torch_time = f"{torch.median:.4f}s" if torch else "-"
        ref_peak = "-" if ref.peak_mib is None else f"{ref.peak_mib:.0f}"
        torch_peak = "-" if torch is None or torch.peak_mib is None else f"{torch.peak_mib:.0f}"
        time_ratio = _ratio(ref.median, torch.median if torch else None)
        memory_ratio = _ratio(ref.peak_mib, torch.peak_mib if torch else None)
        by_round = _ratio_range(round_ratios(ref, torch))
        lines.append(
            f"{name:<7} {ref.median:>9.4f}s {torch_time:>9} {time_ratio:>9} {by_round:>11} "
            f"{_rate(flops, ref, result):>14} {_rate(flops, torch, result):>14} "
            f"{ref_peak:>8} {torch_peak:>9} {memory_ratio:>9}"
        )
    lines += _breakdown_lines(result)
    tables = (
        ("tokens (medium model, batch 1)", result.tokens),
        ("layers (medium model, 4 x 128)", result.layers),
    )
    for title, table in tables:
        if not table:
            continue
        lines += [
            "",
            f"how the cost grows with {title}:",
            f"{'':>7} {'reference':>10} {'growth':>7} {'torch':>9} {'ref/torch':>9}",
        ]
        previous = None
        for step, measured in table.items():
            ref, torch = measured["reference"], measured.get("torch")
            growth = "-" if previous is None else f"{ref.median / previous:.2f}x"
            previous = ref.median
            torch_time = f"{torch.median:.4f}s" if torch else "-"
            ratio = _ratio(ref.median, torch.median if torch else None)
            lines.append(f"{step:>7} {ref.median:>9.4f}s {growth:>7} {torch_time:>9} {ratio:>9}")
    return "\n".join(lines) + "\n"
