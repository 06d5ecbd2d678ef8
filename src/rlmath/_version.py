"""The version of rlmath: the one place it is written.

The ``rlmath`` console script reads this file without importing the package
(``rlmath --version`` does not import torch), and ``rlmath.__version__`` is
this value.
"""

__version__ = "0.1.0"
