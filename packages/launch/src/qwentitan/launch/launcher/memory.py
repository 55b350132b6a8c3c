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
# A CPU rank's memory before its model: Python, torch, torchtitan and the modeling stack
# imported, gloo's buffers, the data loader. A tiny_dense rank measured 1.28 GiB RSS (of 64 on
# one host) where its model's estimate was 0.23 GiB; on a device the host holds this apart.
CPU_PROCESS_BYTES = 1 << 30
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
        # The attention output projection reads q_dim; torchtitan may fuse wq/wk/wv into wqkv.
        q_dim = _in_dim(first, "wo.weight", "o_proj.weight")
        kv_dim = _out_dim(first, "wk.weight", "k_proj.weight")
        if not kv_dim and (fused := _out_dim(first, "wqkv.weight", "qkv_proj.weight")):
            kv_dim = (fused - q_dim) // 2
        experts, expert_ffn, expert_params = _experts(first, hidden)
        return cls(
            params=sum(p.numel() for p in named.values()),
            layers=len(per_layer),
            hidden=hidden,
            vocab=vocab,
            q_dim=q_dim,
            kv_dim=kv_dim,
            ffn_dim=_out_dim(first, "w1.weight", "gate_proj.weight"),
            experts=experts,
            expert_ffn_dim=expert_ffn,
            top_k=_top_k(model) if experts else 0,
            expert_params=expert_params * len(per_layer),
            layer_params=max(per_layer.values(), default=0),
            embedding_params=embed.numel(),
        )


def _out_dim(layer: dict[str, Any], *suffixes: str) -> int:
    """Rows of the first dense (non-expert) weight of `layer` named with one of `suffixes`."""
    for n, p in layer.items():
        if "expert" not in n and n.endswith(suffixes):
            return p.shape[0]
    return 0


def _in_dim(layer: dict[str, Any], *suffixes: str) -> int:
    for n, p in layer.items():
        if n.endswith(suffixes):
            return p.shape[1]
    return 0


def _experts(layer: dict[str, Any], hidden: int) -> tuple[int, int, int]:
    """(experts, expert FFN size, expert parameters) of one layer's stacked expert weights."""
    experts = expert_ffn = expert_params = 0
    for n, p in layer.items():
        if "expert" in n and p.dim() == 3:
            expert_params += p.numel()
            experts = p.shape[0]
            if any(k in n for k in ("w2", "down")):
                expert_ffn = p.shape[2] if p.shape[1] == hidden else p.shape[1]
    return experts, expert_ffn, expert_params


def _top_k(model: torch.nn.Module) -> int:
    for module in model.modules():
        for name in ("top_k", "num_experts_per_tok"):
            if isinstance(value := getattr(module, name, None), int):
                return value
    return 0


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
    process: int = 0
    """The rank's process before its model, counted where the model's memory is the host's."""

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


def estimate_for(
    config: Any, shape: ModelShape, dims: Any, topology: Any, ac: str
) -> MemoryEstimate:
    """`estimate_memory` of a recipe's config under torchtitan's `ParallelDims` on a Topology."""
    # torchtitan casts to the mixed-precision dtype only through fully_shard, which it applies
    # when more than one rank shards (dp_shard x cp > 1); otherwise everything is the training dtype.
    fsdp = dims.dp_shard * dims.cp > 1
    training_bytes = 4 if config.training.dtype == "float32" else 2
    compute_bytes = (
        2 if fsdp and config.training.mixed_precision_param == "bfloat16" else training_bytes
    )
    shards = dims.dp_shard * dims.cp * dims.tp
    return estimate_memory(
        shape,
        seq_len=config.training.seq_len,
        local_batch=config.training.local_batch_size,
        activation_checkpoint=ac,
        available=topology.memory_per_rank_bytes,
        dense_shards=shards,
        expert_shards=shards,
        tensor_parallel=dims.tp,
        training_dtype_bytes=training_bytes,
        compute_dtype_bytes=compute_bytes,
        loss_chunks=getattr(config.loss, "num_chunks", 1),
        fsdp=fsdp,
        process_bytes=CPU_PROCESS_BYTES if topology.device_type == "cpu" else 0,
    )


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
    process_bytes: int = 0,
) -> MemoryEstimate:
    """Estimate bytes per rank; `activation_checkpoint` is "none", "selective" or "full".

    `fsdp`: whether FSDP wraps the model (torchtitan applies it when more than one rank shards);
    without it nothing is gathered and `compute_dtype_bytes` should be the training dtype's.
    """
    dense_params = shape.params - shape.expert_params
    local_params = dense_params / dense_shards + shape.expert_params / expert_shards
    # Parameters, gradients and AdamW exp_avg / exp_avg_sq all live in the training dtype.
    sharded = 4 * training_dtype_bytes * local_params

    # FSDP keeps the current and the prefetched block unsharded (compute dtype) and one block's
    # unsharded gradients (reduce dtype float32) until the reduce-scatter.
    largest = max(shape.layer_params, shape.embedding_params) / tensor_parallel
    transient = (2 * largest * compute_dtype_bytes + largest * 4) if fsdp else 0
    # AdamW's foreach step allocates about two parameter-sized temporaries (the bias-corrected
    # second moment's square root and the update), and the embedding's backward a dense
    # gradient before it is accumulated: transient, but at the step's peak.
    transient += training_dtype_bytes * (2 * local_params + shape.embedding_params / dense_shards)

    tokens = seq_len * local_batch
    activations = _activations(
        shape, tokens, activation_checkpoint, compute_dtype_bytes, tensor_parallel
    )
    # Logits in compute dtype, their float32 upcast and float32 gradient, one chunk at a time.
    logits = (
        tokens * shape.vocab * (compute_dtype_bytes + 8) / max(loss_chunks, 1) / tensor_parallel
    )
    return MemoryEstimate(
        sharded_state=int(sharded),
        unsharded_transient=int(transient),
        activations=int(activations),
        logits=int(logits),
        total=int(sharded + transient + activations + logits + process_bytes),
        available=int(available),
        activation_checkpoint=activation_checkpoint,
        process=int(process_bytes),
    )


def _activations(
    shape: ModelShape, tokens: int, mode: str, compute_bytes: int, tensor_parallel: int
) -> float:
    """Bytes saved for backward over the model, for activation checkpointing `mode`."""
    per_layer = _layer_activation_elems(shape) * compute_bytes * tokens / tensor_parallel
    block_input = shape.hidden * compute_bytes * tokens
    if mode == "full":
        # Each block keeps its input; backward recomputes one block at a time.
        activations = shape.layers * block_input + per_layer
    elif mode == "selective":
        # torchtitan's op-level SAC keeps every other matmul output and attention: about half.
        activations = shape.layers * (block_input + per_layer / 2) + per_layer / 2
    else:
        activations = shape.layers * per_layer
    return activations + 2 * block_input  # embedding output and final norm
