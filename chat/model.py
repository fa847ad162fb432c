"""Loading BlenderBot models and tokenizers, and building the offline presets.

Every model goes through one path: ``from_pretrained`` on a Hub id or a directory, safetensors
only, never remote code. The presets (``tiny``, ``random-400M``) are directories like any
other, built once (from a config and a byte-level BPE tokenizer trained on the shipped sample
data) and then loaded the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import torch
from huggingface_hub import constants as hub_constants
from transformers import (
    AutoTokenizer,
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    BlenderbotTokenizer,
    GenerationConfig,
)

from chat.layout import SAMPLE_DIR
from chat.prompt import SPECIAL_TOKENS

log = logging.getLogger(__name__)

# Presets are built locally (no Hub needed) and then loaded like any checkpoint directory.
# Both use a byte-level BPE tokenizer trained on the sample data with BlenderBot's special ids.
MODEL_PRESETS = {
    # Same architecture, shrunk so CPU training takes minutes (tests, offline demo).
    "tiny": dict(
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        dropout=0.1,
    ),
    # facebook/blenderbot-400M-distill's exact shape with random weights: for timing and
    # memory benchmarks where the Hub is unreachable (its replies are noise).
    "random-400M": dict(
        d_model=1280,
        encoder_layers=2,
        decoder_layers=12,
        encoder_attention_heads=32,
        decoder_attention_heads=32,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
        dropout=0.1,
        vocab_size=8008,
    ),
}
MAX_POSITIONS = 128
TOKENIZER_VOCAB = 2000


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says why and what to try (to train).
    ``reason`` is the why alone (the chat app gives its own advice: it serves, it does not train)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def cache_dir() -> Path:
    """Where built presets live (override with PERSONA_CHAT_CACHE)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "persona-chat"
    return Path(os.environ.get("PERSONA_CHAT_CACHE", default))


def preset_dir(name: str) -> Path:
    """Where preset ``name`` is built."""
    return cache_dir() / f"{name}-blenderbot"


def resolve(name_or_path: str) -> str:
    """Map a preset name to its directory (building it if needed); pass others through."""
    if name_or_path in MODEL_PRESETS:
        path = preset_dir(name_or_path)
        if not (path / "config.json").exists():
            build_preset(name_or_path, path)
        return str(path)
    return name_or_path


def _train_tokenizer(texts: list[str]) -> BlenderbotTokenizer:
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing

    # Order fixes the ids BlenderBot uses: pad 0, bos 1, eos 2, unk 3.
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    assert set(specials) == set(SPECIAL_TOKENS)
    bpe = ByteLevelBPETokenizer(add_prefix_space=True)
    bpe.train_from_iterator(
        texts, vocab_size=TOKENIZER_VOCAB, min_frequency=2, special_tokens=specials, show_progress=False
    )
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    tok = BlenderbotTokenizer(vocab=bpe.get_vocab(), merges=merges, add_prefix_space=True)
    # Like BlenderBot's own tokenizer: every sequence ends with </s>.
    tok._tokenizer.post_processor = TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.eos_token_id)]
    )
    tok.model_max_length = MAX_POSITIONS
    return tok


def build_preset(name: str, path: Path, seed: int = 0) -> Path:
    """Build preset ``name`` into ``path`` atomically (a half-built preset is never visible)."""
    texts = []
    for split in ("train", "validation"):
        with open(SAMPLE_DIR / f"{split}.jsonl") as fh:
            for line in fh:
                row = json.loads(line)
                texts += [row["texts"], row["labels"]]
    log.info("building the %s preset in %s", name, path)
    tokenizer = _train_tokenizer(texts)
    shape = {"vocab_size": len(tokenizer), **MODEL_PRESETS[name]}
    config = BlenderbotConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=MAX_POSITIONS,
        **shape,
    )
    torch.manual_seed(seed)
    model = BlenderbotForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        forced_eos_token_id=config.eos_token_id,
        max_length=60,
        min_length=0,
        num_beams=1,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def hub_reachable() -> bool:
    """Can the Hugging Face Hub be reached? One quick request, no retries, remembered for a
    minute. When it cannot, loading a Hub id would make huggingface_hub retry with back-off
    (~30 s and ~20 warnings) before failing; ``hub_options`` reads the local cache at once instead."""
    return not hub_constants.HF_HUB_OFFLINE and _probe_hub(int(time.monotonic() // 60))


@functools.lru_cache(maxsize=1)
def _probe_hub(minute: int) -> bool:
    try:
        httpx.head(hub_constants.ENDPOINT, timeout=3.0)
    except httpx.HTTPError:
        return False
    return True


def hub_options(name_or_path: str) -> dict:
    """``from_pretrained`` options for ``name_or_path``: a Hub id while the Hub is unreachable is
    read from the local cache only (found there, or a clear error at once)."""
    if Path(name_or_path).is_dir() or hub_reachable():
        return {}
    return {"local_files_only": True}


def load_error(name: str, err: Exception) -> ModelLoadError:
    """Why ``name`` could not be loaded, and what to try."""
    if Path(name).exists():
        return ModelLoadError(f"cannot load the model in {name}: {err}")
    if hub_constants.HF_HUB_OFFLINE:
        hub = "is switched off (HF_HUB_OFFLINE=1)"
    else:
        hub = "did not provide it" if hub_reachable() else "cannot be reached (offline?)"
    reason = f"cannot load model {name!r}: it is not a local directory, and the Hub {hub}"
    return ModelLoadError(
        f"{reason}. Check the spelling, run once with network access so it is cached, or use "
        "--model_name_or_path tiny (or random-400M) to work offline. "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
        reason=reason,
    )


def load_tokenizer(name_or_path: str):
    path = resolve(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, **hub_options(path))
    except (OSError, ValueError) as err:
        raise load_error(path, err) from None


# Attention kernels: "sdpa" lets PyTorch pick per call; "sdpa-<kernel>" allows only that fused
# kernel (plus the plain math one as a fallback for shapes it cannot do); "eager" is
# transformers' original attention. "auto" is the fastest one measured for this model's
# shapes (32 heads of 40 dims over 128/64 tokens) in docs/benchmarks.md.
AUTO_ATTENTION = "sdpa"
ATTENTION = ("auto", "sdpa", "eager", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")


def configure_attention(choice: str) -> str:
    """Apply an ATTENTION choice (process-wide for the sdpa kernels); return the
    ``attn_implementation`` to load models with."""
    if choice not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {choice!r}")
    choice = AUTO_ATTENTION if choice == "auto" else choice
    kernel = choice.removeprefix("sdpa-") if choice.startswith("sdpa-") else None
    torch.backends.cuda.enable_flash_sdp(kernel in (None, "flash"))
    torch.backends.cuda.enable_mem_efficient_sdp(kernel in (None, "efficient"))
    torch.backends.cuda.enable_cudnn_sdp(kernel in (None, "cudnn"))
    return "sdpa" if kernel else choice


def load_model(name_or_path: str, **kwargs) -> BlenderbotForConditionalGeneration:
    path = resolve(name_or_path)
    try:
        model = BlenderbotForConditionalGeneration.from_pretrained(
            path, use_safetensors=True, **hub_options(path), **kwargs
        )
    except (OSError, ValueError) as err:
        raise load_error(path, err) from None
    return model
