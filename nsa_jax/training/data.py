"""Training data: batches that are a pure function of (seed, split, step, row).

Sources (config.data.source):
  "stdlib": the source text of the running interpreter's Python standard library, byte-level
            (vocab 256), files in sorted order, held-out files chosen by a hash of their path.
            No download; note that it differs between Python versions (the fingerprint says which).
  "text":   plain text file(s) by path (a file, a directory or a glob), byte-level.
  "tokens": a flat uint16/uint32 token file (np.memmap), held-out tail or a separate val_path.
  "passkey" / "needle": retrieval of 1 / num_needles key-value facts hidden in filler text
            (optional num_questions: questions per sequence, default 1; optional
            context_loss_weight: loss weight of the non-answer tokens, default 0; optional
            single_question_fraction: rows that ask only at the end, default 0).
  "mqar":   multi-query associative recall: key-value pairs, a long gap, then queried keys.
Because a batch depends only on its step, the iterator state is just the next step (plus a
fingerprint of the source), and a resumed run sees exactly the batches it would have seen.

Document masking (config.data.document_mask, corpus sources only): a batch also carries
"segment_ids" [B, T], one id per document within the row, so that attention (every NSA branch and
dense) never crosses a document boundary and positions restart at each document. A document ends
with its end token, which belongs to it: byte 0 for stdlib/text (the file separator), and
config.data.eos_id for a token file. The target after an end token (the next document's first
token) keeps its loss weight, as in unmasked training.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
import zlib

import numpy as np

SPLITS = {"train": 0, "val": 1}
SOURCES = ("stdlib", "text", "tokens", "passkey", "needle", "mqar")
# Parts of the standard library left out of the corpus: tests and vendored data are huge, repetitive
# or not Python; site-packages is whatever the user installed (not reproducible).
_STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                "site-packages", "dist-packages", "__pycache__", "pydoc_data"}
_FILE_SEP = b"\n\x00\n"  # byte 0 never occurs in source text: it marks file boundaries


def _row_rng(seed: int, split: str, step: int, row: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64([seed, SPLITS[split], step, row]))


def _is_val(relpath: str, val_percent: float) -> bool:
  # Hash of the path alone: a file's split never depends on which other files exist.
  return zlib.crc32(relpath.encode()) % 10000 < val_percent * 100


def _split_files(paths, root, val_percent):
  train, val = [], []
  for p in paths:
    (val if _is_val(os.path.relpath(p, root), val_percent) else train).append(p)
  if not train or not val:  # too few files to split by file: the caller splits by position
    return None
  return train, val


def _read(paths, max_bytes: int) -> np.ndarray:
  chunks, total = [], 0
  for p in paths:
    with open(p, "rb") as f:
      data = f.read()
    chunks.append(data + _FILE_SEP)
    total += len(chunks[-1])
    if max_bytes and total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes or None], dtype=np.uint8)


def stdlib_files() -> tuple[str, list[str]]:
  """Sorted .py files of the running interpreter's standard library (minus _STDLIB_SKIP)."""
  root = sysconfig.get_paths()["stdlib"]
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("config-"))
    out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
  if not out:
    raise FileNotFoundError(f"no .py files under the standard library at {root}")
  return root, sorted(out, key=lambda p: os.path.relpath(p, root))


def _text_files(path: str) -> tuple[str, list[str]]:
  if os.path.isdir(path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    root = path
  else:
    files = glob.glob(path)
    root = os.path.dirname(path) or "."
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(f"config.data.path={path!r} matches no file. Fix: give a text file, "
                            "a directory or a glob")
  return root, files


def _token_file(path, dtype, field):
  """A flat token file as a read-only memmap, with errors that name the field and the fix."""
  where = f"config.data.{field}={path!r}"
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f"{where}: no such file. Fix: point it at a flat {dtype.name} token "
                            "file (e.g. numpy's tofile of the token ids)")
  size = os.path.getsize(path)
  if size == 0:
    raise ValueError(f"{where} is empty. Fix: write the token ids into it first")
  if size % dtype.itemsize:
    other = "uint32" if dtype == np.uint16 else "uint16"
    raise ValueError(f"{where} holds {size} bytes, not a whole number of {dtype.name} tokens "
                     f"({dtype.itemsize} bytes each). Fix: check config.data.token_dtype (maybe "
                     f"{other}) or the file")
  return np.memmap(path, dtype=dtype, mode="r")


