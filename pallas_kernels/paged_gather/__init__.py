"""Paged CKV gathers (`cp_gather_cache` semantics): raw records, or dequantized to bf16."""
from pallas_kernels.paged_gather.api import (DEFAULT_ORDER, DEQUANT, RECORDS, choose_dequant, choose_records,
                                             gather_dequant, gather_records)
from pallas_kernels.paged_gather.pallas_triton import GatherConfig, gather_dequant_triton, gather_records_triton
from pallas_kernels.paged_gather.reference import gather_dequant_reference, gather_records_reference

__all__ = ["DEFAULT_ORDER", "DEQUANT", "GatherConfig", "RECORDS", "choose_dequant", "choose_records",
           "gather_dequant", "gather_dequant_reference", "gather_records", "gather_records_reference",
           "gather_dequant_triton", "gather_records_triton"]
