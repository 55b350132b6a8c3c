"""The trn2.48xlarge recipes: one per implementation path (hf, native, moe-kernels), FSDP over
all 64 ranks, AWS's reference run (`qwen3_8b_tp4_fsdp16_sac`: TP 4 x FSDP 16) and AWS's MoE
run of Neuron SDK 2.34 (`qwen3_30b_a3b_tp4_fsdp16`: Qwen3-30B-A3B at TP 4 x FSDP 16).

Each is a torchtitan config-registry function (`--module qwentitan.launch.recipes --config
<name>`) returning a Trainer.Config sized for one trn2.48xlarge at LNC=2: 64 ranks. None of them has been run on Trainium (see the README); `qwentitan-launch plan`
and `preflight` check them on any host.

Local folders (a trn2 host has them on its own disk; nothing is downloaded at run time) are
torchtitan's own `hf_assets_path`, and for `qwen3_4b_hf` also `checkpoint.initial_load_path`
(the weights it starts from); override them per run with `--hf_assets_path DIR` (and
`--checkpoint.initial_load_path DIR`, absolute: torchtitan 0.3.0 loads initial weights only
from that field, never from `hf_assets_path`, so one folder is two fields). Their defaults:

- `$QWENTITAN_QWEN3_4B_DIR`, else `./assets/hf/Qwen3-4B-Instruct-2507`: the Hugging Face
  model folder of Qwen3-4B-Instruct-2507 (config.json, tokenizer.json, safetensors).
- `$QWENTITAN_QWEN3_30B_A3B_DIR`, else `./assets/hf/Qwen3-30B-A3B`: its tokenizer is
  used by the MoE recipes, whose weights start from a random initialisation.
- `$QWENTITAN_QWEN3_8B_DIR`, else `./assets/hf/Qwen3-8B` (the folder AWS's toml names): the
  Hugging Face model folder of Qwen3-8B, for `qwen3_8b_tp4_fsdp16_sac`.

`qwentitan-launch fetch --recipe NAME` downloads a recipe's model folder from the Hub.

Data is on the host too: every recipe reads the offline corpus (`offline`, built from the
Python installation, no network) unless `--dataloader.dataset` names a JSON-lines file or folder
of `{"text": ...}` lines, or a Hub dataset (then every rank streams it). torchtitan's own
`c4_test` is a folder of torchtitan's source tree, in no wheel, and `c4` streams from the Hub,
so neither is a default. `qwentitan-launch preflight` reads the first batch offline.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import Any

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.qwen3 import config_registry as torchtitan_qwen3

from qwentitan.kernels import KernelChoices
from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.target import Target
from qwentitan.launch.recipes import TRN2_RECIPES, recipe_info
from qwentitan.launch.runtime.checkpointer import GuardedCheckpointManager, guarded
from qwentitan.launch.runtime.data import OFFLINE, TextDataLoader
from qwentitan.launch.runtime.trainer import Trainer
from qwentitan.launch.runtime.validator import PausableValidator, pausable
from qwentitan.launch.tracking import tracked_metrics

__all__ = [
    "TRN2_RECIPES",
    "qwen3_4b_hf",
    "qwen3_4b_native",
    "qwen3_8b_tp4_fsdp16_sac",
    "qwen3_30b_a3b_tp4_fsdp16",
    "qwen3_moe_kernels",
]


def qwen3_4b_folder() -> str:
    return env_defaults.model_folder("QWENTITAN_QWEN3_4B_DIR")


def qwen3_30b_a3b_folder() -> str:
    return env_defaults.model_folder("QWENTITAN_QWEN3_30B_A3B_DIR")


def qwen3_8b_folder() -> str:
    return env_defaults.model_folder("QWENTITAN_QWEN3_8B_DIR")


def trn2_model(flavor: str, path: str, target: Target, kernels: KernelChoices | None = None):
    """The model as it trains on `target` (the config's `model_for`): its attention."""
    from qwentitan.modeling import model_spec

    return model_spec(flavor, path, attn_backend=target.attention, kernels=kernels)


def _model_for(flavor: str, recipe: str):
    return partial(trn2_model, flavor, recipe_info(recipe).path)


def _metrics(recipe: str):
    return tracked_metrics(recipe, recipe_info(recipe).path)


def _ours(config, model_for) -> Trainer.Config:
    """Re-home a torchtitan Trainer.Config as ours (placement, preemption, early stop), with
    qwentitan's checkpoint manager and validator."""
    given = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    given["checkpoint"] = guarded(config.checkpoint)
    given["validator"] = pausable(config.validator)
    return Trainer.Config(**given, model_for=model_for)


def _loss(flavor: str) -> ChunkedLossWrapper.Config:
    from qwentitan.modeling import get_flavor

    vocab = get_flavor(flavor).vocab_size
    return ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab))


