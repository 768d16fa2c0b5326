"""Per-format weight handling of the LM head, one small strategy class per format.

The head never branches on the format: it asks :func:`weight_method_for` for the
class that stores, loads and multiplies its shard, and calls ``method(x)``.
"""

from trtvocab.weights.base import WeightMethod, register, weight_method_for
from trtvocab.weights.dense import DenseWeight

__all__ = ["DenseWeight", "WeightMethod", "register", "weight_method_for"]
