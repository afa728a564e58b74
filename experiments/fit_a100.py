"""Fit the A100 machine profile and write pdjax/sim/profiles/a100.json: an alias of
`python -m experiments.fit_profile --hardware=a100` (see experiments/fit_profile.py for what is fitted on what).

python -m experiments.fit_a100 [--profiling_dir=../shared/data/profiling] [--out=pdjax/sim/profiles/a100.json]
"""
import sys

from experiments import fit_profile
from pdjax.experiment import cli

if __name__ == "__main__":
    fit_profile.define_flags()
    sys.argv.insert(1, "--hardware=a100")   # a later --hardware on the command line still wins
    cli.run(fit_profile.main)
