import importlib.metadata
import re

import qwentitan.launch


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.launch.__version__ == importlib.metadata.version("qwentitan-launch")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.launch.__version__)
