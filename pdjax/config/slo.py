"""SLOConfig: the one SLO type, the serve config's `slo` block and the bounds every metric checks (no JAX).

A request meets the SLOs when it completed and each bound holds (pdjax.metrics.latency.meets_slos): TTFT <= ttft,
its `tbt_quantile` gap <= tbt (1.0: its max gap), TPOT <= tpot; a bound of 0 is no bound. pdjax.metrics calls the
same class `SLOs`.

One alias rule: the metrics' spellings with the unit, `ttft_s` / `tbt_s` / `tpot_s`, name `ttft` / `tbt` / `tpot`
(SLO_ALIASES), as constructor keywords and as keys of a dict parsed by `from_dict` or the serve config's parser
(pdjax.config.parse.dataclass_from_dict reads a class's KEY_ALIASES); a bound given under both names fails
("given twice"), and None (the metrics' old "no bound") is read as 0. A failed check names the key as it was
spelled (`slo.ttft_s=-1, expected ...`).

`as_dict()` is the config spelling (only the bounds set); `summary_dict()` is the results.json "slos" entry
(`ttft_s` ... with None for no bound, and `tbt_quantile`: the results schema, unchanged).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

from pdjax.config.parse import FieldError, check_fields, dataclass_from_dict, number

NO_SLO = "(0 = no SLO)"
SLO_ALIASES = {"ttft_s": "ttft", "tbt_s": "tbt", "tpot_s": "tpot"}
BOUNDS = ("ttft", "tbt", "tpot")


@dataclasses.dataclass(frozen=True, init=False)
class SLOConfig:
    """Latency SLOs in seconds (0 = no SLO on that metric) and the per-request TBT statistic the tbt bound is on
    (tbt_quantile: 1.0 = the request's max gap). Aliases ttft_s / tbt_s / tpot_s: module docstring."""
    ttft: float = number(0.0, low=0, note=NO_SLO)
    tbt: float = number(0.0, low=0, note=NO_SLO)
    tpot: float = number(0.0, low=0, note=NO_SLO)
    tbt_quantile: float = number(1.0, low=0, high=1, low_open=True, note="(1 = the max gap)")

    KEY_ALIASES = SLO_ALIASES       # a class attribute (no annotation): not a field

    def __init__(self, ttft: Optional[float] = None, tbt: Optional[float] = None, tpot: Optional[float] = None,
                 tbt_quantile: float = 1.0, *, ttft_s: Optional[float] = None, tbt_s: Optional[float] = None,
                 tpot_s: Optional[float] = None):
        spelled = {}
        for name, value, alias, alias_value in (("ttft", ttft, "ttft_s", ttft_s), ("tbt", tbt, "tbt_s", tbt_s),
                                                ("tpot", tpot, "tpot_s", tpot_s)):
            if value is not None and alias_value is not None:
                raise ValueError(f"slo: {alias!r} given twice (as {name!r} and its alias {alias!r})")
            if alias_value is not None:
                value, spelled[name] = alias_value, alias
            object.__setattr__(self, name, 0.0 if value is None else value)
        object.__setattr__(self, "tbt_quantile", tbt_quantile)
        try:
            check_fields(self, "slo")
        except FieldError as e:
            name = e.key.split(".")[-1]
            if name in spelled:
                raise FieldError(f"slo.{spelled[name]}", e.value, e.expected) from None
            raise

    @classmethod
    def from_dict(cls, d: Any, where: str = "slo") -> "SLOConfig":
        """From None, an SLOConfig, a mapping, a ConfigDict or another dataclass with these fields (by the one
        parser, aliases included; a None bound is no bound)."""
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        if dataclasses.is_dataclass(d) and not isinstance(d, type):
            d = dataclasses.asdict(d)
        elif hasattr(d, "to_dict"):
            d = d.to_dict()
        if not isinstance(d, Mapping):
            raise TypeError(f"{where}={d!r}: expected None, an SLOConfig, a mapping or a dataclass")
        return dataclass_from_dict(cls, {k: v for k, v in d.items() if v is not None}, where)

    @property
    def ttft_s(self) -> Optional[float]:
        """The TTFT bound in seconds, None when there is none (the metrics' spelling)."""
        return self.ttft or None

    @property
    def tbt_s(self) -> Optional[float]:
        return self.tbt or None

    @property
    def tpot_s(self) -> Optional[float]:
        return self.tpot or None

    @property
    def empty(self) -> bool:
        return not (self.ttft or self.tbt or self.tpot)

    def as_dict(self) -> Dict[str, float]:
        """The bounds set, in the config's spelling ({'ttft': 1.0, 'tbt': 0.2}); tbt_quantile when not 1."""
        out = {k: getattr(self, k) for k in BOUNDS if getattr(self, k) > 0}
        if self.tbt_quantile != 1.0:
            out["tbt_quantile"] = self.tbt_quantile
        return out

    def summary_dict(self) -> Dict[str, Any]:
        """results.json's "slos" entry: {'ttft_s', 'tbt_s', 'tpot_s' (None: no bound), 'tbt_quantile'}."""
        return {"ttft_s": self.ttft_s, "tbt_s": self.tbt_s, "tpot_s": self.tpot_s, "tbt_quantile": self.tbt_quantile}
