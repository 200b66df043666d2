"""A tiny random Llama (or hybrid-SWA Mellum) written as a Hugging Face model folder, for SGLang's
real server to load.

No download: `config.json`, a character-level `tokenizer.json` (one token per printable ASCII
character, so a prompt of N characters is about N tokens and page counts are easy to reason
about), a chat template, and random bf16 weights in `model.safetensors`, all made here. The
weights are random, so the answers are noise; what the model is for is real prefill work, real KV,
and greedy outputs that must come out the same whether a prefix was recomputed or loaded from a tier.

Every token id decodes to visible text (no byte tokens, no unused ids): SGLang's streamed chat
holds back a token whose text is empty or an unfinished UTF-8 character and can then drop its
logprob, and the comparisons here need one logprob per output token. (Special tokens decode to
text too when a request sets `skip_special_tokens: false`, as `http_load.chat` does.)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
FORMAT = 2  # bumped whenever what write_model writes changes, so an old folder is rewritten
FAMILIES = ("llama", "mellum", "lfm2")
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)


@dataclass(frozen=True)
class HFModelSpec:
    """The shape of the model (the defaults: the facts file's 4 layers, hidden 256, 2 KV heads of 64)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    max_positions: int = 32768
    seed: int = 0
    # "llama"; "mellum": SGLang's hybrid sliding-window model (MellumForCausalLM), its layers
    # alternating sliding (window `sliding_window` tokens) and full attention, dense MLPs -- SGLang
    # then keeps an SWA sidecar pool beside the KV pool and calls the storage backend's v2 interface;
    # "lfm2": Lfm2ForCausalLM, layers alternating short convolution (its state in SGLang's Mamba
    # pool, a sidecar too) and full attention
    family: str = "llama"
    sliding_window: int = 128

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V of every layer for one token, computed (and cached) in `dtype`."""
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if dtype == "float32" else 2)


# The demo's and the SGLang-server bench's shape: the same model with a wide MLP, so that prefill
# compute -- what a cached prefix saves -- outweighs attention, which SGLang's CPU attention backend
# (torch_native) computes over the whole sequence even when the prefix is cached. Measured through
# the real server on 2 cores of an AMD EPYC in fp32, a 3,000-token prompt: recomputed 1.84 s, its
# next turn continued from cache 0.27 s; MLP 16,384: 4.2 s / 0.47 s; MLP 4,096: 1.0 s / 0.27 s.
WIDE_MLP = HFModelSpec(intermediate=8192)


def _tokenizer_vocab() -> Dict[str, int]:
    vocab = {ch: i for i, ch in enumerate(CHARACTERS)}
    for s in SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    return vocab


def write_model(folder: str, spec: HFModelSpec = HFModelSpec()) -> str:
    """Write the model into `folder` (kept as it is when it already holds this spec); returns folder."""
    stamp = os.path.join(folder, "radixtier-model.json")
    written = {"format": FORMAT, **asdict(spec)}
    try:
        with open(stamp) as f:
            if json.load(f) == written:
                return folder
    except (OSError, ValueError):
        pass
    if spec.family not in FAMILIES:
        raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {spec.family!r}")
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models

    os.makedirs(folder, exist_ok=True)
    vocab = _tokenizer_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token a character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "model_max_length": spec.max_positions, "chat_template": CHAT_TEMPLATE,
                   "add_bos_token": False}, f)
    common = dict(vocab_size=len(vocab), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, bos_token_id=vocab["<s>"],
                  eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"], tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    if spec.family == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        kinds = ["conv" if i % 2 == 0 else "full_attention" for i in range(spec.layers)]
        common.pop("head_dim")
        cfg = Lfm2Config(**common, layer_types=kinds, block_auto_adjust_ff_dim=False)
        model = Lfm2ForCausalLM(cfg)
    elif spec.family == "mellum":
        from transformers import MellumConfig, MellumForCausalLM

        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)]
        cfg = MellumConfig(**common, sliding_window=spec.sliding_window, layer_types=kinds,
                           mlp_layer_types=["dense"] * spec.layers)
        model = MellumForCausalLM(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    model.to(torch.bfloat16).save_pretrained(folder)
    with open(stamp, "w") as f:
        json.dump(written, f)
    return folder
