"""Config checks declared once: per-field bounds and choices (pdjax.config.parse), the cross-block rules both
backends share, and the model's maximum context, refused the same way by the simulator, the real backend and
every entry point (pdjax.config.validate)."""
import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pdjax.config.deployment import InstanceGroupConfig
from pdjax.config.files import config_file
from pdjax.config.parse import FieldError, check_fields, dataclass_from_dict, number, one_of, positive_int
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import SimConfig, serve_config_from_dict
from pdjax.experiment.run import prepare_experiment, to_plain_dict

REPO = pathlib.Path(__file__).resolve().parent.parent


def serve_dict(**blocks):
    """configs/serve.py as a plain dict, with blocks updated from `blocks` ({'engine': {...}, ...})."""
    d = to_plain_dict(config_file(str(REPO / "README.md"), "configs/serve.py"))
    for block, values in blocks.items():
        if isinstance(values, dict):
            d[block] = {**d[block], **values}
        else:
            d[block] = values
    return d


# ------------------------------------------------------------------------------------------------ per-field checks
@dataclasses.dataclass(frozen=True)
class _Block:
    count: int = positive_int(1)
    share: float = number(0.5, low=0, high=1, low_open=True)
    mode: str = one_of("a", ("a", "b"))

    def __post_init__(self):
        check_fields(self)


@pytest.mark.parametrize("values,message", [
    ({"count": 0}, "blk.count=0, expected a positive int"),
    ({"count": True}, "blk.count=True, expected int"),        # the parser's type check comes first
    ({"share": 0.0}, "blk.share=0.0, expected a number in (0, 1]"),
    ({"mode": "c"}, "blk.mode='c', expected one of ('a', 'b')"),
])
def test_declared_checks_name_the_dotted_key(values, message):
    with pytest.raises(FieldError) as info:
        dataclass_from_dict(_Block, values, "blk")
    assert str(info.value) == message


