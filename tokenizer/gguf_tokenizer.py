"""A model's tokenizer and chat template, rebuilt from a GGUF file's metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the tokenizer as metadata::

    tokenizer.ggml.model        "gpt2" (byte-level BPE) or "llama" (SentencePiece; Gemma's)
    tokenizer.ggml.pre          how text is split before BPE ("smollm", "llama-bpe", ...)
    tokenizer.ggml.tokens       [token string per id]     spelled in GPT-2's byte alphabet
    tokenizer.ggml.merges       ["Ġ t", "h e", ...]       best first (byte-level only)
    tokenizer.ggml.scores       [float per id]            SentencePiece only
    tokenizer.ggml.token_type   [1 normal | 3 control | 4 user-defined | ... per id]
    tokenizer.ggml.{bos,eos,eot,eom}_token_id, tokenizer.ggml.add_bos_token
    tokenizer.chat_template     jinja source

From these a ``tokenizers.Tokenizer`` is built as transformers builds it for the same
file: BPE over the vocabulary and merges, a byte-level pre-tokenizer and decoder, control
tokens added as special (matched whole, dropped by ``decode``), user-defined ones added as
plain tokens, and a BOS post-processor when ``add_bos_token`` is set. Every end id the
file declares (eos, end-of-turn, end-of-message) ends generation.

A SentencePiece vocabulary (``"llama"``) is built as transformers builds it: a BPE with
byte fallback (``<0xC3>``) over the tokens as spelled, ``"▁"`` for a space, and merges that
the file does not store, recovered from the vocabulary (``_sentencepiece_merges``). Gemma's
replaces spaces by a normalizer and ranks merges by the tokens' order; Llama 2's and
Mistral's (any other architecture) prepend ``"▁"`` to the text (``Metaspace``) and rank
merges by the tokens' scores. BOS is added unless the file says not to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from pdserve.checkpoint.gguf_file import require
from pdserve.tokenizer.chat_template import ChatTemplate
from pdserve.tokenizer.tokenizer import HFTokenizer, bytes_to_unicode

# llama.cpp's token types (llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4
_SENTENCEPIECE_SPACE = "\u2581"  # "▁"
# The architectures whose SentencePiece vocabulary is Gemma's (module doc).
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_END_TOKEN_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)

# Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's and Qwen3's: Llama 3's with every digit alone (LLAMA_VOCAB_PRE_TYPE_QWEN2).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo and later; LLAMA_VOCAB_PRE_TYPE_TEKKEN): words split at case changes.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_split() -> pre_tokenizers.PreTokenizer:
    """Every digit alone, then GPT-2's split (SmolLM's ``tokenizer.json`` and llama.cpp agree)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    """Text cut by ``pattern``, each piece then spelled in the byte alphabet."""

    def split() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return split


PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "smollm": _smollm_split,
    "llama-bpe": _regex_split(_LLAMA3_SPLIT),
    "llama3": _regex_split(_LLAMA3_SPLIT),
    "qwen2": _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_split(_QWEN2_SPLIT),
    "tekken": _regex_split(_TEKKEN_SPLIT),
}


def tokenizer_from_gguf(metadata: dict[str, Any]) -> HFTokenizer:
    """The tokenizer (with its chat template, if any) that ``metadata`` describes."""
    kind = require(metadata, "tokenizer.ggml.model")
    tokens: list[str] = require(metadata, "tokenizer.ggml.tokens")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        backend, vocab = _byte_level_backend(metadata, tokens)
    elif kind == "llama":
        if metadata.get("general.architecture") in GEMMA_ARCHITECTURES:
            backend, vocab = _gemma_sentencepiece_backend(metadata, tokens)
        else:
            backend, vocab = _llama_sentencepiece_backend(metadata, tokens)
        add_bos = add_bos is None or add_bos  # llama.cpp's default for SentencePiece
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: byte-level BPE "
            "('gpt2') and SentencePiece ('llama')"
        )
    _add_special_tokens(backend, vocab, tokens, token_types)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    eos_ids = list(dict.fromkeys(metadata[key] for key in _END_TOKEN_KEYS if key in metadata))
    if not eos_ids:
        raise ValueError(
            "the GGUF file declares no end-of-sequence token (tokenizer.ggml.eos_token_id)"
        )
    template_source = metadata.get("tokenizer.chat_template")
    chat_template = None
    if template_source is not None:
        bos_token = tokens[bos_id] if bos_id is not None else ""
        chat_template = ChatTemplate(
            template_source, bos_token=bos_token, eos_token=tokens[eos_ids[0]]
        )
    return HFTokenizer(backend, eos_ids, chat_template, vocab_size=len(tokens))


