"""Pallas GPU kernels of ckv-jax, each beside its pure-jnp reference.

Kernels know bytes, offsets, shapes, block tables and slot lists; they know nothing of DCP,
ranks or layers (that is `ckv_jax`).  Modules: `record_layout` (byte segments of a record),
`float_codes` (bit-level codecs), `record_codec` (encode/decode), `selection` and `tuning`
(which implementation runs, with which tiles), `compat` (what differs between jax versions),
and one folder per op: `cache_writer`, `paged_gather`, `sparse_mla_attention`.
"""
from pallas_kernels import record_codec
from pallas_kernels.record_layout import RecordLayout, Segment

__all__ = ["RecordLayout", "Segment", "record_codec"]
