"""DeploymentConfig: colocated (one instance) or disaggregated (prefill and decode instance groups on disjoint
device sets), validated at start-up (no JAX).

Choices:
- A group (`prefill` or `decode`) has `num_instances` identical instances; each instance gets its own
  (dp, pp, tp) mesh over dp·pp·tp devices. Instances are named by role and index: 'prefill0', 'decode0', ...
- Devices are integer indices into the platform's device list. `devices` of a group lists the devices of
  all its instances in order (instance i takes the i-th run of dp·pp·tp); empty = automatic: prefill
  instances take the first devices, decode instances the next ones. Explicit and automatic groups can be
  mixed; automatic ones take the lowest indices no explicit group claimed.
- Per-group scheduler overrides (`num_pages`, `token_budget`, `max_num_seqs`; 0 = take the value of the
  `scheduler` block) let the prefill side use a large budget and the decode side many sequences.
- `validate_deployment` checks what needs the model and the machine: enough devices, disjoint groups,
  every tp dividing the model's heads, KV heads and MLP width.
- The runner today uses only the 'tensor' axis: 'data' and 'stage' devices hold replicas (see
  pdjax/runtime/mesh.py), so dp/pp > 1 cost devices without speeding anything up yet.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from pdjax.config.parse import dataclass_from_dict

DEPLOYMENT_KINDS = ("colocated", "disaggregated")
ROUTERS = ("round_robin", "least_loaded")


def _positive_int(value, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}={value!r}, expected a positive int")


@dataclasses.dataclass(frozen=True)
class InstanceGroupConfig:
    """One role's instances. dp/pp/tp: mesh of each instance. num_pages / token_budget / max_num_seqs:
    scheduler overrides (0 = the scheduler block's value). devices: explicit device indices of all instances
    (len == num_instances·dp·pp·tp) or empty for automatic placement."""
    num_instances: int = 1
    dp: int = 1
    pp: int = 1
    tp: int = 1
    num_pages: int = 0
    token_budget: int = 0
    max_num_seqs: int = 0
    devices: Tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("num_instances", "dp", "pp", "tp"):
            _positive_int(getattr(self, name), name)
        for name in ("num_pages", "token_budget", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}, expected an int >= 0 (0 = the scheduler block's value)")
        devices = tuple(self.devices)
        for d in devices:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"devices={devices!r}: entry {d!r} is not a device index (int >= 0)")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices={devices!r} lists a device twice")
        if devices and len(devices) != self.num_devices:
            raise ValueError(f"devices={devices!r} has {len(devices)} entries, expected num_instances x dp x pp x "
                             f"tp = {self.num_instances} x {self.dp} x {self.pp} x {self.tp} = {self.num_devices}")
        object.__setattr__(self, "devices", devices)

    @property
    def devices_per_instance(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def num_devices(self) -> int:
        return self.num_instances * self.devices_per_instance


@dataclasses.dataclass(frozen=True)
class DeploymentConfig:
    """kind: 'colocated' (the ColocatedEngine; prefill/decode blocks unused) or 'disaggregated'.
    router: how a new request picks a prefill instance and a handed-off one a decode instance
    ('round_robin' or 'least_loaded': fewest outstanding tokens)."""
    kind: str = "colocated"
    prefill: InstanceGroupConfig = InstanceGroupConfig()
    decode: InstanceGroupConfig = InstanceGroupConfig()
    router: str = "round_robin"

    def __post_init__(self):
        if self.kind not in DEPLOYMENT_KINDS:
            raise ValueError(f"deployment.kind={self.kind!r}, expected one of {DEPLOYMENT_KINDS}")
        if self.router not in ROUTERS:
            raise ValueError(f"deployment.router={self.router!r}, expected one of {ROUTERS}")
        for role in ("prefill", "decode"):
            if not isinstance(getattr(self, role), InstanceGroupConfig):
                raise TypeError(f"deployment.{role}={getattr(self, role)!r}, expected an InstanceGroupConfig")

    @property
    def num_devices(self) -> int:
        return self.prefill.num_devices + self.decode.num_devices

    def instance_names(self, role: str) -> List[str]:
        return [f"{role}{i}" for i in range(self._group(role).num_instances)]

    def _group(self, role: str) -> InstanceGroupConfig:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role={role!r}, expected 'prefill' or 'decode'")
        return getattr(self, role)

    def device_assignment(self, num_available: int) -> Dict[str, Tuple[int, ...]]:
        """Instance name -> its device indices (mesh order), for a machine with `num_available` devices.

        Raises ValueError naming the problem: too few devices, an index out of range, or groups sharing a
        device."""
        if self.num_devices > num_available:
            raise ValueError(
                f"deployment needs {self.num_devices} devices (prefill {self.prefill.num_instances} x "
                f"{self.prefill.devices_per_instance} + decode {self.decode.num_instances} x "
                f"{self.decode.devices_per_instance}), only {num_available} available")
        claimed: Dict[int, str] = {}
        for role in ("prefill", "decode"):
            for d in self._group(role).devices:
                if d >= num_available:
                    raise ValueError(f"deployment.{role}.devices lists device {d}, only {num_available} "
                                     f"available (indices 0..{num_available - 1})")
                if d in claimed:
                    raise ValueError(f"device {d} is in both deployment.{claimed[d]}.devices and "
                                     f"deployment.{role}.devices: groups must be disjoint")
                claimed[d] = role
        free = [d for d in range(num_available) if d not in claimed]
        out: Dict[str, Tuple[int, ...]] = {}
        for role in ("prefill", "decode"):
            group = self._group(role)
            if group.devices:
                devices = list(group.devices)
            else:   # enough are free: the total was checked above and explicit groups are disjoint
                devices, free = free[:group.num_devices], free[group.num_devices:]
            k = group.devices_per_instance
            for i, name in enumerate(self.instance_names(role)):
                out[name] = tuple(devices[i * k:(i + 1) * k])
        return out


def validate_deployment(deployment: DeploymentConfig, spec, num_available: int) -> Dict[str, Tuple[int, ...]]:
    """Check `deployment` against the model `spec` (a ModelSpec) and the machine; returns the device
    assignment. Raises ValueError naming the bad value and what was expected."""
    if deployment.kind == "disaggregated":
        for role in ("prefill", "decode"):
            tp = deployment._group(role).tp
            for name in ("num_heads", "num_kv_heads", "intermediate_size"):
                value = getattr(spec, name)
                if value % tp:
                    raise ValueError(f"deployment.{role}.tp={tp} does not divide {name}={value} of model "
                                     f"{spec.name!r}")
    return deployment.device_assignment(num_available)


def instance_scheduler_config(base, group: InstanceGroupConfig, role: str):
    """The SchedulerConfig of one instance: `base` with the role's policy ('prefill_only' / 'decode_only')
    and the group's non-zero overrides."""
    policy = {"prefill": "prefill_only", "decode": "decode_only"}.get(role)
    if policy is None:
        raise ValueError(f"role={role!r}, expected 'prefill' or 'decode'")
    changes = {"policy": policy}
    for name in ("num_pages", "token_budget", "max_num_seqs"):
        if getattr(group, name):
            changes[name] = getattr(group, name)
    return dataclasses.replace(base, **changes)


def deployment_from_dict(d) -> DeploymentConfig:
    """DeploymentConfig from the nested dict of a config file's `deployment` block (unknown keys fail)."""
    return dataclass_from_dict(DeploymentConfig, d, "deployment")
