"""Expected vLLM tensors written out by hand from full HF tensors (independent of the plan).

vLLM (0.32) on tensor-parallel rank r of tp: qkv_proj = [q rows of r; k rows of r; v rows of r]
(KV heads replicated when tp >= num_kv_heads), gate_up_proj = [gate rows of r; up rows of r],
o_proj/down_proj = column block r, embed_tokens/lm_head = row block r of the vocabulary padded
to a multiple of 64 (padding rows zero), norms whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812


def _kv_rows(t: torch.Tensor, r: int, tp: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    if tp >= kv_heads:
        head = r // (tp // kv_heads)
        return t[head * head_dim : (head + 1) * head_dim]
    return t.chunk(tp, dim=0)[r]


def expected_vllm_tensors(
    full: dict[str, torch.Tensor], config: dict, r: int, tp: int
) -> dict[str, torch.Tensor]:
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if ".self_attn.q_proj." in name:
            prefix, kind = name.split(".self_attn.q_proj.")
            k = full[f"{prefix}.self_attn.k_proj.{kind}"]
            v = full[f"{prefix}.self_attn.v_proj.{kind}"]
            out[f"{prefix}.self_attn.qkv_proj.{kind}"] = torch.cat(
                [
                    t.chunk(tp, dim=0)[r],
                    _kv_rows(k, r, tp, kv_heads, head_dim),
                    _kv_rows(v, r, tp, kv_heads, head_dim),
                ]
            )
        elif ".mlp.gate_proj." in name:
            up = full[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [t.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t.chunk(tp, dim=1)[r]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-t.shape[0] // 64) * 64
            out[name] = F.pad(t, (0, 0, 0, padded - t.shape[0])).chunk(tp, dim=0)[r]
        elif any(s in name for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue
        else:
            out[name] = t
    return out