def _position_split(tokens, val_fraction):
  n_val = max(int(len(tokens) * val_fraction), 1)
  return tokens[:-n_val], tokens[-n_val:]


class WindowSource:
  """Random windows of a flat token array."""

  def __init__(self, tokens: np.ndarray, fingerprint: dict, split: str = "data"):
    self.tokens = tokens
    self.fingerprint = fingerprint
    self.split = split

  def row(self, rng: np.random.Generator, length: int):
    if len(self.tokens) < length:
      share = (" or raise config.data.val_percent (the held-out share)"
               if self.split == "validation" else "")
      raise ValueError(f"the {self.split} split has {len(self.tokens)} tokens, fewer than one "
                       f"window of {length}. Fix: lower config.data.seq_len{share} or give more "
                       "data")
    start = int(rng.integers(0, len(self.tokens) - length + 1))
    seq = np.asarray(self.tokens[start:start + length], dtype=np.int32)
    return seq, np.ones(length - 1, np.float32)


def _fingerprint(name, tokens, **extra):
  head = np.asarray(tokens[: 1 << 20]).tobytes()
  return dict(source=name, num_tokens=int(len(tokens)), crc_head=zlib.crc32(head), **extra)


def corpus_sources(cfg) -> dict[str, WindowSource]:
  """Train and val WindowSources for the stdlib, text and token-file sources."""
  if cfg.source in ("stdlib", "text"):
    root, files = stdlib_files() if cfg.source == "stdlib" else _text_files(cfg.path)
    split = _split_files(files, root, cfg.val_percent)
    if split is None:
      train, val = _position_split(_read(files, cfg.max_bytes), cfg.val_percent / 100)
    else:
      train, val = _read(split[0], cfg.max_bytes), _read(split[1], cfg.max_bytes)
    extra = dict(python=sys.version.split()[0]) if cfg.source == "stdlib" else dict(path=cfg.path)
  elif cfg.source == "tokens":
    dtype = np.dtype(cfg.token_dtype)
    if dtype not in (np.uint16, np.uint32):
      raise ValueError(f"config.data.token_dtype={cfg.token_dtype!r}: expected uint16 or uint32")
    tokens = _token_file(cfg.path, dtype, "path")
    if cfg.val_path:
      train, val = tokens, _token_file(cfg.val_path, dtype, "val_path")
    else:
      train, val = _position_split(tokens, cfg.val_percent / 100)
    extra = dict(path=cfg.path, val_path=cfg.val_path)
  else:
    raise ValueError(f"{cfg.source!r} is not a corpus source")
  return {"train": WindowSource(train, _fingerprint(cfg.source, train, **extra), "training"),
          "val": WindowSource(val, _fingerprint(cfg.source, val, **extra), "validation")}


_FILLER = (b"The grass is green. ", b"The sky is blue. ", b"The sun is yellow. ",
           b"Here we go. ", b"There and back again. ", b"The river flows to the sea. ")


