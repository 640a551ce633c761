"""pdserve.grammar: structured outputs' grammars (llguidance), with no torch.

    GrammarSpec      what the output must match; travels with SamplingParams
    GrammarCompiler  spec → prototype matcher, one per source (bounded LRU)
    GrammarMatcher   one request's state in its grammar

The gateway validates specs here (a 400 with the compiler's reason); the engine masks
logits with the matchers (``engine/token_bitmask.py``).
"""

from pdserve.grammar.compiler import CompilerStats, GrammarCompiler
from pdserve.grammar.matcher import GrammarMatcher
from pdserve.grammar.spec import MAX_GRAMMAR_SOURCE_BYTES, GrammarError, GrammarSpec

__all__ = [
    "MAX_GRAMMAR_SOURCE_BYTES",
    "CompilerStats",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
]
