"""Tiny Qwen3 recipes that train on any machine in minutes: `tiny_dense` (and
`tiny_dense_untied`, its twin with an output head of its own, for pipeline parallelism), `tiny_moe`,
`tiny_moe_kernels`, `tiny_hf`, and `tiny_tp2_fsdp2_sac`, the CPU twin of AWS's reference mesh.

The default data needs no download: the offline corpus (the interpreter's own help text and
standard-library docstrings) read through Qwen3's real tokenizer (151,936-row padded vocabulary).
Two ranks shard the model with FSDP; validation loss on the held-out slice every few steps;
a full DCP checkpoint at the end, from which `--resume` continues.
"""

from __future__ import annotations

from functools import partial

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from qwentitan.kernels import KernelChoices
from qwentitan.launch.base.target import Target
from qwentitan.launch.recipes import recipe_info
from qwentitan.launch.runtime.checkpointer import GuardedCheckpointManager
from qwentitan.launch.runtime.data import OFFLINE, TextDataLoader, qwen_tokenizer_folder
from qwentitan.launch.runtime.trainer import Trainer
from qwentitan.launch.runtime.validator import PausableValidator
from qwentitan.launch.tracking import tracked_metrics
from qwentitan.modeling import get_flavor, model_spec

__all__ = [
    "metrics_config",
    "tiny_dense",
    "tiny_dense_untied",
    "tiny_hf",
    "tiny_moe",
    "tiny_moe_kernels",
    "tiny_tp2_fsdp2_sac",
]

SEED = 0


def metrics_config(recipe: str = "", path: str = "") -> MetricsProcessor.Config:
    """Console metrics every step, and MLflow from the metrics rank (`--metrics.mlflow.no-enable`
    or $QWENTITAN_MLFLOW=off: none). The one place recipes build metrics."""
    return tracked_metrics(recipe, path)


def tiny_model(flavor: str, path: str, target: Target, kernels: KernelChoices | None = None):
    """The tiny model as it trains on `target` (the config's `model_for`)."""
    # The Target names the attention that trains there (SDPA on CPU: FlexAttention has no CPU
    # backward). torchtitan computes MoE experts in bfloat16, which a CPU only emulates; in
    # float32 they also match the kernel experts closely enough for the pilot to compare paths.
    spec = model_spec(
        get_flavor(flavor),
        path,
        attn_backend=target.attention,
        float32_experts=target.device_type == "cpu",
        kernels=kernels,
    )
    if target.backend == "gloo" and get_flavor(flavor).is_moe:
        # gloo's all-to-all takes uneven token splits only in its single-tensor form
        from qwentitan.modeling.gloo_dispatch import with_gloo_token_dispatch

        with_gloo_token_dispatch(spec.model)
    return spec


def _tiny(name: str, flavor: str, *, lr: float) -> Trainer.Config:
    path = recipe_info(name).path
    vocab = get_flavor(flavor).vocab_size
    steps = 40
    return Trainer.Config(
        model_for=partial(tiny_model, flavor, path),
        hf_assets_path=str(qwen_tokenizer_folder()),
        dump_folder=f"./outputs/{name}",
        metrics=metrics_config(name, path),
        dataloader=TextDataLoader.Config(dataset=OFFLINE),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab),
        ),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=4,
            seq_len=128,
            steps=steps,
            # float32 end to end: CPUs have no fast bfloat16 path, and it keeps resume exact.
            mixed_precision_param="float32",
            gc_freq=1000,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=-1,
            # the hf path's Transformers model has no torchtitan sharding configs, so it needs
            # the backend that shards plain modules (qwentitan.modeling refuses the others)
            spmd_backend="partial_dtensor" if path == "hf" else "spmd_types",
        ),
        activation_checkpoint=None,  # tiny activations; recomputing them only costs time
        checkpoint=GuardedCheckpointManager.Config(
            enable=True,
            interval=100,
            last_save_model_only=False,
            keep_latest_k=2,
            # Nothing is loaded initially; torchtitan's default (True) logs a warning that would
            # come before every one-sentence refusal of `train`.
            initial_load_model_only=False,
        ),
        validator=PausableValidator.Config(
            enable=True,
            freq=10,
            # The loader's 8 held-out windows (validation_windows), whatever the layout.
            steps=8,
            dataloader=TextDataLoader.Config(dataset=OFFLINE, split="validation"),
        ),
        comm=CommConfig(init_timeout_seconds=120, train_timeout_seconds=120),
        debug=DebugConfig(seed=SEED),
    )


def tiny_dense() -> Trainer.Config:
    """Dense tiny Qwen3 (qk-norm, GQA, tied embeddings) on the offline corpus."""
    return _tiny("tiny_dense", "tiny-dense", lr=1e-2)


def tiny_dense_untied() -> Trainer.Config:
    """`tiny_dense` with an output head of its own (`tiny-dense-untied`), which pipeline
    parallelism can put in another stage than the embedding."""
    return _tiny("tiny_dense_untied", "tiny-dense-untied", lr=1e-2)


def tiny_moe() -> Trainer.Config:
    """MoE tiny Qwen3 (top-k router, softmax scores) on the offline corpus."""
    return _tiny("tiny_moe", "tiny-moe", lr=1e-2)


def tiny_moe_kernels() -> Trainer.Config:
    """`tiny_moe` with qwentitan.kernels' RoPE, attention and grouped experts (`moe-kernels`)."""
    return _tiny("tiny_moe_kernels", "tiny-moe", lr=1e-2)


def tiny_hf() -> Trainer.Config:
    """`tiny_dense` built as the Transformers v5 model (`hf` path) instead of torchtitan's."""
    return _tiny("tiny_hf", "tiny-dense", lr=1e-2)


def tiny_tp2_fsdp2_sac() -> Trainer.Config:
    """`tiny_dense` on the mesh of AWS's `qwen3_8b_tp4_fsdp16_sac` in small: tensor parallel 2
    x FSDP over the other ranks (2 on `--ranks 4`), selective activation checkpointing, eager,
    a global batch pinned to 8 windows whatever the number of ranks."""
    config = _tiny("tiny_tp2_fsdp2_sac", "tiny-dense", lr=1e-2)
    config.parallelism.tensor_parallel_degree = 2
    config.training.global_batch_size = 8
    config.activation_checkpoint = SelectiveAC.Config()
    return config
