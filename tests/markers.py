"""Marks that several test files share."""
import pytest


def gpu_test(missing: bool, reason: str):
    """A test that needs GPUs: skipped (for `reason`) when they are `missing`, and marked gpu, so that
    `pytest -m gpu` (what python -m lent_gpu.check runs on a lent GPU) selects it."""
    def mark(test):
        return pytest.mark.gpu(pytest.mark.skipif(missing, reason=reason)(test))
    return mark
