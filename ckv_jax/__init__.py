"""ckv-jax: compressed-KV (CKV) cache records of sparse-MLA models under decode context parallelism."""
from ckv_jax import formats
from ckv_jax.formats import RecordFormat
from ckv_jax.paged_cache import empty_cache, read_records, write_records

__version__ = "0.1.0"

__all__ = ["RecordFormat", "empty_cache", "formats", "read_records", "write_records", "__version__"]
