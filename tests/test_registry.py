"""The plug-in registries (pdjax.config.registry): every table agrees with its classes, and a toy policy, router or
step-cost source added in a test with one class and one registration is picked up by every path that takes that
kind of plug-in."""
import pytest

from pdjax.config.registry import POLICIES, ROUTERS, STACKS, baseline_policies
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import serve_config_from_dict
from pdjax.scheduler import Scheduler, make_scheduler, policy_class, register_policy
from pdjax.scheduler.policies import OrcaScheduler, unregister_policy
from pdjax.scheduler.routing import InstanceRouter, register_router

SIM_CONFIG = {"backend": "sim", "seed": 0, "model": {"checkpoint": "opt-13b"},
              "scheduler": {"token_budget": 2048, "max_num_seqs": 32, "max_model_len": 1024, "num_pages": 4096},
              "workload": {"kind": "synthetic", "num_requests": 12, "rate": 4.0, "seed": 0,
                           "prompt_len": {"kind": "uniform", "low": 32, "high": 256},
                           "output_len": {"kind": "uniform", "low": 4, "high": 32}},
              "sim": {"hardware": "a100-80gb-sxm", "num_pages": 0}}


# ------------------------------------------------------------------------------------------------ the tables
@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_row_has_its_class_and_its_traits_hold(name):
    info = POLICIES[name]
    cls = policy_class(name)
    assert issubclass(cls, Scheduler) and cls.name == name
    assert (cls in Scheduler.DECODE_RUN_CLASSES) == info.decode_run
    cfg = SchedulerConfig(policy=name, token_budget=64, max_num_seqs=8, max_model_len=64, num_pages=64)
    assert cfg.chunking == info.chunking
    assert type(make_scheduler(cfg)) is cls
    if info.stall_free:       # a stall-free budget must hold every running decode
        with pytest.raises(ValueError, match="stall-free"):
            SchedulerConfig(policy=name, token_budget=4, max_num_seqs=8, max_model_len=4, num_pages=64)
    assert not (info.role and info.colocated)


def test_the_derived_name_lists_are_the_tables():
    assert baseline_policies() == ("sarathi", "vllm_v0")
    assert POLICIES.names(chunking=True) == ("sarathi", "chunked_only", "chunked_prefill_first", "vllm_v1",
                                             "prefill_only", "decode_only")
    assert POLICIES.names(stall_free=True) == ("sarathi", "vllm_v1", "decode_only")
    assert tuple(ROUTERS) == ("round_robin", "least_loaded", "prefix_affinity", "kv_centric") and \
        all(ROUTERS[r].pick for r in ROUTERS)
    assert tuple(STACKS) == ("pdjax", "distserve", "distserve-vllm", "vllm-eager")
    from pdjax.sim.placement import COLOCATED_POLICIES
    from pdjax.sim.provision import COLOCATED_POLICIES as PROVISION_COLOCATED
    assert tuple(COLOCATED_POLICIES) == tuple(PROVISION_COLOCATED) == baseline_policies()


# ------------------------------------------------------------------------------------------------ a toy policy
class ToyScheduler(OrcaScheduler):
    """A toy policy: Orca's batches under another name (one class)."""
    name = "toy_orca"


@pytest.fixture
def toy_policy():
    register_policy(ToyScheduler, decode_run=True, baseline=3)      # one row
    try:
        yield ToyScheduler.name
    finally:
        unregister_policy(ToyScheduler.name)


def test_a_toy_policy_is_one_class_and_one_row(toy_policy):
    # config validation and the scheduler factory
    cfg = SchedulerConfig(policy=toy_policy, token_budget=1024, max_model_len=1024)
    assert type(make_scheduler(cfg)) is ToyScheduler and not cfg.chunking
    with pytest.raises(ValueError, match="toy_orca"):          # the error lists it among the names
        SchedulerConfig(policy="nope")
    assert ToyScheduler in Scheduler.DECODE_RUN_CLASSES
    # the serve config and the simulator (`--config.backend=sim`)
    from pdjax.sim.run import simulate_config
    d = {**SIM_CONFIG, "scheduler": {**SIM_CONFIG["scheduler"], "policy": toy_policy}}
    result, _ = simulate_config(serve_config_from_dict(d))
    assert len(result.requests) == 12 and all(r.finish_reason == "length" for r in result.requests)
    # the searches: a colocated baseline of the placement and provision searches, by default
    from pdjax.sim import placement as pl
    from pdjax.sim import provision as pv
    assert toy_policy in pl.COLOCATED_POLICIES and toy_policy in pv.COLOCATED_POLICIES
    prob = pl.PlacementProblem(model="opt-13b", node=pl.NodeType("a100-80gb-sxm", gpus_per_node=2), gpu_budget=1,
                               workload=SIM_CONFIG["workload"], ttft_s=0.5, tpot_s=0.1, max_model_len=1024)
    toys = [c for c in pl.enumerate_placements(prob) if c.policy == toy_policy]
    assert toys
    served = pl.serve_config(prob, toys[0], 1.0)
    assert served["scheduler"]["policy"] == toy_policy
    assert served["scheduler"]["token_budget"] == 2048        # never chunks: the budget holds a whole prompt
    assert pv.ProvisionProblem(model="llama-2-7b", workload=SIM_CONFIG["workload"], target_rate=1.0,
                               colocated_policies=(toy_policy,)).colocated_policies == (toy_policy,)
    # a colocated deployment runs it; a disaggregated one does not (it is no role base)
    with pytest.raises(ValueError, match="deployment.kind='disaggregated'"):
        serve_config_from_dict({**d, "deployment": {"kind": "disaggregated"}})


