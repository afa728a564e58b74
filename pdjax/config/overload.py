"""Overload handling keys of the deployment block (no JAX): Mooncake's early rejection and online XpYd rebalancing.

Both are fields of pdjax.config.deployment.DeploymentConfig (declared there, checked field by field by
check_fields); the rules that relate them to the rest of the deployment are `check_overload`, called once from
DeploymentConfig.__post_init__. Semantics: pdjax.scheduler.admission and pdjax.scheduler.rebalance.

- `admission`: 'none' (default), 'current_load' (reject an arrival while the decode instances' load now, with the
  request, exceeds `admission_threshold`) or 'predicted_load' (Mooncake FAST'25's prediction-based early rejection:
  reject when the decode load predicted for the time the request would reach decode exceeds it).
- `admission_threshold`: a decode load (max of the KV-page and sequence-slot fractions, cluster-wide) > 0.
- `admission_handoff_load`: 0 = off (default: a handoff always queues on its decode instance, backpressure); else
  a handed-off request whose decode instance's load with it exceeds this is rejected after its prefill (prefill
  wasted: the late rejection Mooncake's baseline does). Independent of `admission`.
- `admission_prefill_tokens_per_s` / `admission_decode_step_s`: the predictor's priors (0 = learned from the run's
  own steps only).
- `rebalance`: flip instances between the prefill and decode roles online (pdjax.scheduler.rebalance) when one
  side's pressure stays over its threshold (`rebalance_prefill_queue_tokens`: mean prompt tokens queued per
  prefill instance; `rebalance_decode_load`: mean decode load per decode instance) for `rebalance_window_s`
  seconds; a flip drains the instance, then takes `rebalance_flip_s` seconds before it serves the other role.
  `rebalance_trigger`: 'load' (default: those two thresholds) or 'slo' (pdjax.scheduler.rebalance_slo: a side is
  over when its observed TTFT (prefill) / TPOT (decode) at the quantile `rebalance_slo_quantile` exceeds the serve
  config's `slo.ttft` / `slo.tpot`, both of which must then be set: `check_rebalance_slos`, at start-up) or
  'slo_predicted' (the same with the decode side's TPOT predicted from its queue: pdjax.scheduler.rebalance_predict;
  the same slo keys).
All need kind='disaggregated' and no mixed pool (one line otherwise); rebalancing also needs the prefill and
decode groups to be the same machine (pp, tp, hardware, stack, scheduler overrides): a flip changes the role, not
the machine.
"""
from __future__ import annotations

ADMISSION_POLICIES = ("none", "current_load", "predicted_load")
REBALANCE_TRIGGERS = ("load", "slo", "slo_predicted")
SLO_TRIGGERS = ("slo", "slo_predicted")        # the triggers that compare with the serve config's slo block
SAME_MACHINE_KEYS = ("pp", "tp", "hardware", "stack", "num_pages", "token_budget", "max_num_seqs")


def overload_features(dep) -> list:
    """The overload keys a deployment turns on, as 'key=value' strings (for one-line refusals)."""
    on = []
    if dep.admission != "none":
        on.append(f"admission={dep.admission!r}")
    if dep.admission_handoff_load:
        on.append(f"admission_handoff_load={dep.admission_handoff_load!r}")
    if dep.rebalance:
        on.append("rebalance=True")
    return on


def check_overload(dep) -> None:
    """Refuse, in one line naming the key, an overload feature where it does not apply (module docstring)."""
    if dep.rebalance_trigger != "load" and not dep.rebalance:
        raise ValueError(f"deployment.rebalance_trigger={dep.rebalance_trigger!r} with deployment.rebalance=False: "
                         "the trigger is online rebalancing's; expected rebalance=True or rebalance_trigger='load'")
    on = overload_features(dep)
    if not on:
        return
    if dep.kind != "disaggregated":
        raise ValueError(f"deployment.{on[0]} with deployment.kind={dep.kind!r}: early rejection and rebalancing "
                         "act on a disaggregated deployment's decode side; expected kind='disaggregated'")
    if dep.mixed_pool == "borrow" or dep.mixed.num_instances:
        raise ValueError(f"deployment.{on[0]} with a mixed pool (mixed_pool={dep.mixed_pool!r}, mixed.num_instances="
                         f"{dep.mixed.num_instances}): expected no mixed pool (mixed_pool='dedicated', "
                         "mixed.num_instances=0); rebalancing is the alternative to Splitwise's mixed pool")
    if dep.rebalance:
        for key in SAME_MACHINE_KEYS:
            p, d = getattr(dep.prefill, key), getattr(dep.decode, key)
            if p != d:
                raise ValueError(f"deployment.rebalance=True with deployment.prefill.{key}={p!r} != deployment."
                                 f"decode.{key}={d!r}: a flip changes an instance's role, not its machine; expected "
                                 "equal groups")


def check_rebalance_slos(dep, slo) -> None:
    """rebalance_trigger='slo' (or 'slo_predicted') needs the SLOs it compares with: slo.ttft (the prefill side's)
    and slo.tpot (the decode side's) > 0. `slo`: the serve config's SLOConfig (or None); one line naming what is
    missing."""
    if not dep.rebalance or dep.rebalance_trigger not in SLO_TRIGGERS:
        return
    ttft, tpot = (0.0, 0.0) if slo is None else (slo.ttft, slo.tpot)
    if not (ttft > 0 and tpot > 0):
        raise ValueError(f"deployment.rebalance_trigger={dep.rebalance_trigger!r} with slo.ttft={ttft!r}, "
                         f"slo.tpot={tpot!r}: the trigger compares the prefill side's TTFT and the decode side's "
                         "TPOT with them; expected both > 0 (seconds) or rebalance_trigger='load'")
