"""The interface of a linear weight kept packed, and the fusion of several into one.

A ``QuantizedWeight`` is an ``[out_features, in_features]`` matrix that multiplies as it is
stored (``matmul``), looks up embedding rows without dequantizing the rest
(``embedding_rows``), and reorders its rows (``take_rows``: a GGUF's un-permuted q/k).
The model's fused projections (q/k/v, gate/up) are one ``concat_rows`` of their parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class QuantizedWeight(ABC):
    """A linear weight ``[out_features, in_features]`` held packed."""

    scheme: str
    """The format it is held in: a GGUF type's name ("Q4_1") or "int8"."""
    out_features: int
    in_features: int

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T``: ``[tokens, in]`` to ``[tokens, out]``, in ``x``'s dtype."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The ``[out, in]`` float32 matrix it multiplies by."""

    @abstractmethod
    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 ``[len(ids), in]``, dequantizing only those."""

    @abstractmethod
    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows ``index`` (reordered or selected)."""

    @abstractmethod
    def take_columns(self, start: int, end: int) -> QuantizedWeight:
        """The weight of input features ``[start, end)`` (a row-parallel rank's slice)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held."""

    @classmethod
    def concat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        """Weights of this format stacked by rows as one, or None where they do not
        stack (``concat_rows`` then runs each)."""
        return None


class ConcatenatedWeight(QuantizedWeight):
    """Weights of different formats stacked by rows: each multiplies, the outputs are
    concatenated (a Q4_K_M file's attn_q in Q4_K beside its attn_v in Q6_K)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.scheme = "+".join(sorted({part.scheme for part in parts}))
        self.out_features = sum(part.out_features for part in parts)
        self.in_features = parts[0].in_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.matmul(x) for part in self.parts], dim=1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]  # a fused projection is never an embedding

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows that keep the parts in order (each part's rows one run of ``index``, runs in
        the parts' order: a tensor-parallel rank's slice of q, k and v) stay a
        concatenation of the parts' own rows; any other order cannot."""
        ends = torch.tensor([part.out_features for part in self.parts]).cumsum(0)
        owner = torch.bucketize(index, ends, right=True)
        if len(index) > 1 and bool((owner[1:] < owner[:-1]).any()):
            raise ValueError(
                "rows of a concatenation of packed formats can be taken only part by part "
                "in order; reorder the parts' rows before concat_rows"
            )
        starts = ends - torch.tensor([part.out_features for part in self.parts])
        taken = [
            part.take_rows(index[owner == number] - starts[number])
            for number, part in enumerate(self.parts)
            if bool((owner == number).any())
        ]
        return taken[0] if len(taken) == 1 else ConcatenatedWeight(taken)

    def take_columns(self, start: int, end: int) -> QuantizedWeight:
        return ConcatenatedWeight([part.take_columns(start, end) for part in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of ``weights`` stacked by rows: a single packed matrix where they share a
    format (one matmul for q/k/v), else a ``ConcatenatedWeight``."""
    if len({weight.in_features for weight in weights}) != 1:
        raise ValueError("weights concatenated by rows must share in_features")
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    if all(type(weight) is type(first) for weight in weights):
        joined = type(first).concat(weights)
        if joined is not None:
            return joined
    return ConcatenatedWeight(weights)


def packed_weight(module: nn.Module) -> QuantizedWeight | None:
    """The packed weight the loader gave a linear or an embedding, if any
    (``model/architectures/layers.py`` runs it)."""
    return getattr(module, "packed_weight", None)


def attach_packed_weight(module: nn.Module, weight: QuantizedWeight) -> None:
    """Gives a linear or an embedding the packed weight it runs; set past ``nn.Module``'s
    attribute bookkeeping, which holds parameters and submodules only."""
    object.__setattr__(module, "packed_weight", weight)
