"""pdjax: a JAX research framework for LLM serving.

Layers (see DESIGN.md): config/scheduler/workload/metrics/sim import no JAX; models/kernels/runtime/serving do.
"""
import glob as _glob
import importlib.util as _importlib_util
import os as _os
import time as _time

__version__ = "0.1.0"
IMPORT_TIME = _time.time()   # when pdjax was first imported: the start of a run's start-up (see serving/run.py)

# libtpu (the 'tpu' extra: ahead-of-time compilation for TPUs on any host) looks for a TPU VM's metadata when JAX
# starts and prints half a page of errors where there is none. On a host without TPU chips, say there is none; JAX
# then starts its CPU (or GPU) backend as without libtpu, and compile-only TPU topologies still work, in several
# processes at once (libtpu otherwise locks /tmp/libtpu_lockfile for the first process that loads it).
TPU_ABSENT_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
                  "TPU_WORKER_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _installed(module: str) -> bool:
    try:
        return _importlib_util.find_spec(module) is not None
    except ModuleNotFoundError:     # a dotted name whose parent package is absent
        return False


def _host_has_tpu() -> bool:
    return bool(_glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"))


if _installed("libtpu") and not _host_has_tpu():
    for _key, _value in TPU_ABSENT_ENV.items():
        _os.environ.setdefault(_key, _value)
# The CUDA plugin (the 'gpu-aot' extra: compiling for GPUs this host does not have) checks the CUDA driver's version
# when JAX starts and prints a traceback where there is no driver; JAX then runs on the CPU all the same.
if _installed("jax_plugins.xla_cuda12") and not _os.path.exists("/proc/driver/nvidia"):
    _os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