def _byte_level_backend(
    metadata: dict[str, Any], tokens: list[str]
) -> tuple[Tokenizer, dict[str, int]]:
    """Byte-level BPE over the file's merges, split by its pre-tokenizer; and its vocabulary."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    vocab = _byte_level_vocab(tokens)
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=_merges(metadata)))
    except Exception as error:  # noqa: BLE001 — the Rust binding raises a bare Exception
        raise ValueError(
            f"the GGUF tokenizer's merges do not fit its vocabulary: {error}"
        ) from None
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _gemma_sentencepiece_backend(
    metadata: dict[str, Any], tokens: list[str]
) -> tuple[Tokenizer, dict[str, int]]:
    """Gemma's SentencePiece vocabulary as a BPE with byte fallback (module doc).

    A token of spaces only is stored with real spaces (``"  "``) but is looked up after the
    normalizer turned them into ``"▁▁"``: it is re-spelled so."""
    spelled = [
        _SENTENCEPIECE_SPACE * len(token) if " " in token and not token.strip() else token
        for token in tokens
    ]
    vocab = {token: index for index, token in enumerate(spelled)}
    unknown = spelled[metadata.get("tokenizer.ggml.unknown_token_id", 3)]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_sentencepiece_merges(vocab, {token: -index for token, index in vocab.items()}),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", _SENTENCEPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend, vocab


def _llama_sentencepiece_backend(
    metadata: dict[str, Any], tokens: list[str]
) -> tuple[Tokenizer, dict[str, int]]:
    """Llama 2's and Mistral's SentencePiece vocabulary as a BPE with byte fallback (module
    doc): ``"▁"`` prepended to the text's start, merges ranked by the tokens' scores."""
    vocab = {token: index for index, token in enumerate(tokens)}
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = _sentencepiece_merges(vocab, dict(zip(tokens, scores)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SENTENCEPIECE_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(_SENTENCEPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend, vocab


def _sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, best first: every split of a token
    into two tokens of the vocabulary, ranked by the token's score (Gemma's: minus its
    position, since its scores do not follow its merge order), then the longer left part
    first; equal ranks keep the tokens' order, a token's splits by their parts' ids
    (transformers' ``generate_merges``, which this equals)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in scores.items():
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        splits.sort(key=lambda split: (vocab[split[0]], vocab[split[1]]))
        ranked.extend((-score, -len(left), -len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda merge: merge[:3])
    return [(left, right) for _, _, _, left, right in ranked]


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a token written in plain UTF-8 rather than the byte alphabet is re-spelled."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return {
        token
        if set(token) <= alphabet
        else "".join(spelling[byte] for byte in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    merges: list[str] = require(metadata, "tokenizer.ggml.merges")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    return pairs


def _add_special_tokens(
    backend: Tokenizer, vocab: dict[str, int], tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens (``<|im_end|>``) as specials; user-defined ones (``<think>``) as plain
    added tokens. Both are matched whole in text instead of being cut into BPE pieces.

    Only tokens the vocabulary spells as written are added: adding any other would give it
    a new id past the model's vocabulary (transformers skips them the same way)."""
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types)
            if kind == _CONTROL and token in vocab
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types)
            if kind == _USER_DEFINED and token in vocab
        ]
    )
