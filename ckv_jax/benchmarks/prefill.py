"""`ckv-jax bench --ops prefill`: the step time of `prefill_layers` per prefetch depth, the
gather's share of it, and what XLA made of its all-gathers (asynchronous or not, and the room
each has to overlap).

The step is GLM-5-shaped where the flags say so (`--prefill-heads 64 --top-k 2048
--prefill-chunk 8192` on a long `--context`): one request, `heads` query heads split over the
local devices, each token with its own top-k, the attention `implementation=None` selects (the
kernel on a GPU) unless one is named.  The gathers alone (every layer's pack and all-gather, no
write, patch or attention) are timed the same way; at depth 0 the step runs each gather between
its layer's write and attention, so `gather_share_pct` = (step_d - (step_0 - gathers)) / step_d
is the share of the step the gathers leave exposed at depth d (at depth 0: gathers / step_0).
`attention_tflops` is the attention's FLOPs (`sparse_mla_attention.flops`, all layers) over the
whole step's time, a lower bound of the attention's own rate."""
from __future__ import annotations

import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.dcp_step import gather_program, step_arrays
from ckv_jax.full_ckv import remap_topk
from ckv_jax.mla_model import make_model, mla_layer
from ckv_jax.pipelined_prefill import prefill_layers
from ckv_jax.placement import DCP_AXIS, place_caches
from ckv_jax.sparse_mla import attention_implementation
from ckv_jax.step_plan import build_step_plan
from pallas_kernels.sparse_mla_attention import flops as sparse_mla_flops


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


def run(depths, fmt_name, layers, context, chunk, log, *, heads=None, top_k=2048, attention=None, keys="exact"):
    """Step time of `prefill_layers` per depth on the local devices (one request of `context`
    tokens, the last `chunk` of them the step's queries).  heads: query heads of the model
    (default 8 per device; divisible by the device count); top_k: rows per query token;
    attention: the attention implementation (None: the library's choice); keys: the attention's
    (`sparse_mla.KEYS`)."""
    fmt = formats.get(fmt_name)
    devices = jax.devices()
    dcp = len(devices)
    heads = heads or 8 * dcp
    if heads % dcp:
        raise ValueError(f"heads: expected a multiple of the {dcp} devices, got {heads}")
    mesh = jax.make_mesh((dcp,), (DCP_AXIS,), devices=devices)
    layout = DcpLayout(dcp, 1, 64)
    rng = np.random.default_rng(0)
    model = make_model(layers, heads, 256, rng)
    chosen = attention_implementation(fmt, devices[0], context, chunk, heads // dcp, top_k,
                                      implementation=attention, keys=keys)
    layer = mla_layer(model, fmt, dcp, DCP_AXIS, implementation=chosen, keys=keys)
    plan = build_step_plan(layout, np.array([context]), np.array([chunk]), max_tokens=context)
    blocks = -(-(-(-context // dcp)) // 64)
    table = np.arange(blocks, dtype=np.int32)[None, :]
    topk = np.minimum(rng.integers(0, 1 << 30, (plan.num_tokens, top_k)) % (plan.positions()[:, None] + 1),
                      plan.positions()[:, None]).astype(np.int32)
    idx, cnt = remap_topk(jnp.asarray(topk), plan)
    idx, cnt = jnp.stack([idx] * layers), jnp.stack([cnt] * layers)
    x = jnp.asarray(rng.standard_normal((plan.num_tokens, 256)), jnp.float32)
    # real records (finite scales): random bytes would decode to NaNs, which the attention propagates
    kv = rng.standard_normal((512, 512)).astype(jnp.bfloat16)
    pe = rng.standard_normal((512, 64)).astype(jnp.bfloat16)
    pages = np.asarray(fmt.encode(jnp.asarray(kv), jnp.asarray(pe))).reshape(8, 64, fmt.record_bytes)
    host_caches = [np.tile(pages, (blocks // 8 + 1, 1, 1))[:blocks]] * dcp
    master = place_caches(host_caches, mesh)

    def fresh_caches():
        """Every layer's cache, a device copy of the same history (the step donates its caches)."""
        return jax.block_until_ready([master.copy() for _ in range(layers)])

    arrays = step_arrays(plan, table, mesh)
    calls = {"gathers": lambda caches: [gather_program(c, arrays, mesh=mesh) for c in caches]}
    schedules, outputs = {}, {}
    for depth in depths:
        schedules[depth] = collective_schedule(prefill_layers(x, fresh_caches(), model.params, table, plan, idx, cnt,
                                                              layer=layer, depth=depth, mesh=mesh, format=fmt,
                                                              compiled_text=True))
        calls[depth] = functools.partial(_step, x, model.params, table, plan, idx, cnt, layer, depth, mesh, fmt,
                                         outputs)
    seconds = _median_seconds(fresh_caches, calls)
    flops = layers * sparse_mla_flops(plan.num_tokens, heads, top_k, fmt.layout)
    gather_s = seconds["gathers"]
    results = []
    for depth in depths:
        step_s, schedule = seconds[depth], schedules[depth]
        share = None if 0 not in depths else 100 * (step_s - (seconds[0] - gather_s)) / step_s
        results.append(dict(op="prefill_step", format=fmt_name, tokens=context, chunk=chunk, layers=layers,
                            dcp=dcp, depth=depth, heads=heads, top_k=top_k, attention=chosen, keys=keys,
                            implementation="prefill_layers", us=step_s * 1e6, gather_us=gather_s * 1e6,
                            gather_share_pct=share, attention_tflops=flops / step_s / 1e12,
                            exact=bool(np.array_equal(outputs[depth], outputs[depths[0]])), **schedule))
        log(f"  prefill depth {depth}: {step_s * 1e3:.2f} ms per step ({layers} layers, context {context}, "
            f"chunk {chunk}, {heads} heads, top-k {top_k}, D={dcp}, attention {chosen}, {keys} keys); gathers alone "
            f"{gather_s * 1e3:.2f} ms" + ("" if share is None else f", {share:.1f}% of the step exposed")
            + f"; all-gathers async {schedule['async_all_gathers']}, sync {schedule['sync_all_gathers']}")
    return results


def _step(x, params, table, plan, idx, cnt, layer, depth, mesh, fmt, outputs, caches):
    """One step of `prefill_layers` over `caches` (donated); its output kept in outputs[depth]."""
    outputs[depth] = prefill_layers(x, caches, params, table, plan, idx, cnt, layer=layer, depth=depth, mesh=mesh,
                                    format=fmt)[0]
    return outputs[depth]


def _median_seconds(make_inputs, calls, rounds=4):
    """{name: host seconds of `call(make_inputs())` until its result is ready}: the median of the
    rounds after the first (a warm-up that compiles).  The calls take turns within each round,
    so a drift of the machine's speed reaches all of them alike; the inputs are made, and ready,
    before the clock starts."""
    times = {name: [] for name in calls}
    for round_ in range(rounds):
        for name, call in calls.items():
            inputs = make_inputs()
            start = time.perf_counter()
            jax.block_until_ready(call(inputs))
            if round_:
                times[name].append(time.perf_counter() - start)
            del inputs
    return {name: statistics.median(t) for name, t in times.items()}
