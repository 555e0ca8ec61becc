"""The layers the original's dac_ctr model zoo imports: `from elasticdl_preprocessing.layers import ...`."""

from elasticdl_preprocessing.layers.concatenate_with_offset import ConcatenateWithOffset
from elasticdl_preprocessing.layers.discretization import Discretization
from elasticdl_preprocessing.layers.hashing import Hashing
from elasticdl_preprocessing.layers.normalizer import Normalizer

__all__ = ["ConcatenateWithOffset", "Discretization", "Hashing", "Normalizer"]
