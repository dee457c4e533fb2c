"""Generate text from a trained checkpoint (or a freshly initialised model): prefill the prompt,
then sample with a jit-compiled decode loop, streaming the text out as it is produced.

Trained model (a workdir written by experiments.train; the model config comes from the checkpoint):
  python -m experiments.generate --workdir=runs/tiny --prompt="def main(" --max_new_tokens=200
Untrained model from a config file (random weights: for checking the machinery, not the text):
  python -m experiments.generate --config=configs/tiny_cpu.py --attention=dense --prompt="x"
Sampling: --temperature=0 is greedy; --top_k / --top_p filter before sampling. Tokens are bytes
(vocab 256) and are printed as UTF-8; other vocabularies print token ids. Works for NSA, dense and
mixed models. On a GPU the NSA selection branch uses the Pallas decode kernel (--kernel=auto).
"""

from __future__ import annotations

import argparse
import codecs
import functools
import importlib.util
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nsa_jax import decode, sampling
from nsa_jax.model import TransformerLM, check_token_ids

log = logging.getLogger("nsa_jax.generate")


# ----------------------------------------------------------------------------- loading

def _model_config(fields: dict):
  from nsa_jax.training.train import model_config_from  # the training code's typed conversion
  return model_config_from(fields)


def _onto(template, restored):
  """restored (orbax dicts with string keys) reshaped onto the model's pure-dict key types."""
  if not isinstance(template, dict):
    return restored
  return {k: _onto(v, restored[str(k)] if str(k) in restored else restored[k])
          for k, v in template.items()}


def load_checkpoint(workdir: str, step: int | None = None):
  """(model, description) from a training workdir: the config from the checkpoint's metadata, then
  the parameters of the newest (or the given) step."""
  import orbax.checkpoint as ocp
  from nsa_jax.training.checkpointing import Checkpointer, CheckpointError
  path = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(path):  # Checkpointer would create it: a typo must not leave directories
    raise CheckpointError(f"no checkpoint directory {path}. Fix: pass the --workdir that "
                          "experiments.train wrote, or --config for an untrained model.")
  ckpt = Checkpointer(path, async_save=False)
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"no checkpoint in {ckpt.directory}. Fix: train first "
                          "(python -m experiments.train) or pass --config for an untrained model.")
  meta = ckpt.read_meta(step)
  cfg = _model_config(meta["model"])
  state = ckpt.read(step, "its arrays", state=ocp.args.StandardRestore())["state"]
  ckpt.check_finite(step, state["params"])
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  template = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = _onto(template, state["params"])
  # the same bit-for-bit check as training's resume: arrays that decode but differ from the save
  ckpt.check_checksums(step, {"params": params}, meta.get("checksums"), prefix="['params']")
  params = jax.tree.map(lambda t, r: jnp.asarray(r, t.dtype), template, params)
  state_p = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state_p, params)
  nnx.update(model, state_p)
  ckpt.close()
  return model, f"checkpoint {ckpt.step_dir(step)}"


