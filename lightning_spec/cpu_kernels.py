"""A CPU kernel the frozen target runs on, outputs unchanged: transformers' SDPA attention without the key/value copies
of grouped queries (``SHARED_KV_SDPA``, which ``load_target`` picks where transformers would use SDPA), for the
forwards that run transformers' model (training features, batched decoding, architectures ``FastForward`` does not
cover). Measured in benchmarks/README.md."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SHARED_KV_SDPA = "lightning_spec_sdpa"


def sdpa_shared_kv(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
):
    """transformers' SDPA attention, except for a masked multi-token query on CPU (a verify block against the
    KV cache): there SDPA reads each key/value head for its whole query-head group (``enable_gqa``) instead of
    transformers copying keys and values ``num_key_value_groups`` times (``repeat_kv``, SDPA's CPU kernels with a
    mask do not get ``enable_gqa`` from transformers). Same products and sums: bit-identical outputs, measured.
    Everything else (one query token, no mask, GPUs, softcap, position bias) is transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        query.device.type != "cpu"
        or attention_mask is None
        or query.shape[2] == 1
        or query.shape[1] == key.shape[1]
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (N, heads, T, D)
    return out.transpose(1, 2).contiguous(), None  # (N, T, heads, D), no attention weights


@functools.cache
def register_shared_kv_sdpa() -> bool:
    """Register ``sdpa_shared_kv`` (with transformers' SDPA mask builder) under ``SHARED_KV_SDPA``, once per process
    (transformers' attention registry is global). False where this torch/transformers lacks a piece
    (``enable_gqa`` needs torch 2.5): keep plain ``sdpa``."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401 (used above)
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(SHARED_KV_SDPA, sdpa_shared_kv)
    AttentionMaskInterface.register(SHARED_KV_SDPA, sdpa_mask)
    return True
