"""The native stream signal's build, its registration and its custom call, on the CPU (where its
handler only counts; the GPU handler's event record and wait are tested in test_interop_gpu)."""
import array
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from interop import native_signal


def _counting_call(state):
    return lambda *arrays: native_signal.call(arrays, platform="cpu", record_fn=0, wait_fn=0, ready_event=0,
                                              then_wait=0, state=state)


def test_the_library_builds_loads_and_passes_arrays_through_unchanged():
    loaded = native_signal.load()
    assert loaded.library is not None, loaded.why
    assert loaded.library.path.exists() and native_signal.load() is loaded      # once per process
    rng = np.random.default_rng(7)
    cpu = jax.devices("cpu")[0]             # the host handler (on a GPU machine too)
    arrays = tuple(jax.device_put(a, cpu) for a in (
        rng.integers(0, 256, (33, 656), dtype=np.uint8), jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16),
        rng.integers(-9, 9, (4,), dtype=np.int32)))
    state = native_signal.new_state()
    program = jax.jit(lambda a, b, c: _counting_call(state)(a + 1, b * 2, c - 3))
    for calls in (1, 2, 3):
        out = jax.block_until_ready(program(*arrays))
        assert int(state[0]) == calls and int(state[1]) == 0       # counted once per run; no stream on a CPU
    for got, want in zip(out, (arrays[0] + 1, arrays[1] * 2, arrays[2] - 3)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # no effect: an effect would cost every call jax's slow dispatch path
    assert not jax.make_jaxpr(_counting_call(state))(*arrays).effects


def test_the_build_is_the_source_compiled_against_jaxlib_headers(tmp_path):
    """`_build` writes a library exporting both handlers; a failed compile leaves no file."""
    cxx = native_signal.compiler()
    assert cxx is not None, "these tests need a C++ compiler (the README's CPU setup has one)"
    path = tmp_path / "lib" / "libckv_stream_signal.so"
    native_signal._build(cxx, jax.ffi.include_dir(), path)
    handle = ctypes.CDLL(str(path))
    assert handle.CkvStreamSignal and handle.CkvHostSignal
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]          # no temporary left
    broken = tmp_path / "broken" / "lib.so"
    with pytest.raises(Exception) as e:
        native_signal._build("/bin/false", jax.ffi.include_dir(), broken)
    assert type(e.value).__name__ == "CalledProcessError"
    assert list(broken.parent.iterdir()) == []


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", "")
    assert native_signal.compiler() is None
    monkeypatch.setattr(native_signal, "compiler", lambda: None)
    native_signal.load.cache_clear()
    try:
        loaded = native_signal.load()
        assert loaded.library is None and "no C++ compiler" in loaded.why
    finally:
        native_signal.load.cache_clear()
    monkeypatch.undo()
    assert native_signal.load().library is not None        # the same library again (never a second one)


def test_the_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CKV_JAX_CACHE_DIR", str(tmp_path))
    assert native_signal.cache_dir() == tmp_path
    monkeypatch.delenv("CKV_JAX_CACHE_DIR")
    assert native_signal.cache_dir().parts[-2:] == (".cache", "ckv_jax")


@pytest.mark.parametrize("state", [np.zeros(2, np.uint64), array.array("q", [0, 0]), array.array("Q", [0, 0, 0])])
def test_a_bad_state_buffer_is_named(state):
    with pytest.raises(TypeError, match=r"state: expected new_state\(\) \(array.array\('Q'\) of 2 words\)"):
        native_signal.call((jnp.ones(2),), platform="cpu", record_fn=0, wait_fn=0, ready_event=0, then_wait=0,
                           state=state)
