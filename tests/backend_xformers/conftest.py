"""tests/backend_xformers runs the xformers backend's kernel path on the CPU under the Triton
interpreter (set before triton is first imported, as tests/kernels does) unless CUDA is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
