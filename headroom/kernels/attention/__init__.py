"""headroom's attention kernels: C++ for the CPU (built with the others, see
headroom/kernels/__init__.py) and Triton for the GPU (triton.py, imported only where used)."""
