"""Shared command-line parsing and error reporting for the entry points."""

import functools
import os
import sys

from absl import flags


def parse_flags(argv):
  """absl parsing, but a bad --config override is one clear line (exit 2), not a traceback; so
  is a stray positional word (no entry point takes one: `--flag value` with a space after a
  non-boolean flag is fine, but a word left over is almost always a typo that would otherwise be
  dropped while the run goes on with the default)."""
  try:
    rest = flags.FLAGS(argv)
  except SystemExit as e:  # absl's --help prints the usage and exits with status 1
    asked = {"--help", "-?", "--helpshort", "--helpfull", "--helpxml"}
    if e.code == 1 and any(a.split("=", 1)[0] in asked for a in argv[1:]):
      sys.exit(0)
    raise
  except (AttributeError, KeyError, TypeError, ValueError, OSError, flags.Error) as e:
    text = str(e).replace("\\n", "\n")
    if "Traceback (most recent call last)" in text:  # a config file's get_config raised: its
      lines = [ln.strip() for ln in text.splitlines() if ln.strip()]  # last line says why
      head = text.split(": Error whilst", 1)[0] if ": Error whilst" in text else "--config"
      text = f"{head}: the config file raised {lines[-1]}"
    msg = text.replace("\\'", "'").replace("\n", " ")
    if len(msg) > 1 and msg[0] == msg[-1] == "'":  # ml_collections wraps its message in quotes
      msg = msg[1:-1]
    if isinstance(e, (AttributeError, KeyError)) and "Did you mean" not in msg:
      name = msg.strip("'\" ")
      overridden = [a for a in argv[1:] if a.startswith("--") and "." in a.split("=", 1)[0]
                    and a.split("=", 1)[0].rsplit(".", 1)[1] == name]
      if not overridden:  # raised inside a config file's get_config(): a bug there, show it
        raise
      msg = f"no such config field '{name}' in {overridden[0].split('=', 1)[0]} (see configs/base.py)"
    print(f"error: bad command line: {msg}", file=sys.stderr)
    sys.exit(2)
  if len(rest) > 1:
    print(f"error: bad command line: unexpected argument(s) {rest[1:]}: this command takes only "
          "flags. Fix: write each as --name=value (see --help).", file=sys.stderr)
    sys.exit(2)
  return rest


def is_user_error(e: BaseException) -> bool:
  """Bad input (a path, a checkpoint, a value), not a bug: ValueError, OSError and the training
  library's CheckpointError / NonFiniteError (matched by name: no heavy import on the error path)."""
  return isinstance(e, (ValueError, OSError)) or any(
      c.__name__ in ("CheckpointError", "NonFiniteError") for c in type(e).__mro__)


def one_line_errors(main):
  """Wraps an entry point's main: bad input ends as `error: <message>` and exit status 1 instead
  of a traceback (the messages name the problem and the fix). NSA_TRACEBACK=1 shows the
  traceback."""
  @functools.wraps(main)
  def wrapped(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except Exception as e:
      if os.environ.get("NSA_TRACEBACK") == "1" or not is_user_error(e):
        raise
      msg = str(e) if "Fix" in str(e) else f"{type(e).__name__}: {e} (NSA_TRACEBACK=1 shows where)"
      print(f"error: {msg}", file=sys.stderr)
      return 1
  return wrapped


def run_main(main):
  """For the argparse entry points: runs main under one_line_errors and exits with its status
  (1 on bad input; 0 when main returns something that is not an int, such as a path)."""
  rc = one_line_errors(main)()
  sys.exit(rc if isinstance(rc, int) else 0)


def config_value(holder):
  """The value of a config_flags flag. ml_collections defers a config file that fails to load
  (missing, a syntax error) to this access and then raises a long OSError; this exits with one
  line naming the file's problem (status 2, like other bad command lines)."""
  try:
    value = holder.value
    value.keys()  # a config that failed to load is a placeholder raising on first use
    return value
  except OSError as e:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    print(f"error: bad command line: --{holder.name} could not be loaded: "
          f"{lines[-1] if lines else e}", file=sys.stderr)
    sys.exit(2)


def quiet_libraries():
  """Our own INFO lines (logger nsa_jax); jax's and orbax's only from WARNING up (orbax narrates
  every restore at INFO)."""
  import logging
  logging.getLogger().setLevel(logging.WARNING)
  logging.getLogger("absl").setLevel(logging.WARNING)
  logging.getLogger("nsa_jax").setLevel(logging.INFO)
