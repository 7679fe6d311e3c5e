"""Activation memory of one micro-batch on one rank: what each block of `labkit.model` saves for
backward, and the peak at the loss's backward or the last block's.
"""

from __future__ import annotations

from labkit.names import WEIGHTS_SHARDED

from .inputs import PRECISIONS, PlanInputs

ACTIVATION_PARTS = (
    "layers",
    "recomputed_layer",
    "block_gradients",
    "weight_gradient",
    "head",
    "loss_gradients",
    "inputs",
)
_INDEX_BYTES = 8  # int64 token ids, targets and positions
_LOSS_BYTES = 4  # the lab's loss runs in fp32 (`loss_fn(logits.float(), ...)`), so do the logits' gradients


def activation_elem_bytes(precision: str) -> int:
    """Bytes of one activation in the compute dtype: 4 for fp32, 2 for the bf16/fp16 recipes."""
    return 4 if precision == "fp32" else 2


def layer_activation_bytes(tokens: int, hidden_size: int, heads: int, elem_bytes: int) -> int:
    """Bytes one block of `labkit.model.Block` saves for backward, for `tokens` = micro-batch x seq_len.

    Per token: 16 h-wide tensors in the compute dtype (the block's input, ln1's output, the q|k|v
    projection (3 h, one storage), the attention's output (h, which proj reads as a view), the residual after
    attention, ln2's output, the MLP's hidden before and after GELU (4 h each)), the two LayerNorms' fp32
    mean and rstd (16 B), and SDPA's fp32 logsumexp per head (4 a B). No s x s matrix: torch's CPU SDPA
    (flash kernel) and the GPU's flash / memory-efficient kernels save only the logsumexp.
    """
    return tokens * (16 * hidden_size * elem_bytes + 16 + 4 * heads)


def activation_bytes(p: PlanInputs) -> tuple[dict[str, int], str]:
    """The activation peak of one micro-batch on one rank, by part (bytes), and the moment it is reached.

    Two moments compete, each on top of the L layers' saved activations (with checkpointing only each
    block's input, T x h): the loss's backward (the head's saved tensors: the last block's output, ln_f's
    output and its stats, the fp32 log-softmax; and two fp32 logits gradients, T x V each), or the last
    block's backward (its gradient in and its MLP's hidden gradient, 5 T x h; with checkpointing the block
    recomputed whole; and the MLP's output-weight gradient, 4 h x h, computed before autograd adds it into
    `.grad`, except under zero3/hsdp, whose unsharded layer gradients `transient_bytes` counts). Plus the
    batch's int64 ids. All zero with hidden_size=0 (not modelled).
    """
    parts = dict.fromkeys(ACTIVATION_PARTS, 0)
    if not p.hidden_size:
        return parts, ""
    e, h, s = activation_elem_bytes(p.precision), p.hidden_size, p.seq_len
    tokens = p.micro_batch * s
    full = layer_activation_bytes(tokens, h, p.attention_heads, e)
    kept = tokens * h * e if p.activation_checkpointing else full
    common = {"layers": p.layers * kept, "inputs": (2 * tokens + s) * _INDEX_BYTES}
    at_loss = {
        "head": tokens * (2 * h * e + 8 + p.vocab_size * _LOSS_BYTES),
        "loss_gradients": 2 * tokens * p.vocab_size * _LOSS_BYTES,
    }
    in_transient = p.strategy in WEIGHTS_SHARDED
    at_block = {
        "recomputed_layer": full - kept if p.activation_checkpointing else 0,
        "block_gradients": 5 * tokens * h * e,
        "weight_gradient": 0 if in_transient else int(4 * h * h * PRECISIONS[p.precision]["grads"]),
    }
    if sum(at_loss.values()) >= sum(at_block.values()):
        return {**parts, **common, **at_loss}, "loss backward"
    return {**parts, **common, **at_block}, "last block's backward"
