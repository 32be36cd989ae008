"""The policy model: a tiny Qwen3 built from a config (lab) or an HF checkpoint (production)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SIZES = (  # every one of them >= 1
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_positions",
)


@dataclass(frozen=True)
class TinyQwen3Config:
    """Architecture of the lab model (Qwen3: RMSNorm, GQA, q/k norms, SwiGLU, RoPE)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 3
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads; head_dim = hidden_size // num_heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 384
    """SwiGLU hidden width."""
    max_positions: int = 1024
    """Longest sequence (prompt + completion) the model accepts."""
    seed: int = 0
    """Initialisation seed: the same config and seed give bit-identical weights."""

    def __post_init__(self) -> None:
        if small := [f"{name}={getattr(self, name)}" for name in SIZES if not getattr(self, name) >= 1]:
            raise ValueError(f"model sizes must be >= 1, got {', '.join(small)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                "hidden_size must divide by num_heads and num_heads by num_kv_heads, got "
                f"{self.hidden_size}/{self.num_heads}/{self.num_kv_heads}"
            )


def build_model(config: TinyQwen3Config, vocab_size: int, pad_token_id: int) -> Qwen3ForCausalLM:
    """A freshly initialised model; deterministic given (config, vocab_size)."""
    hf_config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )
    hf_config.prodrl_tiny = asdict(config)
    torch.manual_seed(config.seed)
    return Qwen3ForCausalLM(hf_config).eval()


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads batches: the tokenizer's pad token, else its end-of-sequence token (Llama 3
    has no pad token). Padded positions are masked and never recorded, so any id of the vocabulary
    pads."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def load_model(path: str | Path) -> PreTrainedModel:
    """Load an HF checkpoint directory (safetensors) in fp32 for CPU work. A weight it lacks (e.g. its
    name garbled on disk) is an error: transformers would initialize it at random, with a warning."""
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    if info["missing_keys"]:
        raise ValueError(
            f"the weights in {path} lack {sorted(info['missing_keys'])}: corrupt, or another model's"
        )
    return model.eval()


def n_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
