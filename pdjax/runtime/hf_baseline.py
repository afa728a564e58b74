"""The same offline job on HF transformers (PyTorch eager, CPU): the baseline bench_throughput compares against.

pdjax params are written as an HF Llama checkpoint (`save_hf_checkpoint`), loaded with
`LlamaForCausalLM.from_pretrained` in float32, and the P prompts of L tokens run as one batch through
`generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)` (greedy, every request exactly N tokens, as
vLLM's `benchmark_throughput --backend hf` does with equal-length prompts: no padding needed).

Each measurement runs in a fresh subprocess (`python -m pdjax.runtime.hf_baseline REQUEST.json`), because
PyTorch's OpenMP reads OMP_WAIT_POLICY once at start-up: ACTIVE (spinning threads, the default) is fastest
on a quiet machine and collapses when another job holds a core; PASSIVE avoids the collapse. The caller
alternates backends and policies and keeps each one's best.

torch and transformers come from the optional extra `hf` (`pip install -e ".[hf]"`), never from CI's install;
`require_hf` says so in one line when they are missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence


class MissingExtraError(ValueError):
    """An optional extra the user asked for is not installed."""


def require_hf() -> None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"--backend=hf needs the optional extra 'hf' (torch and transformers; not installed: "
                                f"{', '.join(missing)}): pip install -e \".[hf]\"")


def hf_generate(checkpoint_dir: str, prompts: Sequence[Sequence[int]], output_len: int, threads: int) -> Dict:
    """Greedy-generate `output_len` tokens for every prompt (equal lengths) in one batch; in this process.
    Returns {'output_tokens': [[ids] per prompt], 'generate_s', 'generate_cpu_s' (CPU seconds of this process,
    every thread: spinning OpenMP threads count), 'load_s', 'torch', 'transformers'}."""
    import torch  # noqa: PLC0415 (optional hf extra)
    import transformers  # noqa: PLC0415 (optional hf extra)

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - start
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, min_new_tokens=2, **{**kwargs,
                       "attention_mask": torch.ones_like(ids[:1, :8])})   # warm-up (allocator, kernels)
        start, cpu_start = time.perf_counter(), time.process_time()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        generate_s, generate_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    new = out[:, ids.shape[1]:].tolist()
    return {"output_tokens": new, "generate_s": generate_s, "generate_cpu_s": generate_cpu_s, "load_s": load_s,
            "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads}


def run_hf_subprocess(checkpoint_dir: str, prompts: Sequence[Sequence[int]], output_len: int, threads: int,
                      wait_policy: str, timeout_s: float = 1800.0) -> Dict:
    """`hf_generate` in a fresh interpreter with OMP_WAIT_POLICY=`wait_policy` and `threads` OpenMP threads."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"checkpoint_dir": checkpoint_dir, "prompts": [list(p) for p in prompts],
                   "output_len": output_len, "threads": threads}, f)
        request = f.name
    env = {**os.environ, "OMP_WAIT_POLICY": wait_policy, "OMP_NUM_THREADS": str(threads)}
    try:
        proc = subprocess.run([sys.executable, "-m", "pdjax.runtime.hf_baseline", request], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    finally:
        os.unlink(request)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"HF baseline (OMP_WAIT_POLICY={wait_policy}) failed: {tail[0]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wait_policy"] = wait_policy
    return result


def matching_outputs(ours: Dict[str, List[int]], request_ids: Sequence[str], theirs: Sequence[List[int]]) -> int:
    """How many requests got identical greedy tokens on both backends (request i <-> prompt i)."""
    return sum(list(ours[rid]) == list(t) for rid, t in zip(request_ids, theirs))


def _main(argv: List[str]) -> None:
    with open(argv[1]) as f:
        req = json.load(f)
    print(json.dumps(hf_generate(req["checkpoint_dir"], req["prompts"], req["output_len"], req["threads"])))


if __name__ == "__main__":
    _main(sys.argv)
