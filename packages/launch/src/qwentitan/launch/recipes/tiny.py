"""Tiny Qwen3 recipes that train on any machine in minutes: `tiny_dense`, `tiny_moe`,
`tiny_moe_kernels`, `tiny_hf`.

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

from qwentitan.launch.recipes import recipe_info
from qwentitan.launch.runtime.data import OFFLINE, TextDataLoader, qwen_tokenizer_folder
from qwentitan.launch.runtime.platforms import current_platform
from qwentitan.launch.runtime.trainer import Trainer
from qwentitan.launch.tracking import tracked_metrics
from qwentitan.modeling import get_flavor, model_spec

__all__ = ["metrics_config", "tiny_dense", "tiny_hf", "tiny_moe", "tiny_moe_kernels"]

SEED = 0


def metrics_config(recipe: str = "", path: str = "") -> MetricsProcessor.Config:
    """Console metrics every step, and MLflow from the metrics rank (`--metrics.mlflow.no-enable`
    or $QWENTITAN_MLFLOW=off: none). The one place recipes build metrics."""
    return tracked_metrics(recipe, path)


def _tiny(name: str, flavor: str, *, lr: float) -> Trainer.Config:
    platform = current_platform()
    path = recipe_info(name).path
    # The platform names the attention that trains there (SDPA on CPU: FlexAttention has no
    # CPU backward); qwentitan.modeling builds the model with it.
    # torchtitan computes MoE experts in bfloat16, which a CPU only emulates; in float32 they
    # also match the kernel experts closely enough for the pilot to compare the two paths.
    spec = model_spec(
        get_flavor(flavor),
        path,
        attn_backend=platform.attention,
        float32_experts=platform.device_type == "cpu",
    )
    vocab = get_flavor(flavor).vocab_size
    steps = 40
    return Trainer.Config(
        model_spec=spec,
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
            disable_cuda_graphs=not platform.supports_cuda_graphs,
            gc_freq=1000,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=-1,
            # the hf path's Transformers model has no torchtitan sharding configs, so it needs
            # the backend that shards plain modules (qwentitan.modeling refuses the others)
            spmd_backend="partial_dtensor" if path == "hf" else "spmd_types",
        ),
        activation_checkpoint=None,  # tiny activations; recomputing them only costs time
        checkpoint=CheckpointManager.Config(
            enable=True,
            interval=100,
            last_save_model_only=False,
            keep_latest_k=2,
            # Nothing is loaded initially; torchtitan's default (True) logs a warning that would
            # come before every one-sentence refusal of `train`.
            initial_load_model_only=False,
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
    return _tiny("tiny_dense", "tiny-dense", lr=1e-2)


def tiny_moe() -> Trainer.Config:
    """MoE tiny Qwen3 (top-k router, softmax scores) on the offline corpus."""
    return _tiny("tiny_moe", "tiny-moe", lr=1e-2)


def tiny_moe_kernels() -> Trainer.Config:
    """`tiny_moe` with qwentitan.kernels' RoPE, attention and grouped experts (`moe-kernels`)."""
    return _tiny("tiny_moe_kernels", "tiny-moe", lr=1e-2)


def tiny_hf() -> Trainer.Config:
    """`tiny_dense` built as the Transformers v5 model (`hf` path) instead of torchtitan's."""
    return _tiny("tiny_hf", "tiny-dense", lr=1e-2)
