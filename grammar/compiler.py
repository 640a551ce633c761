"""Specs → matchers for one tokenizer: each source compiled once, kept in a bounded LRU.

Compiling is building an ``llguidance.LLMatcher`` for the spec (its lexer and parser over
this tokenizer's vocabulary); a request gets a ``deep_copy`` of the cached prototype, which
costs microseconds. ``EngineHost`` compiles off the engine thread before it queues the
request, so ``add_request`` on the engine thread finds the prototype cached.

    spec ─▶ cache hit? ─yes─▶ deep_copy ─▶ GrammarMatcher
               │no
               └─▶ LLMatcher(tokenizer, grammar)  (ms; seconds for a huge schema)
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import tokenizers

from pdserve.grammar.matcher import GrammarMatcher
from pdserve.grammar.spec import GrammarError, GrammarSpec

DEFAULT_CACHE_SIZE = 256


@dataclass(slots=True)
class CompilerStats:
    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_s: float = 0.0


class GrammarCompiler:
    """Over ``tokenizer``'s vocabulary; the llguidance tokenizer is built from it on first
    use (≈ 0.4 s for a 49k vocabulary), so an engine that never sees a grammar never pays."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._backend = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.stats = CompilerStats()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The spec's prototype matcher, from the cache or compiled now; raises
        ``GrammarError`` with the compiler's reason."""
        with self._lock:
            prototype = self._cache.get(spec)
            if prototype is not None:
                self._cache.move_to_end(spec)
                self.stats.num_cache_hits += 1
                return prototype
        grammar = spec.llguidance_grammar()
        start = time.perf_counter()
        prototype = llguidance.LLMatcher(self._lltokenizer(), grammar)
        elapsed = time.perf_counter() - start
        if prototype.is_error():
            raise GrammarError(prototype.get_error().strip())
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_s += elapsed
            self._cache[spec] = prototype
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return prototype

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, for one request."""
        return GrammarMatcher(self.compile(spec).deep_copy())

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, spec: GrammarSpec) -> bool:
        """Compiled and cached (a hint: another thread may evict it before it is used)."""
        with self._lock:
            return spec in self._cache