def _from_folder(folder: str, **settings: Any) -> GuardedCheckpointManager.Config:
    """Checkpoints on, the run starting from the model weights of the HF folder `folder`."""
    return GuardedCheckpointManager.Config(
        enable=True,
        initial_load_path=folder,
        initial_load_in_hf=True,
        initial_load_model_only=True,
        **settings,
    )


def qwen3_4b_hf() -> Trainer.Config:
    """Transformers v5 Qwen3-4B-Instruct-2507 from its local folder, fine-tuned 10 steps.

    As in the guide: c4-style text (here the offline corpus, on the host), local batch 1 on each of 64 ranks (FSDP over all),
    HF weights loaded at the start and the final model written back as HF safetensors.
    """
    folder = qwen3_4b_folder()
    return Trainer.Config(
        model_for=_model_for("qwen3-4b", "qwen3_4b_hf"),
        hf_assets_path=folder,
        loss=_loss("qwen3-4b"),
        metrics=_metrics("qwen3_4b_hf"),
        dataloader=TextDataLoader.Config(dataset=OFFLINE),
        training=TrainingConfig(local_batch_size=1, seq_len=4096, steps=10, dtype="float32"),
        # the hf path shards with the flattened "fsdp" mesh only partial_dtensor builds
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=-1, spmd_backend="partial_dtensor"
        ),
        activation_checkpoint=FullAC.Config(),
        compile=CompileConfig(enable=False),
        validator=PausableValidator.Config(),
        checkpoint=_from_folder(
            folder,
            interval=10,
            last_save_in_hf=True,
            last_save_model_only=True,
            export_dtype="bfloat16",
        ),
    )


def qwen3_4b_native() -> Trainer.Config:
    """torchtitan's Qwen3 from its own 32B recipe, overridden to the 4B flavor, global batch 64."""
    config = _ours(torchtitan_qwen3.qwen3_32b(), _model_for("qwen3-4b", "qwen3_4b_native"))
    config.metrics = _metrics("qwen3_4b_native")
    config.loss = _loss("qwen3-4b")
    config.hf_assets_path = qwen3_4b_folder()
    config.training.local_batch_size = 1
    config.training.global_batch_size = 64
    config.dataloader = TextDataLoader.Config(dataset=OFFLINE)  # torchtitan's streams c4
    # torchtitan's recipe leaves checkpoints off; a long rented run needs them to survive
    # preemption (every `interval` = 500 steps, full state, resumed by the next run).
    config.checkpoint.enable = True
    return config


def qwen3_moe_kernels() -> Trainer.Config:
    """Qwen3-30B-A3B cut to 4 layers (64 experts, top-4) in eager mode with qwentitan's custom
    ops for experts, attention and RoPE (NKI on Trainium, reference twins elsewhere)."""
    config = _ours(
        torchtitan_qwen3.qwen3_30b_a3b(), _model_for("qwen3-30b-a3b-4l", "qwen3_moe_kernels")
    )
    config.metrics = _metrics("qwen3_moe_kernels")
    config.loss = _loss("qwen3-30b-a3b-4l")
    config.hf_assets_path = qwen3_30b_a3b_folder()
    config.compile = CompileConfig(enable=False)  # eager: the custom ops run as they are
    config.training.local_batch_size = 1
    config.training.steps = 10
    config.dataloader = TextDataLoader.Config(dataset=OFFLINE)  # torchtitan's streams c4
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=1)
    config.checkpoint.enable = True
    return config


