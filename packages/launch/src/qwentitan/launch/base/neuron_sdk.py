"""The trn2 host's software as the Neuron SDK 2.33 documents it: the one place its versions live.

preflight checks a Neuron host against it (`launcher/preflight/neuron_stack.py`), the
`train_trn2` nox session's install into the Neuron venv (`scripts/neuron_venv.py`) reads it by
path, before anything is installed, and the README cites it. It imports nothing on purpose.

Sources, Neuron SDK 2.33 documentation (awsdocs-neuron.readthedocs-hosted.com):
- "What is TorchTitan Neuron?", support matrix (training/torchtitan/about-torchtitan-neuron):
  PyTorch 2.14.0, the torch-neuronx 2.14.3.0 package family, Python 3.12, 3.13 and 3.14 on
  Linux x86_64, and AWS's TorchTitan fork aws-neuron/torchtitan-neuron.
- "Update PyTorch on a DLAMI" (setup/pytorch/update-dlami): the Deep Learning AMI Neuron
  torch-neuronx 2.14.0 holds the stack in /opt/aws_neuronx_venv_torch_neuronx_2_14_0, updated
  with `pip install --upgrade "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki` from the Neuron
  pip repository and PyTorch's CPU index.
- "Install PyTorch for Neuron" (setup/pytorch): the same packages into a fresh venv.
- TorchTitan Neuron release notes: the fork's version, 0.2.2+neuron.1.
"""

SDK_VERSION = "2.33"

# Python versions the Neuron wheels are built for (inclusive).
PYTHON_MIN = (3, 12)
PYTHON_MAX = (3, 14)
PYTHON_RANGE = "3.12-3.14"

# The documented pairs: name -> the version prefix the support matrix names.
TORCH = "2.14.0"
STACK = {
    "torch": TORCH,
    "torch-neuronx": "2.14.3.",  # the 2.14.3.0.* package family, built for torch 2.14.0
    "neuronx-cc": "2.",
    "nki": "",  # any: the documented command pins no version
}

# What qwentitan's install into a Neuron venv never installs, upgrades or removes ...
PROTECTED = ("torch", "torch-neuronx", "neuronx-cc", "nki", "nki-library")
# ... and the CUDA packages PyPI's torch pulls, which a Neuron host must not get.
CUDA_PREFIXES = ("nvidia-", "triton", "cuda-")

DLAMI_VENV = "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The documented install line (requirement specifiers), for the README's manual route.
REQUIREMENTS = (f"torch=={TORCH}", "torch-neuronx==2.14.*", "neuronx-cc==2.*", "nki")

# AWS's TorchTitan for Trainium, and the upstream release qwentitan runs instead.
TORCHTITAN_FORK = "aws-neuron/torchtitan-neuron"
TORCHTITAN_FORK_VERSION = "0.2.2+neuron.1"
TORCHTITAN_UPSTREAM = "0.3.0"


def python_supported(version: tuple[int, ...]) -> bool:
    """Whether a Python (major, minor, ...) is one the Neuron wheels exist for."""
    return PYTHON_MIN <= tuple(version[:2]) <= PYTHON_MAX


def is_protected(name: str) -> bool:
    """Whether a distribution (any spelling) is one the install must leave alone."""
    key = name.lower().replace("_", "-").replace(".", "-")
    return key in PROTECTED or key.startswith(CUDA_PREFIXES)
