"""From a validated ServeConfig to the parts the simulator takes: model, hardware, cost setup, instances with their
schedulers and step times, the router, the KV-transfer times. `simulate` (pdjax.sim.simulator) and
`simulate_disaggregated` (pdjax.sim.disagg) take these parts and know nothing of configs; pdjax.sim.run composes
build -> simulate -> outputs. The simulated deployment is exactly `cfg.deployment` (the block the real engine runs).

Rules (each chosen so a simulated run answers "what would the real engine do with this config"):
- Model: `sim.model` (a registry spec name) if set, else `model.checkpoint` when it is a spec name, else the
  checkpoint directory's name when that is a spec name, else its `pdjax_spec.json`; at `model.dtype` ('auto': the
  spec's own, the 16-bit dtype of the paper checkpoints, float32 of the tiny specs), which every byte count
  (weights, KV pages and transfers, the fit checks) and the matmul rate (HardwareSpec.peak_flops) follow. A
  published step-fit stack was measured at the checkpoint's dtype and refuses another. (On host-cpu the CPU engine
  computes an 'auto' model in float32, but the shipped host-cpu profile was calibrated costing the checkpoint's
  dtype, its fitted efficiencies absorbing the difference, so 'auto' costs the checkpoint's dtype there too.)
- Hardware and cost profile: `sim.hardware`; the profile is `sim.profile` (a JSON path or a shipped profile
  name) if set, else the shipped profile for the hardware (pdjax/sim/profiles/<hardware>.json, then
  <family>.json: 'a100-80gb-pcie' -> a100.json), else first principles (CostParams defaults). A profile that
  carries a frozen "hardware_spec" (host-cpu calibrations) is costed against that spec, not a re-measurement,
  so results are deterministic. A profile with "padding" costs steps at the engine's padded bucket shapes,
  buckets from the serve config exactly as the engine picks them (pdjax.config.buckets.engine_buckets), per
  group (its token budget and max_num_seqs), and the attention implementation the profile was measured on
  (its "attention": 'blocked' costs decodes by the longest context of the kernel's pass).
- Deployment: `check_against_model` (pdjax.config.validate, as the real engine: max_model_len within the model's
  positions, pp <= layers, tp dividing heads / KV heads / MLP width, explicit devices disjoint; the cross-block
  rules were checked, for both backends, when the ServeConfig was built) on a simulated machine with as many
  devices as the deployment asks for, plus any explicit index beyond that (other nodes). Colocated:
  `deployment.colocated.num_instances` replicas ('replica0', ...) of (pp, tp) behind `deployment.router`;
  disaggregated: the prefill and decode groups, the router for both, and the mixed group when it has instances
  ('mixed0', ...; Splitwise's mixed pool, pdjax.scheduler.mixed) with the deployment's thresholds
  (`SimSetup.mixed_prefill_queue_tokens`, `.mixed_decode_load`); with `deployment.mixed_pool='borrow'`
  (`SimSetup.mixed_pool`) no mixed group, the prefill and decode instances run BorrowingSchedulers.
- Schedulers: `instance_scheduler_config` of each group (colocated: the scheduler block's policy; prefill /
  decode: prefill_only / decode_only; mixed: a MixedScheduler, `make_role_scheduler`), vocab_size 0 filled from
  the model as run_real does (out-of-vocabulary prompts rejected).
- KV pages per instance: the group's `num_pages` override; else `sim.num_pages` when > 0; else, on a GPU/TPU,
  the cost model's KV capacity at the group's tp/pp (`kv_cache_capacity_tokens` with gpu_memory_utilization,
  activations for its token_budget and max_num_seqs) in pages; else (host-cpu) `scheduler.num_pages` as given,
  which is what the CPU engine allocates.
- Step time: the group's serving stack (`deployment.<group>.stack`, a registered pdjax.sim.step_time.Stack or a
  stack file) makes it from the group's GroupTiming: 'pdjax' is `make_step_time(model, hardware, tp, pp, params,
  padding, noise)` (noise: the profile's StepNoise, seeded by the run's seed and the role, when sim.step_noise); a
  fitted stack (pdjax.sim.stack: DistServe's engine or its vLLM) is its step fit for (model, hardware, tp), which
  `Stack.check` refuses at build time for any other.
- Disaggregated KV links: from the instances' devices (pdjax.sim.disagg.kv_link), mixed instances' included;
  transfers on one link are serialized. `disaggregated_kwargs(setup, instances)`: the keyword arguments of
  simulate_disaggregated for a built setup (kv_bytes_of, router, serialize_transfers, the mixed pool).
- Workload: `make_workload(cfg.workload, cfg.seed)`, offline mode puts every arrival at 0, as the engine does.
  Requests carry no stop token (the simulator cannot know when a model would emit EOS): they run to max_tokens.
No JAX.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

from pdjax.config.buckets import engine_buckets
from pdjax.config.deployment import instance_scheduler_config, uses_kv_centric
from pdjax.config.model_specs import ModelSpec, spec_at_dtype
from pdjax.config.validate import check_against_model, model_spec_for
from pdjax.scheduler import make_scheduler, request_from_workload
from pdjax.scheduler.base import PLACEHOLDER_TOKEN
from pdjax.scheduler.block_manager import numbered_keys
from pdjax.scheduler.instances import check_instance, make_role_scheduler
from pdjax.scheduler.mixed import make_borrowing_scheduler
from pdjax.scheduler.overload import has_overload, overload_pool_factory, overload_scheduler_maker
from pdjax.scheduler.routing import InstanceRouter
from pdjax.sim.cost_model import CostParams, kv_bytes, kv_cache_capacity_tokens, param_count
from pdjax.sim.disagg import kv_link_between, make_transfer_time
from pdjax.sim.eager import EagerHostStack  # noqa: F401 (registers the 'vllm-eager' stack before check_stacks)
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.kv_tier import apply_kv_centric, configure_router, router_options
from pdjax.sim.simulator import PendingRequest, SimInstance
from pdjax.sim.profile import Profile, profile_for
from pdjax.sim.step_cost import EnginePadding, StepNoise, padding_from_profile
from pdjax.sim.stack import get_stack
from pdjax.sim.step_time import GroupTiming, Stack, StepTime, check_stacks
from pdjax.workload import make_workload

check_stacks()      # every row of the stack table has its factory (step_cost and stack registered theirs)

# --------------------------------------------------------------------------------------------------- setup
@dataclasses.dataclass(frozen=True)
class GroupSetup:
    """One role's resolved instances: scheduler config (policy and num_pages resolved), pp/tp, KV capacity in
    tokens (None when num_pages was given or on host-cpu), engine padding, device indices per instance."""
    role: str
    scheduler_config: Any
    tp: int
    pp: int
    kv_capacity_tokens: Optional[int]
    devices: Tuple[Tuple[int, ...], ...]
    names: Tuple[str, ...]
    padding: Optional[EnginePadding] = None
    stack: Optional[Stack] = None              # its serving stack (pdjax.sim.step_time; 'pdjax': the cost model)
    hardware: Optional[HardwareSpec] = None    # the group's own hardware (deployment.<group>.hardware), else None
    params: Optional[CostParams] = None        # its cost parameters (the shipped profile of that hardware)
    gpu: str = ""                              # its hardware's registry name (a stack's fits are keyed by it)

    @property
    def num_instances(self) -> int:
        return len(self.names)


@dataclasses.dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run is built from (resolved once from a ServeConfig). kind: 'colocated' (one group,
    'colocated') or 'disaggregated' ('prefill' and 'decode' groups)."""
    model: ModelSpec
    hardware: HardwareSpec
    params: CostParams
    profile: str                 # what profile was used ('' = first principles)
    kind: str
    router: str
    groups: Dict[str, GroupSetup]
    async_scheduling: bool = False
    serialize_transfers: bool = True
    mixed_prefill_queue_tokens: int = 8192     # deployment's mixed-pool thresholds (read with a 'mixed' group)
    mixed_decode_load: float = 1.0
    mixed_pool: str = "dedicated"              # deployment.mixed_pool ('borrow': BorrowingSchedulers, no mixed group)
    step_noise: Tuple[float, ...] = ()         # the profile's StepNoise quantiles when sim.step_noise (else ())
    seed: int = 0                              # the run's seed: seeds the step noise
    overload: Any = None                       # the DeploymentConfig when early rejection / rebalancing is on
    kv: Any = None      # the DeploymentConfig when a KV-cache-centric key is on (pdjax.sim.kv_tier), else None
    slo: Any = None     # the serve config's SLOConfig (read by deployment.rebalance_trigger='slo')

    # The colocated group's parts, for the common one-group case.
    def _colocated(self) -> GroupSetup:
        if self.kind != "colocated":
            raise ValueError(f"deployment.kind={self.kind!r}: this setup has groups {sorted(self.groups)}, "
                             "no single scheduler config")
        return self.groups["colocated"]

    @property
    def scheduler_config(self):
        return self._colocated().scheduler_config

    @property
    def kv_capacity_tokens(self) -> Optional[int]:
        return self._colocated().kv_capacity_tokens

    @property
    def padding(self) -> Optional[EnginePadding]:
        return self._colocated().padding