def qwen3_8b_tp4_fsdp16_sac() -> Trainer.Config:
    """AWS's reference run: Qwen3-8B, tensor parallel 4 x FSDP over the other ranks (16 on one
    trn2.48xlarge at LNC 2), selective activation checkpointing, eager, on torchtitan's model.

    As the Neuron SDK 2.33 tutorial "Run a basic TorchTitan training on Neuron" defines its
    config `qwen3_8b_tp4_fsdp16_sac` (module `torchtitan_neuron.models.qwen3`): TP 4 with the
    data-parallel shard degree left at -1 (FSDP takes the rest), eager mode with no
    torch.compile; and as TorchNeuron's public mirror writes its toml
    (docs/torchtitan/qwen3/qwen3_8b_tp4_fsdp.toml of parmoham-aws/test-repo-parmoham): local
    batch 1, sequence 4096, global batch 16, AdamW at lr 3e-4, 2 warm-up steps, 500 steps,
    selective AC by op. Unlike the toml, which trains from a random init on torchtitan's
    `c4_test`, the weights load from the local Qwen3-8B folder (as the qwen3_4b recipes do;
    `--checkpoint.initial-load-path ""` starts from random instead) and the data is the
    offline corpus; checkpoints are on, every 500 steps, so a preempted run resumes.
    """
    folder = qwen3_8b_folder()
    return Trainer.Config(
        model_for=_model_for("qwen3-8b", "qwen3_8b_tp4_fsdp16_sac"),
        hf_assets_path=folder,
        loss=_loss("qwen3-8b"),
        metrics=_metrics("qwen3_8b_tp4_fsdp16_sac"),
        dataloader=TextDataLoader.Config(dataset=OFFLINE),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=1, seq_len=4096, global_batch_size=16, steps=500),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, tensor_parallel_degree=4),
        activation_checkpoint=SelectiveAC.Config(),
        compile=CompileConfig(enable=False),
        validator=PausableValidator.Config(),
        checkpoint=_from_folder(folder, interval=500, last_save_model_only=False),
    )


def qwen3_30b_a3b_tp4_fsdp16() -> Trainer.Config:
    """AWS's MoE run of Neuron SDK 2.34: Qwen3-30B-A3B (48 layers, 128 experts, top-8) on one
    trn2.48xlarge at tensor parallel 4 x FSDP 16, eager, on torchtitan's own model.

    The torch-neuronx 2.34.0 release notes ("Highlights") say TorchTitan Neuron's MoE recipes
    now run upstream `torch._grouped_mm` instead of Neuron's blockwise MoE kernels, at TP 4 x
    FSDP 16 on Trn2 for Qwen3-30B-A3B, with about 1.3x the MFU of the SDK 2.33 recipes. Here
    that is the native path: torchtitan's `GroupedExperts` (whose matmuls are
    `torch._grouped_mm`) on the full flavor, no custom op, so `qwen3_moe_kernels` stays the
    kernel path. torchtitan's 30B-A3B recipe is the base (AdamW at 8e-4, full activation
    checkpointing); from the 8B reference run come local batch 1, sequence 4096, global batch
    16 and eager mode. The attention is the neuron Target's (SDPA, which TorchNeuron sends to
    its NKI flash kernels); the release's "models' own attention" is not reproduced. Weights
    start from a random initialisation (the folder gives the tokenizer); data is the offline
    corpus; checkpoints every 500 steps. Not run on Trainium.
    """
    recipe = "qwen3_30b_a3b_tp4_fsdp16"
    config = _ours(torchtitan_qwen3.qwen3_30b_a3b(), _model_for("qwen3-30b-a3b", recipe))
    config.metrics = _metrics(recipe)
    config.loss = _loss("qwen3-30b-a3b")
    config.hf_assets_path = qwen3_30b_a3b_folder()
    config.dataloader = TextDataLoader.Config(dataset=OFFLINE)  # torchtitan's streams c4
    config.training = TrainingConfig(
        local_batch_size=1, seq_len=4096, global_batch_size=16, steps=500
    )
    config.parallelism = ParallelismConfig(
        data_parallel_shard_degree=-1, tensor_parallel_degree=4, expert_parallel_degree=1
    )
    config.compile = CompileConfig(enable=False)
    config.checkpoint.enable = True
    return config