def fresh_model(config_path: str, attention: str | None, seed: int):
  """(model, description) for an untrained model built from a configs/*.py file."""
  spec = importlib.util.spec_from_file_location("gen_config", config_path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  fields = mod.get_config().model.to_dict()
  if attention:
    fields.update(attention=attention, layer_attention=None)
  cfg = _model_config(fields)
  return TransformerLM(cfg, rngs=nnx.Rngs(params=seed)), f"UNTRAINED model from {config_path}"


# ----------------------------------------------------------------------------- decoding loop

def choose_kernels(mode: str) -> dict:
  """Decode kernels: the Pallas split-K kernels on a GPU unless told otherwise ({} = plain JAX)."""
  use = mode == "pallas" or (mode == "auto" and jax.default_backend() == "gpu")
  log.warning("decode attention: %s on %s", "Pallas kernels (pallas_kernels.decode_attention, "
              "decode_select)" if use else "plain JAX", jax.default_backend())
  return decode.pallas_decode_kernels() if use else {}


def make_chunk_fn(graphdef, chunk: int, kernels: dict, **sample_kw):
  """Jitted: feed `token`, then chunk times (decode step, sample); returns the chunk's tokens."""

  @functools.partial(jax.jit, donate_argnums=1)
  def run(params, cache, token, key):
    model = nnx.merge(graphdef, params)

    def body(carry, _):
      cache, token, key = carry
      logits, cache = decode.decode_step(model, cache, token, check=False, **kernels)
      key, sub = jax.random.split(key)
      nxt = sampling.sample(sub, logits, **sample_kw)
      return (cache, nxt, key), nxt

    (cache, token, key), toks = jax.lax.scan(body, (cache, token, key), None, length=chunk)
    return cache, token, key, toks.T  # toks [B, chunk]

  return run


def generate(model, prompt_ids, max_new_tokens, *, temperature=1.0, top_k=0, top_p=1.0, seed=0,
             chunk=16, kernels=None, on_tokens=None, stop_token=None):
  """Samples max_new_tokens after prompt_ids [B, T]; returns [B, max_new_tokens] int32.

  on_tokens(tokens [B, c]) is called as soon as each chunk is on the host (streaming).
  kernels: the Pallas decode kernels (decode.pallas_decode_kernels()); None = plain JAX.
  stop_token: a row ends with the first one it samples (e.g. a document's end token: decoding
  takes no segment ids, so a model trained with document masking would go on reading across it);
  every later position of that row holds stop_token, and sampling ends after the chunk in which
  the last row stopped, so fewer than max_new_tokens columns may come back.
  """
  b, t = prompt_ids.shape
  if chunk < 1 or max_new_tokens < 1 or b < 1 or t < 1:
    raise ValueError(f"chunk={chunk}, max_new_tokens={max_new_tokens}, prompt shape "
                     f"{tuple(prompt_ids.shape)}: each must be at least 1")
  steps = max_new_tokens - 1  # the first new token comes from the prefill logits
  max_len = t + steps
  if max_len > model.cfg.max_seq_len:
    raise ValueError(f"prompt ({t}) + new tokens ({max_new_tokens}) needs {max_len} cache slots "
                     f"> max_seq_len={model.cfg.max_seq_len}. Fix: shorten the prompt or generate "
                     "less.")
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  sampling.check_sampling(**kw)  # before compiling anything
  check_token_ids(np.asarray(prompt_ids), model.cfg.vocab_size)  # the jitted prefill cannot raise
  params, prefill_fn, _ = decode.jit_decode(model)
  graphdef = nnx.graphdef(model)
  key = jax.random.key(seed)
  logits, cache = prefill_fn(params, jnp.asarray(prompt_ids, jnp.int32), max(max_len, t))
  key, sub = jax.random.split(key)
  token = sampling.sample(sub, logits[:, -1], **kw)
  stopped = np.zeros(b, bool)

  def emit(toks):  # a stopped row's later tokens become stop_token, then the chunk streams
    if stop_token is not None:
      hit = np.cumsum(toks == stop_token, axis=1) > 0
      toks = np.where(stopped[:, None] | np.pad(hit, ((0, 0), (1, 0)))[:, :-1], stop_token, toks)
      stopped[:] |= hit.any(axis=1)
    if on_tokens:
      on_tokens(toks)
    return toks

  out = [emit(np.asarray(token)[:, None])]
  fns = {}
  done = 0
  while done < steps and not stopped.all():
    c = min(chunk, steps - done)
    decode.check_room(cache, c)  # the jitted loop cannot raise; check before entering it
    if c not in fns:
      fns[c] = make_chunk_fn(graphdef, c, kernels or {}, **kw)
    cache, token, key, toks = fns[c](params, cache, token, key)
    out.append(emit(np.asarray(toks)))
    done += c
  return np.concatenate(out, axis=1)


# ----------------------------------------------------------------------------- CLI

def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="training workdir holding checkpoints/")
  src.add_argument("--config", help="configs/*.py for an untrained model")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  ap.add_argument("--attention", choices=["nsa", "dense"], default=None,
                  help="with --config: override the attention kind of every layer")
  ap.add_argument("--prompt", default="def ")
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--num_samples", type=int, default=1, help="batch of samples; the first streams")
  ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  ap.add_argument("--top_k", type=int, default=0, help="0 = off")
  ap.add_argument("--top_p", type=float, default=1.0, help="1 = off")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--chunk", type=int, default=16, help="decode steps per jitted loop call")
  ap.add_argument("--stop_token", type=int, default=None,
                  help="end a sample at this token id (e.g. 0, the byte corpora's document end, "
                       "for a model trained with document masking: decoding is one document)")
  ap.add_argument("--kernel", choices=["auto", "pallas", "xla"], default="auto")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
  if args.max_new_tokens < 1:
    ap.error("--max_new_tokens must be >= 1")
  if args.num_samples < 1:
    ap.error("--num_samples must be >= 1")
  if args.chunk < 1:
    ap.error("--chunk (decode steps per jitted call) must be >= 1")
  if args.stop_token is not None and args.stop_token < 0:
    ap.error(f"--stop_token={args.stop_token}: expected a token id >= 0")
  if args.workdir and args.attention:
    ap.error("--attention applies to --config (an untrained model); a checkpoint's attention is "
             "the one it was trained with")
  if args.config and args.step is not None:
    ap.error("--step picks a checkpoint of --workdir; --config builds an untrained model")
  try:  # the library's own check (a NaN temperature fails it too)
    sampling.check_sampling(args.temperature, args.top_k, args.top_p)
  except ValueError as e:
    ap.error(f"--{e}")
  if args.kernel == "pallas" and jax.default_backend() != "gpu":
    ap.error(f"--kernel=pallas needs a GPU (this backend: {jax.default_backend()}); use "
             "--kernel=auto or --kernel=xla")
  try:
    if args.workdir:
      model, what = load_checkpoint(args.workdir, args.step)
    else:
      model, what = fresh_model(args.config, args.attention, args.seed)
  except Exception as e:  # a bad path or checkpoint: one line, not a traceback
    print(f"error: {e}", file=sys.stderr)
    return 1
  vocab = model.cfg.vocab_size
  byte_level = vocab == 256
  if args.stop_token is not None and args.stop_token >= vocab:
    ap.error(f"--stop_token={args.stop_token} is outside the vocabulary [0, {vocab - 1}]")
  try:
    ids = list(args.prompt.encode("utf-8")) if byte_level else [int(x) for x in args.prompt.split()]
  except ValueError:
    ap.error(f"--prompt={args.prompt!r}: this model's vocabulary is not bytes (vocab_size="
             f"{vocab}), so the prompt must be space-separated token ids, e.g. --prompt='1 2 3'")
  if not ids:
    ap.error("--prompt must not be empty")
  if min(ids) < 0 or max(ids) >= vocab:
    ap.error(f"--prompt holds token ids outside [0, {vocab - 1}] (vocab_size={vocab})")
  prompt = np.tile(np.asarray(ids, np.int32), (args.num_samples, 1))
  print(f"[{what}; attention {model.cfg.attention_kinds}; {len(ids)} prompt tokens]",
        file=sys.stderr)
  utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def upto_stop(row):  # generate() fills a row with stop_token from its first one on
    return row[:row.index(args.stop_token)] if args.stop_token in row else row

  def stream(toks):
    row = upto_stop(toks[0].tolist())
    sys.stdout.write(utf8.decode(bytes(row)) if byte_level else " " + " ".join(map(str, row)))
    sys.stdout.flush()

  kernels = choose_kernels(args.kernel)
  sys.stdout.write(args.prompt)
  start = time.perf_counter()
  try:
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, chunk=args.chunk,
                   kernels=kernels, on_tokens=stream, stop_token=args.stop_token)
  except ValueError as e:
    print(f"\nerror: {e}", file=sys.stderr)
    return 1
  secs = time.perf_counter() - start
  sys.stdout.write(utf8.decode(b"", final=True) + "\n")
  for i in range(1, args.num_samples):
    row = upto_stop(out[i].tolist())
    text = bytes(row).decode("utf-8", "replace") if byte_level else str(row)
    print(f"--- sample {i}\n{args.prompt}{text}")
  print(f"[{out.size} tokens in {secs:.2f} s including compilation]", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
