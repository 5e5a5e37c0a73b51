"""Tensor parallelism over torch.distributed: the group of ranks and its collectives (`group`),
rank 0's messages to the others (`channel`), the layers split over the group (`layers`), and
the worker processes rank 0 starts and watches (`workers`). Imports nothing of the engine, the
models or the backends: the engine (`pagedattn.engine.distributed`) and the models use it."""

from pagedattn.parallel.group import Rendezvous, TPGroup
from pagedattn.parallel.layers import SINGLE

__all__ = ["SINGLE", "Rendezvous", "TPGroup"]
