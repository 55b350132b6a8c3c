import importlib.metadata
import re

import qwentitan.checkpoint


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.checkpoint.__version__ == importlib.metadata.version("qwentitan-checkpoint")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.checkpoint.__version__)
