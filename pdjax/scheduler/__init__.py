"""Pure-Python scheduler library (no JAX): requests, block manager, batching policies.

`make_scheduler(SchedulerConfig(policy=...))` returns the policy's Scheduler; see base.py for the engine
loop and policies.py for the policies and the disaggregation protocol; batch_queue.py for batches in flight
(pipeline parallelism).
"""
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler.base import Scheduler
from pdjax.scheduler.batch_queue import BatchQueue
from pdjax.scheduler.block_manager import BlockManager
from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.policies import POLICIES, make_scheduler, policy_class, register_policy
from pdjax.scheduler.request import Request, RequestStatus, request_from_workload

__all__ = ["BatchQueue", "BlockManager", "POLICIES", "Request", "RequestStatus", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "make_scheduler", "policy_class", "register_policy", "request_from_workload"]