def test_declared_checks_hold_for_direct_construction_and_replace():
    with pytest.raises(FieldError, match=r"^count=0, expected a positive int$"):
        _Block(count=0)
    with pytest.raises(FieldError, match=r"^token_budget=0, expected a positive int$"):
        dataclasses.replace(SchedulerConfig(), token_budget=0)
    assert _Block(share=np.float32(0.25)).share == np.float32(0.25)     # numpy scalars are numbers
    with pytest.raises(FieldError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("block,values,message", [
    ("scheduler", {"token_budget": 0}, "scheduler.token_budget=0, expected a positive int"),
    ("scheduler", {"tile_size": -1}, "scheduler.tile_size=-1, expected an int >= 0 (0 = off)"),
    ("scheduler", {"enable_chunking": 1}, "scheduler.enable_chunking=1, expected bool"),
    ("deployment", {"prefill": {"tp": 0}}, "deployment.prefill.tp=0, expected a positive int"),
    ("sim", {"gpu_memory_utilization": 1.5}, "sim.gpu_memory_utilization=1.5, expected a number in (0, 1]"),
    ("slo", {"tbt": -1.0}, "slo.tbt=-1.0, expected a number >= 0 (0 = no SLO)"),
    ("workload", {"num_requests": 0}, "workload.num_requests=0, expected a positive int"),
    ("engine", {"mode": "batch"}, "engine.mode='batch', expected one of ('online', 'offline')"),
])
def test_serve_config_field_errors_name_the_dotted_key(block, values, message):
    with pytest.raises(ValueError) as info:
        serve_config_from_dict(serve_dict(**{block: values}))
    assert str(info.value).startswith(message), str(info.value)


def test_config_checks_are_declared_per_field():
    """The range checks of the config blocks are field metadata: what each field must be is on the field."""
    declared = {f.name for cls in (SchedulerConfig, InstanceGroupConfig, SimConfig, SamplingParams)
                for f in dataclasses.fields(cls) if f.metadata.get("pdjax_check")}
    assert {"token_budget", "max_num_seqs", "page_size", "num_pages", "tile_size", "policy", "watermark", "pp",
            "tp", "num_instances", "gpu_memory_utilization", "top_p", "max_tokens"} <= declared


# ------------------------------------------------------------------------------------------------ cross-block rules
CROSS_BLOCK = [
    # async scheduling runs one colocated instance: the real engine refuses replicas (the simulator ran them)
    (dict(engine={"async_scheduling": True}, deployment={"colocated": {"num_instances": 2}}),
     "engine.async_scheduling=True runs one colocated instance"),
    (dict(engine={"async_scheduling": True}, deployment={"kind": "disaggregated"}),
     "engine.async_scheduling=True runs one colocated instance"),
    # async needs requests without a stop token (the real engine raised once serving, after compiling)
    (dict(engine={"async_scheduling": True}, model={"eos_token_id": 257}),
     "engine.async_scheduling=True with model.eos_token_id=257"),
    (dict(scheduler={"policy": "decode_only"}), "scheduler.policy='decode_only' with deployment.kind='colocated'"),
    # the roles' policies are derived from the scheduler block's: another policy would be silently replaced
    (dict(scheduler={"policy": "vllm_v1"}, deployment={"kind": "disaggregated"}),
     "scheduler.policy='vllm_v1' with deployment.kind='disaggregated'"),
    # a group's override makes an invalid scheduler: found at start-up, not while building the instance
    (dict(scheduler={"policy": "sarathi"}, deployment={"colocated": {"token_budget": 8}}),
     "deployment.colocated: its scheduler"),
    # explicit buckets below the budget: both backends failed at the first large step, mid-run
    (dict(engine={"token_buckets": (16, 32)}),
     "engine.token_buckets=(16, 32): the largest, 32, is below the token budget 256"),
    (dict(engine={"page_buckets": (8,)}, scheduler={"max_model_len": 1024, "page_size": 16}),
     "engine.page_buckets=(8,): the largest, 8, is below the pages of max_model_len=1024 (64 of 16 tokens)"),
]


@pytest.mark.parametrize("backend", ["sim", "real"])
@pytest.mark.parametrize("blocks,message", CROSS_BLOCK, ids=[m[:40] for _, m in CROSS_BLOCK])
def test_cross_block_rules_refuse_the_same_deployments_on_both_backends(backend, blocks, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        serve_config_from_dict(serve_dict(backend=backend, **blocks))


def test_the_simulator_refuses_async_scheduling_on_replicas(tmp_path):
    from pdjax.sim.run import simulate_config
    d = serve_dict(backend="sim", engine={"async_scheduling": True}, deployment={"colocated": {"num_instances": 2}},
                   workload={"num_requests": 4})
    with pytest.raises(ValueError, match="engine.async_scheduling=True runs one colocated instance"):
        simulate_config(serve_config_from_dict(d))


def test_async_scheduling_on_one_instance_still_simulates():
    from pdjax.sim.run import simulate_config
    d = serve_dict(backend="sim", engine={"async_scheduling": True}, workload={"num_requests": 4})
    result, setup = simulate_config(serve_config_from_dict(d))
    assert setup.async_scheduling and all(r.completed for r in result.requests)


# ------------------------------------------------------------------------------------------------ model's maximum
@pytest.mark.parametrize("backend", ["sim", "real"])
def test_a_context_beyond_the_model_is_refused_at_start_up(backend, tmp_path):
    d = serve_dict(backend=backend, scheduler={"max_model_len": 4096, "num_pages": 4096})
    with pytest.raises(ValueError, match=r"^scheduler.max_model_len=4096, expected <= max_position_embeddings=1024 "
                                         r"of model 'tiny-byte'"):
        prepare_experiment(d, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("backend", ["sim", "real"])
@pytest.mark.parametrize("eos", [259, 100000, -7])
def test_an_eos_token_outside_the_vocabulary_is_refused_at_start_up(backend, eos, tmp_path):
    """An id the model can never sample would never stop a request (issue 27 item 7: it was accepted)."""
    d = serve_dict(backend=backend, model={"eos_token_id": eos})
    with pytest.raises(ValueError, match=rf"^model.eos_token_id={eos} is outside the vocabulary of model 'tiny-byte' "
                                         r"\(ids 0..258\)"):
        prepare_experiment(d, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    prepare_experiment(serve_dict(backend=backend, model={"eos_token_id": 258}), str(tmp_path / "ok"))


@pytest.mark.parametrize("backend", ["sim", "real"])
def test_a_context_far_beyond_the_model_names_the_model_not_the_pages(backend, tmp_path):
    """issue 27: a 100,000-token context reported the pages it lacks instead of the model's 1024 positions."""
    d = serve_dict(backend=backend, scheduler={"max_model_len": 100000})
    with pytest.raises(ValueError, match=r"^scheduler.max_model_len=100000, expected <= max_position_embeddings=1024"):
        prepare_experiment(d, str(tmp_path / "run"))


def test_the_simulator_build_refuses_a_context_beyond_the_model():
    from pdjax.sim.build import build_setup
    d = serve_dict(backend="sim", model={"checkpoint": "llama-2-7b"},
                   scheduler={"max_model_len": 8192, "num_pages": 8192}, sim={"hardware": "a100-80gb-sxm"})
    with pytest.raises(ValueError, match="max_model_len=8192, expected <= max_position_embeddings=4096 of model "
                                         "'llama-2-7b'"):
        build_setup(serve_config_from_dict(d))


def test_placement_refuses_a_context_beyond_the_model():
    from pdjax.sim.placement import NodeType, PlacementProblem
    with pytest.raises(ValueError, match="max_model_len=100000, expected <= max_position_embeddings=2048 of model "
                                         "'opt-13b'"):
        PlacementProblem(model="opt-13b", node=NodeType("a100-80gb-sxm"), gpu_budget=2,
                         workload={"preset": "chat", "num_requests": 8}, ttft_s=1.0, tpot_s=0.1,
                         max_model_len=100000)


SERVE_TOO_LONG = ["--config=configs/serve.py", "--config.scheduler.max_model_len=4096",
                  "--config.scheduler.num_pages=4096"]
TOO_LONG = ("scheduler.max_model_len=4096, expected <= max_position_embeddings=1024 of model 'tiny-byte' (a longer "
            "context has positions the model does not have)")


@pytest.mark.parametrize("entry,flags,prefix", [
    ("experiments.serve", SERVE_TOO_LONG + ["--config.backend=sim", "--workdir=WORKDIR"], ""),
    ("experiments.serve", SERVE_TOO_LONG + ["--workdir=WORKDIR"], ""),
    ("experiments.capacity", SERVE_TOO_LONG + ["--slo_tbt_p99=0.1"], ""),
    ("experiments.sweep", ["--config=configs/sweeps/budget.py:sim", "--config.base.scheduler.max_model_len=4096",
                           "--config.base.scheduler.num_pages=4096", "--workdir=WORKDIR"],
     "sweep point token_budget=256: "),
], ids=["serve-sim", "serve-real", "capacity", "sweep"])
def test_entry_points_say_so_in_one_line_before_anything_runs(tmp_path, entry, flags, prefix):
    flags = [f.replace("WORKDIR", str(tmp_path / "w")) for f in flags]
    out = subprocess.run([sys.executable, "-m", entry, *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: {prefix}{TOO_LONG}"]
    assert not (tmp_path / "w").exists()


def test_a_group_hardware_that_is_no_name_says_so():
    """issue 27: deployment.prefill.hardware='cpu' was refused saying the devices are 'cpu' (the user's own word)."""
    from pdjax.config.deployment import deployment_from_dict
    from pdjax.config.validate import check_group_hardware
    dep = deployment_from_dict({"kind": "disaggregated", "prefill": {"hardware": "cpu"}})
    with pytest.raises(ValueError, match=r"^deployment.prefill.hardware='cpu' is not a hardware name"):
        check_group_hardware(dep, "cpu")
    check_group_hardware(deployment_from_dict({"kind": "disaggregated", "prefill": {"hardware": "host-cpu"}}), "cpu")
    with pytest.raises(ValueError, match="the real engine runs on the devices it has"):
        check_group_hardware(deployment_from_dict({"kind": "disaggregated", "prefill": {"hardware": "h100-sxm"}}),
                             "cpu")