def test_an_unregistered_class_or_a_duplicate_name_fails():
    with pytest.raises(ValueError, match="registered already"):
        register_policy(type("Again", (OrcaScheduler,), {"name": "orca"}), decode_run=True)
    with pytest.raises(TypeError, match="Scheduler subclass"):
        register_policy(int)


# ------------------------------------------------------------------------------------------------ a toy router
def test_a_toy_router_is_one_function_and_one_registration():
    def last(router):          # always the last instance
        return router.instances[-1]
    register_router("toy_last", last)
    try:
        from pdjax.config.deployment import DeploymentConfig
        assert DeploymentConfig(router="toy_last").router == "toy_last"
        from types import SimpleNamespace
        insts = [SimpleNamespace(scheduler=None, role="colocated") for _ in range(3)]
        assert InstanceRouter("toy_last", insts).pick() is insts[-1]
    finally:
        ROUTERS.remove("toy_last")
    with pytest.raises(ValueError, match="router"):
        DeploymentConfig(router="toy_last")


# ------------------------------------------------------------------------------------------------ a toy stack
def test_every_stack_row_has_its_factory_and_makes_step_times():
    from pdjax.sim.build import build_setup, group_step_time
    from pdjax.sim.step_time import StepTime
    for name in STACKS:
        assert STACKS[name].factory is not None, name
    setup = build_setup(serve_config_from_dict(SIM_CONFIG))
    step = group_step_time(setup, "colocated")
    assert isinstance(step, StepTime) and step.pp == 1 and step.takes_context


def test_a_toy_step_cost_source_is_one_class_and_one_registration():
    from pdjax.sim.run import simulate_config
    from pdjax.sim.step_time import StepTimeBase, register_stack

    class FlatStack(StepTimeBase):
        """A toy step-cost source: 1 ms per step plus 1 us per scheduled token; it is its own stack too."""
        name = "toy_flat"

        def __call__(self, out, ctx=None):
            return 1e-3 + 1e-6 * (out.num_prefill_tokens + out.num_decode_tokens)

        def check(self, model, hardware, tp):
            if tp != 1:
                raise ValueError("toy_flat times tp=1 only")

        def step_time(self, group):
            return self

        def describe(self):
            return {"stack": self.name}

    register_stack("toy_flat", FlatStack)
    try:
        d = {**SIM_CONFIG, "deployment": {"colocated": {"stack": "toy_flat"}}}
        result, setup = simulate_config(serve_config_from_dict(d))
        assert setup.groups["colocated"].stack.describe() == {"stack": "toy_flat"}
        assert len(result.requests) == 12
        for it in result.iterations:          # every step took the toy's time
            tokens = it.num_prefill_tokens + it.num_decode_tokens
            assert it.end_time - it.start_time == pytest.approx(1e-3 + 1e-6 * tokens)
        with pytest.raises(ValueError, match="deployment.colocated.stack: toy_flat times tp=1 only"):
            from pdjax.sim.build import build_setup
            build_setup(serve_config_from_dict({**d, "deployment": {"colocated": {"stack": "toy_flat", "tp": 2}}}))
        # the placement search asks the stack which layouts it times
        from pdjax.sim import placement as pl
        prob = pl.PlacementProblem(model="opt-13b", node=pl.NodeType("a100-80gb-sxm", gpus_per_node=2),
                                   gpu_budget=2, workload=SIM_CONFIG["workload"], ttft_s=0.5, tpot_s=0.1,
                                   max_model_len=1024, colocated_stack="toy_flat")
        assert prob.fits_stack("colocated", pl.Layout(1, 1)) and not prob.fits_stack("colocated", pl.Layout(2, 1))
    finally:
        STACKS.remove("toy_flat")