# --------------------------------------------------------------------------------------------------- resolution
def resolve_model(cfg) -> ModelSpec:
    """The cost model's ModelSpec (the module docstring's rule: pdjax.config.validate.model_spec_for) at the dtype
    model.dtype asks for (pdjax.config.model_specs.spec_at_dtype: 'auto' keeps the checkpoint's own)."""
    return spec_at_dtype(model_spec_for(cfg, simulator=True, required=True), cfg.model.dtype)


def _check_stack_dtype(role: str, stack: Stack, model: ModelSpec, checkpoint_dtype: str) -> None:
    """A stack that is not the cost model (a published step fit) was measured at the checkpoint's own dtype: it
    cannot cost another one (ValueError naming the group, the stack and the dtypes)."""
    if model.dtype != checkpoint_dtype and not getattr(stack, "follows_dtype", False):
        raise ValueError(f"deployment.{role}.stack={stack.name!r} was measured at {model.name}'s own dtype "
                         f"{checkpoint_dtype}; model.dtype={model.dtype!r} needs a stack costed from first "
                         "principles (e.g. 'pdjax') or model.dtype='auto'")


def resolve_profile(cfg) -> Tuple[Optional[Profile], str]:
    """The profile of `cfg.sim` (pdjax.sim.profile.profile_for) and what results record of it: sim.profile as
    given, else the shipped file's path ('' for first principles)."""
    profile = profile_for(cfg.sim.profile, cfg.sim.hardware)
    return profile, cfg.sim.profile or (profile.path if profile is not None else "")


