"""The step both the 2-process run and the single-process run gather (D = 4, interleave 2)."""
CASE = dict(world_size=4, interleave=2, fmt_name="fp8_ds_mla", seq_lens=[45, 23, 70], query_lens=[12, 23, 9],
            seed=99)
