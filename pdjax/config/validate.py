"""Rules that relate several blocks of a serve config, checked once, here, for both backends (no JAX).

"The simulator simulates exactly what the engine runs": so whatever the real engine refuses for a reason that is a
fact of the config alone is refused by `check_cross_block` when the ServeConfig is built (ServeConfig.__post_init__:
every entry point, every sweep point, before anything is built), and what needs the model's dimensions is refused
by `check_against_model` (pdjax.sim.build and pdjax.serving.build call it first, once the model spec is known).

Cross-block rules:
- A colocated deployment runs a colocated policy (not a disaggregated role's 'prefill_only' / 'decode_only').
- A disaggregated deployment derives its roles' policies from the scheduler block: its policy is 'sarathi' (or a
  role policy), since any other would be silently replaced.
- engine.async_scheduling=True runs one colocated instance (the engine's asynchronous loop is ColocatedEngine's):
  not colocated replicas, not a disaggregated deployment.
- engine.async_scheduling=True needs requests that run to max_tokens: no stop token (model.eos_token_id=-1).
- A serving stack other than 'pdjax' (deployment.<group>.stack) is a simulator setting: the real engine is the
  pdjax stack, so backend='real' refuses any other.
- Every group's scheduler (the scheduler block with the group's overrides and role policy) is a valid one, and
  explicit shape buckets (engine.token_buckets, seq_buckets, page_buckets) hold its largest step.
- deployment.rebalance_trigger='slo' needs slo.ttft and slo.tpot (pdjax.config.overload.check_rebalance_slos).
Model rules: scheduler.max_model_len <= the model's max_position_embeddings (`check_max_model_len`, also used by
pdjax.sim.placement and the runtime's runner), pp <= its layers and tp dividing its heads
(pdjax.config.deployment.validate_deployment). `check_config_against_model` applies them at start-up, before the
workload is built, whenever `model_spec_for` can tell the model from the config alone (a registry name, a
directory with pdjax_spec.json, `sim.model` on the simulator); an HF checkpoint's spec is known once it is read,
and the build's `check_against_model` checks it then, before anything compiles.
"""
from __future__ import annotations

import json
import pathlib
from typing import Dict, Optional, Tuple

from pdjax.config.deployment import (check_group_against_model, instance_scheduler_config, uses_host_kv,
                                     validate_deployment)
from pdjax.config.files import REPO_ROOT
from pdjax.config.model_specs import MODEL_SPECS, ModelSpec, RopeScaling, get_model_spec
from pdjax.config.overload import check_rebalance_slos
from pdjax.config.parse import FieldError
from pdjax.config.registry import POLICIES


def check_max_model_len(max_model_len: int, spec, key: str = "scheduler.max_model_len") -> None:
    """FieldError naming `key`, its value and the model's limit unless max_model_len <= spec.max_position_embeddings
    (a longer context has positions the model was never given; the real engine cannot run it)."""
    limit = spec.max_position_embeddings
    if max_model_len > limit:
        raise FieldError(key, max_model_len, f"<= max_position_embeddings={limit} of model {spec.name!r} (a "
                         "longer context has positions the model does not have)")


# What a device_kind (jax.Device.device_kind, lower-cased) contains on each hardware family (pdjax.sim.hardware
# names, by the part before the first '-', TPU names by their generation).
_DEVICE_KIND_MARKERS = {"host": ("cpu",), "a100": ("a100",), "h100": ("h100",), "h200": ("h200",), "a40": ("a40",),
                        "l4": ("l4",), "v4": ("tpu v4",), "v5e": ("tpu v5 lite", "tpu v5e"), "v5p": ("tpu v5p",),
                        "v6e": ("tpu v6 lite", "tpu v6e")}


def hardware_name_of(device_kind: str) -> Optional[str]:
    """The pdjax.sim.hardware name (or alias) of a jax device kind ('TPU v5 lite' -> 'v5e'), None when unknown.
    'TPU v5' alone is a v5p (the v5e says 'lite')."""
    kind = device_kind.lower()
    if kind == "tpu v5":
        return "v5p"
    return next((name for name, markers in _DEVICE_KIND_MARKERS.items() if any(m in kind for m in markers)), None)


def hardware_runs_on(hardware: str, device_kind: str) -> Optional[bool]:
    """Whether a device of `device_kind` is the hardware named `hardware` (a pdjax.sim.hardware name or alias);
    None when the name is not one this rule knows (the caller says so)."""
    name = hardware.lower().removeprefix("tpu-")
    markers = _DEVICE_KIND_MARKERS.get(name) or _DEVICE_KIND_MARKERS.get(name.split("-")[0])
    if markers is None:
        return None
    return hardware_name_of(device_kind) == name or any(m in device_kind.lower() for m in markers)


