"""Pallas GPU kernels of ckv-jax, each beside its pure-jnp reference.

Kernels know bytes, offsets, shapes, block tables and slot lists; they know nothing of DCP,
ranks or layers (that is `ckv_jax`).
"""
from pallas_kernels import record_codec
from pallas_kernels.record_codec import RecordLayout, Segment

__all__ = ["RecordLayout", "Segment", "record_codec"]
