"""Machine profiles: the one `Profile` type, loaded by shipped name or by path, and saved atomically. No JAX.

A profile is what the simulator costs steps with on one machine: the fitted `CostParams` and, for a profile
fitted on the pdjax engine itself (host-cpu, `python -m experiments.calibrate`), how that engine pads its steps
and the step-time noise of its loop. JSON (schema "pdjax.machine_profile/v1"):

    {"schema": "pdjax.machine_profile/v1",
     "hardware": "<HardwareSpec name the efficiencies are relative to>",
     "cost_params": {<every CostParams field>},
     "fitted": [<names of the fitted fields; the rest are priors>],
     "fit": {"median_rel_error": float, "p90_rel_error": float, "num_measurements": int, "groups": {...}},
     "source": "<what was measured, model(s), tp/pp, engine/version>",
     "command": "<the command that produced it>",
     optional:
     "hardware_spec": {<HardwareSpec fields>}   the spec frozen at calibration time (host_cpu() re-measures a
                                                 noisy machine: the simulator must use the numbers the fit saw),
     "padding": {"dense_attention": bool[, "attention": 'reference' | 'blocked' | 'pallas', "decode_keys": int]}
                                                 cost steps at the engine's padded bucket shapes and kernel
                                                 (pdjax.sim.step_cost.padding_from_profile),
     "step_noise": {"quantiles": [...], "num_steps": int, "source": str}
                                                 the engine loop's measured / predicted step seconds
                                                 (pdjax.sim.step_cost.StepNoise),
     any other key (e.g. "measurements", "step_context": the raw calibration data) is kept as is in `extra`}

Names: a value without a file suffix is a shipped profile name (pdjax/sim/profiles/<name>.json); anything else
is a path. Both give the same Profile for the same file. `profile_for(profile, hardware)` is the rule every
simulator path uses: the given profile, else the shipped one of the hardware (<hardware>.json, then
<family>.json: 'a100-80gb-pcie' -> a100.json), else None (first principles). Every error names the file.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Dict, Optional, Tuple

from pdjax.config.parse import dataclass_from_dict
from pdjax.metrics import atomic_write_text
from pdjax.sim.cost_model import CostParams
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.step_cost import PADDING_KEYS, check_step_noise

SCHEMA = "pdjax.machine_profile/v1"
PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"
_CORE_KEYS = ("schema", "hardware", "cost_params", "fitted", "fit", "source", "command", "hardware_spec", "padding")


@dataclasses.dataclass(frozen=True)
class Profile:
    """One machine profile (module docstring). `path`: the file it was loaded from ('' when built in memory;
    not part of equality, so a profile loaded by name equals the same file loaded by path)."""
    hardware: str
    params: CostParams
    fitted: Tuple[str, ...] = ()
    fit: Dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""
    command: str = ""
    hardware_spec: Optional[HardwareSpec] = None
    padding: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    path: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        if self.padding is not None:
            unknown = sorted(set(self.padding) - set(PADDING_KEYS))
            if unknown:
                raise ValueError(f"unknown padding keys {unknown}; expected some of {list(PADDING_KEYS)}")
        if self.step_noise:
            check_step_noise(self.step_noise)

    @property
    def step_noise(self) -> Tuple[float, ...]:
        """The StepNoise quantiles ("step_noise"."quantiles"; () when the profile has none)."""
        return tuple(float(x) for x in (self.extra.get("step_noise") or {}).get("quantiles", ()))

    def replace(self, **changes) -> "Profile":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        data = dict(self.extra)
        data.update(schema=SCHEMA, hardware=self.hardware, cost_params=self.params.to_dict(),
                    fitted=list(self.fitted), fit=self.fit, source=self.source, command=self.command)
        if self.hardware_spec is not None:
            data["hardware_spec"] = dataclasses.asdict(self.hardware_spec)
        if self.padding is not None:
            data["padding"] = dict(self.padding)
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "") -> "Profile":
        """The profile of a parsed JSON object; raises ValueError (without the file: `load_profile` adds it)."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema={data.get('schema')!r}, expected {SCHEMA!r}")
        for key in ("hardware", "cost_params"):
            if key not in data:
                raise ValueError(f"lacks {key!r}; keys: {sorted(data)}")
        spec = data.get("hardware_spec")
        if spec:
            spec = dataclass_from_dict(HardwareSpec, spec, "hardware_spec")
        return cls(hardware=data["hardware"], params=CostParams.from_dict(data["cost_params"]),
                   fitted=tuple(data.get("fitted", ())), fit=data.get("fit", {}), source=data.get("source", ""),
                   command=data.get("command", ""), hardware_spec=spec or None, padding=data.get("padding"),
                   extra={k: v for k, v in data.items() if k not in _CORE_KEYS}, path=path)


def shipped_profiles() -> list:
    """Names of the profiles in pdjax/sim/profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def profile_path(name_or_path) -> pathlib.Path:
    """The file of a shipped profile name ('a100' -> pdjax/sim/profiles/a100.json) or of a path; raises
    ValueError naming the value and the shipped profiles when there is no such file."""
    path = pathlib.Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"machine profile {str(name_or_path)!r} not found; shipped profiles: {shipped_profiles()}, "
                         "or a JSON path")
    return path


def load_profile(name_or_path) -> Profile:
    """The Profile of a shipped name or a JSON path. Raises ValueError, one line naming the file, for a missing
    file, malformed JSON or bad contents."""
    path = profile_path(name_or_path)
    try:
        return Profile.from_dict(json.loads(path.read_text()), path=str(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"machine profile {str(path)!r}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"machine profile {str(path)!r}: not a text file ({e.reason} at byte {e.start})") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"machine profile {str(path)!r}: {e}") from None


def save_profile(path, profile: Profile) -> None:
    """Write `profile` as JSON (sorted keys), atomically."""
    atomic_write_text(str(path), json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")


def _shipped_path(hardware: str) -> Optional[pathlib.Path]:
    """pdjax/sim/profiles/<hardware>.json, else <family>.json ('a100-80gb-pcie' -> a100.json), else None."""
    key = hardware.strip().lower()
    for name in (key, key.split("-")[0]):
        path = PROFILES_DIR / f"{name}.json"
        if path.is_file():
            return path
    return None


def profile_for(profile: str, hardware: str) -> Optional[Profile]:
    """The profile a simulation of `hardware` costs with: `profile` (a shipped name or a path) when given, else
    the hardware's shipped profile, else None (CostParams defaults)."""
    if profile:
        return load_profile(profile)
    path = _shipped_path(hardware)
    return load_profile(path) if path is not None else None
