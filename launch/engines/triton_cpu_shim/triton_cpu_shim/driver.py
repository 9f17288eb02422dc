"""The `cpu` backend's driver: always active, target GPUTarget("cpu", "x86_64", 1)."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from triton_cpu_shim import MESSAGE


class CpuDriver(DriverBase):
    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError(MESSAGE)

    def get_current_target(self):
        return GPUTarget("cpu", "x86_64", 1)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError(MESSAGE)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0
