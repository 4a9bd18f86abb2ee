"""Hugging Face transformers: ``LlamaForCausalLM`` with tied embeddings, loaded from our names.

The model's own code runs unchanged. Two conversions bridge the layouts: transformers stores a
linear weight as ``[out, in]`` (ours is ``[in, out]``), and it rotates RoPE features in the
"rotate half" layout, pairing feature j with j + hw/2 where ours pairs 2j with 2j + 1. So every
matrix is transposed, and the output columns of the query and key matrices are permuted per
head: our feature 2j goes to position j, our 2j + 1 to position j + hw/2. Scores are
unchanged because queries and keys move together.

Precision: transformers computes RMSNorm, the rotary tables and the eager softmax in float32
even in a float64 model. ``hf-llama`` loads float64 weights and declares float32, its real
precision; ``hf-llama-claims-float64`` declares float64, so the suite can show where and by
how much that claim fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from conformance.adapter import (
    BackendBase,
    Capability,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
)
from conformance.adapters.torch_backend import as_forward_output, mean_nll
from spec.config import DecoderConfig
from spec.parameters import parameter_names
from spec.tolerances import Precision

__all__ = ["HFLlamaBackend", "HFLlamaClaimsFloat64", "rotate_half_permutation"]

_BLOCK_MATRICES = {
    "attention.query.weight": "self_attn.q_proj.weight",
    "attention.key.weight": "self_attn.k_proj.weight",
    "attention.value.weight": "self_attn.v_proj.weight",
    "attention.output.weight": "self_attn.o_proj.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight",
    "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
}
_BLOCK_GAINS = {
    "attention_norm.gain": "input_layernorm.weight",
    "ffn_norm.gain": "post_attention_layernorm.weight",
}
_ROTATED = {"attention.query.weight", "attention.key.weight"}


def rotate_half_permutation(width: int, heads: int) -> npt.NDArray[np.intp]:
    """``order[i]``: which of our features becomes transformers' feature ``i``."""
    head_width = width // heads
    half = head_width // 2
    within = [2 * i if i < half else 2 * (i - half) + 1 for i in range(head_width)]
    return np.array([head * head_width + j for head in range(heads) for j in within], dtype=np.intp)


def _hf_name(name: str) -> tuple[str, str]:
    """Transformers' parameter name for one of ours, and how it is stored: gain, matrix, table."""
    if name == "token_embedding.weight":
        return "model.embed_tokens.weight", "table"
    if name == "final_norm.gain":
        return "model.norm.weight", "gain"
    _, layer, suffix = name.split(".", 2)
    if suffix in _BLOCK_GAINS:
        return f"model.layers.{layer}.{_BLOCK_GAINS[suffix]}", "gain"
    return f"model.layers.{layer}.{_BLOCK_MATRICES[suffix]}", "matrix"


class HFLlamaBackend(BackendBase):
    """``LlamaForCausalLM`` in float64 weights, declared at its real (float32) precision."""

    name = "hf-llama"
    precision = Precision.FLOAT32
    capabilities = frozenset({Capability.STAGES, Capability.GRADIENTS})
    dtype = torch.float64

    def __init__(self) -> None:
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"

    def _to_ours(self, config: DecoderConfig, name: str, value: torch.Tensor) -> FloatArray:
        array = value.detach().double().numpy()
        _, kind = _hf_name(name)
        suffix = name.split(".", 2)[-1]
        if kind == "matrix":
            if suffix in _ROTATED:
                restored = np.empty_like(array)
                restored[rotate_half_permutation(config.model_width, config.heads)] = array
                array = restored
            array = array.T
        return np.ascontiguousarray(array).copy()

    def _to_hf(self, config: DecoderConfig, name: str, value: npt.ArrayLike) -> torch.Tensor:
        array = np.asarray(value, dtype=np.float64)
        _, kind = _hf_name(name)
        if kind == "matrix":
            array = array.T
            if name.split(".", 2)[-1] in _ROTATED:
                array = array[rotate_half_permutation(config.model_width, config.heads)]
        return torch.as_tensor(np.ascontiguousarray(array), dtype=self.dtype)

    def build(
        self, config: DecoderConfig, parameters: Parameters
    ) -> tuple[DecoderConfig, LlamaForCausalLM]:
        hf_config = LlamaConfig(
            vocab_size=config.vocabulary_size,
            hidden_size=config.model_width,
            intermediate_size=config.feed_forward_width,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.heads,
            hidden_act="silu",
            max_position_embeddings=config.context,
            rms_norm_eps=config.rms_epsilon,
            tie_word_embeddings=True,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_base},
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        hf_config._attn_implementation = "eager"
        model = LlamaForCausalLM(hf_config)
        # The model's own .to and .eval are typed for devices and untyped; use Module's.
        torch.nn.Module.to(model, self.dtype)
        torch.nn.Module.train(model, False)
        hf_parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in parameters:
                hf_parameters[_hf_name(name)[0]].copy_(self._to_hf(config, name, value))
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            raise RuntimeError("transformers did not tie lm_head to embed_tokens")
        return config, model

    def parameters(
        self, model: tuple[DecoderConfig, LlamaForCausalLM]
    ) -> list[tuple[str, FloatArray]]:
        config, hf = model
        hf_parameters = dict(hf.named_parameters())
        return [
            (name, self._to_ours(config, name, hf_parameters[_hf_name(name)[0]]))
            for name in parameter_names(config)
        ]

    def _run(
        self, model: tuple[DecoderConfig, LlamaForCausalLM], tokens: npt.ArrayLike
    ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        hf = model[1]
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        captured: list[tuple[str, torch.Tensor]] = []

        def recorder(stage: str) -> Any:
            def hook(_module: Any, _inputs: Any, output: Any) -> None:
                captured.append((stage, output[0] if isinstance(output, tuple) else output))

            return hook

        modules = [("embedding", hf.model.embed_tokens)]
        modules += [(f"block-{i}", layer) for i, layer in enumerate(hf.model.layers)]
        modules.append(("final-norm", hf.model.norm))
        handles = [module.register_forward_hook(recorder(stage)) for stage, module in modules]
        try:
            logits = hf(input_ids=ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        return captured, logits

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        if shape is not None:
            tokens = np.asarray(tokens).reshape(shape)
        with torch.no_grad():
            stages, logits = self._run(model, tokens)
        return as_forward_output(stages, logits)

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        if detach_lookup or detach_head:
            raise NotImplementedError("transformers' Llama cannot detach one use of a tied weight")
        config, hf = model
        hf.zero_grad(set_to_none=True)
        _, logits = self._run(model, tokens)
        # Targets are aligned with positions here; transformers' own loss would shift them.
        loss = mean_nll(logits, targets, config.vocabulary_size)
        torch.autograd.backward([loss])
        hf_parameters = dict(hf.named_parameters())
        gradients = {}
        for name in parameter_names(config):
            parameter = hf_parameters[_hf_name(name)[0]]
            grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
            gradients[name] = self._to_ours(config, name, grad)
        hf.zero_grad(set_to_none=True)
        return LossOutput(loss=float(loss.item()), gradients=gradients)


class HFLlamaClaimsFloat64(HFLlamaBackend):
    """The same model claiming float64: the suite shows where the float32 internals show."""

    name = "hf-llama-claims-float64"
    precision = Precision.FLOAT64
