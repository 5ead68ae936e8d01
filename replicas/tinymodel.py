"""A tiny Llama model directory for running real vLLM without downloads.

The directory holds a ``config.json`` (2-layer Llama, hidden size 128, float32),
a byte-level tokenizer and ``model.safetensors`` with random weights drawn from
a fixed seed (numpy), so every host generates the same file and every replica
computes the same greedy tokens. The weights are scaled so that attention and
MLP matter and greedy output depends on the whole context (vLLM's
``load_format="dummy"`` weights are so small that greedy output is a short
loop, which makes a poor failover test). About 1.7 MB; meant for tests, demos
and CPU hosts, not for readable text.

The tokenizer has one token per byte (ids 0..255, id == byte value) plus a few
special tokens, so any UTF-8 text round-trips and a multi-byte character spans
several tokens; decoding an unfinished character gives U+FFFD.

``tokenizers``, ``transformers``, ``numpy`` and ``safetensors`` are imported
inside ``ensure_tiny_model``: they come with the ``vllm`` extras only.

CLI: ``python -m replicas.tinymodel DIR``.
"""

from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path

__all__ = ["ensure_tiny_model", "SPECIAL_TOKENS", "VOCAB_SIZE", "CHAT_TEMPLATE"]

# Ids follow the 256 byte tokens.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_BOS, _EOS, _PAD = 256, 257, 258

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    # head_dim 64: the CPU attention backend rejects small head sizes.
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "hidden_act": "silu",
    # room for long test streams (the vLLM tests set max_model_len 8192)
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": _BOS,
    "eos_token_id": _EOS,
    "pad_token_id": _PAD,
    "torch_dtype": "float32",
    "use_cache": True,
}

_GENERATION_CONFIG = {"bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD}

# Written last: its presence means the directory is complete.
_MARKER = "fairstream-tiny.json"
_MARKER_VERSION = 3
_WEIGHT_SEED = 20240611


def ensure_tiny_model(path: str | Path) -> Path:
    """Create the tiny model in ``path`` unless it is already there; return it.

    Raises ``FileExistsError`` if ``path`` holds some other model.
    """
    path = Path(path)
    if _made(path):
        return path
    # Replicas that share the directory start together: one writes, the
    # others wait for it and find the model made.
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _made(path):
            _make(path)
    return path


def _made(path: Path) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()).get("version") == _MARKER_VERSION
    except (OSError, ValueError):
        return False


def _make(path: Path) -> None:
    marker = path / _MARKER
    config = path / "config.json"
    if config.is_file():
        try:
            ours = json.loads(config.read_text()) == _CONFIG
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise FileExistsError(f"{path} holds another model; not overwriting it")
    _write_json(config, _CONFIG)
    _write_json(path / "generation_config.json", _GENERATION_CONFIG)
    _save_tokenizer(path)
    _save_weights(path / "model.safetensors")
    _write_json(marker, {"version": _MARKER_VERSION, "vocab_size": VOCAB_SIZE})


def _write_json(file: Path, data: dict) -> None:
    tmp = file.with_suffix(file.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(file)


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2 byte-level alphabet: byte b is the printable character alphabet[b].
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    # BPE without merges over the byte alphabet: one token per byte.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    # Portable across transformers 4 and 5: 5 writes chat_template.jinja and
    # names its own backend class; 4 reads the template from this file.
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.pop("backend", None)
    _write_json(cfg_file, cfg)
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}")


def _save_weights(file: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    c = _CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    qd = c["num_attention_heads"] * c["head_dim"]
    kvd = c["num_key_value_heads"] * c["head_dim"]
    rng = np.random.default_rng(_WEIGHT_SEED)

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        # std 1/sqrt(fan_in): every layer changes the residual stream by O(1).
        std = gain / np.sqrt(in_dim)
        return (rng.standard_normal((out_dim, in_dim)) * std).astype(np.float32)

    ones = np.ones(h, dtype=np.float32)
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32),
        "model.norm.weight": ones.copy(),
        # Large logits: wide gaps between the best and second-best token keep
        # greedy choices stable against float rounding (batching, prefill vs decode).
        "lm_head.weight": linear(v, h, gain=4.0),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones.copy()
        w[p + "post_attention_layernorm.weight"] = ones.copy()
        # Sharper attention so earlier tokens matter.
        w[p + "self_attn.q_proj.weight"] = linear(qd, h, gain=2.0)
        w[p + "self_attn.k_proj.weight"] = linear(kvd, h, gain=2.0)
        w[p + "self_attn.v_proj.weight"] = linear(kvd, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, qd)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    tmp = file.with_suffix(".tmp")
    save_file(w, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(file)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m replicas.tinymodel DIR", file=sys.stderr)
        return 2
    try:
        print(ensure_tiny_model(args[0]))
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
