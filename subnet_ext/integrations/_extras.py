"""Optional frameworks: import one, or fail with the extra that installs it."""
from __future__ import annotations

import importlib

EXTRAS = {"lightning": "lightning", "transformers": "hf", "accelerate": "hf"}


def import_extra(package: str, feature: str):
    """Import `package` (an optional dependency) and return it.

    Raises:
        ImportError: it is not installed (or fails to import), naming the extra to install
            (pip install "subnet_ext[lightning]" / "subnet_ext[hf]") and the feature that needs it.
    """
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(f"subnet_ext's {feature} integration needs {package}: pip install "
                          f"\"subnet_ext[{EXTRAS.get(package, package)}]\" (import failed: {e})") from e
