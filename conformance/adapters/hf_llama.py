"""Hugging Face transformers: ``LlamaForCausalLM`` with tied embeddings, loaded from our names.

The model's own code runs unchanged; :data:`conformance.layouts.HF_LLAMA` bridges the layouts
(every matrix transposed to ``[out, in]``, the query and key output features permuted per
head from the spec's interleaved pairs to transformers' rotate-half pairs, the names mapped).

Precision: transformers computes RMSNorm, the rotary tables and the eager softmax in float32
even in a float64 model. ``hf-llama`` loads float64 weights and declares float32, its real
precision; ``hf-llama-claims-float64`` declares float64, so the suite can show where and by
how much that claim fails. ``hf-llama-bfloat16`` loads bfloat16 weights and declares bfloat16;
the RoPE frequencies stay in float32, as transformers builds them.
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
from conformance.layouts import HF_LLAMA
from spec.config import DecoderConfig
from spec.tolerances import Precision

__all__ = ["HFLlamaBackend", "HFLlamaBfloat16", "HFLlamaClaimsFloat64"]


class HFLlamaBackend(BackendBase):
    """``LlamaForCausalLM`` in float64 weights, declared at its real (float32) precision."""

    name = "hf-llama"
    precision = Precision.FLOAT32
    capabilities = frozenset({Capability.STAGES, Capability.GRADIENTS})
    dtype = torch.float64

    def __init__(self) -> None:
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"

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
        # transformers builds its RoPE inverse frequencies in float32; Module.to would round
        # them to the weights' dtype with everything else, and bfloat16 frequencies put the
        # angles of position 7,813 off by up to 3.4 radians (transformers#29496). Keep them.
        built_buffers = dict(model.named_buffers())  # .to replaces them, it does not edit them
        # The model's own .to and .eval are typed for devices and untyped; use Module's.
        torch.nn.Module.to(model, self.dtype)
        for name, buffer in built_buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, buffer)
        torch.nn.Module.train(model, False)
        hf_parameters = dict(model.named_parameters())
        with torch.no_grad():
            for theirs, value in HF_LLAMA.export_each(config, parameters):
                hf_parameters[theirs].copy_(torch.as_tensor(value, dtype=self.dtype))
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            raise RuntimeError("transformers did not tie lm_head to embed_tokens")
        return config, model

    def parameters(
        self, model: tuple[DecoderConfig, LlamaForCausalLM]
    ) -> list[tuple[str, FloatArray]]:
        config, hf = model
        state = {name: value.detach().double().numpy() for name, value in hf.named_parameters()}
        return HF_LLAMA.load(config, state)

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
        state = {
            name: (torch.zeros_like(p) if p.grad is None else p.grad).double().numpy()
            for name, p in hf.named_parameters()
        }
        gradients = dict(HF_LLAMA.load(config, state))
        hf.zero_grad(set_to_none=True)
        return LossOutput(loss=float(loss.item()), gradients=gradients)


class HFLlamaBfloat16(HFLlamaBackend):
    """The same model with bfloat16 weights, as it is usually run: transformers still
    computes RMSNorm, the rotary tables and the softmax in float32 and rounds to bfloat16."""

    name = "hf-llama-bfloat16"
    precision = Precision.BFLOAT16
    dtype = torch.bfloat16


class HFLlamaClaimsFloat64(HFLlamaBackend):
    """The same model claiming float64: the suite shows where the float32 internals show."""

    name = "hf-llama-claims-float64"
    precision = Precision.FLOAT64