def check_group_hardware(dep, device_kind: str) -> None:
    """The real engine runs on the devices it has: a group naming another hardware is refused (one line)."""
    for role in dep.roles:
        hardware = dep.group(role).hardware
        if hardware and hardware_runs_on(hardware, device_kind) is None:
            raise ValueError(f"deployment.{role}.hardware={hardware!r} is not a hardware name; expected '' (the "
                             f"devices the engine runs on) or a pdjax.sim.hardware name such as 'host-cpu', "
                             f"'a100-80gb-sxm', 'h100-sxm', 'tpu-v5e'")
        if hardware and not hardware_runs_on(hardware, device_kind):
            raise ValueError(f"deployment.{role}.hardware={hardware!r}: the real engine runs on the devices it has "
                             f"({device_kind!r}); expected '' or that hardware (per-group hardware is a simulator "
                             "setting for other machines)")


def check_kv_centric_blocks(cfg) -> None:
    """A host KV tier and partial transfer need the prefix cache (scheduler.enable_prefix_caching): both key the
    KV they keep by it."""
    dep = cfg.deployment
    if cfg.scheduler.enable_prefix_caching:
        return
    if uses_host_kv(dep):
        raise ValueError("deployment.<group>.host_kv_blocks / host_kv_gib with scheduler.enable_prefix_caching="
                         "False: the host KV tier keeps prefix-cached pages; expected enable_prefix_caching=True")
    if dep.partial_transfer:
        raise ValueError("deployment.partial_transfer=True with scheduler.enable_prefix_caching=False: the decode "
                         "side finds the prefix it holds in its prefix cache; expected enable_prefix_caching=True")


def check_cross_block(cfg) -> None:
    """The cross-block rules of the module docstring for a ServeConfig; ValueError naming the keys and values."""
    dep, engine, policy = cfg.deployment, cfg.engine, cfg.scheduler.policy
    if dep.kind == "colocated" and not POLICIES[policy].colocated:
        raise ValueError(f"scheduler.policy={policy!r} with deployment.kind='colocated': it is the policy of a "
                         "disaggregated deployment's role; expected a colocated policy (e.g. 'sarathi')")
    # A disaggregated deployment's roles run prefill_only / decode_only and its mixed instances a Sarathi-style
    # MixedScheduler, all derived from the scheduler block's policy: one with the `role_base` trait.
    if dep.kind == "disaggregated" and not POLICIES[policy].role_base:
        raise ValueError(f"scheduler.policy={policy!r} with deployment.kind='disaggregated': instances run "
                         "'prefill_only' / 'decode_only' (Sarathi-style chunking per role); expected 'sarathi' (the "
                         "base the roles' policies are derived from)")
    if engine.async_scheduling:
        names = [name for role in dep.roles for name in dep.instance_names(role)]
        if len(names) > 1:
            raise ValueError(f"engine.async_scheduling=True runs one colocated instance (the engine's asynchronous "
                             f"loop); this deployment (deployment.kind={dep.kind!r}) has {len(names)} instances "
                             f"({', '.join(names)}), served by the multi-instance loop, which schedules "
                             "synchronously; expected engine.async_scheduling=False")
        if cfg.model.eos_token_id >= 0:
            raise ValueError(f"engine.async_scheduling=True with model.eos_token_id={cfg.model.eos_token_id}: async "
                             "scheduling needs requests that finish at max_tokens (no stop token); expected "
                             "model.eos_token_id=-1 or engine.async_scheduling=False")
    check_kv_centric_blocks(cfg)
    check_rebalance_slos(dep, cfg.slo)
    if cfg.backend == "real":
        for role in dep.roles:
            if dep.group(role).stack != "pdjax":
                raise ValueError(f"deployment.{role}.stack={dep.group(role).stack!r} with backend='real': a fitted "
                                 "stack is how the simulator times another engine; the real engine is the pdjax "
                                 "stack (expected 'pdjax', or backend='sim')")
    for role in dep.roles:
        try:
            sched = instance_scheduler_config(cfg.scheduler, dep.group(role), role)
        except ValueError as e:
            raise ValueError(f"deployment.{role}: its scheduler (the scheduler block with the group's overrides) "
                             f"is invalid: {e}") from None
        check_buckets_hold(engine, sched, role)


