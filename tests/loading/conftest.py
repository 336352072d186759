import pytest
import triton.language  # noqa: F401  imported now, under TRITON_INTERPRET=1 (tests/conftest.py): its @jit helpers
                        # would be compiled-mode functions if triton were first imported inside reference_ops


from lmkernels._utils import interpreting


@pytest.fixture
def reference_ops(monkeypatch):
    """Run the ops' PyTorch references on CPU tensors (the suite turns the Triton interpreter on globally;
    use_triton() reads TRITON_INTERPRET at call time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreting()


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
