"""Sparse-MLA attention that reads native records (fp8_ds_mla, nvfp4_ds_mla, bf16) directly."""
from pallas_kernels.sparse_mla_attention.api import (DEFAULT_ORDER, KEYS, SPARSE_MLA_ATTENTION, flops,
                                                    sparse_mla_attention)
from pallas_kernels.sparse_mla_attention.pallas_mosaic_gpu import MosaicAttentionTiles, sparse_mla_attention_mosaic
from pallas_kernels.sparse_mla_attention.pallas_triton import AttentionTiles, sparse_mla_attention_triton
from pallas_kernels.sparse_mla_attention.reference import attention_blocked, attention_reference

__all__ = ["AttentionTiles", "DEFAULT_ORDER", "KEYS", "MosaicAttentionTiles", "SPARSE_MLA_ATTENTION",
           "attention_blocked", "attention_reference", "flops", "sparse_mla_attention", "sparse_mla_attention_mosaic",
           "sparse_mla_attention_triton"]
