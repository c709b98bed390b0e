"""A model's sizes from its transformers config, without torch: parameter counts and the tensors a
training step keeps per token, for ``hfscale plan`` (hfscale.memory.estimate).

Values the mapping leaves out take the config class's defaults, read from transformers' source
(hfscale.config.sources.transformers), so ``{model_type: llama}`` means Llama's 4096-wide default. The
parameter counts equal the models transformers builds (tests/test_memory.py builds them on the
meta device); the activation bytes equal the tensors autograd saves (measured there with
saved-tensor hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfscale.config.sources.transformers import UNKNOWN, schema

# The decoder families hfscale sizes: a GPT-2 block (LayerNorm, GELU MLP, learned positions) or a
# Llama block (RMSNorm, gated SiLU MLP, rotary positions).
FAMILY = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}


class ShapeError(ValueError):
    """A config hfscale cannot size; the message names the key."""


@dataclass(frozen=True)
class Shape:
    """The sizes that decide memory, named as in Llama's config."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 0  # learned position embeddings (GPT-2); 0: rotary
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on queries and keys
    dropout: bool = False  # any dropout probability > 0: masks are kept for backward

    @property
    def family(self) -> str:
        return FAMILY[self.model_type]

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, q, kv, f = self.hidden_size, self.num_attention_heads * self.head_dim, \
            self.num_key_value_heads * self.head_dim, self.intermediate_size
        if self.family == "gpt2":
            return 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * f + (2 * f + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_params(self) -> int:
        """Token (and position) embeddings, plus the output head when it is not tied to them."""
        h = self.hidden_size
        return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + self.max_position_embeddings * h

    def params(self) -> int:
        """All parameters, counted once when tied."""
        final_norm = 2 * self.hidden_size if self.family == "gpt2" else self.hidden_size
        return self.embedding_params() + self.num_hidden_layers * self.layer_params() + final_norm

    def largest_layer_params(self) -> int:
        """The most parameters one module holds (DeepSpeed's largest_layer_params: what ZeRO-3
        gathers at once)."""
        h, f = self.hidden_size, self.intermediate_size
        biggest_linear = max(h * f + (f if self.mlp_bias or self.family == "gpt2" else 0),
                             h * 3 * h + 3 * h if self.family == "gpt2" else 0)
        return max(self.vocab_size * h, biggest_linear)

    def layer_activation_bytes(self, element: int) -> int:
        """Bytes one decoder layer keeps for backward per token, its tensors in ``element``-byte
        floats (2: bf16/fp16, 4: fp32); attention through SDPA (flash or memory-efficient: the
        output and a float log-sum-exp per head, no score matrix)."""
        h, f, a = self.hidden_size, self.intermediate_size, self.num_attention_heads
        q, kv = a * self.head_dim, self.num_key_value_heads * self.head_dim
        k = element
        masks = 2 * h if self.dropout else 0  # a byte per element after attention and after the MLP
        if self.family == "gpt2":
            norms = 2 * (2 * k * h + 2 * k)  # input and output of each LayerNorm, its mean and rstd
            attn = 6 * k * h + 4 * a  # q, the fused qkv, v, the output; log-sum-exp
            return norms + attn + 5 * k * f + masks  # GELU(tanh) keeps four f-wide tensors, the down projection one
        norm = 4 * h + 4 + 2 * k * h  # RMSNorm: an fp32 copy of its input, rsqrt, normalized and scaled output
        attn = k * (2 * q + 2 * kv) + 4 * a  # q, k, v, the output; log-sum-exp
        if self.qk_norm:
            attn += (4 + k) * (q + kv) + 4 * (a + self.num_key_value_heads)
        return 2 * norm + attn + 4 * k * f + masks  # gate, SiLU, up, product

    def checkpointed_layer_bytes(self, element: int) -> int:
        """Per token, what a layer keeps under gradient checkpointing: its input."""
        return element * self.hidden_size

    def head_bytes(self, element: int) -> int:
        """Per token, the final norm, the output head's input and the loss: the float logits,
        their log-softmax and, at the start of backward, their gradient ((8 + element) x vocab)."""
        h = self.hidden_size
        norm = 2 * element * h + 2 * element if self.family == "gpt2" else 4 * h + 4 + 2 * element * h
        return norm + (8 + element) * self.vocab_size + 16  # + the token ids and labels (int64)


def _int(s, cfg: dict[str, Any], name: str, alias: str | None = None) -> int | None:
    for key in (name, alias):
        if key is not None and key in cfg:
            v = cfg[key]
            break
    else:
        spec = s.spec(name) or (s.spec(alias) if alias else None)
        v = spec.default if spec is not None else None
    if v is None or v is UNKNOWN:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ShapeError(f"{name} must be a positive whole number, got {v!r}")
    return v


def shape_of(cfg: dict[str, Any]) -> Shape:
    """The Shape of a transformers config mapping (``model_type`` plus sizes; the rest defaults)."""
    mt = cfg.get("model_type")
    if mt not in FAMILY:
        raise ShapeError(f"model_type {mt!r}: hfscale plan sizes {', '.join(sorted(FAMILY))}")
    s = schema(mt)
    if s is None:
        raise ShapeError(f"the {mt} config class could not be read from transformers' source")

    def get(name: str, default: Any = None) -> Any:
        if name in cfg:
            return cfg[name]
        for alias, target in s.aliases.items():
            if target == name and alias in cfg:
                return cfg[alias]
        spec = s.spec(name)
        return default if spec is None or spec.default is UNKNOWN else spec.default

    if mt == "gpt2":
        h, layers, heads = _int(s, cfg, "n_embd", "hidden_size"), _int(s, cfg, "n_layer", "num_hidden_layers"), \
            _int(s, cfg, "n_head", "num_attention_heads")
        f = _int(s, cfg, "n_inner") or 4 * (h or 0)
        kv, positions = heads, _int(s, cfg, "n_positions", "max_position_embeddings")
        dropout = any((get(k, 0.0) or 0.0) > 0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
        tied = get("tie_word_embeddings", True)
    else:
        h, layers, heads = (_int(s, cfg, n) for n in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
        f = _int(s, cfg, "intermediate_size")
        kv, positions = _int(s, cfg, "num_key_value_heads") or heads, 0
        dropout = (get("attention_dropout", 0.0) or 0.0) > 0
        tied = get("tie_word_embeddings", False)
    vocab = _int(s, cfg, "vocab_size")
    missing = [n for n, v in (("hidden_size", h), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("intermediate_size", f), ("vocab_size", vocab)) if not v]
    if missing:
        raise ShapeError(f"{mt}: no value for {', '.join(missing)}")
    head_dim = (_int(s, cfg, "head_dim") if mt != "gpt2" else None) or h // heads
    bias = bool(get("attention_bias", False))
    return Shape(mt, h, layers, heads, kv, head_dim, f, vocab, bool(tied), positions or 0,
                 qkv_bias=bias or mt == "qwen2", o_bias=bias, mlp_bias=bool(get("mlp_bias", False)),
                 qk_norm=mt == "qwen3", dropout=bool(dropout))