class NeedleSource:
  """num_needles "key -> 5-digit value" facts in filler text; the last one is asked for at the end.

  Only the answer digits carry loss weight: the task is retrieval, the filler is noise.
  num_questions > 1 asks num_questions - 1 more questions at random places after the facts (each
  about a random fact; passkey: the one key), so each sequence carries 5 * num_questions scored
  digits instead of 5. The default 1 is the original task, byte for byte.
  context_weight > 0 also puts that loss weight on every other target (filler, facts, questions):
  a language-model signal besides the answers. The default 0 scores the answers only.
  single_question_fraction f: each row, with probability f, asks only the final question. With
  extra questions every question repeats the key, so an answer copies from the nearest earlier
  question, and the facts take the earliest of the random cuts: at 4k tokens and 5 questions an
  answer's nearest earlier copy of its key lies at most the filler's room + ~59 = 3,900 tokens
  back, and in practice far less (3,300 the farthest of 10,000 sampled, median 545; see
  retrieval_distances), while needle_eval's depths 0 / 1% ask from 4,076 / 4,036. A single-question row puts
  its fact at a uniform place, so its one answer's distance is uniform over the row. The default 0
  draws nothing extra: rows stay byte for byte as before.
  """

  def __init__(self, num_needles: int, fingerprint: dict, num_questions: int = 1,
               context_weight: float = 0.0, single_question_fraction: float = 0.0):
    if num_questions < 1:
      raise ValueError(f"config.data.num_questions={num_questions}: must be >= 1")
    if context_weight < 0:
      raise ValueError(f"config.data.context_loss_weight={context_weight}: must be >= 0")
    if not 0.0 <= single_question_fraction <= 1.0:
      raise ValueError(f"config.data.single_question_fraction={single_question_fraction}: must be "
                       "a fraction in [0, 1]. Fix: e.g. 0.5 (half the rows ask only at the end)")
    if single_question_fraction and num_questions == 1:
      raise ValueError(f"config.data.single_question_fraction={single_question_fraction} with "
                       "num_questions=1: every row already asks only at the end, so it would change "
                       "nothing. Fix: num_questions > 1, or leave the fraction at 0")
    self.num_needles = num_needles
    self.num_questions = num_questions
    self.context_weight = context_weight
    self.single_question_fraction = single_question_fraction
    self.fingerprint = fingerprint

  def _question(self, keys, vals, q):
    if self.num_needles == 1:
      return f" What is the pass key? The pass key is {vals[0]}".encode()
    return f" What is the value of key {keys[q]}? It is {vals[q]}".encode()

  def row(self, rng: np.random.Generator, length: int):
    keys = ["".join(chr(c) for c in rng.integers(97, 123, 4)) for _ in range(self.num_needles)]
    vals = [f"{int(v):05d}" for v in rng.integers(0, 100000, self.num_needles)]
    if self.num_needles == 1:
      facts = [f"The pass key is {vals[0]}. Remember it. ".encode()]
      q = 0
    else:
      facts = [f"The value of key {k} is {v}. ".encode() for k, v in zip(keys, vals)]
      q = int(rng.integers(0, self.num_needles))
    question = self._question(keys, vals, q)
    extra = self.num_questions - 1
    # Every question of a passkey row has the same length; a needle row's differ only by key name,
    # which has a fixed length too, so the room is known before the extra questions are drawn.
    room = length - len(question) * (1 + extra) - sum(map(len, facts))
    if room < 0:
      raise ValueError(f"seq_len too short for {self.num_needles} needle(s) and "
                       f"{self.num_questions} question(s): need at least {length - room} tokens. "
                       "Fix: raise config.data.seq_len or lower config.data.num_questions")
    # Drawn only when asked for, so that rows at the default stay as they were.
    if self.single_question_fraction and extra and rng.random() < self.single_question_fraction:
      room, extra = room + len(question) * extra, 0
    filler = b"".join(_FILLER[i] for i in rng.integers(0, len(_FILLER), room // 10 + 1))[:room]
    cuts = np.sort(rng.integers(0, room + 1, len(facts) + extra))
    # The facts take the earliest cuts, so every question comes after all the facts.
    inserts = facts + [self._question(keys, vals, int(i))
                       for i in rng.integers(0, self.num_needles, extra)]
    parts, prev, ends = [], 0, []
    for cut, piece in zip(cuts, inserts):
      parts += [filler[prev:cut], piece]
      prev = cut
      ends.append(sum(map(len, parts)))
    seq = np.frombuffer(b"".join(parts) + filler[prev:] + question, np.uint8).astype(np.int32)
    weights = np.full(length - 1, self.context_weight, np.float32)
    weights[-5:] = 1.0  # targets = seq[1:]: the 5 answer digits are the last 5 targets
    for end in ends[len(facts):]:  # an extra question's digits end at byte `end` (exclusive)
      weights[end - 6:end - 1] = 1.0  # target j predicts byte j + 1
    return seq, weights


def retrieval_distances(source: NeedleSource, length: int, rows: int, seed: int = 0) -> np.ndarray:
  """Tokens from each scored answer back to the nearest earlier copy of its digits, over `rows`
  training rows of `length` tokens (rows 0.. of step 0 at data seed `seed`): how far the data
  asks a model to retrieve. An answer is found by its loss weight of 1, so context_weight must
  not be 1 as well. (Needle rows: two facts sharing a value, ~6e-5 a row, would read short.)"""
  if not isinstance(source, NeedleSource):
    raise ValueError(f"retrieval_distances: a passkey / needle source, not {type(source).__name__}")
  if source.context_weight == 1.0:
    raise ValueError("retrieval_distances: context_loss_weight is 1, so the answers cannot be told "
                     "from the rest by their weight. Fix: any other context_loss_weight")
  out = []
  for r in range(rows):
    seq, weights = source.row(_row_rng(seed, "train", 0, r), length + 1)
    text = bytes(seq.astype(np.uint8))
    for start in np.flatnonzero(weights == 1.0)[::5] + 1:  # target j is byte j + 1
      out.append(start - text.rfind(text[start:start + 5], 0, start))
  return np.asarray(out, np.int64)


class MQARSource:
  """Multi-query associative recall: k1 v1 ... kN vN, a gap of token 0, then Q queried pairs.

  Keys are tokens [16, 136), values [136, 256); loss weight on the value after each queried key.
  """

  def __init__(self, num_pairs: int, num_queries: int, fingerprint: dict):
    if not 1 <= num_pairs <= 120:
      raise ValueError(f"config.data.num_kv_pairs={num_pairs}: must be in [1, 120] (distinct "
                       "byte-level keys)")
    self.num_pairs, self.num_queries = num_pairs, num_queries
    self.fingerprint = fingerprint

  def row(self, rng: np.random.Generator, length: int):
    n, q = self.num_pairs, self.num_queries
    if 2 * (n + q) > length:
      raise ValueError(f"seq_len too short for {n} pairs and {q} queries: need "
                       f"{2 * (n + q)} tokens. Fix: raise config.data.seq_len")
    keys = rng.permutation(120)[:n] + 16
    vals = rng.integers(136, 256, n)
    asked = rng.integers(0, n, q)
    seq = np.zeros(length, np.int32)
    seq[0:2 * n:2], seq[1:2 * n:2] = keys, vals
    seq[length - 2 * q::2], seq[length - 2 * q + 1::2] = keys[asked], vals[asked]
    weights = np.zeros(length - 1, np.float32)
    weights[length - 2 * q::2] = 1.0  # target index j predicts seq[j + 1]: the value after a key
    return seq, weights


def make_sources(cfg) -> dict:
  """{"train": source, "val": source} for config.data (the `data` block)."""
  if cfg.source not in SOURCES:
    raise ValueError(f"config.data.source={cfg.source!r}: unknown. Fix: use one of {SOURCES}")
  if cfg.source in ("passkey", "needle"):
    n = 1 if cfg.source == "passkey" else cfg.num_needles
    # Optional fields (older configs lack them); at their defaults the fingerprint, and so the
    # checkpoints it guards, stay as they were.
    nq = int(cfg.get("num_questions", 1))
    cw = float(cfg.get("context_loss_weight", 0.0))
    sq = float(cfg.get("single_question_fraction", 0.0))
    fp = dict(source=cfg.source, num_needles=n)
    if nq != 1:
      fp["num_questions"] = nq
    if cw:
      fp["context_loss_weight"] = cw
    if sq:
      fp["single_question_fraction"] = sq
    return {s: NeedleSource(n, fp, nq, cw, sq) for s in SPLITS}
  if cfg.source == "mqar":
    fp = dict(source="mqar", num_kv_pairs=cfg.num_kv_pairs, num_queries=cfg.num_queries)
    return {s: MQARSource(cfg.num_kv_pairs, cfg.num_queries, fp) for s in SPLITS}
  return corpus_sources(cfg)


def document_end_id(cfg) -> int | None:
  """The token id that ends a document when config.data.document_mask is on (None when off), with
  one clear error where masking cannot apply."""
  if not cfg.get("document_mask", False):
    return None
  if not isinstance(cfg.document_mask, bool):
    raise ValueError(f"config.data.document_mask={cfg.document_mask!r}: expected True or False")
  eos = cfg.get("eos_id", -1)
  if isinstance(eos, bool) or not isinstance(eos, int):
    raise ValueError(f"config.data.eos_id={eos!r}: expected an integer token id (-1: the source's "
                     "default)")
  if cfg.source in ("stdlib", "text"):
    if eos not in (-1, 0):
      raise ValueError(f"config.data.eos_id={eos}: the {cfg.source} source ends each file with "
                       "byte 0, its only document end. Fix: leave eos_id at -1 (or 0)")
    return 0
  if cfg.source == "tokens":
    if eos < 0:
      raise ValueError("config.data.document_mask=True with a token file needs the id that ends a "
                       "document. Fix: --config.data.eos_id=<your tokenizer's end-of-text id>")
    return eos
  raise ValueError(f"config.data.document_mask=True: the {cfg.source!r} source has no documents "
                   "(one synthetic sequence a row). Fix: turn it off, or train on stdlib, text or "
                   "tokens")


def segment_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
  """[B, T] int32 document ids: position i's id counts the end tokens strictly before it, so an end
  token belongs to the document it ends."""
  ends = (inputs == eos_id).astype(np.int32)
  return np.concatenate([np.zeros_like(ends[:, :1]), np.cumsum(ends[:, :-1], axis=1,
                                                               dtype=np.int32)], axis=1)


class BatchIterator:
  """Yields this process's rows of global batch `step`; state() / restore() for checkpoints.

  Row r of step s is drawn from a generator seeded by (seed, split, s, r), so the global batch
  does not depend on how many processes share it, and any step can be regenerated.
  """

  def __init__(self, source, *, split: str, global_batch: int, seq_len: int, seed: int,
               vocab_size: int, process_index: int = 0, process_count: int = 1, step: int = 0,
               eos_id: int | None = None):
    if global_batch % process_count:
      raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
    self.source, self.split, self.seed, self.seq_len = source, split, seed, seq_len
    self.vocab_size = vocab_size
    if eos_id is not None and not 0 <= eos_id < vocab_size:
      raise ValueError(f"config.data.eos_id={eos_id} is outside the model vocabulary [0, "
                       f"{vocab_size}). Fix: give your tokenizer's end-of-text id")
    self.eos_id = eos_id  # not None: batches carry segment_ids (document masking)
    local = global_batch // process_count
    self.rows = range(process_index * local, (process_index + 1) * local)
    self.step = step

  def batch(self, step: int) -> dict[str, np.ndarray]:
    seqs, weights = zip(*(self.source.row(_row_rng(self.seed, self.split, step, r), self.seq_len + 1)
                          for r in self.rows))
    seqs = np.stack(seqs)
    if seqs.max() >= self.vocab_size or seqs.min() < 0:
      raise ValueError(f"{self.split} batch {step} holds token {int(seqs.max())} outside the model "
                       f"vocabulary [0, {self.vocab_size}). Fix: raise config.model.vocab_size or "
                       "check config.data.token_dtype")
    out = {"inputs": seqs[:, :-1], "targets": seqs[:, 1:], "weights": np.stack(weights)}
    if self.eos_id is not None:
      out["segment_ids"] = segment_ids(out["inputs"], self.eos_id)
    return out

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    out = self.batch(self.step)
    self.step += 1
    return out

  def state(self) -> dict:
    return {"step": self.step, "seed": self.seed, "split": self.split,
            "fingerprint": self.source.fingerprint}

  def restore(self, state: dict):
    """Resumes at state["step"]; refuses a state saved for other data."""
    mine = {"seed": self.seed, "split": self.split, "fingerprint": self.source.fingerprint}
    theirs = {k: state.get(k) for k in mine}
    if _canonical(mine) != _canonical(theirs):
      raise ValueError(f"the checkpoint's data iterator was saved for different data:\n  saved:   "
                       f"{theirs}\n  current: {mine}\nFix: use the same data config (and, for the "
                       "stdlib corpus, the same Python version), or start a fresh workdir")
    self.step = int(state["step"])


def _canonical(d) -> str:
  # JSON round-trips turn tuples into lists: compare in JSON form.
  return json.dumps(d, sort_keys=True, default=str)
