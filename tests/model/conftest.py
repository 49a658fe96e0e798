import pytest

from megatron_ds.model.compile import CompileMode


@pytest.fixture(autouse=True)
def compile_mode_as_found(monkeypatch):
    """compile_layers marks the process's layers compiled for good (CompileMode), which changes the eager K/V
    cache's buffers: each test leaves the mode as it found it, so that tests sharing a process do not depend on
    their order."""
    for name in ("linears_outside", "layers_compiled"):
        monkeypatch.setattr(CompileMode, name, getattr(CompileMode, name))
