"""ZeRO-3 from scratch, in one sentence: every rank keeps 1/n of each weight, gradient and optimizer state;
a unit's weights are all-gathered just before its forward and again before its backward, and its gradients
are reduce-scattered back into the shards as soon as they exist.

    sharding.py   a parameter cut into n dim-0 shards (where its rows land: `labkit.layout`; which modules
                  are units and who owns each parameter: `labkit.units`)
    unit.py       one unit's shards, full buffers and its coalesced all-gather / reduce-scatter
    hooks.py      the four moments (before_forward, after_forward, before_backward, after_grad)
    prefetch.py   the next units' all-gathers (prefetch_depth of them) in flight while this one computes
    optimizer.py  AdamW on the shards, optionally with its state offloaded to host memory
    hsdp.py       HSDP's two groups: shard inside g ranks, all-reduce gradient shards across the n/g replicas
    checkpoint.py save the shards of every rank, load them back at any world size
    comm.py       the collectives, the only place that talks to torch.distributed
"""

from labkit.zero.hooks import ZeRO3
from labkit.zero.optimizer import ShardedAdamW

__all__ = ["ZeRO3", "ShardedAdamW"]
