"""Memory per rank of a planned run, estimated from the model's shapes before anything is launched.

The estimate counts what FSDP2 training with torchtitan keeps on one rank:

- sharded state: parameters, gradients and AdamW's two moments, each split over the ranks
  that shard the parameter (dense weights over FSDP x TP, experts over EP x expert-FSDP);
- transient unsharded parameters: FSDP all-gathers one block at a time and prefetches the
  next, so two blocks (or the embedding / output, whichever is largest) are whole at once,
  plus the block's unsharded gradients before the reduce-scatter;
- activations saved for backward, per token of the local batch, for the chosen activation
  checkpointing mode (formula in `_layer_activation_elems`);
- logits of the loss: torchtitan's ChunkedLossWrapper materialises one chunk at a time;
- the optimizer step's temporaries (foreach AdamW) and the embedding's dense gradient.

It ignores runtime reserves, allocator fragmentation and compiler scratch, which is why a
plan is refused above `USABLE_FRACTION` of the device's memory rather than at 100%.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

USABLE_FRACTION = 0.9
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions the estimate needs, read off a model built on the meta device."""

    params: int
    layers: int
    hidden: int
    vocab: int
    q_dim: int
    kv_dim: int
    ffn_dim: int  # dense MLP intermediate size, 0 in MoE layers
    experts: int = 0
    expert_ffn_dim: int = 0
    top_k: int = 0
    expert_params: int = 0  # parameters inside routed experts (sharded by EP)
    layer_params: int = 0  # parameters of the largest block
    embedding_params: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        """Read the shape from torchtitan (`tok_embeddings`, `wq`, `w1`) or HF (`q_proj`) names."""
        named = dict(model.named_parameters())
        params = sum(p.numel() for p in named.values())
        embed = next(p for n, p in named.items() if "embed" in n and p.dim() == 2)
        vocab, hidden = embed.shape
        per_layer: dict[int, int] = {}
        for name, p in named.items():
            if m := _LAYER.search(name):
                per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + p.numel()
        first = {
            n[_LAYER.search(n).end() :]: p
            for n, p in named.items()
            if _LAYER.search(n) and int(_LAYER.search(n).group(1)) == min(per_layer)
        }

        def out_dim(*suffixes: str) -> int:
            for n, p in first.items():
                if "expert" not in n and n.endswith(suffixes):
                    return p.shape[0]
            return 0

        def in_dim(*suffixes: str) -> int:
            for n, p in first.items():
                if n.endswith(suffixes):
                    return p.shape[1]
            return 0

        # The attention output projection reads q_dim; torchtitan may fuse wq/wk/wv into wqkv.
        q_dim = in_dim("wo.weight", "o_proj.weight")
        kv_dim = out_dim("wk.weight", "k_proj.weight")
        if not kv_dim and (fused := out_dim("wqkv.weight", "qkv_proj.weight")):
            kv_dim = (fused - q_dim) // 2
        experts = expert_ffn = expert_params = 0
        for n, p in first.items():
            if "expert" in n and p.dim() == 3:
                expert_params += p.numel()
                experts = p.shape[0]
                if any(k in n for k in ("w2", "down")):
                    expert_ffn = p.shape[2] if p.shape[1] == hidden else p.shape[1]
        top_k = (
            next(
                (
                    int(v)
                    for m in model.modules()
                    for a in ("top_k", "num_experts_per_tok")
                    if isinstance(v := getattr(m, a, None), int)
                ),
                0,
            )
            if experts
            else 0
        )
        return cls(
            params=params,
            layers=len(per_layer),
            hidden=hidden,
            vocab=vocab,
            q_dim=q_dim,
            kv_dim=kv_dim,
            ffn_dim=out_dim("w1.weight", "gate_proj.weight"),
            experts=experts,
            expert_ffn_dim=expert_ffn,
            top_k=top_k,
            expert_params=expert_params * len(per_layer),
            layer_params=max(per_layer.values(), default=0),
            embedding_params=embed.numel(),
        )


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes per rank, by kind, and what the device offers."""

    sharded_state: int
    unsharded_transient: int
    activations: int
    logits: int
    total: int
    available: int
    activation_checkpoint: str

    @property
    def fits(self) -> bool:
        return self.total <= self.available * USABLE_FRACTION

    def to_dict(self) -> dict[str, object]:
        gib = {k: round(v / 1024**3, 3) for k, v in asdict(self).items() if isinstance(v, int)}
        return {
            **{f"{k}_gib": v for k, v in gib.items()},
            "activation_checkpoint": self.activation_checkpoint,
            "usable_fraction": USABLE_FRACTION,
            "fits": self.fits,
        }


def _layer_activation_elems(shape: ModelShape) -> int:
    """Elements saved for backward per token by one block without checkpointing.

    Attention block: norm input and output (2h), q/k after their norms and v (q + 2kv),
    q/k norm inputs (q + kv), attention output which is also the wo input (q): 4h-ish total
    of 2h + 3q + 3kv. Dense MLP: w1 and w3 outputs, SiLU output and the product fed to w2 (4F),
    plus the ffn norm input and output (2h). A MoE layer saves the same per routed copy of a
    token (top_k x (h + 4F)) plus router logits (E).
    """
    attention = 2 * shape.hidden + 3 * shape.q_dim + 3 * shape.kv_dim
    if shape.experts:
        mlp = 2 * shape.hidden + shape.top_k * (shape.hidden + 4 * shape.expert_ffn_dim)
        mlp += shape.experts
    else:
        mlp = 2 * shape.hidden + 4 * shape.ffn_dim
    return attention + mlp


def meta_model(config: Any) -> torch.nn.Module:
    """The recipe's model built on the meta device: shapes and dtypes, no memory."""
    import torch

    with torch.device("meta"):
        return config.model_spec.model.build()


