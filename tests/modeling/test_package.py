import importlib.metadata
import re

import qwentitan.modeling


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.modeling.__version__ == importlib.metadata.version("qwentitan-modeling")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.modeling.__version__)
