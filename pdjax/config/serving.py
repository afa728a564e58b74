"""ServeConfig: one serving experiment (model, engine, scheduler, workload, SLOs, simulator), validated once.

`serve_config_from_dict` turns the nested dict of an ml_collections config file into frozen dataclasses; an
unknown key or a bad value fails here, at start-up, naming the key path, and a removed key (sim.tp, sim.pp,
sim.num_replicas, sim.router, sim.num_microbatches, deployment.<group>.dp) names its replacement. `sim_block` /
`deployment_block` build the config files' blocks so that a command-line override of a removed key says the same.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Tuple

import ml_collections

from pdjax.config.deployment import REMOVED_GROUP_KEYS, ROLES, DeploymentConfig, deployment_from_dict
from pdjax.config.files import config_block
from pdjax.config.model_specs import MODEL_DTYPES
from pdjax.config.parse import FieldError, check_fields, coerce, dataclass_from_dict, nonneg_int, number, one_of
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.slo import SLOConfig
from pdjax.config.validate import check_cross_block
from pdjax.workload import WorkloadConfig

BACKENDS = ("real", "sim")
MODES = ("online", "offline")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """checkpoint: a directory (HF safetensors or a pdjax orbax checkpoint) or a registry spec name (dummy
    weights). attention_impl: 'auto' | 'blocked' | 'reference' | 'pallas'. dtype: the dtype the weights, the
    activations and the KV cache are held in, on both backends ('auto': the checkpoint's own, float32 on the CPU
    engine; pdjax.config.model_specs.resolve_dtype): the simulator costs weight and KV bytes, KV pages and
    matmul rates at it."""
    checkpoint: str = "tiny-llama"
    attention_impl: str = "auto"
    dtype: str = one_of("auto", MODEL_DTYPES)
    eos_token_id: int = -1          # stop token for every request; -1: none (outputs run to max_tokens)
    verify_checksums: bool = True   # check a checkpoint's files against the SHA-256s recorded when it was saved

    def __post_init__(self):
        check_fields(self, "model")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """mode: 'online' (requests arrive at their trace times on the wall clock) or 'offline' (all at t=0).
    token_buckets / seq_buckets / page_buckets: padded sizes of the flat token axis, the sequence axis and the
    page-table width (empty: pdjax.serving.build.default_buckets). async_scheduling: schedule and dispatch step k+1
    while step k runs (see pdjax/serving/engine.py; needs requests without stop tokens).
    progress: progress bars (warm-up, serving) when stderr is a terminal.
    fail_on_compile: raise at the first XLA compile after warm-up instead of flagging the iteration.
    compilation_cache / compilation_cache_dir: JAX's persistent compilation cache ('' = ~/.cache/pdjax/xla, or
    $XDG_CACHE_HOME/pdjax/xla), so a rerun with the same shapes loads its executables instead of compiling.
    kv_memory_utilization: with num_pages = 0, the fraction of each device's memory the weights, the step's
    temporaries and the KV cache may fill (vLLM's gpu_memory_utilization); the KV cache gets what is left."""
    mode: str = one_of("online", MODES)
    token_buckets: Tuple[int, ...] = ()
    seq_buckets: Tuple[int, ...] = ()
    page_buckets: Tuple[int, ...] = ()
    warmup: bool = True
    progress: bool = True
    async_scheduling: bool = False
    overlap: bool = True   # disaggregated engine: admit arrivals while steps run
    fail_on_compile: bool = False
    compilation_cache: bool = True
    compilation_cache_dir: str = ""
    kv_memory_utilization: float = number(0.9, low=0.0, high=1.0, low_open=True)

    def __post_init__(self):
        check_fields(self, "engine")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Simulator backend: only what the real engine has no use for. What runs where (instances, pp, tp, router)
    is the `deployment` block, which the simulator simulates exactly.

    hardware: a pdjax.sim.hardware name. profile: a cost-profile JSON path or shipped profile name (empty: the
      shipped profile for the hardware, or first principles).
    model: registry spec name the cost model uses (empty: model.checkpoint when it is a spec name, or the
      checkpoint directory's name / pdjax_spec.json).
    num_pages: KV pages per instance (a group's deployment.<group>.num_pages wins). 0 = automatic: from the cost
      model's KV capacity (memory minus params and activations, `gpu_memory_utilization` of HBM) at the group's
      pp/tp on a GPU/TPU, scheduler.num_pages on host-cpu (what the CPU engine allocates). > 0 = exactly this many.
    step_noise: multiply every simulated step by a factor drawn from the profile's measured step-time noise, when
      it has one (CPU calibrations do, GPU profiles do not; pdjax.sim.step_cost.StepNoise, seeded by `seed`).
    """
    hardware: str = "a100-80gb-sxm"
    profile: str = ""
    model: str = ""
    num_pages: int = nonneg_int(0, note="(0 = automatic)")
    gpu_memory_utilization: float = number(0.9, low=0, high=1, low_open=True)
    step_noise: bool = True

    def __post_init__(self):
        check_fields(self, "sim")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP API server (experiments.api_server) only; experiments.serve ignores it.
    max_queued_requests: requests the server holds at once (queued or running in the engine); one more is
      answered 429 instead of growing the queue without bound (0 = no bound).
    drain_timeout_s: on SIGTERM, in-flight requests get this long to finish; the rest are aborted, then the run's
      result files are written. model_name: the name /v1/models serves ('' = the checkpoint's directory name)."""
    max_queued_requests: int = nonneg_int(256, note="(0 = no bound)")
    drain_timeout_s: float = number(30.0, low=0, note="(seconds)")
    model_name: str = ""

    def __post_init__(self):
        check_fields(self, "server")


# Keys the sim block no longer has -> what replaces them (the deployment block serves both backends).
REMOVED_SIM_KEYS = {
    "tp": "deployment.colocated.tp",
    "pp": "deployment.colocated.pp",
    "num_replicas": "deployment.colocated.num_instances",
    "router": "deployment.router",
    "num_microbatches": None,
}


def removed_sim_key_message(key: str) -> str:
    new = REMOVED_SIM_KEYS[key]
    if new is None:   # num_microbatches
        return (f"sim.{key} is not a key any more: pipeline batches in flight come from the schedule: up to pp "
                f"batches, see deployment.<group>.pp")
    return (f"sim.{key} is not a key any more: set {new} (one deployment block describes the placement for both "
            f"backends; --config.backend=sim simulates exactly it)")


def check_removed_sim_keys(sim) -> None:
    """Fail naming the replacement when the `sim` dict sets a removed key."""
    for key in REMOVED_SIM_KEYS:
        if key in (sim or {}):
            raise ValueError(removed_sim_key_message(key))


class _RemovedKeysBlock(ml_collections.ConfigDict):
    """A config block that answers a lookup of a removed key with the message naming its replacement, so a
    command-line override of an old key (`--config.sim.tp=2`) fails at start-up saying what to set instead."""
    _removed: Dict[str, str] = {}

    def __getitem__(self, key):
        if isinstance(key, str) and key in self._removed and key not in self._fields:
            raise KeyError(self._removed[key])
        return super().__getitem__(key)


class SimBlock(_RemovedKeysBlock):
    _removed = {key: removed_sim_key_message(key) for key in REMOVED_SIM_KEYS}


class GroupBlock(_RemovedKeysBlock):
    _removed = {key: f"deployment.<group>.{key} is not a key any more: replicas are deployment.<group>.{new}"
                for key, new in REMOVED_GROUP_KEYS.items()}


def sim_block(**values) -> ml_collections.ConfigDict:
    """configs' `sim` block: every SimConfig field (config_block), old keys answered with their replacement."""
    return SimBlock(config_block(SimConfig, **values).to_dict())


def deployment_block(**values) -> ml_collections.ConfigDict:
    """configs' `deployment` block: every DeploymentConfig field, each group a block of every
    InstanceGroupConfig field (config_block), a group's old `dp` answered with its replacement."""
    block = config_block(DeploymentConfig, **values)
    for role in ROLES:
        block[role] = GroupBlock(block[role].to_dict())
    return block


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    backend: str = one_of(dataclasses.MISSING, BACKENDS)
    seed: int
    model: ModelConfig
    engine: EngineConfig
    scheduler: Any          # pdjax.config.scheduler.SchedulerConfig
    workload: Any           # pdjax.workload.WorkloadConfig
    slo: SLOConfig
    sim: SimConfig
    deployment: DeploymentConfig = DeploymentConfig()   # colocated unless the config says otherwise
    server: ServerConfig = ServerConfig()               # the HTTP API server's settings (experiments.api_server)

    def __post_init__(self):
        check_fields(self)
        check_cross_block(self)


def serve_config_from_dict(d: Mapping[str, Any]) -> ServeConfig:
    """Validate the nested dict of a serve config file (see configs/serve.py)."""
    d = dict(d)
    top = {"backend", "seed", "model", "engine", "scheduler", "workload", "slo", "sim", "deployment", "server"}
    unknown = sorted(set(d) - top)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known top-level keys: {sorted(top)}")
    backend = coerce(str, d.get("backend", "real"), "backend")
    if backend not in BACKENDS:
        raise FieldError("backend", backend, f"one of {BACKENDS}")
    scheduler = dataclass_from_dict(SchedulerConfig, d.get("scheduler"), "scheduler")
    workload = dict(d.get("workload") or {})
    if "max_model_len" in workload:
        raise ValueError("workload.max_model_len is not a serve config key: the run has one max_model_len, "
                         "scheduler.max_model_len, and the workload's caps follow it")
    workload["max_model_len"] = scheduler.max_model_len
    model = dataclass_from_dict(ModelConfig, d.get("model"), "model")
    if workload.get("kind") == "dataset" and not workload.get("tokenizer"):
        workload["tokenizer"] = model.checkpoint      # a dataset's text is tokenized by the model's tokenizer
    sim = d.get("sim")
    check_removed_sim_keys(sim)
    return ServeConfig(
        backend=backend,
        seed=coerce(int, d.get("seed", 0), "seed"),
        model=model,
        engine=dataclass_from_dict(EngineConfig, d.get("engine"), "engine"),
        scheduler=scheduler,
        workload=dataclass_from_dict(WorkloadConfig, workload, "workload"),
        slo=SLOConfig.from_dict(d.get("slo")),
        sim=dataclass_from_dict(SimConfig, sim, "sim"),
        deployment=deployment_from_dict(d.get("deployment")),
        server=dataclass_from_dict(ServerConfig, d.get("server"), "server"),
    )
