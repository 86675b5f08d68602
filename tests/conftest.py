import os
import sys

# Several CPU devices for the multi-device tests; must precede the first use of a backend.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
# Kernels loaded eagerly on a GPU: the adapter's step-program ordering refuses lazy loading (a
# kernel's first launch would synchronize the device while a program waits for the host).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU (compiled Pallas kernels)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
    # a case marked compiled_only has no interpreted run: interpreted, its config takes the path
    # of another case (and on a GPU host one such case did not finish in 120 s), or the interpreted
    # run is one of the Mosaic kernel's slowest, cut for CI's time (the case says which)
    interpreted_twice = [item for item in items if "compiled_only" in item.keywords
                         and getattr(item, "callspec", None) and item.callspec.params.get("kernel_mode") == "interpret"]
    if interpreted_twice:
        config.hook.pytest_deselected(items=interpreted_twice)
        items[:] = [item for item in items if item not in interpreted_twice]


@pytest.fixture(params=["interpret", pytest.param("compiled", marks=pytest.mark.gpu)])
def kernel_mode(request):
    """Pallas kernels run interpreted everywhere and compiled on a GPU."""
    return request.param


@pytest.fixture(params=["xla", "pallas_triton:interpret",
                        pytest.param("pallas_triton:compiled", marks=pytest.mark.gpu)])
def implementation(request):
    """Keyword arguments selecting one implementation of a kernel op and its mode."""
    name, _, mode = request.param.partition(":")
    return dict(implementation=name, interpret=mode == "interpret")
