"""The original's preprocessing layers: `from elasticdl_preprocessing.layers import ...` (its dac_ctr and
census_model_sqlflow model zoo)."""

from elasticdl_preprocessing.layers.concatenate_with_offset import ConcatenateWithOffset
from elasticdl_preprocessing.layers.discretization import Discretization
from elasticdl_preprocessing.layers.hashing import Hashing
from elasticdl_preprocessing.layers.index_lookup import IndexLookup
from elasticdl_preprocessing.layers.normalizer import Normalizer
from elasticdl_preprocessing.layers.sparse_embedding import SparseEmbedding
from elasticdl_preprocessing.layers.to_sparse import ToSparse

__all__ = ["ConcatenateWithOffset", "Discretization", "Hashing", "IndexLookup", "Normalizer", "SparseEmbedding", "ToSparse"]
