"""`ckv-jax bench --ops prefill`: the step time of `prefill_layers` per prefetch depth, and what
XLA made of its all-gathers (asynchronous or not, and the room each has to overlap)."""
from __future__ import annotations

import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.full_ckv import remap_topk
from ckv_jax.mla_model import make_model, mla_layer
from ckv_jax.pipelined_prefill import prefill_layers
from ckv_jax.placement import DCP_AXIS, place_caches
from ckv_jax.step_plan import build_step_plan


def collective_schedule(hlo_text: str) -> dict:
    """What the compiled program does with its all-gathers: how many there are, how many XLA made
    asynchronous (`all-gather-start`/`-done` pairs) and, per pair, how many instructions of the
    schedule lie between start and done (the room it has to overlap with compute)."""
    lines = [line.strip() for line in hlo_text.splitlines()]
    starts, gaps = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"(?:ROOT )?(%?[\w.-]+) = .*? all-gather-start\(", line)
        if m:
            starts[m.group(1)] = i
            continue
        if " all-gather-done(" in line:
            for name, at in list(starts.items()):
                if re.search(re.escape(name) + r"\b", line.split("all-gather-done(", 1)[1]):
                    gaps.append(i - at - 1)
                    del starts[name]
                    break
    sync = sum(1 for line in lines if re.search(r"= \S+ all-gather\(", line))
    return dict(async_all_gathers=len(gaps), sync_all_gathers=sync, instructions_between_start_and_done=gaps)


def run(depths, fmt_name, layers, context, chunk, log):
    """Step time of `prefill_layers` per depth on the local devices (one request)."""
    fmt = formats.get(fmt_name)
    devices = jax.devices()
    dcp = len(devices)
    heads = 8 * dcp
    mesh = jax.make_mesh((dcp,), (DCP_AXIS,), devices=devices)
    layout = DcpLayout(dcp, 1, 64)
    rng = np.random.default_rng(0)
    model = make_model(layers, heads, 256, rng)
    layer = mla_layer(model, fmt, dcp, DCP_AXIS)
    plan = build_step_plan(layout, np.array([context]), np.array([chunk]), max_tokens=context)
    blocks = -(-(-(-context // dcp)) // 64)
    table = np.arange(blocks, dtype=np.int32)[None, :]
    topk = np.minimum(rng.integers(0, 1 << 30, (plan.num_tokens, 2048)) % (plan.positions()[:, None] + 1),
                      plan.positions()[:, None]).astype(np.int32)
    idx, cnt = remap_topk(jnp.asarray(topk), plan)
    idx, cnt = jnp.stack([idx] * layers), jnp.stack([cnt] * layers)
    x = jnp.asarray(rng.standard_normal((plan.num_tokens, 256)), jnp.float32)
    # real records (finite scales): random bytes would decode to NaNs, which the attention propagates
    kv = rng.standard_normal((512, 512)).astype(jnp.bfloat16)
    pe = rng.standard_normal((512, 64)).astype(jnp.bfloat16)
    pages = np.asarray(fmt.encode(jnp.asarray(kv), jnp.asarray(pe))).reshape(8, 64, fmt.record_bytes)
    host_caches = [np.tile(pages, (blocks // 8 + 1, 1, 1))[:blocks]] * dcp
    results, outputs = [], {}
    for depth in depths:
        caches = [place_caches(host_caches, mesh) for _ in range(layers)]
        schedule = collective_schedule(prefill_layers(x, caches, model.params, table, plan, idx, cnt, layer=layer,
                                                      depth=depth, mesh=mesh, format=fmt, compiled_text=True))
        del caches
        times = []
        for trial in range(4):
            caches = [place_caches(host_caches, mesh) for _ in range(layers)]
            jax.block_until_ready(caches)
            start = time.perf_counter()
            out, _ = prefill_layers(x, caches, model.params, table, plan, idx, cnt, layer=layer, depth=depth,
                                    mesh=mesh, format=fmt)
            out = jax.block_until_ready(out)
            if trial:
                times.append(time.perf_counter() - start)
        outputs[depth] = np.asarray(out)
        seconds = statistics.median(times)
        results.append(dict(op="prefill_step", format=fmt_name, tokens=context, chunk=chunk, layers=layers,
                            dcp=dcp, depth=depth, implementation="prefill_layers", us=seconds * 1e6,
                            exact=bool(np.array_equal(outputs[depth], outputs[depths[0]])), **schedule))
        log(f"  prefill depth {depth}: {seconds * 1e3:.2f} ms per step ({layers} layers, context {context}, "
            f"chunk {chunk}, D={dcp}); all-gathers async {schedule['async_all_gathers']}, "
            f"sync {schedule['sync_all_gathers']}")
    return results
