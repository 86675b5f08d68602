"""ckv-jax: compressed-KV (CKV) cache records of sparse-MLA models under decode context parallelism."""
from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.formats import RecordFormat
from ckv_jax.dcp_step import StepArrays, gather_workspace_in_shard_map, step_arrays
from ckv_jax.full_ckv import (all_gather_ckv, patch_current_chunk, remap_topk, workspace_to_global_order,
                              write_records_dcp)
from ckv_jax.placement import DCP_AXIS, dcp_mesh, place_caches
from ckv_jax.paged_cache import empty_cache, read_records, write_records
from ckv_jax.sparse_mla import full_ckv_attention, sparse_mla_attention, sparse_mla_reference, stock_dcp_attention
from ckv_jax.step_plan import StepPlan, build_step_plan

__version__ = "0.1.0"

__all__ = ["DCP_AXIS", "DcpLayout", "RecordFormat", "StepArrays", "StepPlan", "all_gather_ckv", "build_step_plan",
           "dcp_mesh", "empty_cache", "formats", "full_ckv_attention", "gather_workspace_in_shard_map",
           "patch_current_chunk", "place_caches", "read_records", "remap_topk", "sparse_mla_attention",
           "sparse_mla_reference", "step_arrays",
           "stock_dcp_attention", "workspace_to_global_order", "write_records", "write_records_dcp", "__version__"]
