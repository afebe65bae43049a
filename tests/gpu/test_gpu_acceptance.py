"""The GPU acceptance checks (benchmarks/gpu_acceptance.py) as pytest tests, one per check, on this machine's real
GPUs: `python -m pytest -m gpu tests/gpu`. Each check runs as the command runs it, in a subprocess of its own under
its timeout, its raw files in the test's tmp_path. Without a CUDA device and without NVML the whole module is
skipped, in one line; a check that needs more GPUs than the machine has is skipped with its reason."""

import sys
from pathlib import Path

import pytest

from gpuwatch.trainer.config import gpus_present

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_acceptance


def _cuda_device() -> bool:
    import torch

    return torch.cuda.is_available()


if not _cuda_device() and not gpus_present():
    pytest.skip("no CUDA device and no NVML: the GPU acceptance tests need a GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("check", gpu_acceptance.CHECKS, ids=lambda check: check.name)
def test_check_passes_on_this_gpu_machine(check, tmp_path):
    result = gpu_acceptance.run_check(check, tmp_path, dry_run=False, timeout=check.timeout_seconds)
    if result["status"] == "skip":
        pytest.skip(result["reason"])
    log = (tmp_path / check.name / "check.log").read_text()
    assert result["status"] == "pass", f"{result['status']}: {result['reason']}\n{log[-4000:]}"
