"""The op tests' backends: `gpu` is each non-reference backend (metal, cuda) as the one loader
(mlx_open1b.backend.load) gives it: on its device where there is one, else on its CPU emulator."""
import pytest

from mlx_open1b import backend

GPU_BACKENDS = tuple(name for name in backend.BACKENDS if name != "cpu_ref")


@pytest.fixture(params=GPU_BACKENDS)
def gpu(request):
    """The backend module under test; a skip saying why where it cannot load here."""
    try:
        return backend.load(request.param)
    except backend.BackendUnavailable as e:
        pytest.skip(f"backend {request.param!r} cannot load here: {e.reason}")
