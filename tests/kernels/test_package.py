import importlib.metadata
import re

import qwentitan.kernels


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.kernels.__version__ == importlib.metadata.version("qwentitan-kernels")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.kernels.__version__)
