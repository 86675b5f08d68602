"""Paged-cache writer (`concat_and_cache_mla` equivalent): encode records and scatter them by slot."""
from pallas_kernels.cache_writer.api import (DEFAULT_ORDER, WRITE_RECORDS, select, work_bytes, write_records,
                                             write_records_to_all)
from pallas_kernels.cache_writer.pallas_triton import WriterTiles, write_records_to_all_triton, write_records_triton
from pallas_kernels.cache_writer.reference import write_records_reference

__all__ = ["DEFAULT_ORDER", "WRITE_RECORDS", "WriterTiles", "select", "work_bytes", "write_records",
           "write_records_reference", "write_records_to_all", "write_records_to_all_triton", "write_records_triton"]
