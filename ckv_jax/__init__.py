"""ckv-jax: compressed-KV (CKV) cache records of sparse-MLA models under decode context parallelism."""
from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.formats import RecordFormat
from ckv_jax.full_ckv import (DCP_AXIS, all_gather_ckv, dcp_mesh, gather_workspace_in_shard_map, place_caches,
                              remap_topk, workspace_to_global_order)
from ckv_jax.paged_cache import empty_cache, read_records, write_records
from ckv_jax.sparse_mla import full_ckv_attention, sparse_mla_reference, stock_dcp_attention
from ckv_jax.step_plan import StepPlan, build_step_plan

__version__ = "0.1.0"

__all__ = ["DCP_AXIS", "DcpLayout", "RecordFormat", "StepPlan", "all_gather_ckv", "build_step_plan", "dcp_mesh",
           "empty_cache",
           "formats", "full_ckv_attention", "gather_workspace_in_shard_map", "place_caches", "read_records",
           "remap_topk", "sparse_mla_reference", "stock_dcp_attention", "workspace_to_global_order",
           "write_records", "__version__"]
