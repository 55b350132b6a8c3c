"""Fakes of the Neuron packages, installed in `sys.modules` so the real loader code runs.

`install(monkeypatch, version, torch_neuronx_version, has_wrap_nki)` puts a fake `nki`,
`torch_neuronx` and an nki-library of `version` in `sys.modules` for one test; see each module
for the public source it was written from. Kernel tests import nothing else of the Neuron SDK.
"""

from __future__ import annotations

import sys
import types

import pytest

from . import language, nki, nkilib, torch_neuronx

# How each torch-neuronx stand-in launches: (version, has wrap_nki, has nki_op).
TORCH_NEURONX = {
    "documented": (torch_neuronx.DOCUMENTED, False, True),
    "documented-with-wrap_nki": (torch_neuronx.DOCUMENTED, True, True),
    "documented-without-nki_op": (torch_neuronx.DOCUMENTED, False, False),
    "april-source": (torch_neuronx.APRIL_SOURCE, True, True),
}


def install(
    monkeypatch: pytest.MonkeyPatch, version: str = "2.29", host: str = "documented"
) -> dict[str, nki.JitKernel]:
    """Install the fakes; returns {kernel name: fake jit kernel} to inspect its calls.

    `host` is one of TORCH_NEURONX: the torch-neuronx stand-in, whether it has `wrap_nki` and
    whether it has `nki_op`.

    `version` is "2.29", "092a49d" (nki-library's commit of about SDK 2.32, whose
    blockwise_mm_bwd validates shard_option; see nkilib.GENERATIONS) or "2.27", which has
    attention_cte only: rope_hf, attention_bwd and the MoE kernels arrived in nki-library 2.28
    (compare the release branches 2.27 and 2.28 of aws-neuron/nki-library).
    """
    library = nkilib.build("092a49d" if version == "092a49d" else "2.29")
    if version == "2.27":
        library = {k: v for k, v in library.items() if k.endswith("attention_cte")}
    modules: dict[str, types.ModuleType] = {}
    for path, names in library.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in modules:
                modules[name] = types.ModuleType(name)
                if i > 1:
                    setattr(modules[".".join(parts[: i - 1])], parts[i - 1], modules[name])
        vars(modules[path]).update(vars(names))
    for name in [m for m in sys.modules if m.split(".")[0] in ("nki", "nkilib", "torch_neuronx")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nki", nki)
    monkeypatch.setitem(sys.modules, "nki.language", language)
    tnx_version, has_wrap_nki, has_nki_op = TORCH_NEURONX[host]
    fake = torch_neuronx.build(tnx_version, has_wrap_nki=has_wrap_nki, has_nki_op=has_nki_op)
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return {
        name: value
        for names in library.values()
        for name, value in vars(names).items()
        if isinstance(value, nki.JitKernel)
    }
