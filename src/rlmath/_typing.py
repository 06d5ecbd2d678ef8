"""``Unpack`` from ``typing`` (Python >= 3.11), else from ``typing_extensions``.

``typing_extensions`` is a dependency on Python 3.10 only (pyproject.toml).
"""

import sys

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

__all__ = ["Unpack"]
