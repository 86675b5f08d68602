"""Host cost of the pieces of one torch-adapter layer on a GPU, each alone in a loop (median of
300 calls, host clock): the gather and patch dispatches, a trivial donated jit, the event
hand-offs, the chunk copy and the slot lookup.

    python tools/adapter_dispatch_probe.py
"""
import os
import statistics
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import torch

from interop.bench import Workload
from ckv_jax import prefetch, full_ckv
def med(fn, n=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6
work = Workload(4096, 4096, 2)
a = work.adapter(1)
work.step(a); work.step(a); torch.cuda.synchronize()
o = a.orch; st = o.lane("target"); ring = o.pool.ring(st.lane)
cache = a._caches[("target", 0)][2]
kw = dict(mesh=o.mesh, axis_name="dcp", num_rows=o._plan.padded_tokens, implementation=None, interpret=False)
box = [ring[0]]
def g():
    box[0] = prefetch._gather_slot(box[0], cache, o._table, o._local_cu, None, **kw)
print("gather_slot jit", med(g))
comp = prefetch._gather_slot.lower(box[0], cache, o._table, o._local_cu, None, **kw).compile()
def gc():
    box[0] = comp(box[0], cache, o._table, o._local_cu, None)
print("gather_slot compiled", med(gc))
kvj, pej = full_ckv.replicated(o.mesh, jnp.zeros((4096, 512), jnp.bfloat16), jnp.zeros((4096, 64), jnp.bfloat16))
def p():
    box[0] = full_ckv.patch_placed(box[0], kvj, pej, o._rows, None, layout=o.fmt.layout, run=o._patch_run)
print("patch jit", med(p))
ident = jax.jit(lambda x: x + 0, donate_argnums=0)
y = [full_ckv.replicated(o.mesh, jnp.zeros((64,), jnp.int32))[0]]
def t():
    y[0] = ident(y[0])
print("trivial donated jit (mesh sharding)", med(t))
z = [jnp.zeros((64,), jnp.int32)]
def t2():
    z[0] = ident(z[0])
print("trivial donated jit (single device)", med(t2))
ev = a.events; s = torch.cuda.current_stream()
print("event pair both ways", med(lambda: (ev.jax_after_torch(s), ev.torch_after_jax(s))))
print("current_stream", med(lambda: torch.cuda.current_stream(ev.device)))
buf = torch.empty(4096, 512, dtype=torch.bfloat16, device="cuda")
print("torch copy_ 4096x512", med(lambda: buf.copy_(work.kv)))
print("is_pending+check_cache", med(lambda: (o.is_pending(1), __import__("ckv_jax.validation").validation.check_cache(o.fmt, cache))))
print("tensor_of+view", med(lambda: o.pool.tensor_of(ring[1])[:]))
print("check_writable", med(lambda: o.pool.check_writable(st.lane, 1)))
