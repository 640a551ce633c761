"""Mixture-of-experts feed-forward: a router picks ``top_k`` SwiGLU experts per token.

Qwen3-MoE (``mlp.gate``, ``mlp.experts.{e}.gate_proj / up_proj / down_proj``) and Mixtral
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1 / w3 / w2``) differ only in
names and in whether the top-k weights are renormalised (``MoEConfig``): one module serves
both, its experts built with the checkpoint's names so weights load unrenamed.

A step's tokens are computed grouped by expert, not per token: the (token, expert) pairs of
the whole step are sorted by expert, and one grouped matmul (``torch._grouped_mm``) runs
every expert over its own rows, each expert's rows ending where the running count of its
pairs says, with no Python loop over experts and no value read on the host (so a CUDA graph
captures the step whole)::

    router:   probs = softmax(x @ gate)          [tokens, experts]   (float32)
              weight, expert = topk(probs, k)    [tokens, k]         (renormalised or not)
    grouped:  pairs sorted by expert ──▶ | e0: rows 3 7 9 | e1: rows 0 3 | e2: - | e3: 7 |
              ends = searchsorted(sorted, e, right)  3               5        5      6
              y = grouped_mm(silu(gate) * up) ─▶ grouped_mm(down)   [pairs, hidden]
    back:     y in (token, choice) order, times its weight, summed over the k choices

so a step costs about what a dense MLP of ``k`` experts' width costs, not ``num_experts`` ×.
Where the grouped matmul does not run as one kernel (on CPU, strides of the hidden or expert
width not a multiple of 16 bytes; on CUDA, anything but bfloat16 on Hopper or Blackwell),
each expert that got rows runs its own pair of matmuls over them, and the decode step is not
captured in a CUDA graph (``engine/decode_graphs.py``).

DeepSeek-V2/V3 (``mlp.gate``, ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``) route in
float32 their own way (``DeepSeekRouting``: softmax or sigmoid scores, a group limit, a
correction bias on the choice, a scale on the weights) and add always-on shared experts,
one dense SwiGLU of their summed width, to every token's output.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.architectures.layers import GatedMLP
from pdserve.model.model_config import DeepSeekRouting, ModelConfig, MoEConfig


def grouped_matmul_serves(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these stacked experts as one kernel here. On CPU it
    needs rows whose strides are multiples of 16 bytes (tried once, on two rows of the model's
    shapes). On CUDA its one kernel takes bfloat16 on Hopper and Blackwell (compute capability
    9 and 10); elsewhere torch runs it group by group, reading the groups' ends on the host,
    which a CUDA graph cannot capture: those take the loop over experts, eagerly."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if gate_up.is_cuda:
        major, _ = torch.cuda.get_device_capability(gate_up.device)
        return gate_up.dtype == torch.bfloat16 and major in (9, 10)
    hidden = gate_up.shape[1]
    rows = gate_up.new_zeros(2, hidden)
    ends = torch.tensor([1] + [2] * (gate_up.shape[0] - 1), dtype=torch.int32, device=rows.device)
    try:
        torch._grouped_mm(rows, gate_up, offs=ends)
        torch._grouped_mm(rows.new_zeros(2, down.shape[1]), down, offs=ends)
    except RuntimeError:
        return False
    return True


class _Expert(nn.Module):
    """One SwiGLU expert, its three projections under the checkpoint's names."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))
        self.names = names

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        gate, up, down = (cast(nn.Linear, getattr(self, name)) for name in self.names)
        return gate, up, down