def estimate_memory(
    shape: ModelShape,
    *,
    seq_len: int,
    local_batch: int,
    activation_checkpoint: str,
    available: int,
    dense_shards: int,
    expert_shards: int,
    tensor_parallel: int = 1,
    training_dtype_bytes: int = 4,
    compute_dtype_bytes: int = 2,
    loss_chunks: int = 1,
    fsdp: bool = True,
) -> MemoryEstimate:
    """Estimate bytes per rank; `activation_checkpoint` is "none", "selective" or "full".

    `fsdp`: whether FSDP wraps the model (torchtitan applies it when more than one rank shards);
    without it nothing is gathered and `compute_dtype_bytes` should be the training dtype's.
    """
    dense_params = shape.params - shape.expert_params
    # Parameters, gradients and AdamW exp_avg / exp_avg_sq all live in the training dtype.
    state_bytes = 4 * training_dtype_bytes
    sharded = state_bytes * (dense_params / dense_shards + shape.expert_params / expert_shards)

    # FSDP keeps the current and the prefetched block unsharded (compute dtype) and one block's
    # unsharded gradients (reduce dtype float32) until the reduce-scatter.
    largest = max(shape.layer_params, shape.embedding_params) / tensor_parallel
    transient = (2 * largest * compute_dtype_bytes + largest * 4) if fsdp else 0

    tokens = seq_len * local_batch
    per_layer = _layer_activation_elems(shape) * compute_dtype_bytes * tokens / tensor_parallel
    block_input = shape.hidden * compute_dtype_bytes * tokens
    if activation_checkpoint == "full":
        # Each block keeps its input; backward recomputes one block at a time.
        activations = shape.layers * block_input + per_layer
    elif activation_checkpoint == "selective":
        # torchtitan's op-level SAC keeps every other matmul output and attention: about half.
        activations = shape.layers * (block_input + per_layer / 2) + per_layer / 2
    else:
        activations = shape.layers * per_layer
    activations += 2 * block_input  # embedding output and final norm

    # Logits in compute dtype, their float32 upcast and float32 gradient, one chunk at a time.
    logits = (
        tokens * shape.vocab * (compute_dtype_bytes + 8) / max(loss_chunks, 1) / tensor_parallel
    )

    # AdamW's foreach step allocates about two parameter-sized temporaries (the bias-corrected
    # second moment's square root and the update), and the embedding's backward a dense
    # gradient before it is accumulated: transient, but at the step's peak.
    local_params = dense_params / dense_shards + shape.expert_params / expert_shards
    transient += training_dtype_bytes * (2 * local_params + shape.embedding_params / dense_shards)

    total = int(sharded + transient + activations + logits)
    return MemoryEstimate(
        sharded_state=int(sharded),
        unsharded_transient=int(transient),
        activations=int(activations),
        logits=int(logits),
        total=total,
        available=int(available),
        activation_checkpoint=activation_checkpoint,
    )
