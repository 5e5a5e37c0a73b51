"""Tensor parallelism over torch.distributed: the group of ranks (`group`), the layers split
over it (`layers`), and the worker processes rank 0 starts and watches (`workers`)."""

from pagedattn.parallel.group import Rendezvous, TPGroup
from pagedattn.parallel.layers import SINGLE

__all__ = ["SINGLE", "Rendezvous", "TPGroup"]