class SparseMoE(nn.Module):
    """``gate`` (the router, ``[experts, hidden]``) and ``experts``; see the module doc."""

    def __init__(self, config: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            _Expert(config.hidden_size, moe.intermediate_size, moe.expert_names)
            for _ in range(moe.num_experts)
        )
        routing = moe.deepseek_routing
        if routing is not None and routing.score_correction_bias:
            # Under the router, as the checkpoints name it: gate.e_score_correction_bias.
            self.gate.register_buffer("e_score_correction_bias", torch.empty(moe.num_experts))
        self.shared_experts = (
            GatedMLP(config.hidden_size, moe.shared_intermediate_size)
            if moe.shared_intermediate_size
            else None
        )

    def fuse_weights(self) -> None:
        """Stacks the experts transposed: ``gate_up [E, hidden, 2·I]``, ``down [E, I, hidden]``."""
        experts = [cast(_Expert, expert).projections() for expert in self.experts]
        self.gate_t = self.gate.weight.detach().t().contiguous()
        if self.moe.deepseek_routing is not None:
            self.gate_t = self.gate_t.float()
        if self.shared_experts is not None:
            self.shared_experts.fuse_weights()
        self.gate_up = torch.stack(
            [torch.cat([gate.weight, up.weight]).t() for gate, up, _ in experts]
        ).contiguous()
        self.down = torch.stack([down.weight.t() for _, _, down in experts]).contiguous()
        self.grouped_matmul = grouped_matmul_serves(self.gate_up, self.down)
        # Each expert's id, the bounds its pairs end at in the sorted order (``forward``).
        self.expert_ids = torch.arange(self.moe.num_experts, device=self.gate_up.device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts and their float32 weights, ``[tokens, top_k]`` each."""
        moe, routing = self.moe, self.moe.deepseek_routing
        if routing is None:
            probs = torch.softmax(torch.mm(x, self.gate_t).float(), dim=-1)
            weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
        else:
            weights, chosen = self._deepseek_route(torch.mm(x.float(), self.gate_t), routing)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if routing is not None:
            weights = weights * routing.routed_scaling_factor
        return weights, chosen

    def _deepseek_route(
        self, logits: torch.Tensor, routing: DeepSeekRouting
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose among the best groups by the (bias-corrected) scores; weigh by the raw ones."""
        scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if routing.score_correction_bias:
            choice = scores + cast(torch.Tensor, self.gate.e_score_correction_bias).float()
        if routing.num_groups > 1:
            grouped = choice.view(choice.shape[0], routing.num_groups, -1)
            group_scores = grouped.topk(routing.group_score_top, dim=-1).values.sum(dim=-1)
            best_groups = torch.topk(group_scores, routing.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool)
            allowed.scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        chosen = torch.topk(choice, self.moe.top_k, dim=-1).indices
        return scores.gather(1, chosen), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, chosen = self.route(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs by expert
        # Where each expert's pairs end: a search, since bincount on CUDA reads its input's
        # range on the host.
        ends = torch.searchsorted(flat[order], self.expert_ids, right=True, out_int32=True)
        grouped = x[order // moe.top_k]
        if self.grouped_matmul:
            expert_out = self._grouped(grouped, ends)
        else:
            expert_out = self._expert_by_expert(grouped, ends)
        # Back to (token, choice) order, weighed, summed over each token's choices.
        by_pair = expert_out.index_select(0, torch.argsort(order))
        weighed = by_pair.view(x.shape[0], moe.top_k, -1) * weights.to(x.dtype)[..., None]
        out = weighed.sum(dim=1)
        if self.shared_experts is not None:
            out += self.shared_experts.forward(x)
        return out

    def _grouped(self, grouped: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Every expert over its rows of ``grouped`` (rows sorted by expert, expert ``e``'s
        ending at ``ends[e]``): two grouped matmuls, no host value."""
        intermediate = self.moe.intermediate_size
        gate_up = torch._grouped_mm(grouped, self.gate_up, offs=ends)
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        return torch._grouped_mm(activated, self.down, offs=ends)

    def _expert_by_expert(self, grouped: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``_grouped`` where torch's grouped matmul does not take these weights: one pair of
        matmuls per expert that got rows, the rows' counts read on the host."""
        intermediate = self.moe.intermediate_size
        out = torch.empty_like(grouped)
        start = 0
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                gate_up = torch.mm(grouped[start:end], self.gate_up[expert])
                activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
                out[start:end] = torch.mm(activated, self.down[expert])
            start = end
        return out
