"""What a receiver expects: the model's parameters (HF names, shapes) and how each maps onto
vLLM's layout. The HF -> vLLM name mapping is ONE TABLE PER ARCHITECTURE below.

vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and ``gate_proj``/``up_proj`` into
``gate_up_proj`` (concatenated on dim 0, each part sliced per tensor-parallel rank), splits the
row-parallel ``o_proj``/``down_proj`` on dim 1, splits the vocab-parallel ``embed_tokens`` /
``lm_head`` on dim 0 (vocabulary padded to a multiple of 64) and replicates norms.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from podrl.weights.protocol import Box

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Split(enum.Enum):
    REPLICATED = "replicated"
    ROW = "row"  # split on dim 1 (row-parallel linear weight)
    VOCAB = "vocab"  # split on dim 0 after padding the vocabulary
    Q = "q"  # parts of the fused qkv_proj
    K = "k"
    V = "v"
    GATE = "gate"  # parts of the fused gate_up_proj
    UP = "up"


@dataclass(frozen=True)
class NameRule:
    """HF parameter names matching ``pattern`` become ``target`` (``re.sub`` template)."""

    pattern: str
    target: str
    split: Split


# fmt: off
# Llama-style decoders: vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj.
LLAMA_TABLE: tuple[NameRule, ...] = (
    NameRule(r"^model\.embed_tokens\.weight$", r"model.embed_tokens.weight", Split.VOCAB),
    NameRule(r"^lm_head\.weight$", r"lm_head.weight", Split.VOCAB),
    NameRule(r"^model\.norm\.weight$", r"model.norm.weight", Split.REPLICATED),
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.q_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.Q),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.k_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.K),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.v_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.V),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.o_proj\.weight$", r"\1.self_attn.o_proj.weight", Split.ROW),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.o_proj\.bias$", r"\1.self_attn.o_proj.bias", Split.REPLICATED),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.gate_proj\.weight$", r"\1.mlp.gate_up_proj.weight", Split.GATE),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.up_proj\.weight$", r"\1.mlp.gate_up_proj.weight", Split.UP),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.down_proj\.weight$", r"\1.mlp.down_proj.weight", Split.ROW),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", r"\1.\2.weight", Split.REPLICATED),  # noqa: E501
)

# Qwen3 = the Llama layout plus per-head RMS norms on queries and keys (replicated).
QWEN3_TABLE: tuple[NameRule, ...] = (
    *LLAMA_TABLE,
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.(q_norm|k_norm)\.weight$", r"\1.self_attn.\2.weight", Split.REPLICATED),  # noqa: E501
)
# fmt: on

ARCHITECTURE_TABLES: dict[str, tuple[NameRule, ...]] = {
    "Qwen3ForCausalLM": QWEN3_TABLE,
    "LlamaForCausalLM": LLAMA_TABLE,
}


@dataclass(frozen=True)
class ModelDescription:
    """The parameters a receiver expects (HF names -> global shapes) and the attention shape."""

    architecture: str
    params: Mapping[str, tuple[int, ...]]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object] | object) -> ModelDescription:
        """From a Hugging Face config (``config.json`` dict or ``PretrainedConfig``)."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in ARCHITECTURE_TABLES:
            raise ValueError(
                f"architecture {arch!r} has no weight-transfer table; "
                f"supported: {sorted(ARCHITECTURE_TABLES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
        attn_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        params: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}"
            params[f"{p}.input_layernorm.weight"] = (hidden,)
            params[f"{p}.post_attention_layernorm.weight"] = (hidden,)
            for proj, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                params[f"{p}.self_attn.{proj}_proj.weight"] = (rows * head_dim, hidden)
                if attn_bias:
                    params[f"{p}.self_attn.{proj}_proj.bias"] = (rows * head_dim,)
            params[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
            if attn_bias:
                params[f"{p}.self_attn.o_proj.bias"] = (hidden,)
            if arch == "Qwen3ForCausalLM":
                params[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
                params[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
            params[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
            params[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
            params[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
            if mlp_bias:
                raise ValueError("mlp_bias=True is not supported by the weight-transfer table")
        params["model.norm.weight"] = (hidden,)
        if not cfg.get("tie_word_embeddings", False):
            params["lm_head.weight"] = (vocab, hidden)
        return cls(
            architecture=arch,
            params=params,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            intermediate_size=inter,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelDescription:
        """From a Hugging Face model folder's ``config.json`` (what vLLM loads)."""
        path = Path(model_dir) / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()))


@dataclass
class TargetPiece:
    """Copy ``src`` (a block of HF tensor ``hf_name``) to ``dst_offset`` of the target tensor."""

    hf_name: str
    src: Box
    dst_offset: tuple[int, ...]


@dataclass
class TargetTensor:
    """One tensor the receiver fills, and which blocks of which HF tensors go where."""

    name: str
    shape: tuple[int, ...]
    pieces: list[TargetPiece] = field(default_factory=list)


TargetLayout = Mapping[str, TargetTensor]


def hf_layout(description: ModelDescription) -> dict[str, TargetTensor]:
    """Full tensors in HF naming (vLLM's reload path / ``load_weights`` takes these)."""
    return {
        name: TargetTensor(
            name, shape, [TargetPiece(name, Box((0,) * len(shape), shape), (0,) * len(shape))]
        )
        for name, shape in description.params.items()
    }


def _rule_for(table: tuple[NameRule, ...], name: str) -> tuple[NameRule, str] | None:
    for rule in table:
        if re.match(rule.pattern, name):
            return rule, re.sub(rule.pattern, rule.target, name)
    return None


def _check_divisible(what: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp_size}")
    return size // tp_size


def vllm_layout(
    description: ModelDescription, tp_rank: int, tp_size: int
) -> dict[str, TargetTensor]:
    """vLLM's parameters on tensor-parallel rank ``tp_rank`` of ``tp_size`` (vLLM naming)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    table = ARCHITECTURE_TABLES[description.architecture]
    hd = description.head_dim
    q_heads = _check_divisible("num_attention_heads", description.num_attention_heads, tp_size)
    kv_total = description.num_key_value_heads
    if tp_size >= kv_total:
        # vLLM replicates KV heads: each rank holds one, shared by tp_size // kv_total ranks.
        if tp_size % kv_total:
            raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of {kv_total}")
        kv_heads, kv_first = 1, tp_rank // (tp_size // kv_total)
    else:
        kv_heads = _check_divisible("num_key_value_heads", kv_total, tp_size)
        kv_first = tp_rank * kv_heads
    inter = _check_divisible("intermediate_size", description.intermediate_size, tp_size)
    padded_vocab = -(-description.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    vocab_per_rank = _check_divisible("padded vocab", padded_vocab, tp_size)

    targets: dict[str, TargetTensor] = {}
    for hf_name, shape in description.params.items():
        found = _rule_for(table, hf_name)
        if found is None:
            raise ValueError(f"{hf_name}: no rule in the {description.architecture} table")
        rule, target_name = found
        rest = shape[1:]
        zeros_rest = (0,) * len(rest)
        if rule.split is Split.REPLICATED:
            target_shape, src, dst = shape, Box((0,) * len(shape), shape), (0,) * len(shape)
        elif rule.split is Split.ROW:
            cols = _check_divisible(f"{hf_name} dim 1", shape[1], tp_size)
            target_shape = (shape[0], cols)
            src, dst = Box((0, tp_rank * cols), target_shape), (0, 0)
        elif rule.split is Split.VOCAB:
            start = tp_rank * vocab_per_rank
            rows = max(0, min(vocab_per_rank, description.vocab_size - start))
            target_shape = (vocab_per_rank, *rest)
            src, dst = Box((start, *zeros_rest), (rows, *rest)), (0, *zeros_rest)
        elif rule.split in (Split.Q, Split.K, Split.V):
            q_rows, kv_rows = q_heads * hd, kv_heads * hd
            target_shape = (q_rows + 2 * kv_rows, *rest)
            if rule.split is Split.Q:
                src = Box((tp_rank * q_rows, *zeros_rest), (q_rows, *rest))
                dst = (0, *zeros_rest)
            else:
                src = Box((kv_first * hd, *zeros_rest), (kv_rows, *rest))
                at = q_rows if rule.split is Split.K else q_rows + kv_rows
                dst = (at, *zeros_rest)
        else:  # GATE / UP
            target_shape = (2 * inter, *rest)
            src = Box((tp_rank * inter, *zeros_rest), (inter, *rest))
            dst = (0 if rule.split is Split.GATE else inter, *zeros_rest)
        target = targets.setdefault(target_name, TargetTensor(target_name, target_shape))
        if target.shape != target_shape:
            raise ValueError(
                f"{target_name}: parts disagree on shape ({target.shape} vs {target_shape})"
            )
        if src.numel:
            target.pieces.append(TargetPiece(hf_name, src, dst))
    return targets