def _group_pages(cfg, group, sched_cfg, model, hw) -> Tuple[int, Optional[int]]:
    """(num_pages, KV capacity in tokens or None) of one instance of `group` (module docstring rule)."""
    given = group.num_pages or cfg.sim.num_pages
    if given > 0:
        if hw.kind != "cpu":
            _check_pages_fit(model, hw, group, given, sched_cfg.page_size)
        return given, None
    if hw.kind == "cpu":
        if not cfg.scheduler.num_pages:
            raise ValueError(f"scheduler.num_pages=0 sizes the KV cache from a GPU/TPU's memory; hardware "
                             f"{hw.name!r} has no such rule: set scheduler.num_pages, sim.num_pages or "
                             f"deployment.<group>.num_pages")
        return cfg.scheduler.num_pages, None
    capacity = kv_cache_capacity_tokens(model, hw, group.tp, group.pp, cfg.sim.gpu_memory_utilization,
                                        max_num_batched_tokens=sched_cfg.token_budget,
                                        max_num_seqs=sched_cfg.max_num_seqs)
    return capacity // sched_cfg.page_size, capacity


def _check_pages_fit(model: ModelSpec, hw: HardwareSpec, group, num_pages: int, page_size: int) -> None:
    """An explicit cache passes the same check as the automatic sizing: the weights of a device's stage and its share
    of `num_pages` pages fit the device's memory (ValueError naming the model, the hardware and the bytes)."""
    weights = param_count(model) * model.dtype_bytes / (group.tp * group.pp)
    per_token = 2 * (-(-model.num_layers // group.pp)) * (-(-model.num_kv_heads // group.tp)) * model.head_dim
    kv = num_pages * page_size * per_token * model.dtype_bytes
    if weights + kv > hw.hbm_capacity:
        raise ValueError(f"{model.name} does not fit {hw.name} with tp={group.tp}, pp={group.pp} and "
                         f"num_pages={num_pages}: {weights / 2**30:.1f} GiB of weights + {kv / 2**30:.1f} GiB of KV "
                         f"per device > {hw.hbm_capacity / 2**30:.1f} GiB")


def _padding(cfg, profile: Optional[Profile], sched_cfg) -> Optional[EnginePadding]:
    if profile is None or profile.padding is None:
        return None
    s = sched_cfg
    buckets = engine_buckets(s.token_budget, s.max_num_seqs, s.max_model_len, s.page_size,
                             cfg.engine.token_buckets, cfg.engine.seq_buckets, cfg.engine.page_buckets)
    return padding_from_profile(profile.padding, buckets, s.page_size)   # dense flag and attention impl


def _gpu(cfg, group) -> str:
    """The registry name of a group's hardware (the GPU, not a node-type variant; 'host-cpu' is not measured)."""
    name = group.hardware or cfg.sim.hardware
    return name if name.strip().lower() in ("host-cpu", "cpu") else get_hardware_spec(name).name


def build_setup(cfg, hardware: Optional[HardwareSpec] = None) -> SimSetup:
    """Resolve model, hardware, cost parameters and every group of the deployment (module docstring).
    `hardware`: a HardwareSpec replacing the resolved one (the placement search's node types with their own
    link figures; a serve config names a registry spec)."""
    dep = cfg.deployment
    model = resolve_model(cfg)
    checkpoint_dtype = model_spec_for(cfg, simulator=True, required=True).dtype
    profile, profile_name = resolve_profile(cfg)
    if hardware is not None:
        hw = hardware
    elif profile is not None and profile.hardware_spec is not None:
        hw = profile.hardware_spec
    else:
        hw = get_hardware_spec(cfg.sim.hardware)
    params = profile.params if profile is not None else CostParams()
    # Devices: as many as the deployment asks for, plus any explicit index beyond that (other nodes).
    explicit = [d for role in dep.roles for d in dep.group(role).devices]
    assignment = check_against_model(cfg, model, max([dep.num_devices] + [d + 1 for d in explicit]))
    base = cfg.scheduler
    if not base.vocab_size:
        base = dataclasses.replace(base, vocab_size=model.vocab_size)   # as run_real
    groups = {}
    for role in dep.roles:
        group = dep.group(role)
        sched_cfg = instance_scheduler_config(base, group, role)
        group_profile, group_hw, group_params = profile, None, None
        if group.hardware and group.hardware != cfg.sim.hardware:
            if dep.kind == "colocated":
                raise ValueError(f"deployment.colocated.hardware={group.hardware!r}: a colocated deployment runs on "
                                 "one hardware; set sim.hardware instead (groups of a disaggregated deployment may "
                                 "differ)")
            try:
                group_hw = get_hardware_spec(group.hardware)
            except ValueError as e:
                raise ValueError(f"deployment.{role}.hardware: {e}") from None
            group_profile = profile_for("", group.hardware)     # the shipped profile of the group's hardware
            group_params = group_profile.params if group_profile is not None else CostParams()
        pages, capacity = _group_pages(cfg, group, sched_cfg, model, group_hw or hw)
        if pages != sched_cfg.num_pages:
            sched_cfg = dataclasses.replace(sched_cfg, num_pages=pages)
        names = tuple(dep.instance_names(role))
        stack = get_stack(group.stack)
        gpu = _gpu(cfg, group)
        try:
            stack.check(model.name, gpu, group.tp)
        except ValueError as e:
            raise ValueError(f"deployment.{role}.stack: {e}") from None
        _check_stack_dtype(role, stack, model, checkpoint_dtype)
        groups[role] = GroupSetup(role, sched_cfg, group.tp, group.pp, capacity, tuple(assignment[n] for n in names),
                                  names, _padding(cfg, group_profile, sched_cfg), stack, group_hw, group_params, gpu)
    return SimSetup(model=model, hardware=hw, params=params, profile=profile_name, kind=dep.kind,
                    router=dep.router, groups=groups, async_scheduling=bool(cfg.engine.async_scheduling),
                    mixed_prefill_queue_tokens=dep.mixed_prefill_queue_tokens,
                    mixed_decode_load=float(dep.mixed_decode_load),
                    mixed_pool=dep.mixed_pool if dep.kind == "disaggregated" else "dedicated",
                    step_noise=profile.step_noise if profile is not None and cfg.sim.step_noise else (),
                    seed=int(cfg.seed), overload=dep if has_overload(dep) else None,
                    kv=dep if uses_kv_centric(dep) else None, slo=cfg.slo)


# --------------------------------------------------------------------------------------------------- parts
def group_step_time(setup: SimSetup, role: str, noise: bool = True) -> StepTime:
    """The step time of `role`'s instances, made by the group's stack; with the setup's step noise (seeded by the
    run's seed and the role) unless noise=False (the deterministic model, e.g. to compare with measured steps)."""
    g = setup.groups[role]
    step_noise = None
    if noise and setup.step_noise and g.hardware is None:   # the noise was measured on the default hardware
        step_noise = StepNoise(setup.step_noise, seed=zlib.crc32(f"{setup.seed}/{role}".encode()))
    timing = GroupTiming(setup.model, group_hardware(setup, role), g.gpu, g.tp, g.pp, group_params(setup, role),
                         g.padding, step_noise)
    return g.stack.step_time(timing)


def group_hardware(setup: SimSetup, role: str) -> HardwareSpec:
    """The hardware `role`'s instances run on: the group's own, else the setup's."""
    return setup.groups[role].hardware or setup.hardware


def group_params(setup: SimSetup, role: str) -> CostParams:
    return setup.groups[role].params or setup.params


def build_instances(setup: SimSetup) -> Dict[str, List[Any]]:
    """Role -> its instances, each with a fresh scheduler: SimInstances in the group's role (colocated replicas;
    prefill, decode, mixed)."""
    out: Dict[str, List[Any]] = {}
    for role, g in setup.groups.items():
        step_time = group_step_time(setup, role)
        if role == "colocated":
            out[role] = [SimInstance(name, make_scheduler(g.scheduler_config), step_time) for name in g.names]
            for inst in out[role]:
                check_instance(inst.name, role, inst.scheduler)
        else:
            make = make_borrowing_scheduler if setup.mixed_pool == "borrow" else make_role_scheduler
            if setup.overload is not None:
                make = overload_scheduler_maker(setup.overload)
            out[role] = [SimInstance(name, make(role, g.scheduler_config), step_time, role=role)
                         for name in g.names]
    if setup.kv is not None:
        apply_kv_centric(setup, out)
    return out


def build_router(setup: SimSetup, instances: List[Any]) -> InstanceRouter:
    """The colocated replicas' router (`simulate` calls it as router(request, instances))."""
    options = {} if setup.kv is None else router_options(setup, "colocated", instances[0].timer.step_time)
    return InstanceRouter(setup.router, instances, role="colocated", **options)


def build_transfer_time(setup: SimSetup) -> Callable[[SimInstance, SimInstance, int], float]:
    """transfer_time(src, dst, num_tokens) for the instances of a disaggregated `setup` (links from their
    device placement; the KV lives on the pp·tp devices of each instance)."""
    devices = {name: (devs, g.pp, role) for role, g in setup.groups.items() for name, devs in zip(g.names, g.devices)}
    cache: Dict[Tuple[str, str], Callable[[int], float]] = {}

    def transfer_time(src: SimInstance, dst: SimInstance, num_tokens: int) -> float:
        key = (src.name, dst.name)
        fn = cache.get(key)
        if fn is None:
            (src_devices, src_pp, src_role), (dst_devices, dst_pp, dst_role) = devices[src.name], devices[dst.name]
            bw, lat, streams = kv_link_between(group_hardware(setup, src_role), group_hardware(setup, dst_role),
                                               src_devices, dst_devices, src_pp, dst_pp)
            fn = cache[key] = make_transfer_time(setup.model, bw, lat, streams, group_params(setup, src_role))
        return fn(num_tokens)
    return transfer_time


def kv_bytes_fn(setup: SimSetup) -> Callable[[int], int]:
    return lambda n: kv_bytes(setup.model, n)


def disaggregated_kwargs(setup: SimSetup, instances: Dict[str, List[Any]]) -> Dict[str, Any]:
    """Keyword arguments of pdjax.sim.disagg.simulate_disaggregated for a disaggregated `setup` and its built
    `instances` (build_instances): KV bytes, router, transfer serialization, and the mixed pool (its instances
    and thresholds; none without a 'mixed' group)."""
    kwargs = {"kv_bytes_of": kv_bytes_fn(setup), "router": setup.router,
              "serialize_transfers": setup.serialize_transfers, "mixed": instances.get("mixed", []),
              "mixed_prefill_queue_tokens": setup.mixed_prefill_queue_tokens,
              "mixed_decode_load": setup.mixed_decode_load, "mixed_pool": setup.mixed_pool,
              "pool_factory": None if setup.overload is None else overload_pool_factory(setup.overload, setup.slo)}
    if setup.kv is not None:      # the cache-aware routers' options, and partial transfer (pdjax.sim.kv_tier)
        options = {role: router_options(setup, role, instances[role][0].timer.step_time)
                   for role in ("prefill", "decode")}

        def configure(pool):
            configure_router(pool.prefill_router, options["prefill"])
            configure_router(pool.decode_router, options["decode"])
        kwargs.update(configure=configure, partial_transfer=setup.kv.partial_transfer)
    return kwargs


def build_pending_requests(cfg, workload=None) -> list:
    """build_requests' requests as pdjax.sim.simulator.PendingRequests: each Request is made when it arrives
    (the simulators take either)."""
    if workload is None:
        workload = make_workload(cfg.workload, cfg.seed)
    offline = cfg.engine.mode == "offline"
    bases, shared = _key_bases(cfg, workload)
    return [PendingRequest(str(wr.request_id), 0.0 if offline else float(wr.arrival_time),
                           functools.partial(request_from_workload, wr, offline=offline, key_base=base,
                                             content_key_pages=pages))
            for wr, base, pages in zip(workload, bases, shared)]


def build_requests(cfg, workload=None) -> list:
    """Scheduler Requests of `workload` (WorkloadRequests; default make_workload(cfg.workload, cfg.seed)), no stop
    token, every arrival at 0 in offline mode."""
    if workload is None:
        workload = make_workload(cfg.workload, cfg.seed)
    offline = cfg.engine.mode == "offline"
    return [request_from_workload(wr, offline=offline, key_base=base, content_key_pages=pages)
            for wr, base, pages in zip(workload, *_key_bases(cfg, workload))]


def _key_bases(cfg, workload) -> Tuple[list, list]:
    """Each request's page-key base and content-key pages (pdjax.scheduler.block_manager.numbered_keys) when the run
    caches prefixes, else (None, 0) each (content keys)."""
    if not cfg.scheduler.enable_prefix_caching:
        return [None] * len(workload), [0] * len(workload)
    return numbered_keys([wr.prompt_token_ids for wr in workload], cfg.scheduler.page_size, PLACEHOLDER_TOKEN)
