"""gpt-oss over the paged KV cache: a Llama-family model with attention sinks and a mixture of
experts.

Attention (Llama's, `attention_bias`): q/k/v/o with biases, YaRN RoPE (NeoX halves, cos/sin scaled
by YaRN's attention factor), a learned sink logit per query head (`self_attn.sinks`, passed to
`pagedattn.Attention` as `sinks=`: backends without `Capabilities.sinks` refuse the model),
sliding-window and full layers as `config.layer_types` lists them. MLP: a router (linear with
bias, softmax over its top-k logits) picks `num_experts_per_tok` of `num_local_experts` experts
per token; each expert is a clamped SwiGLU (gate and up interleaved in one `[hidden, 2I]` matrix,
`(up + 1) * gate * sigmoid(alpha * gate)`) with biases, in the checkpoint's own layout
(`mlp.experts.gate_up_proj [E, hidden, 2I]`, `down_proj [E, I, hidden]`). The experts run as a
PyTorch loop: correct, not fast.

Checkpoints: bf16/float32 weights (transformers' dequantised ones). The released MXFP4 weights
(`*_blocks`, `*_scales`) are refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedattn.models.llama import LlamaForCausalLM


class GptOssExperts(nn.Module):
    """`num_local_experts` clamped-SwiGLU MLPs in the checkpoint's layout (gate and up interleaved)."""

    def __init__(self, config) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))  # [E, hidden, 2I]: gate, up, gate, up, ...
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))  # [E, I, hidden]
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        # configs before transformers 5.2x hold neither: their modeling code fixes 1.702 and 7.0
        self.alpha = getattr(config, "swiglu_alpha", 1.702)
        self.limit = getattr(config, "swiglu_limit", 7.0)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on x [N, hidden] -> [N, hidden]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [N, 2I]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights: [T, E], each token's routing weight per expert (0: not routed)
        -> the weighted sum of its experts' outputs [T, hidden]."""
        out = torch.zeros_like(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph cannot size its work by the routing (a host read): every expert runs on
            # every row and the unrouted ones add exact zeros. Decode graphs hold few rows.
            for e in range(weights.shape[1]):
                out += (self.expert(e, x) * weights[:, e : e + 1]).to(x.dtype)
            return out
        routed = weights > 0  # [T, E]
        for e in routed.any(dim=0).nonzero().flatten().tolist():  # the experts some token chose, in order
            rows = routed[:, e].nonzero().flatten()
            out.index_add_(0, rows, (self.expert(e, x[rows]) * weights[rows, e : e + 1]).to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        top, chosen = self.router(x).topk(self.top_k, dim=-1)  # [T, k] logits and expert ids
        weights = torch.zeros(x.shape[0], self.experts.gate_up_proj.shape[0], dtype=top.dtype, device=x.device)
        weights.scatter_(1, chosen, torch.softmax(top, dim=-1))  # [T, E]
        return self.experts(x, weights)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: Llama with attention sinks and `GptOssMLP`; run it inside `pagedattn.forward_context`."""

    mlp_cls = GptOssMLP
    attention_sinks = True
    supports_tensor_parallel = False  # its experts and per-head sinks are not split over ranks

    def __init__(self, config, **kwargs) -> None:
        quant = getattr(config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if method is not None:
            raise NotImplementedError(
                f"expected gpt-oss with bf16 or float32 weights, got {method!r}-quantised ones (the released "
                "MXFP4 experts); use a dequantised checkpoint (transformers can save one: load it with "
                "`Mxfp4Config(dequantize=True)` and `save_pretrained`)"
            )
        super().__init__(config, **kwargs)
