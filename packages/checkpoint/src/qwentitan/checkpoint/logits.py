"""Logit check for `verify --logits`: HF model vs torchtitan's Qwen3 loaded from the DCP folder.

Needs the `logits` extra (transformers, torchtitan); imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch

from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.layout import Qwen3Layout

PROMPT_LENGTH = 16
# Both models compute in float32 throughout, so they agree to float32 rounding: the largest
# logit difference may be at most this fraction of the largest |logit| (dense and MoE alike).
RELATIVE_TOLERANCE = 1e-5


@functools.cache
def float32_grouped_experts() -> type:
    """torchtitan's GroupedExperts computing in float32 (this check, and CPU training through
    qwentitan.modeling's `float32_experts`).

    torchtitan 0.3.0's `GroupedExperts.forward` (torchtitan/models/common/moe.py) casts the
    routed tokens and the expert weights to bfloat16 for `torch._grouped_mm`, the training
    kernel; against transformers' float32 experts that alone differs by ~1e-3 relative. This
    subclass runs each expert's SwiGLU as plain float32 matmuls over its slice of the routed
    tokens (the slices `_grouped_mm` would take), so the comparison can be tight. The loop
    is differentiable: under FSDP the forward sees the unsharded weights as plain tensors.
    """
    import torch.nn.functional as F
    from torchtitan.models.common.moe import GroupedExperts

    class Float32GroupedExperts(GroupedExperts):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(
            self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
        ) -> torch.Tensor:
            dtype = x_RD.dtype
            x_RD = x_RD.float()
            counts = num_tokens_per_expert_E.tolist()
            out = []
            for e, x in enumerate(x_RD.split(counts)):
                h = F.silu(x @ self.w1_EFD[e].float().T) * (x @ self.w3_EFD[e].float().T)
                out.append(h @ self.w2_EDF[e].float().T)
            return torch.cat(out).to(dtype)

    return Float32GroupedExperts


def titan_model_config(config: dict[str, Any], where: Path | str):
    """torchtitan's Qwen3Model.Config for a Hugging Face config.json (causal SDPA attention)."""
    layout = Qwen3Layout.from_config(config, where)
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _qwen3_norm

    layers = _layers(config, layout, where)
    for layer in layers:
        # Plain causal SDPA: flex attention needs inductor, and one unmasked prompt needs no mask.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Qwen3Model.Config(
        vocab_size=layout.vocab_size,
        dim=layout.hidden_size,
        norm=_qwen3_norm(layout.hidden_size),
        enable_weight_tying=layout.tie_word_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=layout.vocab_size,
            embedding_dim=layout.hidden_size,
            param_init=_EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(
            in_features=layout.hidden_size,
            out_features=layout.vocab_size,
            param_init=_LINEAR_INIT,
        ),
        layers=layers,
    )
    _set_norm_eps(model, config.get("rms_norm_eps", 1e-6), RMSNorm.Config)
    return model


def _layers(config: dict[str, Any], layout: Qwen3Layout, where: Path | str) -> list[Any]:
    """The decoder layers' configs, built by the builders torchtitan's own flavor table uses."""
    from torchtitan.models.qwen3 import _build_qwen3_layers, _build_qwen3_moe_layers

    common = dict(
        n_layers=layout.num_layers,
        dim=layout.hidden_size,
        n_heads=layout.num_heads,
        n_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        attn_backend="flex",
        rope=_rope(config, layout, where),
    )
    if layout.model_type == "qwen3":
        return _build_qwen3_layers(hidden_dim=layout.intermediate_size, **common)
    if layout.moe_layers != frozenset(range(layout.num_layers)):
        raise CheckpointError(
            f"{where} mixes dense and MoE layers, which torchtitan's Qwen3 cannot build; "
            "verify without --logits."
        )
    layers = _build_qwen3_moe_layers(
        moe_hidden_dim=layout.moe_intermediate_size,
        num_experts=layout.num_experts,
        top_k=config["num_experts_per_tok"],
        moe_comm_backend="standard",
        **common,
    )
    float32_experts = float32_grouped_experts()
    for layer in layers:
        layer.moe.router.route_norm = bool(config.get("norm_topk_prob", False))
        # The one place the verified model departs from torchtitan's: no bf16 experts.
        inner = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = float32_experts.Config(
            **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner) if f.init}
        )
    return layers


def _rope(config: dict[str, Any], layout: Qwen3Layout, where: Path | str) -> Any:
    """Plain RoPE from the config's theta; any rope scaling is refused."""
    from torchtitan.models.common import CosSinRoPE

    rope_parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
    if rope_parameters.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise CheckpointError(
            f"{where} uses rope scaling, which torchtitan's Qwen3 does not implement; "
            "verify without --logits."
        )
    return CosSinRoPE.Config(
        dim=layout.head_dim, max_seq_len=config.get("max_position_embeddings", 4096), theta=theta
    )


def _set_norm_eps(node: Any, eps: float, norm_type: type) -> None:
    if isinstance(node, norm_type):
        node.eps = eps
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _set_norm_eps(getattr(node, f.name), eps, norm_type)
    elif isinstance(node, list):
        for item in node:
            _set_norm_eps(item, eps, norm_type)


def load_titan_model(dcp_dir: Path | str, config: dict[str, Any], where: Path | str):
    """torchtitan's Qwen3 in float32, loaded from `dcp_dir` by torchtitan's CheckpointManager."""
    from torchtitan.components.checkpoint import CheckpointManager

    model = titan_model_config(config, where).build()
    model.init_states(buffer_device=None) if hasattr(model, "init_states") else None
    manager = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder=str(Path(dcp_dir).resolve() / ".no-step-folders-here"),
            initial_load_path=str(Path(dcp_dir).resolve()),
            initial_load_model_only=True,
            keep_latest_k=0,
        ),
        dataloader=None,
        model_parts=[model],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    if not manager.load():
        raise CheckpointError(f"torchtitan loaded nothing from {dcp_dir}; check the folder.")
    manager.close()
    return model.eval()


def prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(
        0, vocab_size, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(0)
    )


def compare_logits(hf_dir: Path, dcp_dir: Path, config: dict[str, Any]) -> tuple[float, float]:
    """Largest |logit difference| of the two models on a fixed prompt, and its tolerance
    (RELATIVE_TOLERANCE times the HF model's largest |logit|)."""
    try:
        import torchtitan  # noqa: F401
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CheckpointError(
            "verify --logits needs transformers and torchtitan; install them with "
            "`pip install 'qwentitan-checkpoint[logits]'` or drop --logits."
        ) from None
    tokens = prompt(config["vocab_size"])
    with torch.no_grad():
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        expected = hf_model(tokens).logits
        del hf_model
        titan = load_titan_model(dcp_dir, config, hf_dir / "config.json")
        titan.to(torch.float32)
        got = titan(tokens)
    tolerance = RELATIVE_TOLERANCE * float(expected.abs().max())
    return float((expected - got).abs().max()), tolerance
