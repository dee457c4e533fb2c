"""Command-line entry point: `python -m experiments.train --config=configs/X.py --workdir=DIR`.

Overrides: --config.model.n_layers=4 (any field). Multi-process launches (SLURM, Open MPI, or
--coordinator_address) call jax.distributed.initialize() first. Exit status 0 also after SIGTERM
(the run saved and stopped); 1 with a one-line reason for bad configs, checkpoints or NaNs.
"""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/*.py)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "work directory: checkpoints, logs, plots")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "yes", "no"],
                                 "call jax.distributed.initialize(): auto = when launched multi-process")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "total processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from nsa_jax.training import train  # after flag parsing: --help stays fast
  train.initialize_distributed(_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax narrates every save at INFO
  try:
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, train.CheckpointError, train.NonFiniteError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"done: step {summary['step']}, train loss {summary['train'].get('loss', float('nan')):.4f}, "
        f"val loss {summary['val'].get('loss', float('nan')):.4f}"
        + (f" (stopped by {summary['stopped']})" if summary["stopped"] else ""))
  return 0


if __name__ == "__main__":
  app.run(main)  # absl exits with main's return value
