"""The reference's formulas in a narrower precision: every operation's result rounded.

:class:`EmulatedModel` computes what :class:`impl.model.DecoderModel` computes, but as a
careful port in float32, bfloat16 or float16 would: the parameters are held rounded to the
format; each operation (a matrix product, an RMSNorm, a rotation, a softmax, SwiGLU, the
loss) works internally in float32 (the accumulator every such port uses) from rounded inputs,
and its result is rounded to the format before the next operation sees it. The gradients
go through the same operations backwards, each rounded likewise. RMSNorm rounds twice
(normalized, then times the gain), as transformers' LlamaRMSNorm does, after a mean square
kept in the working precision, as it does too; the loss is rounded to the format.

It is the instrument the tolerances are derived with (:mod:`conformance.tools.tolerance_survey`):
its departure from the float64 reference, over thousands of generated configurations, is
what a correct implementation at that precision may show. It rounds at least as often as
the real ports measured (torch, transformers), so it errs towards the larger error.
Validation and refusals are the reference's own: the float64 model is built first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from impl import resources
from impl.errors import BlockFailure, FinalNormFailure, RmsZeroMeanSquare
from impl.model import DecoderModel, _ran_out, _require_working_memory
from impl.tape import Array, Tensor, unbroadcast
from spec.formats import NumberFormat, Precision, number_format

__all__ = ["Arithmetic", "EmulatedModel", "EmulatedResult", "RecursiveSumsModel"]

IndexArray = npt.NDArray[np.intp]


class Arithmetic:
    """Rounding to the format, and the float32 (float64 for float64) working precision."""

    def __init__(self, form: NumberFormat) -> None:
        self.form = form
        self.work = np.float64 if form.precision is Precision.FLOAT64 else np.float32

    def q(self, values: npt.ArrayLike) -> Array:
        """A result rounded to the format (through the working precision)."""
        return self.form.round(np.asarray(values, dtype=self.work))

    def w(self, values: Array) -> npt.NDArray[Any]:
        """An operand in the working precision."""
        return values.astype(self.work)

    def product(self, a: Array, b: Array) -> Array:
        """``a @ b`` accumulated in the working precision, rounded once."""
        return self.q(self.w(a) @ self.w(b))


class EmulatedResult:
    """The stages and logits of one emulated forward pass (tape tensors)."""

    def __init__(self, stages: list[tuple[str, Tensor]], logits: Tensor) -> None:
        self.stages = stages
        self.logits = logits


class EmulatedModel:
    """A decoder over ``reference``'s parameters, computed in ``precision``."""

    # What a variant (a mutant) may replace: the arithmetic, two roundings, the keys hidden.
    arithmetic_class: type[Arithmetic] = Arithmetic

    def _round_scores(self, values: npt.ArrayLike) -> Array:
        """How attention scores, their exponentials and weights are rounded."""
        return self.arithmetic.q(values)

    def _round_normalized(self, values: Array) -> Array:
        """How RMSNorm's normalized rows are held before the gain multiplies them."""
        return values

    def _row_sum(self, values: Array) -> npt.NDArray[Any]:
        """Each row's sum (the last axis, kept) in the working precision, unrounded: numpy's
        pairwise summation, as a vectorised or tree-reducing port adds."""
        result: npt.NDArray[Any] = self.arithmetic.w(values).sum(axis=-1, keepdims=True)
        return result

    def _hidden_keys(self, tokens: int) -> npt.NDArray[np.bool_]:
        """``[T, T]``: True where a query may not see a key (the keys after it)."""
        return np.triu(np.ones((tokens, tokens), dtype=bool), k=1)

    def __init__(self, reference: DecoderModel, precision: Precision | str) -> None:
        self.reference = reference
        self.config = reference.config
        self.arithmetic = self.arithmetic_class(number_format(precision))
        self.leaves = {
            p.name: Tensor(self.arithmetic.q(p.tensor.value), requires_grad=True)
            for p in reference.parameters()
        }

    # ------------------------------------------------------------------ operations
    def _matmul(self, a: Tensor, b: Tensor) -> Tensor:
        ar = self.arithmetic
        if b.value.ndim == 2:
            inner, outer = b.shape
            rows = a.value.reshape(-1, inner)

            def vjp(g: Array) -> tuple[Array, Array]:
                upstream = g.reshape(-1, outer)
                return (
                    ar.product(upstream, b.value.T).reshape(a.shape),
                    ar.product(rows.T, upstream),
                )

            value = ar.product(rows, b.value).reshape(*a.shape[:-1], outer)
            return Tensor.from_operation(value, (a, b), vjp, "matmul")

        def batched_vjp(g: Array) -> tuple[Array, Array]:
            return (
                unbroadcast(ar.product(g, np.swapaxes(b.value, -1, -2)), a.shape),
                unbroadcast(ar.product(np.swapaxes(a.value, -1, -2), g), b.shape),
            )

        return Tensor.from_operation(ar.product(a.value, b.value), (a, b), batched_vjp, "matmul")

    def _add(self, a: Tensor, b: Tensor) -> Tensor:
        def vjp(g: Array) -> tuple[Array, Array]:
            return g, g

        return Tensor.from_operation(self.arithmetic.q(a.value + b.value), (a, b), vjp, "add")

    def _rms_norm(self, x: Tensor, gain: Tensor) -> Tensor:
        ar, q = self.arithmetic, self.arithmetic.q
        epsilon = float(self.config.rms_epsilon)
        width = x.shape[-1]
        mean_square = self._mean_square(x.value)
        if epsilon == 0.0 and bool(np.any(mean_square == 0)):
            raise RmsZeroMeanSquare(row=int(np.flatnonzero(mean_square.reshape(-1) == 0)[0]))
        # The root in float64, rounded once (for float32 and float64 exactly as before the
        # mean square stayed unrounded: there the two are the same).
        shifted = ar.w(mean_square.astype(np.float64) + epsilon)
        inverse_root = q(1 / np.sqrt(shifted.astype(np.float64)))
        normalized = q(x.value * inverse_root)

        def vjp(g: Array) -> tuple[Array, Array]:
            scaled = q(g * gain.value)
            dot = q(self._row_sum(q(scaled * x.value)))
            # dot r^3 / n one factor at a time: r^3 alone overflows float16 for an RMS
            # below 0.025, and float32 for the tiny rows of an epsilon of 0.
            projection = q(q(q(q(dot * inverse_root) / width) * inverse_root) * inverse_root)
            grad_x = q(q(scaled * inverse_root) - q(x.value * projection))
            grad_gain = q(ar.w(q(g * normalized)).reshape(-1, width).sum(axis=0))
            return grad_x, grad_gain

        value = q(self._round_normalized(normalized) * gain.value)
        return Tensor.from_operation(value, (x, gain), vjp, "rms_norm")

    def _mean_square(self, values: Array) -> Array:
        """Each row's mean square in the working precision, unrounded, as transformers'
        LlamaRMSNorm computes it: in float16 a square alone overflows past |x| = 256, which a
        residual stream of a trained model's size reaches (variant ``loud``)."""
        work = self.arithmetic.w(values)
        result: Array = self._row_sum(work * work) / values.shape[-1]
        return result

    def _tables(self, length: int) -> tuple[Array, Array]:
        head_width = self.config.head_width
        pairs = head_width // 2
        inverse_frequency = float(self.config.rope_base) ** (
            -2.0 * np.arange(pairs, dtype=np.float64) / head_width
        )
        # The angles in the working precision, as a careful port computes them; the tables
        # are then stored in the format.
        angles = self.arithmetic.w(np.arange(length, dtype=np.float64)[:, None] * inverse_frequency)
        return self.arithmetic.q(np.cos(angles)), self.arithmetic.q(np.sin(angles))

    def _rotary(self, x: Tensor, cos: Array, sin: Array) -> Tensor:
        q = self.arithmetic.q

        def rotate(values: Array, sine: Array) -> Array:
            first, second = values[..., 0::2], values[..., 1::2]
            rotated = np.empty(values.shape)
            rotated[..., 0::2] = q(q(first * cos) - q(second * sine))
            rotated[..., 1::2] = q(q(first * sine) + q(second * cos))
            return rotated

        def vjp(g: Array) -> tuple[Array]:
            return (rotate(g, -sin),)

        return Tensor.from_operation(rotate(x.value, sin), (x,), vjp, "rotary")

    def _attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        ar, q = self.arithmetic, self.arithmetic.q
        tokens, head_width = query.shape[-2:]
        root = math.sqrt(head_width)
        future = self._hidden_keys(tokens)
        r = self._round_scores
        scores = r(ar.product(query.value, np.swapaxes(key.value, -1, -2)) / root)
        masked = np.where(future, -np.inf, scores)
        exponentials = r(np.exp(r(masked - masked.max(axis=-1, keepdims=True))))
        weights = r(exponentials / r(self._row_sum(exponentials)))

        def vjp(g: Array) -> tuple[Array, Array, Array]:
            weight_gradient = ar.product(g, np.swapaxes(value.value, -1, -2))
            total = q(self._row_sum(q(weight_gradient * weights)))
            scores_gradient = q(q(q(weight_gradient - total) * weights) / root)
            return (
                ar.product(scores_gradient, key.value),
                ar.product(np.swapaxes(scores_gradient, -1, -2), query.value),
                ar.product(np.swapaxes(weights, -1, -2), g),
            )

        mixed = ar.product(weights, value.value)
        return Tensor.from_operation(mixed, (query, key, value), vjp, "causal_attention")

    def _sigmoid(self, u: Array) -> Array:
        """``1 / (1 + exp(-u))``: saturates to 0 or 1 where exp overflows."""
        q = self.arithmetic.q
        return q(1 / q(1 + q(np.exp(-u))))

    def _silu_slope(self, u: Array, sigmoids: Array) -> Array:
        """SiLU's derivative ``s (1 + u (1 - s))`` from the forward pass's sigmoids."""
        q = self.arithmetic.q
        return q(q(q(q(1 - sigmoids) * u) + 1) * sigmoids)

    def _swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        q = self.arithmetic.q
        u = gate.value
        sigmoids = self._sigmoid(u)
        activated = q(u * sigmoids)

        def vjp(g: Array) -> tuple[Array, Array]:
            slope = self._silu_slope(u, sigmoids)
            return q(q(slope * up.value) * g), q(g * activated)

        return Tensor.from_operation(q(activated * up.value), (gate, up), vjp, "swiglu")

    def _nll(self, logits: Tensor, targets: IndexArray) -> Tensor:
        ar, q = self.arithmetic, self.arithmetic.q
        vocabulary = logits.shape[-1]
        rows = logits.value.reshape(-1, vocabulary)
        count = rows.shape[0]
        # log_softmax as one operation in the working precision, its result rounded (as
        # torch's is on half-precision logits), then the mean of the picked entries.
        shifted = ar.w(rows - rows.max(axis=-1, keepdims=True))
        log_probabilities = q(shifted - np.log(self._row_sum(np.exp(shifted))))
        value = q(-self._row_sum(log_probabilities[np.arange(count), targets])[0] / count)

        def vjp(g: Array) -> tuple[Array]:
            grad = q(np.exp(ar.w(log_probabilities)))
            grad[np.arange(count), targets] = q(grad[np.arange(count), targets] - 1)
            return (q(grad * q(g / count)).reshape(logits.shape),)

        return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")

    # ------------------------------------------------------------------ the model
    def _heads(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        heads = self.config.heads
        split = x.value.reshape(batch, tokens, heads, width // heads).transpose(0, 2, 1, 3)

        def vjp(g: Array) -> tuple[Array]:
            return (g.transpose(0, 2, 1, 3).reshape(x.shape),)

        return Tensor.from_operation(np.ascontiguousarray(split), (x,), vjp, "split_heads")

    def _merge(self, x: Tensor) -> Tensor:
        batch, heads, tokens, head_width = x.shape
        merged = x.value.transpose(0, 2, 1, 3).reshape(batch, tokens, heads * head_width)

        def vjp(g: Array) -> tuple[Array]:
            return (g.reshape(batch, tokens, heads, head_width).transpose(0, 2, 1, 3),)

        return Tensor.from_operation(merged, (x,), vjp, "merge_heads")

    def _block(self, layer: int, x: Tensor, cos: Array, sin: Array) -> Tensor:
        leaf = {
            name.removeprefix(f"blocks.{layer}."): tensor
            for name, tensor in self.leaves.items()
            if name.startswith(f"blocks.{layer}.")
        }

        def normalize(values: Tensor, gain: str, component: str) -> Tensor:
            try:
                return self._rms_norm(values, leaf[gain])
            except RmsZeroMeanSquare as error:
                raise BlockFailure(source=error, layer=layer, component=component) from error

        normed = normalize(x, "attention_norm.gain", "attention RMSNorm")
        query = self._rotary(
            self._heads(self._matmul(normed, leaf["attention.query.weight"])), cos, sin
        )
        key = self._rotary(
            self._heads(self._matmul(normed, leaf["attention.key.weight"])), cos, sin
        )
        value = self._heads(self._matmul(normed, leaf["attention.value.weight"]))
        attended = self._matmul(
            self._merge(self._attention(query, key, value)), leaf["attention.output.weight"]
        )
        hidden = self._add(x, attended)
        normed = normalize(hidden, "ffn_norm.gain", "feed-forward RMSNorm")
        activated = self._swiglu(
            self._matmul(normed, leaf["ffn.gate.weight"]),
            self._matmul(normed, leaf["ffn.up.weight"]),
        )
        return self._add(hidden, self._matmul(activated, leaf["ffn.down.weight"]))

    def _run(self, ids: IndexArray, *, detach_lookup: bool, detach_head: bool) -> EmulatedResult:
        names = list(self.leaves)
        table = self.leaves[names[0]]
        lookup = table.detach() if detach_lookup else table
        head = table.detach() if detach_head else table
        width = table.shape[1]

        def gather_vjp(g: Array) -> tuple[Array]:
            grad = np.zeros(table.shape)
            np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
            return (self.arithmetic.q(grad),)

        hidden = Tensor.from_operation(
            np.take(lookup.value, ids, axis=0), (lookup,), gather_vjp, "gather_rows"
        )
        stages = [("embedding", hidden)]
        cos, sin = self._tables(ids.shape[1])
        for layer in range(self.config.layers):
            hidden = self._block(layer, hidden, cos, sin)
            stages.append((f"block-{layer}", hidden))
        try:
            normalized = self._rms_norm(hidden, self.leaves[names[-1]])
        except RmsZeroMeanSquare as error:
            raise FinalNormFailure(source=error) from error
        stages.append(("final-norm", normalized))

        def transpose_vjp(g: Array) -> tuple[Array]:
            return (g.T,)

        head_t = Tensor.from_operation(head.value.T, (head,), transpose_vjp, "transpose")
        return EmulatedResult(stages, self._matmul(normalized, head_t))

    def _bounded(
        self, ids: IndexArray, operation: str, needed: int, **detach: bool
    ) -> EmulatedResult:
        """The pass over ``ids`` under the reference's memory bound."""
        batch, length = ids.shape
        bound = _require_working_memory(operation, batch, length, needed)
        try:
            return self._run(ids, **detach)
        except MemoryError as error:
            raise _ran_out(operation, batch, length, needed, bound) from error

    def forward(self, tokens: npt.ArrayLike, shape: Sequence[int] | None = None) -> EmulatedResult:
        """Every stage and the logits, for tokens the reference accepts."""
        ids = self.reference.validate_tokens(tokens, shape)
        needed = resources.forward_bytes(self.config, *ids.shape)
        return self._bounded(ids, "a forward pass", needed, detach_lookup=False, detach_head=False)

    def loss_and_gradients(
        self,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> tuple[float, dict[str, Array]]:
        """The mean loss and every parameter's gradient, each rounded to the format."""
        reference = self.reference
        flat, batch, length = reference._validate_token_shape(tokens, None)
        target_ids = reference.validate_targets(targets, batch, length)
        ids = reference._checked_token_ids(flat, batch, length)
        for leaf in self.leaves.values():
            leaf.zero_grad()
        needed = resources.loss_bytes(self.config, batch, length)
        result = self._bounded(
            ids,
            "a loss and its backward pass",
            needed,
            detach_lookup=detach_lookup,
            detach_head=detach_head,
        )
        loss = self._nll(result.logits, target_ids)
        loss.backward(retain_graph=False)
        gradients = {
            name: np.zeros(leaf.shape) if leaf.grad is None else self.arithmetic.q(leaf.grad)
            for name, leaf in self.leaves.items()
        }
        for leaf in self.leaves.values():
            leaf.zero_grad()
        return float(loss.value), gradients


class RecursiveSumsModel(EmulatedModel):
    """:class:`EmulatedModel` with every row sum (softmax denominators, the loss's sum of
    exponentials and its mean, RMSNorm's mean square and the backward passes' row sums)
    accumulated one term after another in the working precision, as a plain loop in C or
    Rust (``iter().sum()``) adds. Its rounding error grows with the square root of the
    number of terms, pairwise summation's with the square root of their logarithm: at 70,001
    logits a row (``large-ids``) its float32 loss is about 20 times farther from the float64
    reference's than the pairwise emulation's. The matrix products stay BLAS's (blocked along
    the inner dimension); a probe port that also loops its products stays within 43% of the
    bounds calibrated with both instruments."""

    def _row_sum(self, values: Array) -> npt.NDArray[Any]:
        # Accumulated in place: attention's rows are [heads, T, T], one copy is enough.
        work = self.arithmetic.w(values)
        np.add.accumulate(work, axis=-1, out=work)
        result: npt.NDArray[Any] = work[..., -1:].copy()
        return result
