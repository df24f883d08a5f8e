"""`python -m headroom.kernels`: build headroom's CPU kernels into torch's cache."""

from headroom.kernels import cpu_kernels

module, why = cpu_kernels()
print(f"headroom CPU kernels: {why}")
raise SystemExit(0 if module is not None else 1)
