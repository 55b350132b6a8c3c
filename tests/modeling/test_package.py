import importlib.metadata
import re

import qwentitan.modeling


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.modeling.__version__ == importlib.metadata.version("qwentitan-modeling")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.modeling.__version__)


def test_importing_the_package_leaves_transformers_to_the_hf_path():
    """The native paths' ranks and the launcher's plan import this package and never build a
    transformers config: transformers (~0.8 s) is imported only where one is built."""
    import subprocess
    import sys

    code = "import sys, qwentitan.modeling; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    from qwentitan.modeling import flavor_to_hf_config

    assert flavor_to_hf_config("tiny-dense").architectures == ["Qwen3ForCausalLM"]