def check_buckets_hold(engine, sched, role: str) -> None:
    """Explicit shape buckets (engine.token_buckets / seq_buckets / page_buckets; empty = automatic) hold the
    largest step a group's scheduler `sched` can schedule: its token budget, max_num_seqs and a max-length request's
    pages. Otherwise both backends would fail at the first such step, mid-run."""
    pages = sched.pages_per_max_request
    for key, sizes, needed, what in (
            ("token_buckets", engine.token_buckets, sched.token_budget, f"the token budget {sched.token_budget}"),
            ("seq_buckets", engine.seq_buckets, sched.max_num_seqs, f"max_num_seqs={sched.max_num_seqs}"),
            ("page_buckets", engine.page_buckets, pages,
             f"the pages of max_model_len={sched.max_model_len} ({pages} of {sched.page_size} tokens)")):
        if sizes and max(sizes) < needed:
            raise ValueError(f"engine.{key}={tuple(sizes)}: the largest, {max(sizes)}, is below {what} of "
                             f"deployment.{role}'s scheduler; expected one >= {needed} (or () for automatic buckets)")


def check_eos_token_id(eos_token_id: int, spec) -> None:
    """model.eos_token_id is -1 (none) or a token of the model's vocabulary: an id the model can never sample would
    silently never stop a request."""
    if eos_token_id != -1 and not 0 <= eos_token_id < spec.vocab_size:
        raise ValueError(f"model.eos_token_id={eos_token_id} is outside the vocabulary of model {spec.name!r} "
                         f"(ids 0..{spec.vocab_size - 1}); expected such an id, or -1 for no stop token")


def check_against_model(cfg, spec, num_available: int) -> Dict[str, Tuple[int, ...]]:
    """The model rules for a ServeConfig and the model `spec` it runs, on a machine of `num_available` devices;
    returns the deployment's device assignment (validate_deployment). ValueError naming the key and both values."""
    check_max_model_len(cfg.scheduler.max_model_len, spec)
    check_eos_token_id(cfg.model.eos_token_id, spec)
    return validate_deployment(cfg.deployment, spec, num_available)


def _checkpoint_dir(checkpoint: str) -> pathlib.Path:
    """The checkpoint path as the real engine finds it: as given (absolute, or relative to the working directory),
    else relative to the repository root."""
    path = pathlib.Path(checkpoint)
    if path.is_absolute() or path.exists():
        return path
    return pathlib.Path(REPO_ROOT) / checkpoint


def model_spec_for(cfg, *, simulator: Optional[bool] = None, required: bool = False) -> Optional[ModelSpec]:
    """The ModelSpec a ServeConfig runs, from the config alone (no weights read), or None when only loading the
    checkpoint can tell (an HF directory) and not `required` (then ValueError naming the fix).

    simulator (default: cfg.backend == 'sim'): the simulator's rule: `sim.model` if set, else model.checkpoint when
    it is a registry spec name, else the checkpoint directory's name when that is one, else its pdjax_spec.json.
    The real engine's: a registry name, else the directory's pdjax_spec.json (what pdjax.models.checkpoint loads)."""
    simulator = cfg.backend == "sim" if simulator is None else simulator
    if simulator and cfg.sim.model:
        return get_model_spec(cfg.sim.model)
    checkpoint = cfg.model.checkpoint
    if checkpoint in MODEL_SPECS:
        return MODEL_SPECS[checkpoint]
    name = pathlib.Path(checkpoint).name
    if simulator and name in MODEL_SPECS:
        return MODEL_SPECS[name]
    spec_file = _checkpoint_dir(checkpoint) / "pdjax_spec.json"
    if spec_file.is_file():
        try:
            data = json.loads(spec_file.read_text())
            if data.get("rope_scaling"):
                data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
            return ModelSpec(**data)
        except (OSError, ValueError, TypeError, AttributeError):
            if required:
                raise
            return None      # unreadable or malformed: the checkpoint loader names the file and what is wrong
    if required:
        raise ValueError(f"sim: cannot tell the model of model.checkpoint={checkpoint!r} (not a registry spec name, "
                         f"no pdjax_spec.json there); set sim.model to one of {sorted(MODEL_SPECS)}")
    return None


def check_config_against_model(cfg) -> None:
    """At start-up: the model rules (max_model_len, pp and tp of every group the deployment uses) against the
    model `model_spec_for` tells from the config; nothing when it cannot tell without loading weights."""
    spec = model_spec_for(cfg)
    if spec is None:
        return
    check_max_model_len(cfg.scheduler.max_model_len, spec)
    check_eos_token_id(cfg.model.eos_token_id, spec)
    for role in cfg.deployment.roles:
        check_group_against_model(role, cfg.deployment.group(role), spec)
