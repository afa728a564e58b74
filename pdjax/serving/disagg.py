"""Disaggregated (prefill/decode) serving engine: prefill instances and decode instances on disjoint device
groups, each with its own mesh (any pp x tp layout), runner and scheduler, and one KV transfer per request between
them (`transfer_kv`, which routes each layer to the decode stage holding it, resharded to that stage's TP layout).

`DisaggregatedEngine` is the disaggregated configuration of the multi-instance loop
(pdjax.serving.cluster.ClusterEngine: the per-request protocol, the loop, transfer warm-up and its limits are
documented there); colocated replicas run on the same loop with instances of role 'colocated'.
"""
from __future__ import annotations

from typing import Sequence

from pdjax.serving.cluster import ClusterEngine, ClusterResult, Instance, TransferRecord

DisaggregatedResult = ClusterResult

__all__ = ["DisaggregatedEngine", "DisaggregatedResult", "Instance", "TransferRecord"]


class DisaggregatedEngine(ClusterEngine):
    """A ClusterEngine of `prefill` instances (role 'prefill') and `decode` instances (role 'decode'); keyword
    arguments as ClusterEngine (router, clock, sleep, on_token, overlap, transfer, compile_counter,
    fail_on_compile)."""

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance], **kwargs):
        prefill, decode = list(prefill), list(decode)
        for group, role in ((prefill, "prefill"), (decode, "decode")):
            if not group:
                raise ValueError(f"a disaggregated engine needs at least one {role} instance")
            for inst in group:
                if inst.role != role:
                    raise ValueError(f"instance {inst.name!r} has role {inst.role!r} but was given as {role}")
        super().__init__(prefill + decode, **kwargs)

    @property
    def prefill_router(self):
        return self.entry_router
