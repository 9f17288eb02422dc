"""The `cpu` backend's compiler: accepts the `cpu` target, compiles nothing."""

import hashlib

from triton.backends.compiler import BaseBackend, GPUTarget

from triton_cpu_shim import MESSAGE


class CpuBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget):
        return target.backend == "cpu"

    def hash(self) -> str:
        return hashlib.sha256(b"triton_cpu_shim 0.1.0").hexdigest()

    def parse_options(self, options: dict) -> object:
        raise NotImplementedError(MESSAGE)

    def add_stages(self, stages: dict, options: object) -> None:
        raise NotImplementedError(MESSAGE)

    def load_dialects(self, context):
        pass

    def get_module_map(self) -> dict:
        return {}
