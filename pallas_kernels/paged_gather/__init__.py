"""Paged CKV gathers (`cp_gather_cache` semantics): raw records, or dequantized to bf16; and the
gather of records by slot (decode-sized lists, top-k rows)."""
from pallas_kernels.paged_gather.api import (DEFAULT_ORDER, GATHER_DEQUANT, GATHER_RECORDS, GATHER_SLOTS,
                                             dequantize_records, gather_dequant, gather_records, gather_slots,
                                             select_dequant, select_records)
from pallas_kernels.paged_gather.pallas_triton import (GatherTiles, gather_dequant_triton, gather_records_triton,
                                                       gather_slots_triton, record_pieces)
from pallas_kernels.paged_gather.reference import (gather_dequant_reference, gather_records_reference,
                                                   gather_slots_reference)

__all__ = ["DEFAULT_ORDER", "GATHER_DEQUANT", "GATHER_RECORDS", "GATHER_SLOTS", "GatherTiles", "dequantize_records",
           "gather_dequant", "gather_dequant_reference", "gather_dequant_triton", "gather_records",
           "gather_records_reference", "gather_records_triton", "gather_slots", "gather_slots_reference",
           "gather_slots_triton", "record_pieces", "select_dequant", "select_records"]
