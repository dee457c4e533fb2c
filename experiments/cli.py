"""Shared command-line parsing for the absl entry points."""

import sys

from absl import flags


def parse_flags(argv):
  """absl parsing, but a bad --config override is one clear line (exit 2), not a traceback."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    msg = str(e).replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
    if len(msg) > 1 and msg[0] == msg[-1] == "'":  # ml_collections wraps its message in quotes
      msg = msg[1:-1]
    print(f"error: bad command line: {msg}", file=sys.stderr)
    sys.exit(2)
