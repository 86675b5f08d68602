"""Paged-cache writer (`concat_and_cache_mla` equivalent): encode records and scatter them by slot."""
from pallas_kernels.cache_writer.api import DEFAULT_ORDER, IMPLEMENTATIONS, choose, select, work_bytes, write_records
from pallas_kernels.cache_writer.pallas_triton import WriterConfig, write_records_triton
from pallas_kernels.cache_writer.reference import write_records_reference

__all__ = ["DEFAULT_ORDER", "IMPLEMENTATIONS", "WriterConfig", "choose", "select", "work_bytes", "write_records",
           "write_records_reference", "write_records_triton"]
