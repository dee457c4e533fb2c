"""Command-line entry point: `python -m experiments.train --config=configs/X.py --workdir=DIR`.

Overrides: --config.model.n_layers=4 (any field). Multi-process launches (SLURM, Open MPI, or
--coordinator_address) call jax.distributed.initialize() first. Exit status 0 also after SIGTERM
(the run saved and stopped); 1 with a one-line reason for bad configs, checkpoints or NaNs.
"""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments.cli import config_value, parse_flags, quiet_libraries

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
  # Our own INFO lines (run header, which NSA implementation ran); others' only from WARNING up:
  # jax and orbax narrate every backend probe and every save at INFO.
  quiet_libraries()
  train.initialize_distributed(_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  if train.jax.process_index() != 0:  # one voice: only process 0 logs and reports
    logging.getLogger("nsa_jax").setLevel(logging.WARNING)
  config = config_value(_CONFIG)
  try:
    summary = train.train_and_evaluate(config, _WORKDIR.value)
  except (ValueError, OSError, train.CheckpointError, train.NonFiniteError) as e:  # OSError: e.g.
    # a workdir that cannot be written
    print(f"error: {e}", file=sys.stderr)
    return 1
  if train.jax.process_index() != 0:
    return 0
  total = config.train.num_steps
  if not summary["train"] and not summary["val"] and summary["step"] >= total:  # already done
    print(f"done: the run is already at step {summary['step']} (config.train.num_steps="
          f"{total}); nothing to train. Fix: raise num_steps to "
          "continue it")
    return 0
  if not summary["train"] and not summary["val"]:  # stop_after at the resumed step (said above)
    print(f"done: step {summary['step']}; nothing trained in this invocation")
    return 0
  fmt = lambda d: f"{d['loss']:.4f}" if "loss" in d else "n/a"
  print(f"done: step {summary['step']}, train loss {fmt(summary['train'])}, val loss "
        f"{fmt(summary['val'])}" + (f" (stopped by {summary['stopped']})" if summary["stopped"] else ""))
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)  # absl exits with main's return value
