"""The trn2 host's software as the Neuron SDK documents it: the one place its versions live.

preflight checks a Neuron host against it (`launcher/preflight/neuron_stack.py`), the
`train_trn2` nox session's install (`scripts/neuron_venv.py`) reads it by path, before anything
is installed, and the README cites it. It imports nothing on purpose.

Two documented stacks, the newest the default (Neuron SDK documentation,
awsdocs-neuron.readthedocs-hosted.com):
- 2.34 (released 2026-11-30; release notes 2.34.0): TorchNeuron and TorchTitan Neuron are
  updated and TorchAO Neuron is new. "What is TorchAO Neuron?" (training/torchao-neuron) lists
  the 2.34 stack it requires: PyTorch 2.14.0, torch-neuronx 2.14.3.1 and torchtitan-neuron
  0.2.2+neuron.2 (for its MXFP8 recipes); its release notes give Python 3.12, 3.13 and 3.14.
  (These versions are the TorchAO pages'; TorchNeuron's own 2.34 notes are not cited here.)
  TorchAO Neuron itself (MXFP8 training) is for Trn3 only, so it is not
  part of a trn2 stack.
- 2.33: "What is TorchTitan Neuron?" support matrix (training/torchtitan/about-torchtitan-neuron)
  and the TorchNeuron release notes: PyTorch 2.14.0 with the torch-neuronx 2.14.3.0 package
  family, Python 3.12, 3.13 and 3.14 on Linux x86_64, TorchTitan Neuron 0.2.2+neuron.1.
Both: neuronx-cc 2.* and nki from the Neuron pip repository, torch from PyTorch's CPU index
("Install PyTorch for Neuron", setup/pytorch; "Update PyTorch on a DLAMI", setup/pytorch/
update-dlami: the Deep Learning AMI Neuron keeps the stack in
/opt/aws_neuronx_venv_torch_neuronx_2_14_0). TorchNeuron runs on Trn2 and Trn3 only.
"""

SDK_VERSIONS = ("2.34", "2.33")  # newest first
SDK_VERSION = SDK_VERSIONS[0]  # the default: what the README's setup and preflight name first

# Python versions the Neuron wheels are built for (inclusive), the same in both stacks.
PYTHON_MIN = (3, 12)
PYTHON_MAX = (3, 14)
PYTHON_RANGE = "3.12-3.14"

# torch, the same in both stacks: torch-neuronx 2.14.3.x is built for exactly this release.
TORCH = "2.14.0"
# The Transformers release AWS's guide tested with that stack: the install into the trn2
# environment takes it where the Neuron venv has none, and `nox -s tests-3.13` runs it (the
# `neuron-pair` dependency group in pyproject.toml holds TORCH and TRANSFORMERS; a test checks).
TRANSFORMERS = "5.16.0"

# The torch-neuronx release of both stacks (2.14.3.0 in 2.33, 2.14.3.1 in 2.34).
TORCH_NEURONX = "2.14.3"

# Per stack: distribution -> documented release family ("" = any version). A version matches
# its family when it equals it or continues it after a dot (`matches`).
STACKS = {
    "2.34": {"torch": TORCH, "torch-neuronx": "2.14.3.1", "neuronx-cc": "2", "nki": ""},
    "2.33": {"torch": TORCH, "torch-neuronx": "2.14.3.0", "neuronx-cc": "2", "nki": ""},
}
STACK = STACKS[SDK_VERSION]

# AWS's TorchTitan for Trainium (its version per stack), and the upstream release qwentitan runs.
TORCHTITAN_FORK = "aws-neuron/torchtitan-neuron"
TORCHTITAN_FORK_VERSIONS = {"2.34": "0.2.2+neuron.2", "2.33": "0.2.2+neuron.1"}
TORCHTITAN_FORK_VERSION = TORCHTITAN_FORK_VERSIONS[SDK_VERSION]
TORCHTITAN_UPSTREAM = "0.3.0"

# What qwentitan never installs, upgrades or removes on a Neuron host ...
PROTECTED = ("torch", "torch-neuronx", "neuronx-cc", "nki", "nki-library")
# ... and the CUDA packages PyPI's torch pulls, which a Neuron host must not get.
CUDA_PREFIXES = ("nvidia-", "triton", "cuda-")

DLAMI_VENV = "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The documented install line (requirement specifiers), for the README's manual route.
REQUIREMENTS = (f"torch=={TORCH}", "torch-neuronx==2.14.*", "neuronx-cc==2.*", "nki")


def python_supported(version: tuple[int, ...]) -> bool:
    """Whether a Python (major, minor, ...) is one the Neuron wheels exist for."""
    return PYTHON_MIN <= tuple(version[:2]) <= PYTHON_MAX


def normalize(name: str) -> str:
    """A distribution's name as indexes compare it (PEP 503): lower case, runs of -_. as -."""
    out = name.lower()
    for char in "_.":
        out = out.replace(char, "-")
    while "--" in out:
        out = out.replace("--", "-")
    return out


def is_protected(name: str) -> bool:
    """Whether a distribution (any spelling) is one qwentitan leaves alone."""
    key = normalize(name)
    return key in PROTECTED or key.startswith(CUDA_PREFIXES)


def matches(version: str, family: str) -> bool:
    """Whether `version` (a local label like +cpu ignored) is of the documented `family`."""
    public = version.split("+", 1)[0]
    return not family or public == family or public.startswith(family + ".")


def is_fork(version: str) -> bool:
    """Whether an installed torchtitan version is AWS's fork rather than an upstream release."""
    return "neuron" in version or version.startswith("0.2.")
