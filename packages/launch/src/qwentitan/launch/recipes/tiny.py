"""Tiny Qwen3 recipes that train on any machine in minutes: `tiny_dense`, `tiny_moe`.

The default data needs no download: the offline corpus (the interpreter's own help text and
standard-library docstrings) read through Qwen3's real tokenizer (151,936-row padded vocabulary).
Two ranks shard the model with FSDP; validation loss on the held-out slice every few steps;
a full DCP checkpoint at the end, from which `--resume` continues.
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.protocols.model_spec import ModelSpec

from qwentitan.launch.data import OFFLINE, TextDataLoader, qwen_tokenizer_folder
from qwentitan.launch.platforms import current_platform
from qwentitan.launch.trainer import Trainer

__all__ = ["metrics_config", "tiny_dense", "tiny_moe"]

SEED = 0


def metrics_config() -> MetricsProcessor.Config:
    """Console metrics every step. The one place recipes build metrics (tracking swaps it)."""
    return MetricsProcessor.Config(log_freq=1)


def _prototype_spec(flavor: str, attn_backend: str) -> ModelSpec:
    # Stand-in until qwentitan.modeling's `model_spec(get_flavor(...), "native")` lands.
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        model_registry,
    )

    dim, head_dim, vocab = 64, 16, 151936
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=1024, theta=1000000.0)
    common = dict(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, rope=rope)
    if flavor == "tiny-dense":
        layers = _build_qwen3_layers(hidden_dim=192, attn_backend="flex", **common)
        tied = True
    else:
        layers = _build_qwen3_moe_layers(
            moe_hidden_dim=64,
            num_experts=8,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            **common,
        )
        tied = False
    model = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    spec = model_registry("debugmodel")
    spec.flavor = flavor
    spec.model = model
    return spec


def _tiny(flavor: str, *, lr: float) -> Trainer.Config:
    platform = current_platform()
    spec = _prototype_spec(flavor, platform.attention)
    steps = 40
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(qwen_tokenizer_folder()),
        dump_folder=f"./outputs/{flavor.replace('-', '_')}",
        metrics=metrics_config(),
        dataloader=TextDataLoader.Config(dataset=OFFLINE),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        ),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=2,
            seq_len=128,
            steps=steps,
            # float32 end to end: CPUs have no fast bfloat16 path, and it keeps resume exact.
            mixed_precision_param="float32",
            disable_cuda_graphs=not platform.supports_cuda_graphs,
            gc_freq=1000,
        ),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        activation_checkpoint=None,  # tiny activations; recomputing them only costs time
        checkpoint=CheckpointManager.Config(
            enable=True, interval=100, last_save_model_only=False, keep_latest_k=2
        ),
        validator=Validator.Config(
            enable=True,
            freq=10,
            steps=2,
            dataloader=TextDataLoader.Config(dataset=OFFLINE, split="validation"),
        ),
        comm=CommConfig(init_timeout_seconds=120, train_timeout_seconds=120),
        debug=DebugConfig(seed=SEED),
    )


def tiny_dense() -> Trainer.Config:
    """Dense tiny Qwen3 (qk-norm, GQA, tied embeddings) on the offline corpus."""
    return _tiny("tiny-dense", lr=3e-3)


def tiny_moe() -> Trainer.Config:
    """MoE tiny Qwen3 (top-k router, softmax scores) on the offline corpus."""
    return _tiny("tiny-moe", lr=3e-3)
