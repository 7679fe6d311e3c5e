"""What a module returned, as the tensors in it: the backward hooks arm on those that need a gradient.

A unit's forward may return a tensor, a tuple or list, a dict, or a dataclass (Hugging Face's
`ModelOutput` is an ordered dict and a dataclass); its backward begins when the first of its output
tensors that autograd reaches gets its gradient. FSDP2 walks the output pytree the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `output`, depth first: tensors, tuples, lists, dicts and dataclasses; nothing else."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from output_tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from output_tensors(value)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            yield from output_tensors(getattr(output, f.name, None))


def needing_grad(output: Any) -> list[torch.Tensor]:
    """The tensors of `output` that a backward will reach (grad enabled and `requires_grad`)."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in output_tensors(output) if t.requires_grad]
