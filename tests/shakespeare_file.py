"""Where the tests find Tiny Shakespeare (../shared/data/tinyshakespeare.txt beside the repository, or
$SUBNET_EXT_TINY_SHAKESPEARE), and the mark of the tests that read it."""
import os

import pytest

from subnet_ext.data.shakespeare import ENVIRONMENT_VARIABLE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.environ.get(ENVIRONMENT_VARIABLE) or os.path.join(os.path.dirname(REPO), "shared", "data",
                                                             "tinyshakespeare.txt")
needs_tiny_shakespeare = pytest.mark.skipif(not os.path.isfile(PATH), reason=f"Tiny Shakespeare is not at {PATH}")
